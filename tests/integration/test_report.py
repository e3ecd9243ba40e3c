"""``dpsweep-report`` and ``dpsweep.analysis.report``: tables from a real sweep, plots, formats, bad input.

A real sweep on digits (σ ∈ {1, 2} × seeds {0, 1} through the ``dpsweep -m`` CLI, plus a
non-private baseline for the same seeds, one epoch each) is trained once for the module; the other
tests log small synthetic runs with the MLflow client, into this session's sqlite store.
"""

from __future__ import annotations

import base64
import html
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
from helpers import browser_dom, chromium_path, log_run, run_script
from hydra import compose, initialize_config_module
from mlflow.tracking import MlflowClient
from PIL import Image

from dpsweep.analysis.report import (
    MEMORY_STAGES,
    best_runs,
    build_report,
    memory_groups,
    memory_table,
    metric_histories,
    pareto_front,
    render,
    report_runs,
    search_runs,
    summary_table,
    swept_params,
)
from dpsweep.analysis.report.table import SPREAD_LIMIT
from dpsweep.cli.report import main, run
from dpsweep.run.runner import train

SWEEP = pytest.mark.xdist_group("report")  # the tests of the real sweep: one worker trains it once

BIN = Path(sys.executable).parent
EXPERIMENT = "rep"
PLOTS = {"pareto.png", "accuracy_vs_dp.noise_multiplier.png", "curves.png", "memory.png"}


# ---------------------------------------------------------------------------------------------
# the real sweep
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sweep:
    uri: str
    sweep_id: str  # the private sweep (σ × seed)
    parent_run_id: str  # its parent run, made by the sweeper


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """``dpsweep -m`` over σ=1,2 × seed=0,1 with DP and, meanwhile, the non-private baseline for
    seeds 0 and 1, trained in this process (outside the sweep, as a baseline usually is): 6 runs
    of 1 epoch, into one sqlite store."""
    cwd = tmp_path_factory.mktemp("report-sweep")
    uri = f"sqlite:///{cwd / 'mlflow.db'}"
    # the store exists before two processes write to it; artifacts stay in the temporary directory
    MlflowClient(uri).create_experiment(EXPERIMENT, artifact_location=(cwd / "mlruns").as_uri())
    common = ["train.epochs=1", "train.progress=false", "dataset.image_size=16", "tracking.log_model=false",  # 16 px
              f"tracking.uri={uri}", f"tracking.experiment_name={EXPERIMENT}"]  # fmt: skip
    sweep_job = subprocess.Popen(
        [BIN / "dpsweep", "-m", "dp=dpsgd", "dp.noise_multiplier=1.0,2.0", "train.seed=0,1", *common], cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each: two processes of 2 threads on 2 cores run several times slower
    try:
        with initialize_config_module("dpsweep.conf", version_base="1.3"):
            for seed in (0, 1):
                train(compose("config", overrides=["dp=off", f"train.seed={seed}", *common]))
    finally:
        torch.set_num_threads(threads)
        out, err = sweep_job.communicate(timeout=300)
    assert sweep_job.returncode == 0, out + err
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None
    exp_id = exp.experiment_id
    private = client.search_runs([exp_id], "params.`dp.enabled` = 'True'")
    [sweep_id] = {r.data.tags["sweep.id"] for r in private}
    [parent] = client.search_runs([exp_id], f"tags.`sweep.id` = '{sweep_id}' and tags.`sweep.role` = 'parent'")
    assert {r.data.tags["mlflow.parentRunId"] for r in private} == {parent.info.run_id}
    return Sweep(uri, sweep_id, parent.info.run_id)


@contextmanager
def tracking_uri(uri: str) -> Iterator[None]:
    """mlflow.search_runs reads the global tracking URI: set it for the block only."""
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)


def independent_aggregates(uri: str) -> pd.DataFrame:
    """The table's numbers computed from mlflow.search_runs alone, by σ ("off": the baseline)."""
    with tracking_uri(uri):
        runs = mlflow.search_runs(experiment_names=[EXPERIMENT], output_format="pandas")
    runs = runs[(runs["status"] == "FINISHED") & (runs["tags.sweep.role"] != "parent")]
    grouped = runs.groupby(runs["params.dp.noise_multiplier"].fillna("off"))
    out = pd.DataFrame(
        {
            "mean": grouped["metrics.test_accuracy"].mean(),
            "std": grouped["metrics.test_accuracy"].std(),
            "n": grouped.size(),
            "epsilon": grouped["metrics.epsilon"].max(),
            "seeds": grouped["params.train.seed"].agg(lambda s: sorted(s)),
        }
    )
    out["drop"] = out.at["off", "mean"] - out["mean"]
    return out


def _row(table: pd.DataFrame, sigma: float | None) -> pd.Series:
    match = table["noise_multiplier"].isna() if sigma is None else table["noise_multiplier"] == sigma
    [index] = table.index[match]
    return table.loc[index]


@pytest.mark.slow
@SWEEP
def test_report_says_which_private_runs_are_not_for_release(sweep: Sweep) -> None:
    """The 4 DP runs ran without dp.secure_mode (train.seed regenerates their noise); the 2 non-private
    runs release nothing private and are not counted."""
    text = "\n".join(build_report(sweep.uri, EXPERIMENT).warnings)
    assert "4 runs ran without dp.secure_mode: their noise and Poisson sampling can be regenerated" in text


