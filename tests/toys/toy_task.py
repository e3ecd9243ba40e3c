"""A toy task from this test file alone (issue 57, done-when): its schema, its Hydra config node, its task
object, its engine and a mechanism that declares it, each registered here for this module's tests and
removed afterwards; a run trains through the runner end to end, logs the ε of its DP-SGD ledger, and is
audited white-box by the runner through the private-step protocol alone (no line of the toy names the
audit: a test greps its source).

The toy: multinomial logistic regression on the digits, by its own DP-SGD step (Abadi et al. 2016,
Alg. 1): Poisson batches at the plan's rate q, each example's gradient in closed form (softmax minus the
one-hot label, times the input), clipped to L2 norm C, summed, N(0, σ²C²) added per coordinate, divided
by the expected batch qN. Its ledger is DP-SGD's: ``steps`` Poisson-subsampled Gaussian mechanisms of
noise multiplier σ at rate q (``dpsweep.privacy.ledger.dpsgd``)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from helpers import Composer
from hydra.core.config_store import ConfigStore
from mlflow.tracking import MlflowClient
from torch import Tensor, nn
from torch.utils.data import Dataset

from dpsweep.config import Config, ConfigError, TaskConfig, to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.data.resident import Generators, materialize
from dpsweep.mechanisms import MECHANISMS
from dpsweep.mechanisms.base import EngineTable
from dpsweep.mechanisms.dpsgd import DPSGD
from dpsweep.mechanisms.engines import ENGINES, Engine
from dpsweep.mechanisms.private_step import PrivateStep, Release, Score, TrainingSet, extra_units, show, stepped
from dpsweep.plan import accounting, prepare
from dpsweep.privacy import ledger
from dpsweep.privacy.streams import Purpose
from dpsweep.run.runner import train
from dpsweep.tasks import TASKS, Checkpointed, Marks, RunInputs, Stages
from dpsweep.tracking import Tracker

NAME = "toy_logistic"  # the task, its config node and its engine
MECHANISM = "toy_logistic_dpsgd"  # DP-SGD, its example-level steps the toy's own
DIGITS = DatasetFacts(1437, (1, 28, 28), 10)


@dataclass
class ToyTaskConfig(TaskConfig):
    """Logistic regression on flattened images by its own DP-SGD step, scored by test accuracy."""

    name: str = NAME
    objective: ClassVar[str] = "test_accuracy"
    shows_model: ClassVar[bool] = False  # the model group is unused: the model is the toy's linear map
    units: ClassVar[tuple[str, ...]] = ("example",)
    engines: ClassVar[tuple[str, ...]] = (NAME,)
    audits: ClassVar[tuple[str, ...]] = ("white_box",)
    label: ClassVar[str] = f"task={NAME}"
    objective_label: ClassVar[str] = "test accuracy"

    def check(self, cfg: Config) -> None:
        if not cfg.dp.enabled:
            raise ConfigError("dp.enabled", False, f"true with task={NAME} (it trains by its own DP-SGD step only)")


class ToySGD(DPSGD):
    """DP-SGD (its ledger and what it declares), its example-level steps the toy task's own engine."""

    engines_at: ClassVar[EngineTable] = {"example": (NAME,)}


