"""``dpsweep-plan``: the same jobs as ``dpsweep -m``, with the ε each run will log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import child_runs, run_dpsweep, run_main, run_script
from hydra import initialize_config_module

from dpsweep.cli.composing import sweep_jobs
from dpsweep.cli.plan import format_table, main, plan
from dpsweep.launchers.expand import expand
from dpsweep.privacy import schedule
from dpsweep.privacy.ledger import Accounting


@pytest.fixture()
def hydra_ctx() -> Iterator[None]:
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        yield


def test_expansion_is_the_cartesian_product_in_hydra_order(hydra_ctx: None) -> None:
    jobs, _ = sweep_jobs(["train.batch_size=32,64", "dp.noise_multiplier=0.5,1.0,2.0", "train.epochs=3"])
    assert len(jobs) == 6
    assert jobs[0] == ["train.batch_size=32", "dp.noise_multiplier=0.5", "train.epochs=3"]
    assert jobs[-1] == ["train.batch_size=64", "dp.noise_multiplier=2.0", "train.epochs=3"]


def test_sweeper_params_of_a_preset_come_first_and_the_command_line_wins(hydra_ctx: None) -> None:
    jobs, _ = sweep_jobs(["experiment=demo"])
    assert [j[:2] for j in jobs] == [
        ["dp=off", "dp.noise_multiplier=0.8"], ["dp=off", "dp.noise_multiplier=1.6"],
        ["dp=dpsgd", "dp.noise_multiplier=0.8"], ["dp=dpsgd", "dp.noise_multiplier=1.6"],
    ]  # fmt: skip
    assert len(sweep_jobs(["experiment=demo", "dp.noise_multiplier=1.0"])[0]) == 2


@pytest.mark.slow
def test_expand_gives_the_jobs_hydras_basic_sweeper_launches(hydra_ctx: None, tmp_path: Path) -> None:
    """Sweeper params, a range, a choice and a ``+key``: the jobs Hydra's own sweeper launches, in its order."""
    from hydra import compose
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import HydraContext
    from omegaconf import open_dict

    params = {"train.batch_size": "32,64", "train.epochs": "1"}
    overrides = ["train.seed=range(0,3)", "dp.noise_multiplier=choice(0.5,1.5)", "+note=a,b", "train.epochs=2"]
    launched: list[list[str]] = []

    class Recorder:
        def launch(self, jobs: list[list[str]], initial_job_idx: int) -> list[object]:
            launched.extend(list(job) for job in jobs)
            return []

    loader = GlobalHydra.instance().config_loader()
    config = compose("config", return_hydra_config=True)
    with open_dict(config):
        config.hydra.sweep.dir = str(tmp_path)
    hydras = BasicSweeper(max_batch_size=None, params=params)
    hydras.config, hydras.hydra_context = config, HydraContext(config_loader=loader, callbacks=Callbacks())
    hydras.launcher = Recorder()  # type: ignore[assignment]
    hydras.sweep(overrides)  # composes every job first: the +key is a legal override
    jobs = expand(overrides, params, loader)
    assert jobs == launched and len(jobs) == 2 * 3 * 2 * 2
    assert jobs[0] == ["train.batch_size=32", "train.epochs=2", "train.seed=0", "dp.noise_multiplier=0.5", "+note=a"]


def test_rows_carry_the_trainers_epsilon_and_budget(hydra_ctx: None) -> None:
    rows = plan(["dp=off,dpsgd", "dp.noise_multiplier=0.7,1.5", "train.epochs=4", "sweep.max_epsilon=5"])
    off = [r for r in rows if r.epsilon is None]
    dp = [r for r in rows if r.epsilon is not None]
    assert len(off) == 2 and all(r.noise_multiplier is None and not r.over_budget for r in off)
    pld = Accounting("pld")  # the default accountant
    for r in dp:
        expected = schedule.epsilon(
            schedule.poisson_schedule(1437, 64), r.noise_multiplier, 1e-5, epochs=4, accounting=pld
        )
        assert r.epsilon == expected.epsilon and r.steps == expected.steps == 4 * 23
        assert r.over_budget == (r.epsilon > 5)
    assert [r.over_budget for r in dp] == [True, False]


def test_the_table_shows_every_key_that_differs_between_jobs(hydra_ctx: None) -> None:
    """Issue 33, item 7: four identical rows before; a column per swept key the table had none for."""
    table = format_table(plan(["model.hidden_units=16,64", "optimizer.momentum=0,0.9", "train.epochs=2"]))
    header, *rows = table.splitlines()[:5]
    assert header.split()[-2:] == ["model.hidden_units", "optimizer.momentum"]
    assert [row.split()[-2:] for row in rows] == [["16", "0"], ["16", "0.9"], ["64", "0"], ["64", "0.9"]]
    assert "train.epochs" not in header  # the same for every job
    same = format_table(plan(["dp.noise_multiplier=0.8,1.2"])).splitlines()[0]
    assert "dp.noise_multiplier" not in same  # the σ column shows it


def test_target_epsilon_rows_show_the_calibrated_sigma(hydra_ctx: None) -> None:
    [row] = plan(["dp.target_epsilon=2.0", "train.epochs=3"])
    assert row.noise_multiplier != 1.0 and 1.99 <= row.epsilon <= 2.0  # type: ignore[operator]


