"""Optuna search through the dpsweep sweeper: studies, resume, Pareto sets, failures, pruning, bad input.

Studies run the dpsweep app in this process (``helpers.run_dpsweep``: the same Hydra app, exit code
and output as the console script; tests/integration/test_cli.py runs the console script itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from helpers import Composer, run_dpsweep
from mlflow.tracking import MlflowClient

from dpsweep.config import ConfigError, to_config
from dpsweep.launchers.nodes import ParamSpec
from dpsweep.launchers.optuna_sweeper import BEAT_ATTR, DRIVER_ATTR, _fail_dead_trials, _tell
from dpsweep.launchers.search import OBJECTIVES, check_search_space, distribution, grid_values
from dpsweep.process.liveness import ProcessId
from dpsweep.run.pruning import open_storage
from dpsweep.tracking import STALE_AFTER_S

FAST = ["train.epochs=1", "train.progress=false", "tracking.log_model=false"]  # no model: saving it takes seconds


def dpsweep(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``dpsweep -m *args`` in this process, from ``cwd`` (each test's own directory)."""
    assert Path.cwd() == cwd
    return run_dpsweep("-m", *args)


def write_search(folder: Path, name: str, body: str) -> list[str]:
    """A user's own search file, added with --config-dir."""
    (folder / "search").mkdir(parents=True, exist_ok=True)
    (folder / "search" / f"{name}.yaml").write_text("# @package _global_\n" + body)
    return ["--config-dir", str(folder), f"search={name}"]


def trial_runs(cwd: Path, study: str) -> list[object]:
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dpsweep")
    if exp is None:  # (a refused study may leave the store it warmed, without its experiment)
        return []
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`optuna.study` = '{study}'")


def load(cwd: Path, study: str) -> optuna.Study:
    return optuna.load_study(study_name=study, storage=f"sqlite:///{cwd / 'optuna.db'}")


@pytest.mark.slow
def test_study_runs_resumes_and_tags_its_trials(tmp_path: Path) -> None:
    args = ["search=accuracy_tpe", "hydra.sweeper.optuna.pruner=null", "hydra.sweeper.optuna.n_jobs=2", *FAST]
    first = dpsweep(tmp_path, *args, "hydra.sweeper.optuna.n_trials=4")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "dpsweep: study digits_accuracy_tpe: 4 trials (4 complete)" in first.stdout
    second = dpsweep(tmp_path, *args, "hydra.sweeper.optuna.n_trials=7")  # same study name: resume
    assert second.returncode == 0, second.stdout + second.stderr
    study = load(tmp_path, "digits_accuracy_tpe")
    assert [t.number for t in study.trials] == list(range(7))  # exactly 3 added, numbering continued
    runs = [r for r in trial_runs(tmp_path, "digits_accuracy_tpe") if r.data.tags.get("sweep.role") != "parent"]  # type: ignore[attr-defined]
    assert sorted(int(r.data.tags["optuna.trial"]) for r in runs) == list(range(7))  # type: ignore[attr-defined]
    for trial in study.trials:
        [run] = [r for r in runs if r.data.tags["optuna.trial"] == str(trial.number)]  # type: ignore[attr-defined]
        assert trial.values == [run.data.metrics["test_accuracy"]]  # type: ignore[attr-defined]
        assert float(run.data.params["dp.noise_multiplier"]) == trial.params["dp.noise_multiplier"]  # type: ignore[attr-defined]
    drawn = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(set(drawn)) == 7, drawn  # the resumed sampler did not draw the first driver's trials again


