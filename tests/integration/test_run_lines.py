"""What a run's start and result lines say (issue 56, item 9): an audit run's lower bounds beside its ε
(and the flag where they show the run less private than its ledger), the fused step, the ranks of a
run across devices, a task's method, and a calibrated σ in a few digits. Real runs, tracked into a
sqlite store; the figures on the lines are checked against what the run logged."""

from __future__ import annotations

import math
import re
from pathlib import Path

import planted
import pytest
from helpers import Composer, child_runs, run_dpsweep, run_script
from mlflow.tracking import MlflowClient

from dpsweep.cli.lines import start_line, summary_line
from dpsweep.config import to_config
from dpsweep.run.runner import train

AUDIT = ["audit.mode=white_box", "dp.target_epsilon=1", "train.epochs=3"]
RECOMMENDER = [
    "task=recommender", "dataset.num_users=400", "dataset.held_out_users=60", "dataset.items=150",
    "dataset.mean_ratings=15", "train.batch_size=400", "train.epochs=1", "dp.noise_multiplier=2",
]  # fmt: skip
DPAM = ["task.method=dpam", "dp.mechanism=dpsgd", "train.batch_size=100", "dp.max_grad_norm=0.1"]


def _result_line(stdout: str) -> str:
    [line] = [x for x in stdout.splitlines() if x.startswith("dpsweep: run ")]
    return line


@pytest.mark.slow  # about 10 s: one audit run through the dpsweep command
def test_an_audit_runs_result_line_shows_its_lower_bounds_beside_epsilon(
    tmp_path: Path, client: MlflowClient, mlflow_uri: str, experiment_name: str
) -> None:
    """docs/src/guides/audit.md: "the accountant says ε ≤ 8; this run shows ε ≥ 2" on the run's own line."""
    done = run_dpsweep(
        *AUDIT, "train.progress=false", "tracking.log_model=false", f"tracking.uri={mlflow_uri}",
        f"tracking.experiment_name={experiment_name}",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    line = _result_line(done.stdout)
    exp = client.get_experiment_by_name(experiment_name)
    assert exp is not None
    [run] = client.search_runs([exp.experiment_id])
    m = run.data.metrics
    bounds = f"white_box audit: ε ≥ {m['audit.epsilon_lower']:.3f}, f-DP ε ≥ {m['audit.epsilon_lower_fdp']:.3f} (95%)"
    assert f"ε={m['epsilon']:.3f} ∈ [" in line and f", {m['epsilon']:.3f}] (pld, " in line and bounds in line, line
    assert line.index(f"ε={m['epsilon']:.3f}") < line.index("audit: ε ≥"), line  # beside the accountant's bound
    assert "FLAGGED" not in line and m["audit.claim_rejected"] == 0, line  # a correct run


@pytest.mark.slow  # about 10 s: one audit run with a bug planted
def test_an_audit_run_that_catches_a_bug_is_flagged_on_its_result_line(
    make_cfg: Composer, client: MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenth of the noise the ledger claims (tests/planted.py): the line says the run is less private
    than its ledger says, and why, as the audit guide defines the flag."""
    cfg = make_cfg(*AUDIT)
    result = train(cfg, attach=[planted.bug("noise_tenth", monkeypatch)])
    line = summary_line(to_config(cfg), result)
    m = client.get_run(result.run_id).data.metrics
    assert "FLAGGED: less private than its ledger says" in line, line
    if m["audit.epsilon_lower"] > m["epsilon"]:
        assert f"its bound {m['audit.epsilon_lower']:.3f} exceeds ε={m['epsilon']:.3f}" in line, line
    if m["audit.claim_rejected"] == 1:
        assert "the f-DP test rejects its own ledger (audit.claim_rejected=1)" in line, line


@pytest.mark.slow  # about 10 s: one run of the fused step
def test_the_lines_of_a_fused_run_say_fused(make_cfg: Composer) -> None:
    cfg = make_cfg("dp.grad_sample_mode=fused", "train.epochs=1")
    start, summary = start_line(cfg, "out"), summary_line(to_config(cfg), train(cfg))
    assert "dpsgd per example, fused step (σ=1, C=1)" in start, start
    assert "dpsgd per example, fused step; " in summary, summary
    plain = make_cfg("train.epochs=1")
    assert "step" not in start_line(plain, "out")  # Opacus's hooks, the default: as before


@pytest.mark.parametrize(("method", "args"), [("als", []), ("dpam", DPAM)])
def test_the_lines_of_a_recommender_run_say_its_method(
    make_cfg: Composer, client: MlflowClient, method: str, args: list[str]
) -> None:
    """DPALS and DPAM are both task=recommender, model recommender: only task.method tells their runs apart."""
    cfg = make_cfg(*RECOMMENDER, *args)
    result = train(cfg)
    start, summary = start_line(cfg, "out"), summary_line(to_config(cfg), result)
    assert client.get_run(result.run_id).data.params["task.method"] == method
    assert f"seed=0 method={method}, " in start, start
    assert f"seed=0 method={method}  recall_at_20=" in summary, summary


def test_the_start_line_of_a_run_across_nodes_says_its_ranks(make_cfg: Composer) -> None:
    start = start_line(make_cfg("launcher=slurm", "train.nodes=2", "train.devices=2"), "out")
    assert "seed=0 on 4 ranks (2 nodes × 2 devices), dpsgd per example" in start, start
    one = start_line(make_cfg(), "out")  # one process of a task without methods: as before
    assert "method=" not in one and "ranks" not in one, one


@pytest.mark.slow  # about 20 s: a run of two gloo ranks under torchrun
def test_the_lines_of_a_run_across_devices_say_its_ranks(tmp_path: Path) -> None:
    done = run_script(
        "dpsweep", "train.progress=false", "tracking.log_model=false", "train.epochs=1", "train.devices=2", cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [start] = [x for x in done.stdout.splitlines() if x.startswith("dpsweep: training ")]
    assert "seed=0 on 2 ranks, dpsgd per example" in start, done.stdout
    (run,) = child_runs(tmp_path)
    assert f"dpsweep: run {run.info.run_id[:8]} " in done.stdout, done.stdout
    assert "seed=0 on 2 ranks  test_accuracy=" in _result_line(done.stdout), done.stdout


@pytest.mark.slow  # about 8 s: a run with σ calibrated
def test_a_calibrated_sigma_is_shown_in_four_digits_rounded_up(make_cfg: Composer, client: MlflowClient) -> None:
    """The run keeps σ whole (its param); its line shows at most 4 significant digits, and not less than σ."""
    cfg = make_cfg("dp.target_epsilon=3", "train.epochs=1")
    result = train(cfg)
    line = summary_line(to_config(cfg), result)
    found = re.search(r"  σ=(\S+) C=", line)
    assert found is not None, line
    sigma = float(client.get_run(result.run_id).data.params["dp.noise_multiplier"])
    assert sigma == result.noise_multiplier and len(repr(sigma)) > 6  # calibrated: a float's digits
    shown = float(found.group(1))
    assert len(found.group(1).replace(".", "").lstrip("0")) <= 4, line
    assert sigma <= shown <= sigma * (1 + 1e-3) and math.isclose(shown, float(f"{sigma:.4g}"), rel_tol=1e-3), line