@pytest.mark.slow
@SWEEP
def test_table_equals_aggregates_computed_independently(sweep: Sweep) -> None:
    r = build_report(sweep.uri, EXPERIMENT)
    expected = independent_aggregates(sweep.uri)
    assert len(r.table) == 3 and r.counts == {
        "total": 6,
        "finished": 6,
        "failed": 0,
        "pruned": 0,
        "running": 0,
        "duplicate": 0,
        "diverged": 0,
    }
    for sigma in (None, 1.0, 2.0):
        row = _row(r.table, sigma)
        want = expected.loc["off" if sigma is None else str(sigma)]
        assert want["seeds"] == ["0", "1"] and row["runs"] == want["n"] == 2
        assert row["test_accuracy_mean"] == pytest.approx(want["mean"], rel=1e-12)
        assert row["test_accuracy_std"] == pytest.approx(want["std"], rel=1e-12)
        fixed = (row["dataset"], row["model"], row["batch_size"], row["lr"], row["epochs"])
        assert fixed == ("digits", "cnn", 64, 0.05, 1)
        if sigma is None:
            assert not row["private"] and pd.isna(row["epsilon"]) and pd.isna(row["accuracy_drop"])
            assert row["accountant"] is None or pd.isna(row["accountant"])
        else:
            assert row["private"] and (row["max_grad_norm"], row["delta"], row["accountant"]) == (1.0, 1e-5, "pld")
            assert row["epsilon"] == pytest.approx(want["epsilon"], rel=1e-12)
            assert row["accuracy_drop"] == pytest.approx(want["drop"], rel=1e-12)
            assert row["baseline_config_id"] == _row(r.table, None)["config_id"]
    assert _row(r.table, 2.0)["epsilon"] < _row(r.table, 1.0)["epsilon"]  # more noise, less privacy loss
    assert not r.table.iloc[0]["private"]  # the baseline leads its block
    # one epoch: the seeds' accuracies are far apart, and every row whose spread is above SPREAD_LIMIT of its
    # mean is flagged, each with its figures (issue 56, item 9e)
    unstable = [w for w in r.warnings if ": unstable across seeds: " in w or ": the spread across seeds" in w]
    for sigma in (None, 1.0, 2.0):
        want = expected.loc["off" if sigma is None else str(sigma)]
        flagged = want["std"] > SPREAD_LIMIT * want["mean"]
        assert bool(_row(r.table, sigma)["unstable"]) == flagged
        assert sum(f"(± {100 * want['std']:.2f})" in w for w in unstable) == flagged, unstable
    [warning] = [w for w in r.warnings if w not in unstable]  # the DP runs ran without secure mode; nothing else
    assert warning.startswith("4 runs ran without dp.secure_mode")


