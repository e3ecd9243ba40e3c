"""``dpsweep-report`` on ``task=gan`` runs: the privacy–utility table of a DP-WGAN-GP (ε, TSTR accuracy
mean ± std over seeds, the drop against the non-private GAN), the real-data reference and the
memorisation share under it, and ``gan_samples.png``, the final sample grids by ε.

Four real GAN runs on digits (σ=1.2 and dp=off, seeds 0 and 1, one epoch each) are trained once for
the module into their own sqlite store; the other tests log small runs with the MLflow client.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, stdev

import numpy as np
import pandas as pd
import pytest
from helpers import fresh_store, log_run
from hydra import compose, initialize_config_module
from mlflow.tracking import MlflowClient
from PIL import Image

from dpsweep.analysis import report
from dpsweep.analysis.report import samples
from dpsweep.analysis.report.cells import epsilon_text
from dpsweep.cli.report import run
from dpsweep.run.runner import train

GAN_RUNS = pytest.mark.xdist_group("report_gan")  # the tests of the trained runs: one worker trains them once
EXPERIMENT = "gan-report"
QUICK = [
    "task=gan", "train.epochs=1", "task.tstr_epochs=1", "task.critic_width=8", "task.generator_width=16",
    "dataset.test_fraction=0.75",  # 449 training images: 8 critic steps, a quarter of the work
    "task.memorisation_samples=100", "task.memorisation_check=true", "tracking.log_model=false",
    "train.progress=false",
]  # fmt: skip


@dataclass(frozen=True)
class GanStore:
    uri: str
    private: tuple[str, ...]  # run ids, σ=1.2, seeds 0 and 1
    public: tuple[str, ...]  # run ids, dp=off, seeds 0 and 1

    def metric(self, run_ids: tuple[str, ...], name: str) -> list[float]:
        client = MlflowClient(self.uri)
        return [client.get_run(r).data.metrics[name] for r in run_ids]


@pytest.fixture(scope="module")
def gan_store(tmp_path_factory: pytest.TempPathFactory) -> GanStore:
    """2 seeds of a DP GAN (σ=1.2) and 2 of the non-private GAN, 1 epoch each, in their own store."""
    cwd = tmp_path_factory.mktemp("report-gan")
    uri, tracking = fresh_store(cwd, EXPERIMENT)
    ids: dict[str, list[str]] = {"private": [], "public": []}
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        for kind, dp in (("private", "dp.noise_multiplier=1.2"), ("public", "dp=off")):
            for seed in (0, 1):
                ids[kind].append(
                    train(compose("config", overrides=[*QUICK, *tracking, dp, f"train.seed={seed}"])).run_id
                )
    return GanStore(uri, tuple(ids["private"]), tuple(ids["public"]))


def _row(table: pd.DataFrame, private: bool) -> pd.Series:
    [index] = table.index[table["private"] == private]
    return table.loc[index]


def _rows_md(text: str) -> list[list[str]]:
    lines = [x for x in text.splitlines() if x.startswith("|")]
    return [[c.strip() for c in x.strip().strip("|").split("|")] for x in lines]


@pytest.mark.slow
@GAN_RUNS
def test_gan_rows_score_tstr_and_drop_against_the_non_private_gan(gan_store: GanStore) -> None:
    r = report.build_report(gan_store.uri, EXPERIMENT)
    t = r.table
    assert len(t) == 2 and list(t["model"]) == ["gan", "gan"] and list(t["task"]) == ["gan", "gan"]
    assert not t.iloc[0]["private"]  # the non-private GAN leads its block
    private, public = _row(t, True), _row(t, False)
    tstr_private = gan_store.metric(gan_store.private, "tstr_accuracy")
    tstr_public = gan_store.metric(gan_store.public, "tstr_accuracy")
    assert private["test_accuracy_mean"] == pytest.approx(mean(tstr_private), rel=1e-12)
    assert private["test_accuracy_std"] == pytest.approx(stdev(tstr_private), rel=1e-12)
    assert public["test_accuracy_mean"] == pytest.approx(mean(tstr_public), rel=1e-12)
    assert private["accuracy_drop"] == pytest.approx(mean(tstr_public) - mean(tstr_private), rel=1e-12, abs=1e-15)
    assert private["baseline_config_id"] == public["config_id"] and pd.isna(public["accuracy_drop"])
    assert private["epsilon"] == pytest.approx(max(gan_store.metric(gan_store.private, "epsilon")), rel=1e-12)
    assert (private["runs"], public["runs"], private["runs_without_accuracy"]) == (2, 2, 0)
    critic_lr = float(MlflowClient(gan_store.uri).get_run(gan_store.private[0]).data.params["task.critic_lr"])
    assert list(t["lr"]) == [critic_lr, critic_lr] != [0.05, 0.05]  # the GAN's own lr, not optimizer.lr (item 8)
    shares = gan_store.metric(gan_store.private, "memorisation_share")
    assert private["memorisation_share"] == pytest.approx(mean(shares), rel=1e-12)

    # the reference: the same classifier trained on real data, over the non-private GAN runs
    real = gan_store.metric(gan_store.public, "real_accuracy")
    [ref] = report.reference_accuracies(r.table_runs).to_dict("records")
    assert (ref["dataset"], ref["model"], ref["classifier"], ref["runs"]) == ("digits", "gan", "cnn", 2)
    assert ref["real_accuracy_mean"] == pytest.approx(mean(real), rel=1e-12)
    assert ref["real_accuracy_std"] == pytest.approx(stdev(real), rel=1e-12)
    notes = r.notes()
    [reference] = [n for n in notes if "trained on real data" in n]
    shown = f"{mean(real) * 100:.2f} ± {stdev(real) * 100:.2f}%"
    assert reference.startswith("digits/gan: the same classifier (cnn)") and f"{shown} test accuracy" in reference
    assert "(2 non-private runs)" in reference
    [memorised] = [n for n in notes if "memorisation share" in n]
    assert f"ε={epsilon_text(private['epsilon'])} {mean(shares) * 100:.1f}%" in memorised
    assert "TSTR" in notes[1] and not any("no tstr_accuracy metric" in w for w in r.warnings)
    assert any(
        "logged memorisation_share, a statistic of the training data that no accountant" in w for w in r.warnings
    )

    # the rendered table says what its accuracy is
    md = report.render(r, "md")
    rows = _rows_md(md)
    header = rows[0]
    assert "TSTR accuracy (%)" in header and not any("test accuracy" in h for h in header)
    cells = [dict(zip(header, row, strict=True)) for row in rows[2:]]
    assert [(c["model"], c["task"]) for c in cells] == [("gan", "gan"), ("gan", "gan")]
    assert float(cells[1]["TSTR accuracy (%)"].split(" ± ")[0]) == pytest.approx(mean(tstr_private) * 100, abs=0.0051)
    assert float(cells[1]["drop (pp)"]) == pytest.approx(private["accuracy_drop"] * 100, abs=0.0051)
    assert r"TSTR accuracy (\%)" in report.render(r, "tex")
    csv = pd.read_csv(io.StringIO(report.render(r, "csv")), float_precision="round_trip")
    assert list(csv["task"]) == ["gan", "gan"] and list(csv["model"]) == ["gan", "gan"]
    assert csv["test_accuracy_mean"].tolist() == t["test_accuracy_mean"].tolist()


@pytest.mark.slow
@GAN_RUNS
def test_report_out_draws_the_final_sample_grids_by_epsilon(
    gan_store: GanStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    r = run(["--experiment", EXPERIMENT, "--tracking-uri", gan_store.uri, "--out", str(out)])
    err = capsys.readouterr().err
    assert f"wrote {out / 'gan_samples.png'}" in err and "Downloading artifacts" not in err  # no progress bars
    assert {p.name for p in out.iterdir()} == {"report.md", "pareto.png", "curves.png", "memory.png", "gan_samples.png"}
    with Image.open(out / "gan_samples.png") as img:
        assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 300  # 2 tiles side by side
        img.verify()
    assert 20_000 < (out / "gan_samples.png").stat().st_size < 5_000_000
    assert "![gan samples](gan_samples.png)" in (out / "report.md").read_text()
    # the tiles: by ε, the non-private GAN last; each the grid of its row's first run
    order = samples.sample_rows(r.table, "gan")
    assert list(order["private"]) == [True, False]
    client = MlflowClient(gan_store.uri)
    epoch, grid = samples.final_sample_grid(client, order.iloc[0]["run_ids"][0], tmp_path / "grid") or (0, None)
    assert epoch == 1 and grid is not None and grid.name == "epoch_001.png"
    # curves.png read the chosen runs' TSTR accuracy (their objective), not test_accuracy
    chosen = report.best_runs(r.runs)
    assert set(chosen) == set(gan_store.private)
    assert report.history_metrics(r.runs, chosen) == ["tstr_accuracy", "epsilon"]


# ---------------------------------------------------------------------------------------------
# logged runs: the newest sample grid, tasks mixed in one table
# ---------------------------------------------------------------------------------------------


BASE = {"dataset.name": "digits", "model.name": "cnn", "train.batch_size": "64", "optimizer.lr": "0.05",
        "train.epochs": "2", "train.seed": "0"}  # fmt: skip
DP = {"dp.enabled": "True", "dp.noise_multiplier": "1.0", "dp.max_grad_norm": "1.0", "dp.delta": "1e-05",
      "dp.accountant": "rdp"}  # fmt: skip
OFF = {"dp.enabled": "False"}
GAN = {"task.name": "gan", "task.latent_dim": "64", "task.critic_lr": "0.001", "task.tstr_epochs": "15"}


def test_the_newest_sample_grid_is_the_one_of_the_highest_epoch(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, tmp_path: Path
) -> None:
    run_id = log_run(client, experiment_name, BASE | OFF | GAN, {"tstr_accuracy": 0.5}, {"task.name": "gan"})
    for epoch in (2, 10, 9):  # logged out of order; 10 > 9 > 2 as numbers
        client.log_image(run_id, np.full((8, 8), epoch, dtype=np.uint8), f"samples/epoch_{epoch:03d}.png")
    found = samples.final_sample_grid(client, run_id, tmp_path)
    assert found is not None and found[0] == 10
    with Image.open(found[1]) as img:
        assert np.asarray(img).max() == 10
    bare = log_run(client, experiment_name, BASE | OFF | GAN, {"tstr_accuracy": 0.5}, {})
    assert samples.final_sample_grid(client, bare, tmp_path) is None


def test_mixed_tasks_keep_their_blocks_and_the_table_says_which_accuracy_is_whose(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, tmp_path: Path
) -> None:
    # classifier runs from before tasks (no task.name) and GAN runs (model.name is the TSTR classifier)
    log_run(client, experiment_name, BASE | OFF, {"test_accuracy": 0.95}, {})
    log_run(client, experiment_name, BASE | DP, {"test_accuracy": 0.80, "epsilon": 2.0}, {})
    log_run(client, experiment_name, BASE | OFF | GAN, {"tstr_accuracy": 0.70, "real_accuracy": 0.93}, {})
    log_run(client, experiment_name, BASE | OFF | GAN | {"train.seed": "1"},
            {"tstr_accuracy": 0.60, "real_accuracy": 0.91}, {})  # fmt: skip
    log_run(client, experiment_name, BASE | DP | GAN, {"tstr_accuracy": 0.40, "epsilon": 2.0}, {})
    r = report.build_report(mlflow_uri, experiment_name)
    t = r.table.set_index(["model", "private"])
    assert list(r.table["model"]) == ["cnn", "cnn", "gan", "gan"]
    assert t.loc[("cnn", True), "task"] == "classifier" and t.loc[("gan", True), "task"] == "gan"
    assert t.loc[("cnn", True), "accuracy_drop"] == pytest.approx(0.15)  # against the classifier baseline
    assert t.loc[("gan", False), "test_accuracy_mean"] == pytest.approx(0.65)
    assert t.loc[("gan", True), "accuracy_drop"] == pytest.approx(0.25)  # against the non-private GAN
    assert report.swept_params(r.table) == []  # task.* differ from the classifier's (absent) only: not swept
    md = report.render(r, "md")
    header = _rows_md(md)[0]
    assert "accuracy (%)" in header and "task" in header and not any(h.startswith("task.") for h in header)
    assert "Accuracy: each row's task objective (classifier rows: test accuracy; gan rows: TSTR accuracy)" in md
    assert "digits/gan: the same classifier (cnn) trained on real data instead: 92.00 ± 1.41% test accuracy" in md
    assert not any("no test_accuracy metric" in w or "no tstr_accuracy" in w for w in r.warnings)
    # the sample figure: GAN rows only; runs without grids get a tile that says so
    path = samples.plot_task_samples(r, "gan", tmp_path / "gan_samples.png")
    assert path is not None and path.name == "gan_samples.png" and path.stat().st_size > 0
    assert list(samples.sample_rows(r.table, "gan")["model"]) == ["gan", "gan"]


def test_a_classifier_only_report_has_no_task_column_and_no_sample_figure(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, tmp_path: Path
) -> None:
    log_run(client, experiment_name, BASE | OFF | {"task.name": "classifier"}, {"test_accuracy": 0.95}, {})
    log_run(client, experiment_name, BASE | DP | {"task.name": "classifier"}, {"test_accuracy": 0.8, "epsilon": 2}, {})
    r = report.build_report(mlflow_uri, experiment_name)
    header = _rows_md(report.render(r, "md"))[0]
    assert "test accuracy (%)" in header and "task" not in header
    assert "task" not in pd.read_csv(io.StringIO(report.render(r, "csv"))).columns
    assert list(r.table["task"]) == ["classifier", "classifier"] and list(r.table["model"]) == ["cnn", "cnn"]
    assert samples.plot_task_samples(r, "gan", tmp_path / "gan_samples.png") is None
    assert samples.plot_samples(r, tmp_path) == []
    assert not (tmp_path / "gan_samples.png").exists()
