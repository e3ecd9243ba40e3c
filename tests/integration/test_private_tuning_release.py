"""What a private tuning releases (issue 54, item 3): a real ``dpsweep -m sweep.private_tuning=true`` sweep
on digits (σ ∈ {1, 1.5}, 1 epoch), with K = 3 trials, beside a non-private run, into one sqlite store.

Papernot & Steinke 2022 ("Hyperparameter Tuning with Renyi Differential Privacy", ICLR) bound the
released trial's ε for a number of trials K that nobody learns, so that what is released (the reports'
md, csv, tex and html, their figures, and dpsweep-ui's view) shows the released trial alone, at the
procedure's ε under the accountant that computed it (rdp), and never K, the other trials or the trial's
seed. ``dpsweep-report --all-trials`` is the analyst's view of every trial, marked not for release in the
table itself.

K is drawn from the operating system's entropy; the sweep runs in this process with the draw fixed at 3
(``dpsweep.privacy.tuning.draw_k``), so that there are trials to withhold whatever the draw, and each
trial's secret seed is recorded as it is drawn (``dpsweep.privacy.tuning.secret_seed``): the store holds
it nowhere. The trials log their models (``tracking.log_model=true``: MLflow 3 LoggedModels, which the
experiment's Models tab lists whatever the view filters).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers import fresh_store, run_dpsweep, run_main
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from dpsweep.analysis import report
from dpsweep.cli.report import main
from dpsweep.privacy import tuning
from dpsweep.tracking import VIEW_KEY, VIEW_TAG
from dpsweep.tracking.views import save_view

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("private-tuning-release")]

EXPERIMENT = "tuned"
K = 3
COMMON = ["train.epochs=1", "train.progress=false"]
FORMATS = ("md", "csv", "tex", "html")


@dataclass(frozen=True)
class Tuned:
    uri: str
    sweep_id: str
    parent: Run
    trials: list[Run]  # K, the released one among them
    released: Run
    baseline: Run  # a non-private run of the experiment, outside the sweep
    drawn_seeds: list[str]  # each trial's train.seed, as drawn
    sweep_dir: Path  # hydra.sweep.dir: each job's .hydra/overrides.yaml
    single_run_rdp: float  # the released trial's own RDP ε, logged before the release

    @property
    def withheld(self) -> list[Run]:
        return [r for r in self.trials if r.info.run_id != self.released.info.run_id]

    @property
    def seeds(self) -> list[str]:
        return self.drawn_seeds

    def job_overrides(self) -> list[list[str]]:
        """Each trial's overrides as Hydra gave them to its job (what a requeued job is given again)."""
        return [yaml.safe_load(p.read_text()) for p in sorted(self.sweep_dir.glob("*/.hydra/overrides.yaml"))]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuned]:
    cwd = tmp_path_factory.mktemp("private-tuning")
    uri, tracking = fresh_store(cwd, EXPERIMENT)
    before = Path.cwd()
    os.chdir(cwd)
    seeds: list[str] = []
    draw = tuning.secret_seed

    def recorded() -> int:
        seed = draw()
        seeds.append(str(seed))
        return seed

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tuning, "draw_k", lambda *_: K)
            mp.setattr(tuning, "secret_seed", recorded)
            swept = run_dpsweep(
                "-m", "sweep.private_tuning=true", "sweep.tuning_mean_trials=3", "sweep.tuning_distribution=geometric",
                "dp.noise_multiplier=1.0,1.5", "tracking.log_model=true", f"hydra.sweep.dir={cwd / 'sweep'}",
                *COMMON, *tracking,
            )  # fmt: skip
        assert swept.returncode == 0, swept.stdout + swept.stderr
        plain = run_dpsweep("dp=off", "train.seed=0", "tracking.log_model=false", *COMMON, *tracking)
        assert plain.returncode == 0, plain.stdout + plain.stderr
    finally:
        os.chdir(before)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    sweep_id = parent.data.tags["sweep.id"]
    best = parent.data.tags["tuning.best_run_id"]
    # the released trial by the parent's tag alone: it carries no tag of its sweep
    of_sweep = [r for r in runs if r.data.tags.get("sweep.id") == sweep_id and r is not parent]
    trials = [*of_sweep, *(r for r in runs if r.info.run_id == best and r not in of_sweep)]
    [baseline] = [r for r in runs if r.data.params.get("dp.enabled") == "False"]
    assert len(trials) == K == int(parent.data.tags["tuning.k"]) == len(seeds)
    [released] = [r for r in trials if r.data.tags.get("tuning.released") == "true"]
    assert released.info.run_id == best
    own = min(client.get_metric_history(best, "epsilon_rdp"), key=lambda m: m.timestamp).value  # the run's, then
    yield Tuned(uri, sweep_id, parent, trials, released, baseline, seeds, cwd / "sweep", own)  # the procedure's


