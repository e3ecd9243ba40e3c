"""Issue 54, item 4 (resume and data): a resumed run's ε is its plan's whatever its checkpoint claims, MovieLens
without its movies file is refused (its item count is private), and the fused step releases pure noise on an
empty Poisson batch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fabricate import fabricate_movielens, movielens_ratings
from helpers import Composer, runs_of, train_interrupted
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from torch import nn

from dpsweep.config import CNNConfig, ConfigError, to_config
from dpsweep.mechanisms import fused
from dpsweep.models import classifiers
from dpsweep.plan import config_hash, dataset_facts, prepare
from dpsweep.run import checkpoint
from dpsweep.run.runner import train
from dpsweep.tasks.classifier.task import ClassifierRun

EPOCHS = 3
STEPS_PER_EPOCH = 23  # digits: ceil(1437 / 64)


def _planned_epsilon(cfg: DictConfig) -> float:
    """The plan's ε for the whole run (what ``dpsweep-plan`` prints)."""
    config = to_config(cfg)
    privacy = prepare(config, dataset_facts(config)[0]).privacy
    assert privacy is not None
    return privacy.epsilon


def _checkpoint_of_epoch_1(make_cfg: Composer, ckpt: Path) -> DictConfig:
    """A DP run of EPOCHS epochs interrupted in its second: the checkpoint of its first, in ``ckpt``."""
    cfg = make_cfg(f"train.epochs={EPOCHS}", f"train.checkpoint_dir={ckpt}")
    train_interrupted(cfg, ClassifierRun, 2)
    blob = checkpoint.read(ckpt / checkpoint.FILENAME)
    assert blob["training_state"]["epoch"] == 1 and blob["training_state"]["steps"] == STEPS_PER_EPOCH
    assert [tuple(h)[2] for h in blob["privacy_accountant_state_dict"]["history"]] == [STEPS_PER_EPOCH]
    return cfg


