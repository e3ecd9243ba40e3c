"""dp.mechanism and dp.unit through the runner (issue 17): DP-FTRL at example level, user-level DP-SGD
and DP-FTRL over users plan, train, log and resume with the ε of exactly what ran: no amplification
for DP-FTRL (nothing is sampled), Poisson amplification for DP-SGD, N = users at user level."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from dp_accounting import dp_event
from helpers import Composer, straight_and_resumed
from memory_metrics import memory_bytes
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from scipy import stats
from torch import nn

from dpsweep.config import ConfigError, to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.mechanisms import dpftrl_accounting, functional, fused
from dpsweep.plan import prepare
from dpsweep.privacy.ledger import Accounting
from dpsweep.privacy.schedule import epsilon, poisson_schedule
from dpsweep.privacy.streams import Streams
from dpsweep.run.runner import train
from dpsweep.tasks.classifier import task

STREAMS = Streams.of_run(seed=0, config_hash="0")  # the private streams of a hand-built run

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)
USERS = ["dp.unit=user", "dataset.users=partition", "dataset.num_users=50", "train.batch_size=10"]
FTRL = ["dp.mechanism=dpftrl", "optimizer.momentum=0.9"]
FUSED = ["dp.engine=fused"]


def _event_types(event: dp_event.DpEvent) -> set[type]:
    found = {type(event)}
    for child in getattr(event, "events", []) or []:
        found |= _event_types(child)
    inner = getattr(event, "event", None)
    if inner is not None:
        found |= _event_types(inner)
    return found


def test_dpftrl_is_planned_without_sampling_and_dpsgd_with_it(make_cfg: Composer) -> None:
    ftrl = prepare(to_config(make_cfg(*FTRL, "train.epochs=6", "dp.noise_multiplier=4",
                                      "dp.ftrl_restart_every=2", "dp.ftrl_tree_completion=true")), DIGITS)  # fmt: skip
    assert ftrl.privacy is not None and ftrl.privacy.sample_rate is None and ftrl.steps == 6 * 23
    [entry] = ftrl.privacy.ledger.entries
    assert dp_event.PoissonSampledDpEvent not in _event_types(entry.event)
    expected = dpftrl_accounting.ftrl_epsilon(4.0, 23, 6, 1e-5, 2, True, accountant="pld")  # the default accountant
    assert ftrl.privacy.epsilon == pytest.approx(expected, rel=1e-12)
    sgd = prepare(to_config(make_cfg("train.epochs=6", "dp.noise_multiplier=4")), DIGITS)
    assert sgd.privacy is not None
    assert all(dp_event.PoissonSampledDpEvent in _event_types(e.event) for e in sgd.privacy.ledger.entries)
    assert sgd.privacy.epsilon < ftrl.privacy.epsilon  # amplification: the same σ costs less when sampled
    calibrated = prepare(to_config(make_cfg(*FTRL, "train.epochs=6", "dp.target_epsilon=5")), DIGITS)
    assert calibrated.privacy is not None and calibrated.privacy.epsilon <= 5 and calibrated.privacy.calibrated


def test_user_level_plans_over_users(make_cfg: Composer) -> None:
    plan = prepare(to_config(make_cfg(*USERS, "train.epochs=4", "dp.noise_multiplier=1.5")), DIGITS)
    assert plan.privacy is not None and plan.privacy.sample_rate == 1 / 5 and plan.steps == 4 * 5
    schedule = poisson_schedule(50, 10)  # N = 50 users, 10 expected per step
    pld = Accounting("pld")  # the default accountant
    assert plan.privacy.epsilon == epsilon(schedule, 1.5, 1e-5, epochs=4, accounting=pld).epsilon
    both = prepare(to_config(make_cfg(*USERS, *FTRL, "train.epochs=4", "dp.noise_multiplier=3")), DIGITS)
    assert both.privacy is not None
    expected = dpftrl_accounting.ftrl_epsilon(3.0, 5, 4, 1e-5, accountant="pld")
    assert both.privacy.epsilon == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["dp.unit=user"], "dp.unit", "this dataset has none"),
        (["dataset.users=natural"], "dataset.users", "digits carries no user ids"),
        (["dataset.users=partition", "dataset.num_users=1"], "dataset.num_users", "2 or more users"),
        (["dataset.users=partition", "dataset.num_users=2000"], "dataset.num_users", "2 to N=1437"),
        (["dataset.users=partition", "dataset.user_label_skew=0"], "dataset.user_label_skew", "positive"),
        ([*USERS, "dp.max_examples_per_user=0"], "dp.max_examples_per_user", "1 or more"),
        ([*USERS, "dp.delta=0.05"], "dp.delta", "below 1/N = 0.02 (N=50)"),
        (["dp.mechanism=dpftrl", "optimizer=adam"], "optimizer.name", "fixed linear workload"),
        ([*FTRL, "dp.ftrl_restart_every=20"], "dp.ftrl_restart_every", "from 1 to train.epochs=2"),
        ([*FTRL, "dp.clipping=quantile"], "dp.clipping", "fixed with dp.mechanism=dpftrl"),
        ([*FUSED, "dp.pad_to=63"], "dp.pad_to", "at least train.batch_size=64"),
        ([*FUSED, *FTRL], "dp.mechanism", "dpsgd with dp.engine=fused"),
        ([*FUSED, "dp.clipping=adaptive"], "dp.clipping", "fixed with dp.engine=fused"),
        ([*FUSED, "train.physical_batch_size=16"], "train.physical_batch_size", "dp.pad_to sets the rows"),
        (["dp.pad_to=96"], "dp.pad_to", "null unless dp.engine=fused"),
    ],
)
def test_bad_mechanism_and_unit_input_is_refused_before_training(
    make_cfg: Composer, overrides: list[str], key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        prepare(to_config(make_cfg(*overrides)), DIGITS)
    assert err.value.key == key and allowed in str(err.value), str(err.value)


@pytest.mark.slow
def test_dpftrl_and_user_level_runs_log_the_epsilon_of_what_ran(make_cfg: Composer, client: MlflowClient) -> None:
    ftrl = train(make_cfg(*FTRL, "dp.noise_multiplier=4", "train.epochs=2", "tracking.run_name=ftrl"))
    run = client.get_run(ftrl.run_id)
    tags, m = run.data.tags, run.data.metrics
    assert tags["dp.mechanism"] == "dpftrl" and tags["dp.neighbours"] == "replace_one_with_zero"
    assert tags["dp.unit"] == "example" and ftrl.steps == 2 * 23
    assert m["epsilon"] == pytest.approx(dpftrl_accounting.ftrl_epsilon(4.0, 23, 2, 1e-5, accountant="pld"), rel=1e-12)
    first = min(client.get_metric_history(ftrl.run_id, "epsilon"), key=lambda h: h.step)
    # after epoch 1: one epoch's tree, on PLD's coarser grid before the last epoch (an upper bound)
    assert first.value == pytest.approx(dpftrl_accounting.ftrl_epsilon(4.0, 23, 1, 1e-5, accountant="pld"), rel=1e-3)
    assert "train_loss" not in m and 0 <= m["test_accuracy"] <= 1

    user = train(make_cfg(*USERS, "dp.noise_multiplier=1.5", "train.epochs=2", "tracking.run_name=user"))
    tags, m = client.get_run(user.run_id).data.tags, client.get_run(user.run_id).data.metrics
    assert tags["dp.unit"] == "user" and tags["dp.mechanism"] == "dpsgd" and user.steps == 2 * 5
    pld = Accounting("pld")
    assert m["epsilon"] == epsilon(poisson_schedule(50, 10), 1.5, 1e-5, epochs=2, accounting=pld).epsilon
    for stage in ("batch_load", "backward", "optimizer_step"):
        assert memory_bytes(m, stage) > 0  # the stages of one step on exactly B users


@pytest.mark.slow
def test_an_interrupted_dpftrl_run_resumes_its_tree_exactly(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    args = [*FTRL, "dp.noise_multiplier=3", "train.epochs=4", "dp.ftrl_restart_every=2", "dp.ftrl_tree_completion=true"]
    # interrupted in epoch 4: after epoch 3 the second tree is half done
    ckpt = tmp_path / "ckpt"
    straight, resumed = straight_and_resumed(make_cfg, client, experiment_name, args, task.ClassifierRun, 4, ckpt)
    assert resumed.steps == straight.steps == 4 * 23
    assert resumed.epsilons == straight.epsilons
    expected = dpftrl_accounting.ftrl_epsilon(3.0, 23, 4, 1e-5, 2, True, accountant="pld")
    assert resumed.epsilon == pytest.approx(expected, rel=1e-12)
    assert resumed.model is not None and straight.model is not None
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the same tree noise, the same fixed order, the same steps


def _fused_beside(
    make_cfg: Composer, client: MlflowClient, args: list[str], steps: int, fused_only: tuple[str, ...] = ()
) -> Run:
    """A fused run of ``args`` (and ``fused_only``) beside the run of the same settings without it: FINISHED,
    with the same steps, ledger, per-epoch ε and logged ε; the fused run's MLflow run."""
    other = train(make_cfg(*args, "tracking.run_name=not-fused"))
    ran = train(make_cfg(*args, *FUSED, *fused_only, "tracking.run_name=fused"))
    run = client.get_run(ran.run_id)
    assert run.info.status == "FINISHED" and run.data.params["dp.grad_sample_mode"] == "fused"
    assert ran.steps == other.steps == steps and ran.epsilons == other.epsilons
    assert ran.ledger == other.ledger and ran.ledger.entries, ran.ledger  # entry by entry: the same releases
    assert run.data.metrics["epsilon"] == client.get_run(other.run_id).data.metrics["epsilon"]
    return run