def _report(tuned: Tuned, *args: str) -> str:
    done = run_main(main, "--experiment", EXPERIMENT, "--tracking-uri", tuned.uri, "--no-log", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr  # the notes of csv go to stderr


def _csv(tuned: Tuned, *args: str) -> pd.DataFrame:
    done = run_main(main, "--experiment", EXPERIMENT, "--tracking-uri", tuned.uri, "--format", "csv", *args)
    assert done.returncode == 0, done.stderr
    return pd.read_csv(io.StringIO(done.stdout), dtype={"run_ids": str})


def _secrets(tuned: Tuned) -> list[str]:
    """What a released output must not contain: each trial's seed, and the withheld trials' and the parent's ids."""
    ids = [r.info.run_id[:8] for r in [*tuned.withheld, tuned.parent]]
    return [*tuned.seeds, *ids]


def test_the_released_outputs_show_the_released_trial_alone_at_the_procedures_rdp_epsilon(
    tuned: Tuned, tmp_path: Path
) -> None:
    procedure = tuned.parent.data.metrics["epsilon_tuning"]
    for scope in ([], ["--sweep", tuned.sweep_id]):
        r = report.build_report(tuned.uri, EXPERIMENT, scope[1] if scope else None)
        private = r.table[r.table["private"]]
        # one row, of the released trial alone: the number of rows and of runs would tell K
        assert list(private["run_ids"]) == [(tuned.released.info.run_id,)] and list(private["runs"]) == [1]
        assert list(private["accountant"]) == ["rdp"] and list(private["epsilon"]) == [pytest.approx(procedure)]
        assert r.counts["total"] == (1 if scope else 2)  # the withheld trials are counted nowhere
        for fmt in FORMATS:
            text = _report(tuned, *scope, "--format", fmt)
            assert not [s for s in _secrets(tuned) if s in text], (fmt, text)
            assert f"{K} runs" not in text and f"{K + 1} runs" not in text and "tuning.k" not in text
        csv = _csv(tuned, *scope)
        assert list(csv[csv["private"]]["accountant"]) == ["rdp"] and list(csv[csv["private"]]["runs"]) == [1]
    tex = _report(tuned, "--sweep", tuned.sweep_id, "--format", "tex")
    [caption] = [line for line in tex.splitlines() if line.startswith(r"\caption{")]
    assert "the whole tuning procedure's, under the rdp accountant" in caption, caption
    md = _report(tuned, "--format", "md")
    assert f"run {tuned.released.info.run_id[:8]}: the released trial of a private tuning" in md
    assert "the rdp accountant, which computed it" in md
    # the figures (pdf for a paper; svg here, whose text stays text): the released trial alone, no seed
    out = tmp_path / "paper"
    _report(tuned, "--sweep", tuned.sweep_id, "--out", str(out), "--figure-format", "svg",
            "--runs", tuned.released.info.run_id[:8], tuned.baseline.info.run_id[:8])  # fmt: skip
    figures = {p.name: p.read_text() for p in out.glob("*.svg")}
    assert {"pareto.svg", "curves.svg"} <= set(figures)
    for name, text in figures.items():
        assert not [s for s in _secrets(tuned) if s in text] and "NOT FOR RELEASE" not in text, name
    assert "rdp accountant" in figures["pareto.svg"]  # the ε axis names the procedure's accountant


def test_all_trials_is_the_analysts_view_marked_not_for_release_in_every_format(tuned: Tuned, tmp_path: Path) -> None:
    r = report.build_report(tuned.uri, EXPERIMENT, tuned.sweep_id, all_trials=True)
    trials = r.table[r.table["tuning"].notna()]  # and the baseline the sweep borrows
    assert r.all_trials and int(trials["runs"].sum()) == K and (~r.table["private"]).sum() == 1  # every trial: K
    released = r.table[r.table["tuning"] == "released"]
    assert list(released["run_ids"]) == [(tuned.released.info.run_id,)]  # a row of its own
    csv = _csv(tuned, "--sweep", tuned.sweep_id, "--all-trials")
    assert set(csv["release"]) == {"not for release"} and int(csv[csv["private"]]["runs"].sum()) == K
    assert list(csv[csv["trial"] == "released"]["run_ids"]) == [tuned.released.info.run_id]
    assert set(csv[csv["private"]]["trial"]) <= {"released", "withheld"}
    md = _report(tuned, "--sweep", tuned.sweep_id, "--all-trials")
    header, _, *rows = [line for line in md.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    at = [c.strip() for c in header.strip("|").split("|")]
    assert [row[at.index("release")] for row in cells] == ["not for release"] * len(rows)
    assert sorted(row[at.index("trial")] for row in cells).count("released") == 1
    html = _report(tuned, "--sweep", tuned.sweep_id, "--all-trials", "--format", "html")
    assert html.count("<td>not for release</td>") == len(r.table) and "<th>trial</th>" in html
    tex = _report(tuned, "--sweep", tuned.sweep_id, "--all-trials", "--format", "tex")
    [caption] = [line for line in tex.splitlines() if line.startswith(r"\caption{")]
    assert caption.startswith(r"\caption{Not for release: every trial of a private tuning"), caption
    out = tmp_path / "all"
    _report(tuned, "--sweep", tuned.sweep_id, "--all-trials", "--out", str(out), "--figure-format", "svg")
    assert all("NOT FOR RELEASE" in p.read_text() for p in out.glob("*.svg")) and any(out.glob("*.svg"))


def test_dpsweep_uis_view_shows_the_released_trial_alone_without_its_seed_or_a_way_to_k(tuned: Tuned) -> None:
    client = MlflowClient(tuned.uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    key = save_view(client, experiment.experiment_id)
    state = json.loads(client.get_experiment(experiment.experiment_id).tags[VIEW_TAG + key])
    assert key == VIEW_KEY and "searchFilter" in state
    # the runs MLflow's UI lists under the view's filter: the released trial and the run outside the sweep
    shown = client.search_runs([experiment.experiment_id], state["searchFilter"])
    assert {r.info.run_id for r in shown} == {tuned.released.info.run_id, tuned.baseline.info.run_id}
    assert "params.`train.seed`" not in state["selectedColumns"]  # it differs between them, and is secret
    [released] = [r for r in shown if r.info.run_id == tuned.released.info.run_id]
    assert not [s for s in tuned.seeds if s in released.info.run_name]  # the name holds no seed
    assert "train.seed" not in released.data.params  # nor its params (issue 54, item 3)
    assert released.info.run_name == released.data.tags["mlflow.runName"]
    # no link to the parent run, which holds K
    assert not {"mlflow.parentRunId", "sweep.parent_run_id"} & set(released.data.tags)
    assert all(r.data.tags["tuning.withheld"] == "true" for r in [*tuned.withheld, tuned.parent])


def test_a_store_from_before_the_release_tags_is_withheld_too(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """A tuning that ended before its release, or was tagged by an older dpsweep: dpsweep-ui's view still
    leaves out every trial but the released one, and the parent run; and the models of the trials of a
    sweep that ended unreleased are deleted, which MLflow's Models tab would list whatever the view
    filters (issue 54, item 3), but not those of a sweep still running (one of them is to be released)."""
    exp_id = client.create_experiment(experiment_name)

    def logged(tags: dict[str, str], seed: str | None = None) -> str:
        run_id = client.create_run(exp_id, tags=tags).info.run_id
        client.log_param(run_id, "task.name", "classifier")
        if seed is not None:
            client.log_param(run_id, "train.seed", seed)
        client.log_metric(run_id, "test_accuracy", 0.5)
        return run_id

    trial = {"sweep.id": "s1", "sweep.private_tuning": "True"}
    parent = logged({"sweep.id": "s1", "sweep.role": "parent", "tuning.k": "2"})
    best = logged(trial | {"tuning.released": "true"}, "11")
    other = logged(trial | {"tuning.released": "false"}, "12")
    unreleased = logged({"sweep.id": "s2", "sweep.private_tuning": "True"}, "13")  # its sweep died before release
    dead_parent = logged({"sweep.id": "s2", "sweep.role": "parent"})
    client.set_terminated(dead_parent, "KILLED")
    plain = logged({"sweep.id": "s3"}, "0")
    running = logged({"sweep.id": "s4", "sweep.private_tuning": "True"}, "14")  # its sweep runs now
    logged({"sweep.id": "s4", "sweep.role": "parent"})
    models = {run_id: client.create_logged_model(exp_id, name="model", source_run_id=run_id).model_id
              for run_id in (best, unreleased, plain, running)}  # fmt: skip
    save_view(client, exp_id)
    listed = {m.model_id for m in client.search_logged_models([exp_id])}
    assert listed == {models[best], models[plain], models[running]}
    state = json.loads(client.get_experiment(exp_id).tags[VIEW_TAG + VIEW_KEY])
    shown = {r.info.run_id for r in client.search_runs([exp_id], state["searchFilter"])}
    assert shown == {best, plain}
    hidden = {parent, other, unreleased, dead_parent, running}
    assert all(client.get_run(r).data.tags.get("tuning.withheld") == "true" for r in hidden)
    assert "params.`train.seed`" not in state["selectedColumns"]


def _logged(client: MlflowClient, run: Run, tmp: str) -> str:
    """All a run shows of itself: its name, tags, params and config.yaml."""
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", tmp)).read_text()
    return json.dumps([run.info.run_name, run.data.tags, run.data.params]) + config


def test_the_released_trial_leads_neither_to_its_sweep_nor_to_a_seed(tuned: Tuned) -> None:
    """Issue 54, item 3 (D2 a, b, d): no tag of the released trial names its sweep, whose search lists the
    parent run (which holds K) and the other trials, and nothing a trial logged tells its seed, not even a
    hash of it (31 bits are searched in minutes); each trial's checkpoint directory is named by an override
    of its own job, which a requeued job is given again."""
    client = MlflowClient(tuned.uri)
    released = client.get_run(tuned.released.info.run_id)  # as the release left it
    tags = released.data.tags
    links = [tuned.sweep_id, tuned.parent.info.run_id]
    assert not [k for k, v in tags.items() if v in links], tags  # sweep.id and claim.owner held the sweep's id
    assert not {"sweep.id", "claim.owner", "sweep.parent_run_id", "mlflow.parentRunId", "config.hash"} & set(tags)
    with tempfile.TemporaryDirectory() as tmp:
        for trial in tuned.trials:  # whichever is released: no trial logs its seed or its parent run
            run = client.get_run(trial.info.run_id)
            shown = _logged(client, run, tmp)
            assert "train.seed" not in run.data.params and not [s for s in tuned.seeds if s in shown], shown
            assert tuned.parent.info.run_id not in shown, shown
        config = yaml.safe_load(Path(client.download_artifacts(released.info.run_id, "config.yaml", tmp)).read_text())
    assert "seed" not in config["train"] and not {"id", "parent_run_id"} & set(config["sweep"])
    assert not [s for s in links if s in json.dumps(config)]
    # the checkpoint directory: no hash of the job's overrides, whose seed a search would find; the override
    # that names it is the job's own, so that a requeue (the same overrides) finds its checkpoint again
    jobs = tuned.job_overrides()
    assert len(jobs) == K
    directories = {client.get_run(r.info.run_id).data.tags["train.checkpoint_dir"] for r in tuned.trials}
    for job in jobs:
        seeded = hashlib.sha256(" ".join(job).encode()).hexdigest()[:16]  # what named it before (issue 33)
        assert not [d for d in directories if seeded in d or any(s in d for s in tuned.seeds)], (seeded, directories)
    given = {o.partition("=")[2].strip("'") for job in jobs for o in job if o.startswith("train.checkpoint_dir=")}
    assert directories == given and len(given) == K


def test_the_models_tab_lists_the_released_trials_model_alone_without_its_seed(tuned: Tuned) -> None:
    """Issue 54, item 3 (D2 c): each trial logged its model (tracking.log_model=true); MLflow's Models tab
    lists an experiment's LoggedModels whatever dpsweep-ui's view filters, each with its run's params:
    after the release, the released trial's is the only one, and it carries no train.seed."""
    client = MlflowClient(tuned.uri)
    models = client.search_logged_models([tuned.parent.info.experiment_id])
    assert [m.source_run_id for m in models] == [tuned.released.info.run_id]  # K = 3 trials logged one each
    [model] = models
    assert "train.seed" not in model.params and not [s for s in tuned.seeds if s in json.dumps(model.params)]
    assert model.params["dp.noise_multiplier"] == tuned.released.data.params["dp.noise_multiplier"]


def test_the_released_trials_own_epsilon_is_set_beside_the_procedures_under_the_same_accountant(
    tuned: Tuned,
) -> None:
    """Issue 54, item 3 (D3): the procedure's ε is RDP's (Papernot & Steinke 2022); the released trial's
    ``epsilon_single_run`` beside it is the trial's own RDP ε (its ``epsilon_rdp``), not its ``epsilon``
    under its dp.accountant (pld, lower), and its ledger and note name the accountant."""
    client = MlflowClient(tuned.uri)
    released = client.get_run(tuned.released.info.run_id)
    metrics = released.data.metrics
    assert metrics["epsilon_single_run"] == pytest.approx(tuned.single_run_rdp)
    with tempfile.TemporaryDirectory() as tmp:
        record = json.loads(
            Path(client.download_artifacts(released.info.run_id, "privacy_ledger.json", tmp)).read_text()
        )
    [dpsgd, event] = record["events"]
    assert dpsgd["epsilon_alone"]["rdp"] == pytest.approx(tuned.single_run_rdp)  # one event: the run's own RDP ε
    assert dpsgd["epsilon_alone"]["pld"] < tuned.single_run_rdp  # what epsilon_single_run held before (pld)
    assert record["epsilon_single_run"] == {"rdp": pytest.approx(tuned.single_run_rdp)}
    assert record["epsilon"] == {"rdp": pytest.approx(metrics["epsilon_tuning"])} and record["accountant"] == "rdp"
    assert f"own ε under rdp was {tuned.single_run_rdp:.6g}" in event["note"], event["note"]
    assert "epsilon_single_run is this trial's alone, under RDP too" in released.data.tags["tuning.epsilon"]
    assert released.data.tags["tuning.accountant"] == "rdp"
    assert metrics["epsilon_single_run"] < metrics["epsilon"] == metrics["epsilon_tuning"]


def test_a_private_tuning_with_shared_streams_is_refused_before_any_job(tmp_path: Path) -> None:
    """Issue 54, item 3 (D6): dp.stream_seed gives every run that sets it the same batches and noise;
    the trials of a private tuning must be independent repetitions (Papernot & Steinke 2022)."""
    uri, tracking = fresh_store(tmp_path, EXPERIMENT)
    before = Path.cwd()
    os.chdir(tmp_path)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tuning, "draw_k", lambda *_: 1)  # quick, where it is not refused
            done = run_dpsweep(
                "-m", "sweep.private_tuning=true", "sweep.tuning_mean_trials=3", "sweep.tuning_distribution=geometric",
                "dp.noise_multiplier=1.0,1.5", "dp.stream_seed=7", *COMMON, "tracking.log_model=false", *tracking,
            )  # fmt: skip
    finally:
        os.chdir(before)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert "dp.stream_seed=7 is invalid" in line and "sweep.private_tuning=true" in line, done.stderr
    assert not MlflowClient(uri).search_runs([e.experiment_id for e in MlflowClient(uri).search_experiments()])
