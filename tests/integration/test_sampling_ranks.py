"""The sampling check (issue 58, item 3) of the runs it did not read before: a black-box audit's, whose
canaries change the set the run samples (N as the audit declares it), and a run across ranks, whose
ranks' shares of each step are summed into the step's batch (N the whole run's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Composer, child_runs, run_script
from mlflow.tracking import MlflowClient

from dpsweep.run.runner import train

RUN = ["train.progress=false", "tracking.log_model=false", "train.epochs=2"]  # test_distributed's


def test_a_black_box_audit_run_is_checked_and_passes(make_cfg: Composer, client: MlflowClient) -> None:
    """The default digits config audited black-box: N − m + included examples, sampled at the plan's q."""
    run = client.get_run(train(make_cfg("audit.mode=black_box", "dp.target_epsilon=1", "train.epochs=1")).run_id)
    assert run.data.metrics["sampling_p_value"] > 1e-3, run.data.metrics
    assert run.data.tags["sampling.check"] == "passed", run.data.tags


@pytest.mark.slow  # about 25 s: one 2-rank run on 2 cores
def test_an_honest_run_across_two_ranks_is_checked_on_its_summed_batches(tmp_path: Path) -> None:
    done = run_script("dpsweep", *RUN, "train.devices=2", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = child_runs(tmp_path)
    assert run.data.tags["sampling.check"] == "passed", run.data.tags
    assert run.data.metrics["sampling_p_value"] > 1e-3, run.data.metrics
    assert "sampling refused" not in done.stderr