def _rewrite(ckpt: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """The checkpoint altered by ``change`` and written back: still tensors and numbers only (read with
    ``weights_only=True``), still of this config (its hash untouched)."""
    blob = checkpoint.read(ckpt / checkpoint.FILENAME)
    change(blob)
    torch.save(blob, ckpt / checkpoint.FILENAME)


def _empty_history(blob: dict[str, Any]) -> None:
    blob["privacy_accountant_state_dict"]["history"] = []


def _no_steps_at_all(blob: dict[str, Any]) -> None:  # the step count lowered with the history: consistent
    blob["privacy_accountant_state_dict"]["history"] = []
    blob["training_state"]["steps"] = 0


def _more_noise(blob: dict[str, Any]) -> None:  # the history's σ raised tenfold
    blob["privacy_accountant_state_dict"]["history"] = [
        (10 * float(s), float(q), int(n)) for s, q, n in blob["privacy_accountant_state_dict"]["history"]
    ]


@pytest.mark.parametrize("change", [_empty_history, _no_steps_at_all, _more_noise])
def test_a_checkpoint_whose_ledger_is_not_its_plans_is_set_aside_and_the_rerun_spends_the_plans_epsilon(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str,
    change: Callable[[dict[str, Any]], None],
) -> None:  # fmt: skip
    """The red team's checkpoint: an emptied accountant history (or a lowered step count, or a raised σ) in
    a file of the right config resumed to a FINISHED run that reported less than its plan's ε. Now the
    loaded checkpoint's steps and ledger are checked against the plan: refused (ConfigError naming
    train.checkpoint_dir), set aside, and the run started again trains afresh to the plan's ε."""
    ckpt = tmp_path / "ckpt"
    cfg = _checkpoint_of_epoch_1(make_cfg, ckpt)
    _rewrite(ckpt, change)
    with pytest.raises(ConfigError) as err:
        train(cfg)
    [aside] = ckpt.glob(f"{checkpoint.FILENAME}.invalid-*")
    assert err.value.key == "train.checkpoint_dir" and str(aside) in str(err.value), str(err.value)
    assert not (ckpt / checkpoint.FILENAME).exists()
    [refused] = runs_of(client, experiment_name)
    assert refused.info.status == "FAILED"
    again = train(cfg)
    assert again.run_id != refused.info.run_id and again.steps == EPOCHS * STEPS_PER_EPOCH
    assert again.epsilon == _planned_epsilon(cfg)


def test_an_intact_checkpoint_still_resumes_to_the_plans_epsilon(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = _checkpoint_of_epoch_1(make_cfg, ckpt)
    [killed] = runs_of(client, experiment_name)
    resumed = train(cfg)
    assert resumed.run_id == killed.info.run_id and resumed.steps == EPOCHS * STEPS_PER_EPOCH
    assert resumed.epsilon == _planned_epsilon(cfg) and not list(ckpt.glob(f"{checkpoint.FILENAME}.*"))


@pytest.mark.parametrize(
    ("epoch", "steps"),
    [
        (EPOCHS + 1, (EPOCHS + 1) * STEPS_PER_EPOCH),  # past train.epochs: nothing left to train, nothing charged
        (-1, 0),
        (1, -1),
        (1, STEPS_PER_EPOCH + 1),  # more than the plan takes in one epoch
        (1, 23.0),  # not a count
    ],
)
def test_a_checkpoint_whose_counters_are_out_of_range_is_set_aside_before_any_work(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str, epoch: int, steps: float
) -> None:
    """Its epoch outside 0..train.epochs, or its steps outside 0..the plan's for those epochs: set aside as
    invalid where the run starts (before its MLflow run), and the run trains afresh to the plan's ε."""
    ckpt = tmp_path / "ckpt"
    cfg = _checkpoint_of_epoch_1(make_cfg, ckpt)
    [killed] = runs_of(client, experiment_name)

    def counters(blob: dict[str, Any]) -> None:
        blob["training_state"]["epoch"], blob["training_state"]["steps"] = epoch, steps

    _rewrite(ckpt, counters)
    assert checkpoint.peek_any(ckpt) is not None  # readable, of this config
    result = train(cfg)
    assert result.run_id != killed.info.run_id and result.steps == EPOCHS * STEPS_PER_EPOCH
    assert result.epsilon == _planned_epsilon(cfg)
    [aside] = ckpt.glob(f"{checkpoint.FILENAME}.invalid-*")
    assert client.get_run(result.run_id).data.tags["checkpoint.set_aside"] == str(aside)


def test_peek_sets_aside_out_of_range_counters_of_the_right_config(tmp_path: Path, make_cfg: Composer) -> None:
    cfg = make_cfg(f"train.epochs={EPOCHS}")
    config = to_config(cfg)
    plan = prepare(config, dataset_facts(config)[0])
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch, steps, valid in ((0, 0, True), (2, 46, True), (EPOCHS, 69, True), (EPOCHS + 1, 69, False),
                                (2, 47, False), (2, -1, False)):  # fmt: skip
        state = checkpoint.TrainingState(config_hash(config), "r", epoch, steps)
        checkpoint.save(tmp_path, state, model, optimizer, None)
        found = checkpoint.peek(tmp_path, config_hash(config), plan)
        assert (found.state is not None) == valid, (epoch, steps)
        assert (found.set_aside is None) == valid and (found.set_aside is None or ".invalid-" in found.set_aside.name)
        checkpoint.remove(tmp_path)


# ---------------------------------------------------------------------------------------------
# MovieLens without its movies file
# ---------------------------------------------------------------------------------------------
def test_a_movielens_run_without_its_movies_file_exits_2_before_any_run(
    tmp_path: Path, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """Without the catalogue the items would be the ids rated in the file: one more user, the only rater of an
    item, would add an item to the released model (61 items against 60, at the same ε). The refusal names the
    key and the missing file, and no run is left (tests/unit/data/test_movielens.py: every layout)."""
    root = tmp_path / "ml"
    fabricate_movielens(root, "u.data", movielens_ratings(users=40, items=30), items=30, catalogue=False)
    args = [
        str(Path(sys.executable).with_name("dpsweep")), "task=recommender", "dataset=movielens",
        f"dataset.root={root}", "dataset.num_users=36", "dataset.held_out_users=4", "train.batch_size=36",
        "dp.delta=0.001", "train.progress=false", f"tracking.uri={mlflow_uri}",
        f"tracking.experiment_name={experiment_name}",
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "dataset.root=" in proc.stderr and "u.item" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert client.get_experiment_by_name(experiment_name) is None or not runs_of(client, experiment_name)


# ---------------------------------------------------------------------------------------------
# the fused step on an empty Poisson batch
# ---------------------------------------------------------------------------------------------
C, SIGMA, DIVISOR = 0.5, 1.5, 4.0


def _steps() -> dict[str, fused.FusedStep]:
    """The example-level and the user-level fused step of the cnn (the vmap way), eager (as on a CPU)."""
    torch.manual_seed(0)
    model = classifiers.build(CNNConfig(hidden_units=16), (1, 28, 28), 10)
    loss = nn.CrossEntropyLoss()
    return {
        "example": fused.FusedStep(model, loss, max_grad_norm=C, pad_to=8, mode=None),
        "user": fused.FusedUserStep(model, loss, max_grad_norm=C, pad_to=8, max_examples=2, mode=None),
    }


def _gradient(step: fused.FusedStep, rows: int, generator: torch.Generator) -> torch.Tensor:
    x, y = torch.randn(rows, 1, 28, 28), torch.randint(0, 10, (rows,))
    segment = torch.arange(rows) if isinstance(step, fused.FusedUserStep) else None  # one example a user
    grads = step.gradient(x, y, noise_multiplier=SIGMA, divisor=DIVISOR, generator=generator, segment=segment)
    return torch.cat([g.flatten() for g in grads.values()])


@pytest.mark.parametrize("level", ["example", "user"])
def test_an_empty_batch_releases_pure_noise_and_draws_the_noise_a_step_draws(level: str) -> None:
    """No example (or user) sampled: the noised sum of no clipped gradients, N(0, σ²C²) over the divisor, drawn
    from the generator given, which ends where a step of a non-empty batch leaves it."""
    step = _steps()[level]
    empty, nonempty = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    released = _gradient(step, 0, empty)
    _gradient(step, 3, nonempty)
    assert torch.equal(empty.get_state(), nonempty.get_state())  # the stream goes on as after any step
    expected = torch.normal(0.0, SIGMA * C / DIVISOR, released.shape, generator=torch.Generator().manual_seed(7))
    assert torch.equal(released, expected)


def test_fused_runs_of_tiny_batches_train_through_empty_ones(make_cfg: Composer, client: MlflowClient) -> None:
    """B = 2 of 1437 examples: an empty Poisson batch about one step in seven (the reported crash); at user level
    one expected user a step of 50: about one step in three."""
    for overrides, steps in (
        (["train.batch_size=2"], 719),
        (["dp.unit=user", "dataset.users=partition", "dataset.num_users=50", "train.batch_size=1"], 50),
    ):
        result = train(make_cfg("dp.grad_sample_mode=fused", "train.epochs=1", *overrides))
        assert client.get_run(result.run_id).info.status == "FINISHED" and result.steps == steps, overrides
        assert result.model is not None and all(torch.isfinite(p).all() for p in result.model.parameters())
