"""Resume: a run killed mid-training and started again continues its MLflow run from the last
completed epoch, and reports the same ε (and, with restored RNG state, the same model) as a run
that was never interrupted, its private clipping-norm release charged once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import Composer, runs_of
from mlflow.tracking import MlflowClient

from dpsweep.config import to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.plan import prepare
from dpsweep.privacy import schedule
from dpsweep.privacy.ledger import Accounting
from dpsweep.run import checkpoint
from dpsweep.run.runner import train

DPSWEEP = str(Path(sys.executable).with_name("dpsweep"))
EPOCHS = 5


def _saved_epoch(ckpt: Path) -> int:
    try:
        return int(torch.load(ckpt / checkpoint.FILENAME, weights_only=False)["training_state"]["epoch"])
    except (FileNotFoundError, EOFError, RuntimeError, KeyError):
        return 0


@pytest.mark.slow
def test_sigterm_then_resume_matches_an_uninterrupted_run(
    tmp_path: Path, make_cfg: Composer, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    ckpt = tmp_path / "ckpt"
    args = [
        DPSWEEP, f"train.epochs={EPOCHS}", "train.progress=false", f"train.checkpoint_dir={ckpt}",
        f"tracking.uri={mlflow_uri}", f"tracking.experiment_name={experiment_name}", "tracking.log_model=false",
        "dp.clipping=quantile",  # a release before training: the resumed run must not charge it twice
    ]  # fmt: skip
    first = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while _saved_epoch(ckpt) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, first.communicate()
    os.kill(first.pid, signal.SIGTERM)  # what scancel, qdel and preemption send
    out, err = first.communicate(timeout=120)
    assert first.returncode == 143, out + err  # 128 + SIGTERM, as a shell reports it
    assert err.count("dpsweep: interrupted (SIGTERM); a run in progress was ended KILLED") == 1, err
    assert "Traceback" not in err, err  # one line, not every frame the interrupt went through (issue 33, item 9)
    [killed] = runs_of(client, experiment_name)
    assert killed.info.status == "KILLED" and killed.data.tags["failure.kind"] == "interrupted"
    done_before = _saved_epoch(ckpt)
    assert 2 <= done_before < EPOCHS

    second = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    [resumed] = runs_of(client, experiment_name)  # the same run, reopened
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.tags["resume.count"] == "1"
    assert not {"error", "error.type", "failure.kind"} & set(resumed.data.tags)  # no longer a failure
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "test_accuracy")]
    assert sorted(set(steps)) == list(range(1, EPOCHS + 1))
    assert not (ckpt / checkpoint.FILENAME).exists()  # removed once the run finished

    cfg = make_cfg(f"train.epochs={EPOCHS}", "tracking.experiment_name=uninterrupted", "dp.clipping=quantile")
    plan = prepare(to_config(cfg), DatasetFacts(1437, (1, 28, 28), 10))
    assert plan.privacy is not None
    assert resumed.data.metrics["epsilon"] == plan.privacy.epsilon  # the release and every step, exactly once
    pld = Accounting("pld")  # the default accountant
    without_release = schedule.epsilon(schedule.poisson_schedule(1437, 64), 1.0, 1e-5, epochs=EPOCHS, accounting=pld)
    assert plan.privacy.epsilon > without_release.epsilon

    straight = train(cfg)
    assert straight.epsilons["rdp"] == resumed.data.metrics["epsilon_rdp"]
    assert straight.test_accuracy == resumed.data.metrics["test_accuracy"]  # same samples, same noise, same C
    chosen = straight.ledger.entries[0].params["max_grad_norm_chosen"]
    assert resumed.data.params["dp.max_grad_norm_chosen"] == str(chosen)


def test_a_checkpoint_of_another_config_is_never_loaded_and_the_run_starts_afresh(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    """Issue 39, item 5: a reused hydra.sweep.dir gives a new job an old job's directory. Its checkpoint
    (another config) is set aside, kept for inspection, and the new run trains from its first epoch."""
    state = checkpoint.TrainingState(config_hash="0" * 16, run_id="x", epoch=1, steps=1)
    model = torch.nn.Linear(2, 2)
    checkpoint.save(tmp_path, state, model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    result = train(make_cfg(f"train.checkpoint_dir={tmp_path}", "train.epochs=1"))
    assert result.steps == 23 and len(result.epochs) == 1  # afresh: not resumed from the other config's epoch
    aside = tmp_path / f"{checkpoint.FILENAME}.config-{'0' * 16}"
    assert aside.exists() and not (tmp_path / checkpoint.FILENAME).exists()
    [run] = runs_of(client, experiment_name)
    assert run.info.status == "FINISHED" and run.data.tags["checkpoint.set_aside"] == str(aside)


def test_checkpointed_rng_replays_device_resident_poisson_batches() -> None:
    """A resumed device-resident run draws the batches the interrupted one would have drawn."""
    from dpsweep.data import resident

    x, y = torch.arange(500.0).unsqueeze(1), torch.arange(500) % 10
    generator = resident.device_generator(torch.device("cpu"), seed=3)
    batches = resident.PoissonBatches(x, y, sample_rate=0.05, device=torch.device("cpu"), generator=generator)
    list(batches)  # epoch 1
    saved = checkpoint.capture_rng(generator)
    epoch2 = [b.clone() for b, _ in batches]
    checkpoint.restore_rng(saved, generator)
    assert all(torch.equal(a, b) for a, (b, _) in zip(epoch2, batches, strict=True))


def test_a_finished_runs_checkpoint_is_stale_and_the_config_runs_afresh(
    tmp_path: Path, make_cfg: Composer, monkeypatch: pytest.MonkeyPatch, client: MlflowClient, experiment_name: str
) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = make_cfg("train.epochs=1", f"train.checkpoint_dir={ckpt}")
    with monkeypatch.context() as died:  # the process died after its run FINISHED, before removing its checkpoint
        died.setattr(checkpoint, "remove", lambda directory: None)
        first = train(cfg)
    assert checkpoint.peek_any(ckpt) is not None
    second = train(cfg)  # not a resume of the finished run (nor a skip that leaves the stale file for ever)
    assert second.run_id != first.run_id and checkpoint.peek_any(ckpt) is None
    assert {r.info.run_id: r.info.status for r in runs_of(client, experiment_name)} == {
        first.run_id: "FINISHED",
        second.run_id: "FINISHED",
    }
    assert second.epsilon == first.epsilon and second.steps == first.steps


class _RunsACommand:
    """What a crafted checkpoint holds: unpickling it would run a shell command (pickle's __reduce__)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused_as_unreadable_and_runs_nothing(tmp_path: Path) -> None:
    """Issue 39, item 7: checkpoints are read with torch.load(weights_only=True); a pickle that calls a
    function is set aside like a corrupt file, and its command never runs."""
    marker, ckpt = tmp_path / "ran", tmp_path / "ckpt"
    ckpt.mkdir()
    state = {"config_hash": "h", "run_id": "r", "epoch": 1, "steps": 1, "payload": _RunsACommand(marker)}
    torch.save({"training_state": state}, ckpt / checkpoint.FILENAME)
    found = checkpoint.peek(ckpt, "h")
    assert found.state is None and found.set_aside is not None and found.set_aside.exists()
    assert not (ckpt / checkpoint.FILENAME).exists() and checkpoint.peek_any(ckpt) is None
    assert not marker.exists()  # nothing ran
    with pytest.raises(checkpoint.UNREADABLE):
        checkpoint.read(found.set_aside)
    assert not marker.exists()


def test_every_checkpoint_dpsweep_writes_is_read_without_unpickling_code(tmp_path: Path) -> None:
    """The RNG states (NumPy's included) and Opacus's accountant survive torch.load(weights_only=True)."""
    import numpy as np

    generator = torch.Generator().manual_seed(3)
    np.random.seed(7)
    rng = checkpoint.capture_rng(generator)
    expected = np.random.random(5)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = checkpoint.TrainingState("h", "r", 1, 4, [{"test_accuracy": 0.5}], 10, rng)
    path = checkpoint.save(tmp_path, state, model, optimizer, None)
    blob = checkpoint.read(path)  # weights_only=True
    again = checkpoint.TrainingState(**blob["training_state"])
    np.random.seed(0)
    checkpoint.restore_rng(again.rng, torch.Generator())
    assert np.array_equal(np.random.random(5), expected)  # NumPy's stream continues where it was saved
    assert checkpoint.load(tmp_path, "h", model, optimizer, None).steps == 4