def test_a_starting_driver_fails_only_the_trials_of_dead_drivers(tmp_path: Path) -> None:
    """Issue 39, item 6: a second driver on a study must leave the first driver's running trials be."""
    gone = subprocess.run(["true"], check=True)  # a process that has ended: its token names no live one
    assert gone.returncode == 0
    dead = ProcessId.current().token.replace(f":{os.getpid()}:", ":999999999:")
    study = optuna.create_study(study_name="shared", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    mine, theirs, old, remote = (study.ask() for _ in range(4))
    mine.set_user_attr(DRIVER_ATTR, ProcessId.current().token)
    mine.set_user_attr(BEAT_ATTR, time.time())
    theirs.set_user_attr(DRIVER_ATTR, dead)
    remote.set_user_attr(DRIVER_ATTR, "elsewhere:1:2")  # another host: judged by its heartbeat
    remote.set_user_attr(BEAT_ATTR, time.time() - 2 * STALE_AFTER_S)
    failed = dict(_fail_dead_trials(study))
    assert sorted(failed) == [theirs.number, old.number, remote.number]
    assert "no longer running" in failed[theirs.number] and "no heartbeat" in failed[remote.number]
    states = {t.number: t.state for t in study.trials}
    assert states[mine.number] == optuna.trial.TrialState.RUNNING
    assert _tell(study, theirs.number, [0.5], optuna.trial.TrialState.COMPLETE) is False  # told already: no crash
    assert _tell(study, mine.number, [0.5], optuna.trial.TrialState.COMPLETE) is True


@pytest.mark.slow
def test_a_study_resumed_after_its_driver_was_killed_ends_its_runs_and_fails_its_trials(tmp_path: Path) -> None:
    """The killed driver's trial is told FAIL and its MLflow run ended KILLED by the resumed study."""
    args = ["search=accuracy_tpe", "hydra.sweeper.optuna.pruner=null", "hydra.sweeper.optuna.n_jobs=1",
            "hydra.sweeper.optuna.n_trials=2", "train.progress=false", "tracking.log_model=false"]  # fmt: skip
    # the store exists before the driver starts: this test's polling client and the driver would both create it
    # (MLflow's migrations of a new sqlite file are not safe against a second process doing the same)
    MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments(max_results=1)
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(
        [Path(sys.executable).parent / "dpsweep", "-m", *args, "train.epochs=500"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.time() + 300
        while not any(  # a trial's run, not the study's parent run (RUNNING before any trial is asked)
            r.info.status == "RUNNING" and r.data.tags.get("sweep.role") != "parent"  # type: ignore[attr-defined]
            for r in trial_runs(tmp_path, "digits_accuracy_tpe")
        ):
            assert time.time() < deadline and driver.poll() is None, (tmp_path / "driver.log").read_text()
            time.sleep(0.5)
    finally:
        driver.kill()
        driver.wait(timeout=60)
    again = dpsweep(tmp_path, *args, "train.epochs=1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "ended run" in again.stdout and "KILLED" in again.stdout
    runs = trial_runs(tmp_path, "digits_accuracy_tpe")
    assert not [r for r in runs if r.info.status == "RUNNING"]  # type: ignore[attr-defined]
    states = [t.state for t in load(tmp_path, "digits_accuracy_tpe").trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]  # a failed trial counts


@pytest.mark.slow
def test_multi_objective_study_writes_its_pareto_set(tmp_path: Path) -> None:
    short = "hydra.sweeper.optuna.params={train.epochs: {type: int, low: 1, high: 3}}"  # the preset's: 2 to 10
    proc = dpsweep(tmp_path, "search=pareto_nsga2", "hydra.sweeper.optuna.n_trials=4", short, "train.progress=false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Pareto set: trial" in proc.stdout
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [parent] = [r for r in trial_runs(tmp_path, "digits_pareto_nsga2") if r.data.tags.get("sweep.role") == "parent"]  # type: ignore[attr-defined]
    pareto = json.loads(Path(client.download_artifacts(parent.info.run_id, "pareto.json")).read_text())  # type: ignore[attr-defined]
    complete = [t for t in load(tmp_path, "digits_pareto_nsga2").trials if t.values]
    assert pareto and all(len(p["values"]) == 2 for p in pareto)
    for p in pareto:  # no complete trial dominates a Pareto member (accuracy up, ε down)
        acc, eps = p["values"]
        assert not any(t.values[0] >= acc and t.values[1] <= eps and t.values != [acc, eps] for t in complete)


@pytest.mark.slow
def test_a_failing_trial_does_not_stop_the_study(tmp_path: Path) -> None:
    args = write_search(tmp_path / "conf", "fails", """
hydra:
  sweeper:
    optuna:
      sampler: grid
      n_trials: 2
      study_name: fails
      params:
        train.batch_size: {type: categorical, choices: [64, 5000]}
""")  # fmt: skip
    proc = dpsweep(tmp_path, *args, *FAST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    states = sorted(t.state.name for t in load(tmp_path, "fails").trials)
    assert states == ["COMPLETE", "FAIL"]  # B=5000 > N failed; the other trial still ran
    assert "2 trials (1 complete, 1 fail)" in proc.stdout


@pytest.mark.slow
def test_pruning_stops_a_trial_whose_accuracy_lags(tmp_path: Path) -> None:
    def phase(name: str, lr: float, trials: int) -> subprocess.CompletedProcess[str]:
        # a narrow float range pins the learning rate (categorical choices may not change within a study)
        args = write_search(tmp_path / f"conf_{name}", name, f"""
hydra:
  sweeper:
    optuna:
      sampler: random
      n_trials: {trials}
      study_name: prune
      pruner: median
      params:
        optimizer.lr: {{type: float, low: {lr}, high: {lr * 1.0001}}}
""")  # fmt: skip
        return dpsweep(tmp_path, *args, "train.epochs=4", "train.progress=false", "sweep.pruner_startup_trials=1")

    good = phase("good", 0.05, 1)  # one healthy trial sets the median
    assert good.returncode == 0, good.stdout + good.stderr
    lagging = phase("bad", 1e-5, 2)  # a learning rate that learns nothing
    assert lagging.returncode == 0, lagging.stdout + lagging.stderr
    study = load(tmp_path, "prune")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED"]
    [run] = [r for r in trial_runs(tmp_path, "prune") if r.data.tags.get("optuna.trial") == "1"]  # type: ignore[attr-defined]
    assert run.info.status == "KILLED" and run.data.tags["optuna.pruned"] == "true"  # type: ignore[attr-defined]
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "test_accuracy")  # type: ignore[attr-defined]
    assert 1 <= len(history) < 4  # stopped early, partial metrics kept


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["search=accuracy_tpe", "hydra.sweeper.optuna.sampler=cmaes"],
            "unknown sampler 'cmaes'; valid: grid, nsga2, random, tpe",
        ),
        (["search=accuracy_tpe", "hydra.sweeper.optuna.objective=loss"], "unknown objective 'loss'; valid: accuracy"),
        (
            ["search=accuracy_tpe", "hydra.sweeper.optuna.sampler=nsga2"],
            "hydra.sweeper.optuna.sampler='nsga2' is invalid",
        ),
        (["search=accuracy_tpe", "hydra.sweeper.optuna.n_trials=0"], "hydra.sweeper.optuna.n_trials=0 is invalid"),
        (
            ["search=accuracy_tpe", "hydra.sweeper.optuna.storage=postgresql://u:p@127.0.0.1:1/db"],
            "a reachable Optuna storage",
        ),
        (["search=accuracy_tpe", "hydra.sweeper.optuna.storage=sqlite:////no/such/dir/optuna.db"], "does not exist"),
    ],
)
def test_bad_studies_stop_before_any_trial(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = dpsweep(tmp_path, *args, *FAST)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert not (tmp_path / "mlflow.db").exists() or trial_runs(tmp_path, "digits_accuracy_tpe") == []


def test_unknown_parameter_and_empty_range_in_a_search_file(tmp_path: Path) -> None:
    unknown = write_search(
        tmp_path / "c1",
        "typo",
        """
hydra: {sweeper: {optuna: {params: {dp.noise_multiplyer: {type: float, low: 0.5, high: 2}}}}}
""",
    )
    proc = dpsweep(tmp_path, *unknown, *FAST)
    assert (
        proc.returncode == 2
        and "dp.noise_multiplyer" in proc.stderr
        and "did you mean dp.noise_multiplier" in proc.stderr
    ), proc.stdout + proc.stderr
    empty = write_search(
        tmp_path / "c2",
        "empty",
        """
hydra: {sweeper: {optuna: {params: {optimizer.lr: {type: float, low: 0.5, high: 0.5}}}}}
""",
    )
    proc = dpsweep(tmp_path, *empty, *FAST)
    assert (
        proc.returncode == 2
        and "hydra.sweeper.optuna.params.optimizer.lr='[0.5, 0.5]' is invalid: a range with low < high" in proc.stderr
    ), proc.stdout + proc.stderr


def test_distributions_and_grids() -> None:
    assert distribution("x", ParamSpec(type="float", low=0.1, high=1.0, log=True)).log
    assert grid_values("x", ParamSpec(type="float", low=0.8, high=1.6, step=0.4)) == [0.8, 1.2, 1.6]
    assert grid_values("b", ParamSpec(type="int", low=32, high=128, step=32)) == [32, 64, 96, 128]
    for bad, message in [
        (ParamSpec(type="categorical"), "non-empty list"),
        (ParamSpec(type="float", low=1.0, high=0.1), "low < high"),
        (ParamSpec(type="float", low=0.0, high=1.0, log=True), "positive lower bound"),
        (ParamSpec(type="normal", low=0.0, high=1.0), "float, int, categorical"),
    ]:
        with pytest.raises(ConfigError, match=message):
            distribution("x", bad)
    with pytest.raises(ConfigError, match="a step, to grid-search"):
        grid_values("x", ParamSpec(type="float", low=0.1, high=1.0))


def test_budget_objective_calibrates_sigma_itself() -> None:
    budget = OBJECTIVES.get("accuracy_under_budget")
    assert budget.extra_overrides(2.5) == ["dp.target_epsilon=2.5"]
    with pytest.raises(ConfigError, match="does not set itself"):
        check_search_space({"dp.noise_multiplier": ParamSpec(low=0.5, high=2)}, ["dp.noise_multiplier"], budget, "tpe",
                           "inline")  # fmt: skip


def test_a_runs_ranks_are_not_searched_on_slurm() -> None:
    """On Slurm every trial's job is submitted with the tasks of the first trial's run: train.devices and
    train.nodes are one value a study there (an override), searched only where torchrun launches the ranks."""
    accuracy, devices = OBJECTIVES.get("accuracy"), {"train.devices": ParamSpec(type="categorical", choices=[1, 2])}
    with pytest.raises(ConfigError) as err:
        check_search_space(devices, ["train.devices"], accuracy, "tpe", "slurm")
    assert err.value.key == "hydra.sweeper.optuna.params" and err.value.value == "train.devices"
    assert "a key other than train.devices on Slurm" in str(err.value)
    assert "train.devices" in check_search_space(devices, ["train.devices"], accuracy, "tpe", "local")


def test_journal_storage(tmp_path: Path) -> None:
    storage = open_storage(f"journal://{tmp_path / 'study.log'}")
    study = optuna.create_study(storage=storage, study_name="j")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert (
        len(optuna.load_study(study_name="j", storage=open_storage(f"journal://{tmp_path / 'study.log'}")).trials) == 2
    )


@pytest.mark.slow
def test_budget_study_calibrates_each_trial_to_the_budget(tmp_path: Path) -> None:
    budget = ["hydra.sweeper.optuna.n_trials=2", "hydra.sweeper.optuna.epsilon_budget=1.5"]
    short = "hydra.sweeper.optuna.params={train.epochs: {type: int, low: 1, high: 3}}"  # the preset's: 2 to 12
    proc = dpsweep(tmp_path, "search=budget_tpe", *budget, short, "train.progress=false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [
        r
        for r in trial_runs(tmp_path, "digits_budget_tpe")
        if r.data.tags.get("sweep.role") != "parent"  # type: ignore[attr-defined]
    ]
    assert len(runs) == 2
    for run in runs:
        assert run.data.params["dp.target_epsilon"] == "1.5"  # type: ignore[attr-defined]
        assert 1.49 <= run.data.metrics["epsilon"] <= 1.5  # type: ignore[attr-defined]  # calibrated σ, never over


def test_the_accuracy_objectives_score_a_study_by_its_tasks_objective(make_cfg: Composer) -> None:
    """A task=gan study is told each trial's tstr_accuracy; a classifier study its test_accuracy."""
    gan, classifier = to_config(make_cfg("task=gan")), to_config(make_cfg())
    for name in ("accuracy", "accuracy_under_budget"):
        assert OBJECTIVES.get(name).metric_names(gan.task.objective) == ("tstr_accuracy",)
        assert OBJECTIVES.get(name).metric_names(classifier.task.objective) == ("test_accuracy",)
    assert OBJECTIVES.get("accuracy_epsilon").metric_names(gan.task.objective) == ("tstr_accuracy", "epsilon")