class ToyRun:
    """One run of the toy (a :class:`dpsweep.tasks.TaskRun` and a ``PrivateRun``)."""

    private_metrics: tuple[str, ...] = ("train_loss",)
    private_stages: bool = True  # its first step's memory follows its Poisson batch's (private) size: none logged

    def __init__(self, inputs: RunInputs) -> None:
        self.inputs, self.cfg, self.plan = inputs, inputs.cfg, inputs.plan
        x, y = materialize(inputs.data.test)
        self.model = nn.Linear(int(np.prod(inputs.data.input_shape)), inputs.data.num_classes)
        self.test = (x.flatten(1), y)
        self.train_set: Dataset[Any] = inputs.data.train
        self.steps = 0

    def tags(self) -> dict[str, Any]:
        return {"model.trainable_params": sum(p.numel() for p in self.model.parameters())}

    def wrap_training_set(self, wrapper: TrainingSet) -> None:
        """Another training set, sampled at the plan's rate and steps and divided by the plan's qN (below)."""
        self.train_set = wrapper.training_set(self.train_set)

    def start(self, run: Tracker) -> Checkpointed:
        privacy, streams = self.plan.privacy, self.inputs.streams
        assert privacy is not None  # the toy's schema refuses dp.enabled=false
        x, self.y = materialize(self.train_set)
        self.x = x.flatten(1)
        self.sigma, self.q, self.c = privacy.noise_multiplier, privacy.poisson_rate, self.cfg.dp.max_grad_norm
        self.divisor = self.q * self.plan.facts.n_train  # the expected batch of the plan's N: public
        self.per_epoch = self.plan.steps // self.cfg.train.epochs
        self.generators = Generators(
            sampling=torch.Generator().manual_seed(streams.seed(Purpose.sampling, 0)),
            noise=torch.Generator().manual_seed(streams.seed(Purpose.noise, 0)),
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.cfg.optimizer.lr)
        params = dict(self.model.named_parameters())
        self.step = PrivateStep(params, self.c, lambda: self.q)
        return Checkpointed(self.model, self.optimizer, None, self.generators)

    def private_step(self) -> PrivateStep:
        return self.step

    def per_example(self, x: Tensor, y: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """Each example's gradient of its cross-entropy (softmax(Wx + b) - onehot(y), times x for W), and the losses."""
        with torch.no_grad():
            logits = self.model(x)
            error = logits.softmax(1) - nn.functional.one_hot(y, logits.shape[1]).to(logits.dtype)
            loss = nn.functional.cross_entropy(logits, y, reduction="none")
        return {"weight": error[:, :, None] * x[:, None, :], "bias": error}, loss

    def dp_step(self, stages: Stages) -> Tensor:
        """One DP-SGD step (module doc); the wrappers' rows clipped with the batch's, the release shown to them."""
        pick = torch.rand(len(self.y), generator=self.generators["sampling"]) < self.q
        units, loss = self.per_example(self.x[pick], self.y[pick])
        extra = extra_units(self.step.wrappers, self.steps)
        if extra is not None:
            units = {k: torch.cat([g, extra[k].to(g.dtype)]) for k, g in units.items()}
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in units.values()))  # type: ignore[arg-type]
        factor = (self.c / (norms + 1e-6)).clamp(max=1.0)
        summed = {k: torch.einsum("i,i...->...", factor, g) for k, g in units.items()}
        noise = self.generators["noise"]
        noisy = {k: s + self.sigma * self.c * torch.randn(s.shape, generator=noise) for k, s in summed.items()}
        release = Release(self.steps, {k: s / self.divisor for k, s in summed.items()},
                          {k: n / self.divisor for k, n in noisy.items()}, self.divisor, units)  # fmt: skip
        show(self.step.wrappers, release)
        for name, p in self.model.named_parameters():
            p.grad = release.noisy[name]
        self.optimizer.step()
        stepped(self.step.wrappers, self.steps)
        self.steps += 1
        stages.stepped()
        return loss

    def train_epoch(self, epoch: int, stages: Stages) -> dict[str, float]:
        losses = [self.dp_step(stages) for _ in range(self.per_epoch)]
        seen = torch.cat(losses)
        return {"train_loss": float(seen.mean()) if len(seen) else float("nan")}

    def evaluate(self, epoch: int, final: bool) -> dict[str, float]:
        with torch.no_grad():
            x, y = self.test
            return {"test_accuracy": float((self.model(x).argmax(1) == y).float().mean())}

    def done(self) -> bool:
        return False

    def probe(self, stages: Stages) -> dict[str, float]:
        raise NotImplementedError("the toy has no memory probe")

    def memory_iteration(self, stages: Marks) -> None:
        return None  # never asked: private_stages

    def example_score(self) -> Score:
        return lambda x, y: -self.per_example(x.flatten(1), y)[1]

    def released_model(self) -> tuple[nn.Module, np.ndarray]:
        return copy.deepcopy(self.model), np.zeros((1, self.model.in_features), dtype=np.float32)

    def trained_model(self) -> nn.Module:
        return self.model.eval()

    def privacy_ledger(self) -> ledger.Ledger:
        return ledger.Ledger((ledger.dpsgd(self.sigma, self.q, self.steps),)) if self.steps else ledger.Ledger()

    def params(self) -> dict[str, Any]:
        return {}


