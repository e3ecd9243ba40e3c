"""The tracking process dies under a run (issue 39, item 2): stopped after epoch 1 (what the run logs
then queues up unwritten), killed after epoch 3, as the OOM killer would. The run must end FINISHED
with every epoch's metrics, written once, or FAILED saying what was lost; never FINISHED with less.
A real ``dpsweep`` process and its real tracking child, SIGSTOP and SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import child_runs
from mlflow.tracking import MlflowClient

from dpsweep.tracking.channel import CHILD_MODULE

BIN = Path(sys.executable).parent


def tracking_child(run: subprocess.Popen[str]) -> psutil.Process:
    [child] = [p for p in psutil.Process(run.pid).children() if CHILD_MODULE in " ".join(p.cmdline())]
    return child


@pytest.mark.slow
def test_a_killed_tracking_process_loses_no_metric(tmp_path: Path) -> None:
    args = ["train.epochs=4", "tracking.log_model=false", "tracking.experiment_name=dpsweep"]
    run = subprocess.Popen(
        [str(BIN / "dpsweep"), *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert run.stdout is not None
    lines: list[str] = []
    child = None
    try:
        for line in run.stdout:
            lines.append(line)
            if "epoch 1/4" in line:
                child = tracking_child(run)
                child.send_signal(signal.SIGSTOP)
            if "epoch 3/4" in line and child is not None:
                child.send_signal(signal.SIGKILL)
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    err = "".join(lines)  # stdout and stderr
    assert child is not None, err
    assert run.returncode == 0, err
    assert f"pid {child.pid}) ended with exit code -9; started another" in err
    [r] = child_runs(tmp_path)
    assert r.info.status == "FINISHED", err
    history = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(r.info.run_id, "test_accuracy")
    assert sorted(h.step for h in history) == [1, 2, 3, 4], err
    assert "epsilon" in r.data.metrics and "dpsweep: run" in err