@pytest.mark.slow
@SWEEP
def test_sweep_report_writes_valid_pngs_and_logs_them_on_the_parent_run(
    sweep: Sweep, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    r = run(["--experiment", EXPERIMENT, "--sweep", sweep.sweep_id, "--out", str(out), "--tracking-uri", sweep.uri])
    stdout = capsys.readouterr().out
    assert r.parent_run_id == sweep.parent_run_id and r.counts["total"] == 4  # the parent is not a run of it
    assert {p.name for p in out.iterdir()} == PLOTS | {"report.md"}
    written = (out / "report.md").read_text()
    assert written.startswith(stdout)  # the table and notes, then the plots embedded as images
    embedded = [line for line in written[len(stdout) :].splitlines() if line.startswith("![")]
    assert sorted(line.split("](")[1].rstrip(")") for line in embedded) == sorted(PLOTS)
    for name in PLOTS:
        with Image.open(out / name) as img:
            assert img.format == "PNG" and img.size[0] >= 400 and img.size[1] >= 300
            img.verify()
    client = MlflowClient(sweep.uri)
    logged = {a.path for a in client.list_artifacts(sweep.parent_run_id, "report")}
    assert logged == {f"report/{n}" for n in PLOTS | {"report.md"}}
    groups = memory_groups(memory_table(r.table_runs), r.table)  # the bars of memory.png
    assert groups["configs"].sum() == 3 and (groups["iteration_peak_bytes"] > 0).all()
    # only the non-private group has a run peak: a DP run's peak over its Poisson batches would tell their sizes
    assert groups["run_peak_bytes"].notna().sum() == 1 and (groups["run_peak_bytes"].dropna() > 0).all()
    largest = list(groups["run_peak_bytes"].fillna(groups["iteration_peak_bytes"]))
    assert largest == sorted(largest, reverse=True)  # largest first (the run peak, else the first iteration's)
    # the sweep holds no baseline: it comes from the experiment's non-private runs, and says so
    assert len(r.table) == 3 and (~r.table["private"]).sum() == 1
    assert any("the sweep has no non-private run" in w for w in r.warnings)
    whole = build_report(sweep.uri, EXPERIMENT)
    columns = ["config_id", "epsilon", "test_accuracy_mean", "test_accuracy_std", "accuracy_drop", "runs"]
    pd.testing.assert_frame_equal(
        r.table[columns].sort_values("config_id", ignore_index=True),
        whole.table[columns].sort_values("config_id", ignore_index=True),
    )


@pytest.mark.slow
@SWEEP
def test_curves_show_the_chosen_runs(sweep: Sweep, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = build_report(sweep.uri, EXPERIMENT)
    best = best_runs(r.runs)
    accuracies = r.runs.set_index("run_id").loc[best, "metrics.test_accuracy"]
    assert len(best) == 3 and list(accuracies) == sorted(accuracies, reverse=True)
    assert set(best) <= set(r.runs.loc[r.runs["private"], "run_id"])
    history = metric_histories(sweep.uri, best[:1])
    assert list(history["metric"]) == ["epsilon", "test_accuracy"] and set(history["step"]) == {1}
    chosen = r.runs.loc[~r.runs["private"], "run_id"].iloc[0]
    run(["--experiment", EXPERIMENT, "--out", str(tmp_path), "--tracking-uri", sweep.uri, "--runs", chosen[:10]])
    assert "wrote" in capsys.readouterr().err and (tmp_path / "curves.png").stat().st_size > 0


class _Page(HTMLParser):
    """Every src and href of a page, and its tables' rows."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.rows = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.sources += [v or "" for k, v in attrs if k in ("src", "href")]
        self.rows += tag == "tr"


@pytest.mark.slow
@SWEEP
def test_html_report_is_one_self_contained_page_and_figures_take_a_format_and_dpi(sweep: Sweep, tmp_path: Path) -> None:
    """report.html needs nothing beside it: the table, the notes and every figure, embedded (SVG
    here), and a real browser (headless Chromium) shows them all. PDF figures are real PDFs."""
    base = ["--experiment", EXPERIMENT, "--sweep", sweep.sweep_id, "--tracking-uri", sweep.uri, "--no-log"]
    svg = tmp_path / "svg"
    r = run([*base, "--out", str(svg), "--format", "html", "--figure-format", "svg"])
    assert {p.name for p in svg.iterdir()} == {n.replace(".png", ".svg") for n in PLOTS} | {"report.html"}
    page = _Page()
    text = (svg / "report.html").read_text()
    page.feed(text)
    assert text.startswith("<!doctype html>") and "</html>" in text
    assert page.rows == len(r.table) + 1  # the header and one row per config
    assert len(page.sources) == len(PLOTS) and all(s.startswith("data:image/svg+xml;base64,") for s in page.sources)
    for source in page.sources:  # each figure is in the page, whole
        assert base64.b64decode(source.split(",", 1)[1]).lstrip().startswith((b"<?xml", b"<svg"))
    for note in r.notes():
        assert html.escape(note) in text
    # in a real browser: every figure decodes, and the table is there (a copy of the page with a probe)
    probe = (
        '<script>addEventListener("load", () => document.body.dataset.images = [...document.images]'
        '.map(i => i.complete && i.naturalWidth > 0 ? "ok" : "broken").join(","));</script>'
    )
    (svg / "probe.html").write_text(text.replace("</body>", probe + "</body>"))
    dom = browser_dom(chromium_path(), (svg / "probe.html").as_uri(), budget_ms=5000)
    images = re.search(r'data-images="([^"]*)"', dom)
    assert images is not None and images.group(1) == ",".join(["ok"] * len(PLOTS)), dom[-2000:]
    assert dom.count("<tr") == len(r.table) + 1
    pdf = tmp_path / "pdf"
    run([*base, "--out", str(pdf), "--figure-format", "pdf", "--dpi", "300"])
    for name in PLOTS:
        figure = (pdf / name.replace(".png", ".pdf")).read_bytes()
        assert figure.startswith(b"%PDF")
        assert b"/FontFile2" in figure and b"/Type3" not in figure, name  # TrueType embedded (issue 33, item 8)
    assert "<text" in (svg / "report.html").read_text() or any(  # SVG text stays text (svg.fonttype none)
        b"<text" in base64.b64decode(s.split(",", 1)[1]) for s in page.sources
    )
    low, high = tmp_path / "low", tmp_path / "high"
    run([*base, "--out", str(low), "--dpi", "60"])
    run([*base, "--out", str(high), "--dpi", "240"])
    with Image.open(low / "pareto.png") as a, Image.open(high / "pareto.png") as b:
        assert b.size[0] == pytest.approx(4 * a.size[0], rel=0.05)  # pixels scale with --dpi


@pytest.mark.slow
@SWEEP
def test_curves_are_labelled_by_what_differs_with_legends_outside_the_data(sweep: Sweep) -> None:
    from dpsweep.analysis.report import plots

    r = build_report(sweep.uri, EXPERIMENT)
    private = r.runs[r.runs["private"]]
    pair = list(private.sort_values(["params.dp.noise_multiplier", "params.train.seed"])["run_id"][:2])  # σ=1, 2 seeds
    labels = plots.run_labels(r, pair)
    assert sorted(labels.values()) == ["seed=0", "seed=1"]  # only what differs: no σ, no run id
    fig = plots.curves_figure(metric_histories(sweep.uri, pair), labels)
    accuracy, eps = fig.axes  # two panels, no twin axis
    assert sorted(str(line.get_label()) for line in accuracy.get_lines()) == ["seed=0", "seed=1"]
    [shared] = eps.get_lines()  # same σ, q and steps: one ε line, named for both runs
    assert shared.get_label() in ("seed=0 = seed=1 (identical ε)", "seed=1 = seed=0 (identical ε)")
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # right of the data, not on it
    sigmas = list(private.drop_duplicates("params.dp.noise_multiplier")["run_id"][:2])
    assert sorted(plots.run_labels(r, sigmas).values())[0].startswith("σ=")


# ---------------------------------------------------------------------------------------------
# formats parse back to the same numbers
# ---------------------------------------------------------------------------------------------
def _split_accuracy(cell: str) -> tuple[float, float | None]:
    mean, _, std = cell.partition("±")
    return float(mean), float(std) if std.strip() else None


def _rows_md(text: str) -> list[list[str]]:
    lines = [x for x in text.splitlines() if x.startswith("|")]
    return [[c.strip() for c in x.strip().strip("|").split("|")] for x in lines]


def _rows_tex(text: str) -> list[list[str]]:
    body = text.split(r"\toprule")[1].split(r"\bottomrule")[0].replace(r"\midrule", "")
    rows = [x.strip().removesuffix(r"\\").strip() for x in body.splitlines() if x.strip()]
    return [[c.strip().replace(r"$\pm$", "±") for c in x.split(" & ")] for x in rows]


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        self._in_cell = tag in ("td", "th")
        if self._in_cell:
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        self._in_cell = False if tag in ("td", "th") else self._in_cell

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.rows[-1][-1] += data


def _rows_html(text: str) -> list[list[str]]:
    parser = _Cells()
    parser.feed(text)
    return [[c.strip() for c in row] for row in parser.rows]


MISSING_CELLS = {"—", "--"}


def _check_text_rows(rows: list[list[str]], table: pd.DataFrame, header: list[str]) -> None:
    """Rounded cells equal the table's numbers: accuracy in %, 2 decimals; ε to 3 significant digits."""
    assert len(rows) == len(table)
    for cells, (_, row) in zip(rows, table.iterrows(), strict=True):
        cell = dict(zip(header, cells, strict=True))
        assert (cell["dataset"], cell["model"], int(cell["B"]), float(cell["lr"])) == ("digits", "cnn", 64, 0.05)
        mean, std = _split_accuracy(cell["test accuracy"])
        assert mean == pytest.approx(row["test_accuracy_mean"] * 100, abs=0.0051)
        assert std == pytest.approx(row["test_accuracy_std"] * 100, abs=0.0051)
        assert int(cell["runs"]) == row["runs"]
        if row["private"]:
            assert float(cell["σ"]) == row["noise_multiplier"] and float(cell["δ"]) == row["delta"]
            assert float(cell["ε"]) == pytest.approx(row["epsilon"], rel=6e-3)  # 3 significant digits
            assert float(cell["drop"]) == pytest.approx(row["accuracy_drop"] * 100, abs=0.0051)
        else:
            assert {cell["σ"], cell["ε"], cell["drop"]} <= MISSING_CELLS and cell["accountant"] == "non-private"


HEADER = [
    "dataset",
    "model",
    "B",
    "σ",
    "C",
    "clipping",
    "lr",
    "epochs",
    "δ",
    "accountant",
    "ε",
    "test accuracy",
    "drop",
    "runs",
]


@pytest.mark.slow
@SWEEP
@pytest.mark.parametrize(("fmt", "rows"), [("md", _rows_md), ("html", _rows_html)])
def test_text_formats_parse_back_to_the_same_numbers(
    sweep: Sweep, fmt: str, rows: Callable[[str], list[list[str]]]
) -> None:
    r = build_report(sweep.uri, EXPERIMENT, sort="epsilon")
    parsed = rows(render(r, fmt))
    assert len(parsed[0]) == len(HEADER) and parsed[0][10] in ("ε", r"$\varepsilon$")
    _check_text_rows(parsed[2:] if fmt == "md" else parsed[1:], r.table, HEADER)  # md: a rule under the header


@pytest.mark.slow
@SWEEP
def test_tex_is_a_paper_table_with_shared_settings_in_its_caption(sweep: Sweep) -> None:
    """Issue 33, item 8: booktabs; what every row shares (dataset, model, B, lr, epochs, runs) moves to
    the caption; δ reads as a power of ten; ε has one number of decimals; the numbers parse back."""
    r = build_report(sweep.uri, EXPERIMENT, sort="epsilon")
    text = render(r, "tex")
    assert r"\begin{table}" in text and r"\toprule" in text and r"\bottomrule" in text
    caption = re.search(r"\\caption\{(.*)\}", text)
    assert caption is not None, text
    shared = dict(item.split(": ", 1) for item in caption.group(1).split("; "))
    assert (shared["dataset"], shared["model"], shared["$B$"], shared["lr"], shared["runs"]) == (
        "digits", "cnn", "64", "0.05", "2"
    ), shared  # fmt: skip
    header, *rows = _rows_tex(text)
    assert "dataset" not in header and "$B$" not in header and r"$\varepsilon$" in header, header
    cells = [dict(zip(header, row, strict=True)) for row in rows]
    assert len(cells) == len(r.table)
    decimals = set()
    for cell, (_, row) in zip(cells, r.table.iterrows(), strict=True):
        mean, _ = _split_accuracy(cell[r"test accuracy (\%)"])
        assert mean == pytest.approx(row["test_accuracy_mean"] * 100, abs=0.0051)
        if row["private"]:
            assert cell[r"$\delta$"] == "$10^{-5}$" and row["delta"] == 1e-5
            assert float(cell[r"$\varepsilon$"]) == pytest.approx(row["epsilon"], rel=6e-3)
            decimals.add(len(cell[r"$\varepsilon$"].partition(".")[2]))
        else:
            assert cell[r"$\varepsilon$"] == "--" and cell[r"$\delta$"] == "--"
    assert len(decimals) == 1, cells  # one number of decimals down the ε column


@pytest.mark.slow
@SWEEP
def test_csv_parses_back_to_the_same_numbers_exactly(sweep: Sweep) -> None:
    r = build_report(sweep.uri, EXPERIMENT)
    back = pd.read_csv(io.StringIO(render(r, "csv")), float_precision="round_trip")
    numbers = ["epsilon", "test_accuracy_mean", "test_accuracy_std", "accuracy_drop", "noise_multiplier", "delta"]
    pd.testing.assert_frame_equal(back[numbers], r.table[numbers].reset_index(drop=True))
    assert list(back["runs"]) == list(r.table["runs"]) and list(back["private"]) == list(r.table["private"])
    assert back["run_ids"].str.split().map(len).tolist() == [2, 2, 2]


@pytest.mark.slow
@SWEEP
def test_sort_keys_order_rows_within_the_block(sweep: Sweep) -> None:
    by_eps = build_report(sweep.uri, EXPERIMENT, sort="epsilon").table
    by_acc = build_report(sweep.uri, EXPERIMENT, sort="accuracy").table
    for table in (by_eps, by_acc):
        assert list(table["private"]) == [False, True, True]  # the baseline leads
    assert by_eps["epsilon"].iloc[1] < by_eps["epsilon"].iloc[2]
    assert by_acc["test_accuracy_mean"].iloc[1] >= by_acc["test_accuracy_mean"].iloc[2]


# ---------------------------------------------------------------------------------------------
# synthetic runs: missing metrics, counts, warnings, baselines, the Pareto front
# ---------------------------------------------------------------------------------------------
DP = {
    "dataset.name": "digits", "model.name": "cnn", "dp.enabled": "True", "train.batch_size": "64",
    "dp.noise_multiplier": "1.0", "dp.max_grad_norm": "1.0", "dp.delta": "1e-05", "dp.accountant": "rdp",
    "optimizer.lr": "0.05", "train.epochs": "2", "train.seed": "0", "train.eval_batch_size": "1024",
    "model.hidden_units": "32", "tracking.uri": "elsewhere", "train.checkpoint_dir": "/tmp/x",
}  # fmt: skip
OFF = {k: v for k, v in DP.items() if not k.startswith("dp.")} | {"dp.enabled": "False"}


def test_a_run_with_a_missing_metric_is_reported_not_crashed_on(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.9})
    log_run(client, experiment_name, DP, {"test_accuracy": 0.6, "epsilon": 3.0})
    no_accuracy = log_run(client, experiment_name, DP | {"train.seed": "1"}, {"epsilon": 3.0})
    no_epsilon = log_run(client, experiment_name, DP | {"dp.noise_multiplier": "2.0"}, {"test_accuracy": 0.5})
    nothing = log_run(client, experiment_name, DP | {"dp.noise_multiplier": "4.0"}, {})
    r = build_report(mlflow_uri, experiment_name)
    one = _row(r.table, 1.0)
    assert (one["runs"], one["runs_without_accuracy"], one["test_accuracy_mean"]) == (2, 1, 0.6)
    assert pd.isna(one["test_accuracy_std"]) and one["accuracy_drop"] == pytest.approx(0.3)
    assert pd.isna(_row(r.table, 2.0)["epsilon"]) and pd.isna(_row(r.table, 4.0)["test_accuracy_mean"])
    text = "\n".join(r.warnings)
    assert f"run {no_accuracy} (σ=1) is FINISHED but has no test_accuracy metric" in text
    assert f"run {no_epsilon} (σ=2) is FINISHED but has no epsilon metric" in text
    assert f"run {nothing} (σ=4)" in text
    for fmt in ("md", "tex", "html"):  # the notes under the table name the run
        assert f"run {no_accuracy} (σ=1) is FINISHED but has no test_accuracy metric" in render(r, fmt)
    cells = {row[3]: row[-3] for row in _rows_md(render(r, "md"))[2:]}  # σ -> test accuracy
    assert cells == {"—": "90.00", "1": "60.00", "2": "50.00", "4": "—"}  # one run: no ±; none: a dash
    assert len(pd.read_csv(io.StringIO(render(r, "csv")))) == 4
    run(["--experiment", experiment_name, "--tracking-uri", mlflow_uri, "--out", str(tmp_path)])  # no memory metrics
    assert {p.name for p in tmp_path.iterdir()} == PLOTS | {"report.md"} and "wrote" in capsys.readouterr().err


def test_counts_failed_pruned_and_running_and_ignores_probes_and_the_parent(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = {"sweep.id": "abc123def456"}
    log_run(client, experiment_name, DP, {"test_accuracy": 0.6, "epsilon": 3.0}, sweep)
    log_run(client, experiment_name, DP, {}, sweep, status="FAILED")
    log_run(client, experiment_name, DP, {}, sweep, status="KILLED")
    log_run(client, experiment_name, DP, {}, sweep | {"optuna.pruned": "true"}, status="KILLED")
    log_run(client, experiment_name, DP, {}, sweep, status="RUNNING")
    log_run(client, experiment_name, DP, {"test_accuracy": 0.99}, sweep | {"probe": "true"})
    parent = log_run(client, experiment_name, {}, {}, sweep | {"sweep.role": "parent"})
    run(["--experiment", experiment_name, "--sweep", "abc123def456", "--tracking-uri", mlflow_uri, "--format", "csv"])
    captured = capsys.readouterr()
    r = build_report(mlflow_uri, experiment_name, "abc123def456")
    assert r.counts == {
        "total": 5,
        "finished": 1,
        "failed": 2,
        "pruned": 1,
        "running": 1,
        "duplicate": 0,
        "diverged": 0,
    }
    assert r.parent_run_id == parent and len(r.table) == 1 and r.table["test_accuracy_mean"].iloc[0] == 0.6
    assert "1 of 5 runs FINISHED; 2 failed, 1 pruned, 1 running" in captured.err  # CSV: notes on stderr
    assert "FINISHED" not in captured.out and len(captured.out.splitlines()) == 2


def test_a_diverged_run_is_no_baseline_and_a_spread_above_the_mean_is_flagged(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """Issue 33, item 2: one non-private seed fell to chance; before, the baseline was 53.35 ± 61.73
    and the drop negative, without a word."""
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.97})
    why = "test_accuracy stayed at chance (best 0.0970 <= 0.1474)"
    fallen = log_run(client, experiment_name, OFF | {"train.seed": "1"}, {"test_accuracy": 0.097},
                     {"run.diverged": "true", "run.diverged.reason": why})  # fmt: skip
    log_run(client, experiment_name, DP, {"test_accuracy": 0.60, "epsilon": 3.0})
    log_run(client, experiment_name, DP | {"train.seed": "1"}, {"test_accuracy": 0.64, "epsilon": 3.0})
    log_run(client, experiment_name, DP | {"dp.noise_multiplier": "2.0"}, {"test_accuracy": 0.9, "epsilon": 1.0})
    log_run(client, experiment_name, DP | {"dp.noise_multiplier": "2.0", "train.seed": "1"},
            {"test_accuracy": 0.05, "epsilon": 1.0})  # fmt: skip
    r = build_report(mlflow_uri, experiment_name)
    assert r.counts["diverged"] == 1 and r.counts["finished"] == 5
    baseline = _row(r.table, None)
    assert (baseline["runs"], baseline["test_accuracy_mean"]) == (1, 0.97)
    assert _row(r.table, 1.0)["accuracy_drop"] == pytest.approx(0.97 - 0.62)
    text = "\n".join(r.notes())
    assert f"1 run diverged and are left out of the rows' means and baselines ({fallen[:8]}: {why})" in text
    assert "5 of 6 runs FINISHED" in text and "1 diverged (left out)" in text
    assert "σ=2: the spread across seeds (± 60.10) exceeds the mean (47.50)" in text
    assert "σ=1: the spread" not in text


def test_mixed_accountants_and_delta_are_warned(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    # one row whose runs carry different accountants and δ (runs logged without those params, only tags)
    bare = {k: v for k, v in DP.items() if k not in ("dp.accountant", "dp.delta")}
    log_run(client, experiment_name, bare, {"test_accuracy": 0.6, "epsilon": 3.0},
            {"dp.accountant": "rdp", "dp.delta": "1e-05"})  # fmt: skip
    log_run(client, experiment_name, bare | {"train.seed": "1"}, {"test_accuracy": 0.6, "epsilon": 2.5},
            {"dp.accountant": "prv", "dp.delta": "1e-06"})  # fmt: skip
    # two rows of one dataset and model under different accountants: not one front
    log_run(client, experiment_name, DP | {"dp.noise_multiplier": "2.0"}, {"test_accuracy": 0.5, "epsilon": 1.0})
    log_run(client, experiment_name, DP | {"dp.noise_multiplier": "2.0", "dp.accountant": "prv"},
            {"test_accuracy": 0.5, "epsilon": 0.9})  # fmt: skip
    r = build_report(mlflow_uri, experiment_name)
    text = "\n".join(r.warnings)
    assert "mixes accountants (prv, rdp) across its runs" in text and "mixes δ (1e-05, 1e-06)" in text
    assert "digits/cnn: the rows use different accountants (prv, rdp)" in text
    assert "digits/cnn: no FINISHED non-private run" in text
    assert len(r.table) == 3  # accountant is a hyperparameter of the row: rdp and prv rows stay apart


def test_each_row_is_compared_with_the_best_matching_baseline(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.90})
    log_run(client, experiment_name, OFF | {"train.epochs": "5"}, {"test_accuracy": 0.95})
    log_run(client, experiment_name, DP, {"test_accuracy": 0.60, "epsilon": 3.0})
    log_run(client, experiment_name, DP | {"train.epochs": "5"}, {"test_accuracy": 0.70, "epsilon": 5.0})
    log_run(client, experiment_name, DP | {"train.epochs": "5", "optimizer.lr": "0.1"},
            {"test_accuracy": 0.75, "epsilon": 5.0})  # fmt: skip
    log_run(client, experiment_name, DP | {"model.hidden_units": "64"}, {"test_accuracy": 0.65, "epsilon": 3.0})
    r = build_report(mlflow_uri, experiment_name)
    t = r.table.set_index("config_id")
    dp = t[t["private"]]
    drops = {
        (int(row["epochs"]), row["lr"], row["params.model.hidden_units"]): row["accuracy_drop"]
        for _, row in dp.iterrows()
    }
    expected = {(2, 0.05, "32"): 0.30, (5, 0.05, "32"): 0.25, (5, 0.1, "32"): 0.20, (2, 0.05, "64"): 0.25}
    assert drops == pytest.approx(expected)  # epochs 5 rows against the epochs 5 baseline, the rest against 2
    text = "\n".join(r.warnings)
    assert "differs in optimizer.lr 0.1 vs 0.05" in text and "differs in model.hidden_units 64 vs 32" in text
    md = render(r, "md")
    assert "model.hidden_units" in md.splitlines()[0]  # a swept hyperparameter gets its own column
    assert "model.hidden\\_units" in render(r, "tex")


def test_pareto_front_keeps_only_undominated_private_rows(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    points = {"0.5": (1.0, 0.50), "1.0": (2.0, 0.70), "1.5": (2.5, 0.65), "2.0": (3.0, 0.80), "3.0": (3.0, 0.75)}
    for sigma, (eps, acc) in points.items():
        log_run(client, experiment_name, DP | {"dp.noise_multiplier": sigma}, {"test_accuracy": acc, "epsilon": eps})
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.99})
    r = build_report(mlflow_uri, experiment_name)
    front = pareto_front(r.table)
    assert list(front["noise_multiplier"]) == [0.5, 1.0, 2.0] and list(front["epsilon"]) == [1.0, 2.0, 3.0]
    memory = memory_table(r.runs)
    assert list(memory.columns[1:7]) == list(MEMORY_STAGES) and len(memory) == 6