def _passes_recorded(monkeypatch: pytest.MonkeyPatch) -> list[fused.FusedStep]:
    """The fused steps the runs of this test build, to read how many passes they took."""
    made: list[fused.FusedStep] = []
    build = fused.FusedStep.__init__

    def recorded(self: fused.FusedStep, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(fused.FusedStep, "__init__", recorded)
    return made


@pytest.mark.slow
def test_a_fused_run_is_dpsgd_with_the_same_ledger_and_sampling(
    make_cfg: Composer, client: MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dp.grad_sample_mode=fused trains example-level DP-SGD: the ε, steps and ledger of a hooks run at the same
    settings, its batches Poisson at the same q (χ² against Binomial(N, q)), and it learns."""
    args = ["dp.noise_multiplier=1.0", "train.epochs=2"]
    run = _fused_beside(make_cfg, client, args, steps=2 * 23)
    assert run.data.metrics["test_accuracy"] > 0.3  # chance is 0.1: it learns
    # passes of exactly B rows: about half the Poisson batches exceed it and take a second pass, none is
    # truncated, and the ledger is still the hooks run's (the ε of the batches actually drawn)
    made = _passes_recorded(monkeypatch)
    bound_b = [*args, "tracking.experiment_name=bound_b"]
    _fused_beside(make_cfg, client, bound_b, steps=2 * 23, fused_only=("dp.pad_to=64",))
    [step] = made
    assert step.pad_to == 64 and 2 * 23 + 10 < step.passes < 2 * 2 * 23, step.passes
    # the sampler a fused run trains with: each example in with probability q = 1/ceil(N/B)
    cfg = to_config(make_cfg(*args, *FUSED))
    x, y = torch.zeros(1437, 1), torch.zeros(1437, dtype=torch.long)
    no_order: Any = None  # Poisson-sampled: no fixed order
    own = functional.OwnRun(
        cfg, nn.Linear(1, 2), nn.CrossEntropyLoss(), (x, y, None), no_order, 1.0, torch.device("cpu"), STREAMS
    )
    setup = functional.FusedPoisson().setup(own)
    assert setup.expected_units == 64  # train.batch_size, public (issue 58, item 5): not int(1437 / 23) = 62
    sizes = [len(b.y) for _ in range(40) for b in setup.batches]  # 40 epochs of 23 steps
    q = 1 / 23
    edges = [0, 50, 55, 58, 61, 64, 67, 70, 75, 1438]
    observed = [sum(lo <= s < hi for s in sizes) for lo, hi in itertools.pairwise(edges)]
    expected = [len(sizes) * (stats.binom.cdf(hi - 1, 1437, q) - stats.binom.cdf(lo - 1, 1437, q))
                for lo, hi in itertools.pairwise(edges)]  # fmt: skip
    assert stats.chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


@pytest.mark.slow
def test_a_user_level_fused_run_is_user_level_dpsgd(make_cfg: Composer, client: MlflowClient) -> None:
    """dp.grad_sample_mode=fused dp.unit=user: the users, ε, steps and ledger of a user-level DP-SGD run at the
    same settings (the same Poisson draws of users), and it learns."""
    args = [*USERS, "dp.noise_multiplier=0.8", "train.epochs=3", "dp.max_examples_per_user=8"]
    run = _fused_beside(make_cfg, client, args, steps=3 * 5)
    assert run.data.tags.get("dp.unit", run.data.params.get("dp.unit")) == "user"
    assert run.data.metrics["test_accuracy"] > 0.2, run.data.metrics  # chance is 0.1
    # the users a fused run trains with: each user in with probability q = 1/ceil(U/B) = 1/5
    cfg = to_config(make_cfg(*args, *FUSED))
    x, y, users = torch.zeros(200, 1), torch.zeros(200, dtype=torch.long), torch.arange(200) % 50
    no_order: Any = None  # Poisson-sampled: no fixed order
    own = functional.OwnRun(
        cfg, nn.Linear(1, 2), nn.CrossEntropyLoss(), (x, y, users), no_order, 0.8, torch.device("cpu"), STREAMS
    )
    setup = functional.FusedUsers().setup(own)
    sampled = [b.num_users for _ in range(200) for b in setup.batches]  # 200 epochs of 5 steps
    edges = [0, 7, 9, 10, 11, 13, 51]
    observed = [sum(lo <= s < hi for s in sampled) for lo, hi in itertools.pairwise(edges)]
    expected = [len(sampled) * (stats.binom.cdf(hi - 1, 50, 0.2) - stats.binom.cdf(lo - 1, 50, 0.2))
                for lo, hi in itertools.pairwise(edges)]  # fmt: skip
    assert stats.chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


@pytest.mark.slow
def test_an_interrupted_fused_run_resumes_exactly(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    args = [*FUSED, "dp.noise_multiplier=1.0", "train.epochs=3"]
    ckpt = tmp_path / "ckpt"
    straight, resumed = straight_and_resumed(make_cfg, client, experiment_name, args, task.ClassifierRun, 3, ckpt)
    assert resumed.steps == straight.steps == 3 * 23
    assert resumed.epsilons == straight.epsilons
    assert resumed.model is not None and straight.model is not None
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the same batches and noise from the checkpointed generator


@pytest.mark.slow
def test_user_level_memory_stages_tell_nothing_of_the_users(make_cfg: Composer, client: MlflowClient) -> None:
    """Issue 39, item 10: the stages are measured on B users of exactly dp.max_examples_per_user examples,
    so two partitions of the data into users (another seed, another skew) log the same bytes."""
    logged = []
    for extra in (["dataset.users_seed=0"], ["dataset.users_seed=1", "dataset.user_label_skew=0.1"]):
        ran = train(make_cfg(*USERS, "dp.noise_multiplier=1.5", "train.epochs=1", "dp.max_examples_per_user=4", *extra))
        metrics = client.get_run(ran.run_id).data.metrics
        logged.append({k: v for k, v in metrics.items() if k.startswith("system/memory/")})
    assert logged[0] and logged[0] == logged[1]


@pytest.mark.slow
def test_a_compiled_fused_run_trains_on_the_cpu(make_cfg: Composer, client: MlflowClient) -> None:
    """dp.compile=true on the CPU: the memory census met the fake and batched tensors torch.compile
    keeps, and the run crashed (RuntimeError: cannot access data pointer). The mlp's compiled tail is
    quick to compile."""
    ran = train(make_cfg("model=mlp", *FUSED, "dp.compile=true", "train.epochs=1"))
    run = client.get_run(ran.run_id)
    assert run.info.status == "FINISHED" and memory_bytes(run.data.metrics, "backward") > 0
    assert ran.steps == 23 and ran.test_accuracy > 0.2