@pytest.mark.slow
def test_plan_rows_match_the_jobs_dpsweep_m_launches(tmp_path: Path) -> None:
    """Also the smoke test of the console script: a real process, its exit code and its output."""
    sweep = ["train.batch_size=32,128", "dp.noise_multiplier=0.6,1.4", "train.epochs=1", "sweep.max_epsilon=3"]
    planned = run_script("dpsweep-plan", *sweep, "--json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    rows = json.loads(planned.stdout)
    assert len(rows) == 4
    kept = {(r["batch_size"], r["noise_multiplier"]): r["epsilon"] for r in rows if not r["over_budget"]}
    dropped = [r for r in rows if r["over_budget"]]
    assert kept and dropped  # the budget splits this grid

    swept = run_dpsweep("-m", *sweep, "train.progress=false")
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert "parent_run_id" not in swept.stdout, swept.stdout  # skip lines name the job without internal overrides
    skips = [line for line in swept.stdout.splitlines() if line.startswith("dpsweep: skip")]
    assert len(skips) == len(dropped)
    for r in dropped:
        assert any(
            f"train.batch_size={r['batch_size']} dp.noise_multiplier={r['noise_multiplier']}" in s for s in skips
        )
    runs = child_runs(tmp_path)
    assert all(run.info.status == "FINISHED" for run in runs)
    logged = {
        (int(run.data.params["train.batch_size"]), float(run.data.params["dp.noise_multiplier"])): run.data.metrics[
            "epsilon"
        ]
        for run in runs
    }
    assert logged == kept  # same jobs, and exactly the planned ε

    again = run_script("dpsweep-plan", *sweep, "--json", cwd=tmp_path)  # what a rerun of the sweep would do
    assert again.returncode == 0, again.stderr
    by_config = {
        (int(run.data.params["train.batch_size"]), float(run.data.params["dp.noise_multiplier"])): run.info.run_id
        for run in runs
    }
    for r in json.loads(again.stdout):
        key = (r["batch_size"], r["noise_multiplier"])
        if r["over_budget"]:
            assert r["skipped"] is None
        else:
            assert r["skipped"] == f"already FINISHED as run {by_config[key]} (sweep.force=true runs it again)"
    forced = run_script("dpsweep-plan", *sweep, "sweep.force=true", "--json", cwd=tmp_path)
    assert all(r["skipped"] is None for r in json.loads(forced.stdout)), forced.stderr


def test_plan_marks_the_jobs_dpsweep_m_would_skip_as_repeats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default store, sqlite:///mlflow.db, is not there: nothing FINISHED
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        rows = plan(["train.seed=0,0,1", "train.epochs=1"])
    assert [r.skipped for r in rows] == [None, "same config as job 0", None]
    assert not (tmp_path / "mlflow.db").exists()  # planning created no store
    table = run_main(main, "train.seed=3,3", "train.epochs=1")
    assert table.returncode == 0, table.stderr
    assert "skipped: same config as job 0" in table.stdout
    assert "1 of 2 jobs would be skipped by dpsweep -m" in table.stdout


def test_plan_table_and_bad_input() -> None:
    table = run_main(main, "experiment=demo")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["job", "dataset", "model", "B", "σ", "C", "lr", "epochs", "δ", "ε"]
    assert sum("non-DP" in line for line in lines) == 2 and "6.483" in table.stdout  # PLD, the default
    rdp = run_main(main, "experiment=demo", "dp.accountant=rdp")
    assert rdp.returncode == 0 and "7.414" in rdp.stdout, rdp.stderr
    opacus = run_main(main, "experiment=demo", "dp.accountant=rdp", "dp.rdp_orders=opacus")  # Opacus's orders
    assert opacus.returncode == 0 and "7.417" in opacus.stdout, opacus.stderr
    bad = run_main(main, "dp.noise_multiplier=0,1")
    assert bad.returncode == 2 and "dp.noise_multiplier=0.0 is invalid" in bad.stderr, bad.stderr
    pasted = run_main(main, "-m", "experiment=demo")  # the dpsweep -m line pasted as it is (issue 33, item 9)
    assert pasted.returncode == 0 and pasted.stdout == table.stdout, pasted.stderr
    unknown = run_main(main, "dataset=imagenet")
    assert unknown.returncode == 2 and "imagenet" in unknown.stderr, unknown.stderr


def test_plan_shows_the_ranks_of_a_run_across_devices_and_its_single_process_epsilon() -> None:
    one = run_main(main, "--json")
    two = run_main(main, "--json", "train.devices=2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    (single,), (ranked,) = json.loads(one.stdout), json.loads(two.stdout)
    assert single["world_size"] == 1 and ranked["world_size"] == 2
    assert ranked["epsilon"] == single["epsilon"] and ranked["steps"] == single["steps"]
    table = run_main(main, "train.devices=2")
    assert "ranks: 2 a run" in table.stdout and "ranks:" not in run_main(main).stdout, table.stdout
    nodes = run_main(main, "--json", "launcher=slurm", "train.devices=2", "train.nodes=3")
    assert nodes.returncode == 0 and json.loads(nodes.stdout)[0]["world_size"] == 6, nodes.stderr
    refused = run_main(main, "train.devices=2", "dp.mechanism=dpftrl")
    assert refused.returncode == 2 and "train.devices=2 is invalid: 1 with dp.mechanism=dpftrl" in refused.stderr, (
        refused.stderr
    )


def test_plan_says_how_many_jobs_trials_per_job_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``launcher.trials_per_job=3``: 4 jobs to run take 2 submitted jobs, each running its trials in turn."""
    monkeypatch.chdir(tmp_path)
    done = run_main(main, "launcher=local", "launcher.trials_per_job=3", "train.seed=0,1,2,3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trials per job: 3, one after another in each job's process; 4 jobs to run take 2 jobs" in done.stdout
    single = run_main(main, "launcher=local", "train.seed=0,1")
    assert single.returncode == 0 and "trials per job" not in single.stdout, single.stdout + single.stderr
