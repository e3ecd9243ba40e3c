"""``dpsweep-report`` with dp.mechanism and dp.unit (issue 17): a ``mechanism`` and a ``unit`` column,
a note on whom each row's ε protects, rows split by mechanism and by unit with the non-private row
as their baseline, and a Pareto plot coloured by mechanism with user-level rows as squares.

Five real runs on digits (one epoch, 16 px) are trained once for the module into their own store:
the non-private baseline, DP-SGD and DP-FTRL over examples (equal but for dp.mechanism), and DP-SGD
over 50 users and over examples on the same 50-user partition (equal but for dp.unit). The other
tests log runs with the MLflow client, as runs from before these keys (neither param nor tag) or
with the keys as tags only.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from helpers import log_run, markdown_rows, row_of_run, trained_store
from matplotlib.colors import to_hex
from mlflow.tracking import MlflowClient
from PIL import Image

from dpsweep.analysis import report
from dpsweep.analysis.report import plots
from dpsweep.analysis.report.columns import mechanism_order
from dpsweep.analysis.report.plots import MECHANISM_COLORS

TRAINED = pytest.mark.xdist_group("report_mechanisms")  # the tests of the trained runs: one worker trains them
EXPERIMENT = "mechanisms"
COMMON = ["train.epochs=1", "train.progress=false", "tracking.log_model=false", "dataset.image_size=16"]
PARTITION = ["dataset.users=partition", "dataset.num_users=50", "train.batch_size=10"]
RUNS = {  # (mechanism, unit, B) -> overrides
    ("off", "", 64): ["dp=off"],
    ("dpsgd", "example", 64): [],
    ("dpftrl", "example", 64): ["dp.mechanism=dpftrl"],
    ("dpsgd", "example", 10): PARTITION,
    ("dpsgd", "user", 10): ["dp.unit=user", *PARTITION],
}


@dataclass(frozen=True)
class Store:
    uri: str
    run_ids: dict[tuple[str, str, int], str]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    cwd = tmp_path_factory.mktemp("report-mechanisms")
    uri, ids = trained_store(cwd, EXPERIMENT, COMMON, RUNS)
    return Store(uri, ids)


def _legend_texts(fig: object) -> list[str]:
    [ax] = [a for a in fig.axes if a.get_visible()]  # type: ignore[attr-defined]
    return [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.mark.slow
@TRAINED
def test_rows_split_by_mechanism_and_unit_against_the_non_private_baseline(store: Store) -> None:
    r = report.build_report(store.uri, EXPERIMENT)
    table = r.table
    assert len(table) == len(RUNS) and table["config_id"].is_unique  # one row per run: none pooled
    rows = {key: row_of_run(table, run_id) for key, run_id in store.run_ids.items()}
    for (mechanism, unit, batch), row in rows.items():
        assert row["batch_size"] == batch
        if mechanism == "off":
            assert not row["private"] and row["mechanism"] is None and row["unit"] is None
        else:
            assert row["private"] and (row["mechanism"], row["unit"]) == (mechanism, unit)
    # the pairs differ in exactly one param, the mechanism or the unit, and still make two rows
    params = [c for c in table.columns if c.startswith("params.")]

    def differing(a: tuple[str, str, int], b: tuple[str, str, int]) -> set[str]:
        x, y = rows[a][params], rows[b][params]
        return {c.removeprefix("params.") for c in params if not (x[c] == y[c] or (pd.isna(x[c]) and pd.isna(y[c])))}

    assert differing(("dpsgd", "example", 64), ("dpftrl", "example", 64)) == {"dp.mechanism"}
    assert differing(("dpsgd", "example", 10), ("dpsgd", "user", 10)) == {"dp.unit"}
    base = rows[("off", "", 64)]
    for key, row in rows.items():
        if key[0] == "off":
            continue
        assert row["baseline_config_id"] == base["config_id"]  # mechanism, unit and the users set aside
        assert row["accuracy_drop"] == pytest.approx(base["test_accuracy_mean"] - row["test_accuracy_mean"])
    text = "\n".join(r.warnings)
    assert "dataset.users" not in text and "dataset.num_users" not in text  # users change nothing without DP
    assert "differs in train.batch_size 10 vs 64" in text  # what does differ is still said
    # ε per user: N = 50 users sampled at 10 per step; the same partition over examples: N = 1437
    assert rows[("dpsgd", "user", 10)]["epsilon"] > rows[("dpsgd", "example", 10)]["epsilon"]


@pytest.mark.slow
@TRAINED
def test_tables_show_mechanism_and_unit_and_say_whom_epsilon_protects(store: Store) -> None:
    r = report.build_report(store.uri, EXPERIMENT, sort="epsilon")
    md = report.render(r, "md")
    cells = markdown_rows(md)
    header = list(cells[0])
    assert header.index("accountant") + 1 == header.index("mechanism") == header.index("unit") - 1
    assert header.index("unit") + 1 == header.index("ε")
    by_eps = {(row["mechanism"], row["unit"], row["B"]) for row in cells}
    assert by_eps == {("—", "—", "64"), ("dpsgd", "example", "64"), ("dpftrl", "example", "64"),
                      ("dpsgd", "example", "10"), ("dpsgd", "user", "10")}  # fmt: skip
    assert "dp.mechanism" not in header and "dataset.num_users" not in header  # no column twice
    notes = r.notes()
    [unit_note] = [n for n in notes if n.startswith("Unit:")]
    assert "unit=user: ε per user" in unit_note and "dataset.num_users = 50" in unit_note
    assert "unit=example: ε per example" in unit_note and "one Pareto front each" in unit_note
    [mechanism_note] = [n for n in notes if n.startswith("Mechanism:")]
    assert "dpftrl = DP-FTRL" in mechanism_note and "replaced by a zero record" in mechanism_note  # its tag
    assert "dpsgd = DP-SGD" in mechanism_note and "added or removed" in mechanism_note
    for fmt in ("md", "tex", "html"):
        text = report.render(r, fmt)
        assert "mechanism" in text and "unit" in text and "ε per user" in text
    tex = report.render(r, "tex")
    assert "dpftrl & example" in tex and "dpsgd & user" in tex
    html = report.render(r, "html")
    assert "<th>mechanism</th>" in html and "<th>unit</th>" in html and "<td>dpftrl</td>" in html
    csv = pd.read_csv(io.StringIO(report.render(r, "csv")))
    assert list(csv.columns[csv.columns.get_loc("accountant") + 1 :][:3]) == ["mechanism", "unit", "private"]
    public = csv[~csv["private"]]
    assert public["mechanism"].isna().all() and public["unit"].isna().all()
    private = csv[csv["private"]]
    assert sorted(zip(private["mechanism"], private["unit"], strict=True)) == [
        ("dpftrl", "example"), ("dpsgd", "example"), ("dpsgd", "example"), ("dpsgd", "user")]  # fmt: skip


@pytest.mark.slow
@TRAINED
def test_pareto_plot_colours_by_mechanism_and_marks_users(store: Store, tmp_path: Path) -> None:
    r = report.build_report(store.uri, EXPERIMENT)
    fig = plots.pareto_figure(r.table)
    texts = _legend_texts(fig)
    assert texts[:4] == [
        "DP-SGD configs (mean ± std over seeds)", "DP-FTRL configs (mean ± std over seeds)",
        "ε per example", "ε per user (N = users)",
    ]  # fmt: skip
    assert {"Pareto front (per example)", "Pareto front (per user)"} <= set(texts)  # one front per unit
    assert any(t.startswith("non-private") for t in texts)
    [ax] = fig.axes
    points = [line for line in ax.get_lines() if len(line.get_xdata()) and line.get_linestyle() in ("None", "none")]
    drawn = {(to_hex(line.get_color()), line.get_marker(), float(line.get_xdata()[0])) for line in points}
    eps = {key: row_of_run(r.table, run_id)["epsilon"] for key, run_id in store.run_ids.items() if key[0] != "off"}
    blue = to_hex("tab:blue")
    ftrl = to_hex(MECHANISM_COLORS[mechanism_order("dpftrl")[0]])  # its rank among the registered mechanisms
    assert ftrl != blue and (ftrl, "o", eps[("dpftrl", "example", 64)]) in drawn  # DP-FTRL: its own colour
    assert (blue, "o", eps[("dpsgd", "example", 64)]) in drawn  # DP-SGD: blue, as every config before
    assert (blue, "s", eps[("dpsgd", "user", 10)]) in drawn  # user level: a square
    assert sum(marker == "s" for _, marker, _ in drawn) == 1
    ids = store.run_ids
    labels = plots.run_labels(r, [ids[("off", "", 64)], ids[("dpsgd", "example", 64)], ids[("dpftrl", "example", 64)]])
    assert "mechanism=dpftrl" in labels[ids[("dpftrl", "example", 64)]]  # curves.png names the mechanism
    assert "mechanism=dpsgd" in labels[ids[("dpsgd", "example", 64)]]
    assert "mechanism" not in labels[ids[("off", "", 64)]] and "non-private" in labels[ids[("off", "", 64)]]
    path = plots.plot_pareto(r.table, tmp_path / "pareto.png")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] >= 400 and img.size[1] >= 300
        img.verify()


# ---------------------------------------------------------------------------------------------
# runs logged with the client: from before the keys, and with the keys as tags only
# ---------------------------------------------------------------------------------------------
DP = {
    "dataset.name": "digits", "model.name": "cnn", "dp.enabled": "True", "train.batch_size": "64",
    "dp.noise_multiplier": "1.0", "dp.max_grad_norm": "1.0", "dp.delta": "1e-05", "dp.accountant": "rdp",
    "optimizer.lr": "0.05", "train.epochs": "2", "train.seed": "0", "model.hidden_units": "32",
}  # fmt: skip
OFF = {k: v for k, v in DP.items() if not k.startswith("dp.")} | {"dp.enabled": "False"}
TAGS = {"dp.neighbours": "add_or_remove_one", "dp.release": "not-for-release", "dp.secure_mode": "False"}


def test_runs_from_before_the_keys_are_dpsgd_over_examples_and_render_as_before(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.9})
    old = log_run(client, experiment_name, DP, {"test_accuracy": 0.6, "epsilon": 3.0})
    new = DP | {"dp.noise_multiplier": "2.0", "dp.mechanism": "dpsgd", "dp.unit": "example"}
    log_run(client, experiment_name, new, {"test_accuracy": 0.5, "epsilon": 1.5}, TAGS)
    r = report.build_report(mlflow_uri, experiment_name)
    row = row_of_run(r.table, old)
    assert (row["mechanism"], row["unit"]) == ("dpsgd", "example")
    assert list(r.table["mechanism"]) == [None, "dpsgd", "dpsgd"] and not report.shows_privacy_kinds(r.table)
    assert report.swept_params(r.table) == ["dp.noise_multiplier"]  # a missing dp.mechanism is dpsgd: not swept
    md = report.render(r, "md")
    assert "mechanism" not in md and "unit" not in md and "Unit:" not in md  # as before these keys
    assert "mechanism" not in report.render(r, "csv").splitlines()[0]
    fig = plots.pareto_figure(r.table)
    assert _legend_texts(fig) == ["Pareto front", "non-private: 90.0%", "configs (mean ± std over seeds)"]
    [ax] = fig.axes
    [configs] = ax.containers  # one errorbar of every private config, in the blue of before
    assert to_hex(configs.lines[0].get_color()) == to_hex("tab:blue") and configs.lines[0].get_marker() == "o"


def test_mechanism_and_unit_fall_back_to_the_tags(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    """A run whose params lack the keys but whose tags (set at the end of a DP run) carry them."""
    users = {"dataset.users": "partition", "dataset.num_users": "40", "train.batch_size": "8"}
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.9})
    ftrl = TAGS | {"dp.mechanism": "dpftrl", "dp.unit": "user", "dp.neighbours": "replace_one_with_zero"}
    tagged = log_run(client, experiment_name, DP | users, {"test_accuracy": 0.4, "epsilon": 6.0}, ftrl)
    plain = log_run(
        client, experiment_name, DP | {"dp.noise_multiplier": "3.0"}, {"test_accuracy": 0.5, "epsilon": 1.0}
    )
    r = report.build_report(mlflow_uri, experiment_name)
    assert (row_of_run(r.table, tagged)["mechanism"], row_of_run(r.table, tagged)["unit"]) == ("dpftrl", "user")
    assert (row_of_run(r.table, plain)["mechanism"], row_of_run(r.table, plain)["unit"]) == ("dpsgd", "example")
    cells = {(c["mechanism"], c["unit"], c["ε"]) for c in markdown_rows(report.render(r, "md"))}
    assert cells == {("—", "—", "—"), ("dpftrl", "user", "6"), ("dpsgd", "example", "1")}
    assert any("dataset.num_users = 40" in n for n in r.notes())
    front = report.pareto_front(r.table)  # ε per user and ε per example: a front each, so both are on one
    assert sorted(front["unit"]) == ["example", "user"]
    texts = _legend_texts(plots.pareto_figure(r.table))
    assert "DP-FTRL configs (mean ± std over seeds)" in texts and "ε per user (N = users)" in texts