class ToyTask:
    def build(self, inputs: RunInputs) -> ToyRun:
        return ToyRun(inputs)


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    """The toy's task, engine, mechanism and config node, for this module's tests only; afterwards removed
    from each registry (and its schema from ``task_schemas``, which lists TaskConfig's subclasses that
    name an objective: other modules' messages list the tasks)."""
    store = ConfigStore.instance()
    TASKS.register(NAME)(ToyTask())
    ENGINES.register(NAME)(Engine(NAME, "the toy task's own DP-SGD step", units=("example",)))
    MECHANISMS.register(MECHANISM)(ToySGD())
    store.store(group="task", name=NAME, node=ToyTaskConfig)
    yield
    ToyTaskConfig.objective = ""  # out of task_schemas(): the class outlives the module
    for registry in (TASKS, ENGINES, MECHANISMS):
        registry._entries.pop(NAME, None)
    MECHANISMS._entries.pop(MECHANISM, None)
    for name in (f"{NAME}.yaml", f"base_{NAME}.yaml"):  # base_: register_configs() stores every schema it lists
        store.repo["task"].pop(name, None)


TOY = [f"task={NAME}", f"dp.mechanism={MECHANISM}", "dp.noise_multiplier=1.2", "optimizer.lr=0.5"]


def test_the_toy_task_trains_end_to_end_and_logs_the_epsilon_of_its_ledger(
    make_cfg: Composer, client: MlflowClient
) -> None:
    result = train(make_cfg(*TOY))
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["task.name"] == NAME
    assert run.data.tags["dp.engine"] == NAME and run.data.tags["dp.mechanism"] == MECHANISM
    cfg = to_config(make_cfg(*TOY))
    plan = prepare(cfg, DIGITS)
    assert plan.privacy is not None and result.steps == plan.steps == 2 * 23  # FAST: 2 epochs of ceil(N/B)
    claimed = ledger.dpsgd(1.2, plan.privacy.poisson_rate, plan.steps)
    assert [e.params for e in result.ledger.entries] == [claimed.params]
    spent = ledger.epsilon(ledger.Ledger((claimed,)), cfg.dp.delta, accounting(cfg.dp)).epsilon
    assert result.epsilon == pytest.approx(spent, rel=1e-9) and plan.privacy.epsilon == pytest.approx(spent, rel=1e-9)
    assert run.data.metrics["epsilon"] == pytest.approx(spent, rel=1e-9)
    assert run.data.metrics["test_accuracy"] > 0.5  # it learns: ten classes, chance 0.1


def test_the_runner_audits_the_toy_white_box_with_no_audit_line_in_it(make_cfg: Composer, client: MlflowClient) -> None:
    for toy in (ToyRun, ToyTask, ToySGD):  # what trains: no line names the audit
        assert "audit" not in inspect.getsource(toy).lower(), toy
    said = [line.strip() for line in inspect.getsource(ToyTaskConfig).splitlines() if "audit" in line.lower()]
    assert said == ['audits: ClassVar[tuple[str, ...]] = ("white_box",)']  # the schema declares it, once
    result = train(make_cfg(*TOY, "audit.mode=white_box"))
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["audit.mode"] == "white_box"
    metrics = run.data.metrics
    # the canaries went through the toy's clipping and noise and are seen in its releases (a step that dropped
    # its wrappers' rows leaves a bound of 0), and the bound does not reject the ledger's claim
    assert 0 < metrics["audit.epsilon_lower"] <= metrics["epsilon"] and metrics["audit.claim_rejected"] == 0


def test_the_toy_says_what_it_cannot_run(make_cfg: Composer) -> None:
    with pytest.raises(ConfigError, match=r"audit.mode='black_box' .*off with task=toy_logistic"):
        train(make_cfg(*TOY, "audit.mode=black_box"))