def test_no_point_label_of_the_pareto_plot_crosses_the_baseline_line(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """Issue 33, item 8: points just under the non-private line had their labels drawn over it."""
    from matplotlib.text import Annotation

    from dpsweep.analysis.report import plots

    # the front is σ=1 alone, 1 point under the line at 80%: the label's first place (6 pt above) crosses it
    for sigma, (eps, acc) in {"1.0": (1.0, 0.79), "2.0": (2.0, 0.50)}.items():
        log_run(client, experiment_name, DP | {"dp.noise_multiplier": sigma}, {"test_accuracy": acc, "epsilon": eps})
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.80})
    fig = plots.pareto_figure(build_report(mlflow_uri, experiment_name).table)
    [ax] = fig.axes
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    line = float(ax.transData.transform((0.0, 80.0))[1])
    [note] = [t for t in ax.texts if isinstance(t, Annotation)]  # one label per point of the front
    box = note.get_window_extent(renderer)
    assert not box.y0 <= line <= box.y1, (note.get_text(), box, line)
    assert note.xyann != plots.LABEL_OFFSETS_PT[0]  # moved from its first place


def test_the_memory_table_reads_runs_logged_before_in_bytes(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """Runs log MiB as system/memory/<figure>_mib (MLflow's UI shows them off the Model metrics tab,
    issue 56, item 2); runs before logged bytes as memory/<figure>_bytes, and the oldest as
    memory.<figure>_bytes. A store holding all three reports each in bytes."""
    log_run(client, experiment_name, DP, {"test_accuracy": 0.7, "epsilon": 2.0, "memory.backward_bytes": 1e3})
    log_run(client, experiment_name, DP | {"dp.noise_multiplier": "2.0"},
            {"test_accuracy": 0.6, "epsilon": 1.0, "memory/backward_bytes": 3e3})  # fmt: skip
    log_run(client, experiment_name, DP | {"dp.noise_multiplier": "3.0"},
            {"test_accuracy": 0.5, "epsilon": 0.5, "system/memory/backward_mib": 5e3 / 2**20,
             "system/memory/peak_mib": 1.5})  # fmt: skip
    r = build_report(mlflow_uri, experiment_name)
    memory = memory_table(r.runs)
    assert sorted(memory["backward_bytes"]) == [1e3, 3e3, 5e3]
    assert sorted(memory["run_peak_bytes"].dropna()) == [1.5 * 2**20]


def test_search_runs_reads_every_page(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    for seed in range(5):
        log_run(client, experiment_name, DP | {"train.seed": str(seed)}, {"test_accuracy": 0.5 + seed / 100})
    paged = search_runs(mlflow_uri, experiment_name, page_size=2)
    whole = search_runs(mlflow_uri, experiment_name)
    assert len(paged) == 5 and set(paged["run_id"]) == set(whole["run_id"])
    assert summary_table(report_runs(paged))["runs"].tolist() == [5]


# ---------------------------------------------------------------------------------------------
# bad input: exit 2, one line naming the option, its value and what is allowed
# ---------------------------------------------------------------------------------------------
def test_an_empty_selection_says_why(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = {"sweep.id": "0123456789ab"}
    for status in ("FAILED", "FAILED", "KILLED"):
        log_run(client, experiment_name, DP, {}, sweep, status=status)
    log_run(client, experiment_name, DP, {}, sweep | {"optuna.pruned": "true"}, status="KILLED")
    assert main(["--experiment", experiment_name, "--sweep", "0123456789ab", "--tracking-uri", mlflow_uri]) == 2
    err = capsys.readouterr().err
    assert "dpsweep-report: error: --sweep='0123456789ab' is invalid: 0 FINISHED runs of 4 (3 failed, 1 pruned)" in err


BAD = [
    (["--experiment", "nope"], "--experiment='nope' is invalid: no such experiment at sqlite:///",
     "experiments there: "),
    (["--sweep", "feedfeedfeed"], "--sweep='feedfeedfeed' is invalid: no run of experiment 'rep' is tagged",
     "sweeps there: "),
    (["--format", "docx"], "--format='docx' is invalid: unknown format", "valid: csv, html, md, tex"),
    (["--sort", "loss"], "--sort='loss' is invalid: unknown sort key", "valid: accuracy, epsilon"),
    (["--runs", "zzzz"], "--runs='zzzz' is invalid: a run id (or a unique prefix) of the experiment 'rep'",
     "matches no run"),
    (["--out", "/proc/dpsweep-report"], "--out='/proc/dpsweep-report' is invalid: a directory you can write to", ""),
    (["--figure-format", "jpg"], "--figure-format='jpg' is invalid", "one of png, pdf, svg"),
    (["--dpi", "0"], "--dpi=0 is invalid", "a positive number of dots per inch"),
]  # fmt: skip


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store with an experiment named like the real sweep's, of two logged runs (one in a sweep):
    what the bad-input tests need, without training."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('small-store') / 'mlflow.db'}"
    client = MlflowClient(uri)
    log_run(client, EXPERIMENT, OFF, {"test_accuracy": 0.9})
    log_run(client, EXPERIMENT, DP, {"test_accuracy": 0.6, "epsilon": 3.0}, {"sweep.id": "abc123def456"})
    return uri


@pytest.mark.parametrize(("argv", "what", "allowed"), BAD, ids=[b[0][0] for b in BAD])
def test_bad_input_exits_2_naming_the_option(
    small_store: str, capsys: pytest.CaptureFixture[str], argv: list[str], what: str, allowed: str
) -> None:
    args = ["--experiment", EXPERIMENT, "--tracking-uri", small_store, *argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"dpsweep-report: error: {what}" in err and allowed in err, err


def test_an_out_path_that_is_a_file_is_rejected(
    small_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "report.md"
    a_file.write_text("not a directory")
    assert main(["--experiment", EXPERIMENT, "--tracking-uri", small_store, "--out", str(a_file)]) == 2
    assert f"--out='{a_file}' is invalid: a directory you can write to" in capsys.readouterr().err


def test_a_missing_database_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"sqlite:///{tmp_path / 'absent.db'}"
    assert main(["--experiment", EXPERIMENT, "--tracking-uri", uri]) == 2
    assert "an existing MLflow database (none at" in capsys.readouterr().err
    assert not (tmp_path / "absent.db").exists()


@pytest.mark.slow
@SWEEP
def test_console_script(sweep: Sweep, tmp_path: Path) -> None:
    """The smoke test of the console script: a real process, its exit code and its output."""
    ok = run_script("dpsweep-report", "--experiment", EXPERIMENT, "--tracking-uri", sweep.uri, "--format", "csv",
                    cwd=tmp_path)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert len(pd.read_csv(io.StringIO(ok.stdout))) == 3 and "6 of 6 runs FINISHED" in ok.stderr, ok.stderr


def test_clipping_is_a_column_and_a_quantile_runs_c_is_not_pooled_apart(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    quantile = DP | {"dp.clipping": "quantile", "dp.clip_quantile": "0.5"}
    log_run(
        client, experiment_name, quantile | {"dp.max_grad_norm_chosen": "0.8"}, {"test_accuracy": 0.6, "epsilon": 3}
    )
    log_run(client, experiment_name, quantile | {"train.seed": "1", "dp.max_grad_norm_chosen": "1.3"},
            {"test_accuracy": 0.7, "epsilon": 3})  # fmt: skip
    log_run(client, experiment_name, DP | {"dp.clipping": "adaptive", "dp.clip_quantile": "0.7"},
            {"test_accuracy": 0.5, "epsilon": 3})  # fmt: skip
    log_run(client, experiment_name, DP, {"test_accuracy": 0.4, "epsilon": 3})  # before dp.clipping existed
    r = build_report(mlflow_uri, experiment_name)
    rows = _rows_md(render(r, "md"))
    header = [c.split(" (")[0] for c in rows[0]]
    cells = {row[header.index("clipping")]: (row[header.index("C")], row[header.index("runs")]) for row in rows[2:]}
    assert cells == {"quantile γ=0.5": ("—", "2"), "adaptive γ=0.7": ("1", "1"), "fixed": ("1", "1")}


def test_a_best_of_k_table_warns_with_the_composed_epsilon_and_a_private_tuning_names_the_released_run(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    log_run(client, experiment_name, DP, {"test_accuracy": 0.6, "epsilon": 3.0})
    log_run(client, experiment_name, DP | {"optimizer.lr": "0.1"}, {"test_accuracy": 0.7, "epsilon": 3.0})
    log_run(client, experiment_name, DP | {"optimizer.lr": "0.2"}, {"test_accuracy": 0.65, "epsilon": 2.5})
    text = "\n".join(build_report(mlflow_uri, experiment_name).warnings)
    assert "digits/cnn at ε=3: the best of these 2 private rows is picked after seeing them all" in text
    assert "ε = 6 at δ = 2e-05 (basic composition" in text and "sweep.private_tuning=true" in text
    assert "at ε=2.5" not in text  # a row alone at its ε is a point of the trade-off, not a choice
    tuned = experiment_name + "-tuned"
    best = log_run(client, tuned, DP | {"train.seed": "7"},
                   {"test_accuracy": 0.7, "epsilon": 4.1, "epsilon_single_run": 3.0, "epsilon_tuning": 4.1},
                   {"tuning.released": "true"})  # fmt: skip
    log_run(client, tuned, DP | {"train.seed": "9"}, {"test_accuracy": 0.6, "epsilon": 3.0, "epsilon_tuning": 4.1},
            {"tuning.released": "false"})  # fmt: skip
    log_run(client, tuned, DP | {"train.seed": "8", "optimizer.lr": "0.2"},
            {"test_accuracy": 0.5, "epsilon": 2.5, "epsilon_tuning": 4.1}, {"tuning.released": "false"})  # fmt: skip
    # issue 54, item 3: the report shows the released trial alone, the analyst's view all of them
    report = build_report(mlflow_uri, tuned)
    text = "\n".join(report.warnings)
    assert f"run {best[:8]}: the released trial of a private tuning" in text and "best of these" not in text
    assert list(report.table["epsilon"]) == [4.1] and list(report.table["accountant"]) == ["rdp"]
    for fmt in ("md", "csv", "tex"):
        assert "4.1" in render(report, fmt) and "| 3 " not in render(report, fmt)
    everything = build_report(mlflow_uri, tuned, all_trials=True)
    text = "\n".join(everything.warnings)
    assert f"only {best[:8]} (tag tuning.released=true; trial: released) may be published" in text
    assert list(everything.table["epsilon"]) == [4.1, 4.1, 4.1]  # the released trial is a row of its own
    assert list(everything.table["tuning"]) == ["released", "withheld", "withheld"]


def test_accuracy_is_not_plotted_against_a_sigma_calibrated_per_mechanism(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, tmp_path: Path
) -> None:
    """Issue 33, item 8: runs calibrated to a target ε each ran their mechanism's own σ (DP-FTRL's at
    an ε is not DP-SGD's). σ is plotted only over the runs that set it; the rest against their target."""
    from dpsweep.analysis.report import plots

    calibrated = {("dpsgd", "1.0"): ("1.1", 0.60), ("dpsgd", "3.0"): ("0.6", 0.75),
                  ("dpftrl", "1.0"): ("3.2", 0.55), ("dpftrl", "3.0"): ("1.4", 0.70)}  # fmt: skip
    for (mechanism, target), (sigma, acc) in calibrated.items():
        params = DP | {"dp.mechanism": mechanism, "dp.target_epsilon": target, "dp.noise_multiplier": sigma}
        log_run(client, experiment_name, params, {"test_accuracy": acc, "epsilon": float(target)})
    log_run(client, experiment_name, OFF | {"dp.target_epsilon": "None"}, {"test_accuracy": 0.9})
    table = build_report(mlflow_uri, experiment_name).table
    assert "dp.noise_multiplier" in swept_params(table)  # the calibrated σ differ ...
    axes = dict(plots.sweep_axes(table))
    assert "dp.noise_multiplier" not in axes and {"dp.target_epsilon", "dp.mechanism"} <= set(axes)  # ... unplotted
    written = {p.name for p in plots.plot_sweeps(table, tmp_path)}
    assert "accuracy_vs_dp.noise_multiplier.png" not in written and "accuracy_vs_dp.target_epsilon.png" in written

    for sigma, acc in (("0.8", 0.62), ("1.2", 0.58)):  # σ set by the user: plotted, over these runs alone
        params = DP | {"dp.mechanism": "dpsgd", "dp.target_epsilon": "None", "dp.noise_multiplier": sigma}
        log_run(client, experiment_name, params, {"test_accuracy": acc, "epsilon": 2.0})
    table = build_report(mlflow_uri, experiment_name).table
    rows = dict(plots.sweep_axes(table))["dp.noise_multiplier"]
    private = rows[rows["private"].astype(bool)]
    assert sorted(private["noise_multiplier"]) == [0.8, 1.2] and (~rows["private"].astype(bool)).sum() == 1
