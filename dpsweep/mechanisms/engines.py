"""How a private run computes, clips and noises its gradients: the engines, each stating once what it needs.

    dpsweep                                   # dp.engine=null: the mechanism's own (DP-SGD per example: opacus)
    dpsweep dp.engine=fused                   # DP-SGD in compiled passes of one fixed shape
    dpsweep dp.mechanism=dpftrl               # own_steps: the one engine DP-FTRL declares

A mechanism (:mod:`dpsweep.mechanisms.base`) says what is released and how it is accounted; an engine is
what takes its steps. Which combinations run is not a table kept anywhere: each owner declares what it
supports, and :func:`check` asks them, as dp_accounting's accountants answer ``supports(event)``
(``dp_accounting.PrivacyAccountant.supports``):

- a mechanism, the engines that run its steps at each privacy unit (``Mechanism.engines(unit)``, its
  default first);
- a task, the engines, privacy units and audit modes it takes, and whether it has a distributed path
  (``TaskConfig.engines``, ``units``, ``audits``, ``distributed``: :mod:`dpsweep.config.task`);
- a mechanism, the audit modes its steps let canaries into and whether it runs across ranks
  (``Mechanism.audits``, ``Mechanism.distributed``), and the ``task.method`` values it trains (``methods``);
- an engine (:class:`Engine`), the clipping it takes, whether a step may be split into physical
  batches, whether it runs across ranks, which ``dp.grad_sample_mode`` values it reads, which audits
  its steps let canaries into, the ``dp.*`` keys only it reads, and how a task that builds its steps
  from its engine (``TaskConfig.builds_steps``: task=classifier) builds one (:attr:`Engine.steps`);
- a launcher, whether it starts ranks and nodes (``dpsweep.config.launcher.LauncherSpec``).

The engines:

- ``opacus``: Opacus's ``PrivacyEngine`` (Yousefpour et al. 2021, "Opacus: User-Friendly Differential
  Privacy Library in PyTorch"; :mod:`dpsweep.mechanisms.opacus_engine`), per-sample gradients by
  ``dp.grad_sample_mode``: ``hooks``, ``ghost`` (ghost clipping, Goodfellow 2015 and Li et al. 2022,
  "Large Language Models Can Be Strong Differentially Private Learners": per-sample norms without
  per-sample gradients, so one fixed norm and nothing a canary row can join), ``functorch`` or ``ew``.
  Per example only: its hooks clip examples, not users. Across ranks through Opacus's distributed
  optimizers (``DistributedDPOptimizer``, and ``DistributedDPOptimizerFastGradientClipping`` for ghost
  clipping: ``opacus/optimizers/__init__.py``, ``get_optimizer_class``).
- ``own_steps``: dpsweep's per-unit steps from ``torch.func`` gradients (:mod:`dpsweep.mechanisms.functional`):
  DP-FTRL (Kairouz et al. 2021), user-level DP-SGD (McMahan et al. 2018, "Learning Differentially Private
  Recurrent Language Models"), and task=recommender's DPAM; one fixed C, a step one pass, one process.
- ``fused``: dpsweep's fused DP-SGD step (:mod:`dpsweep.mechanisms.fused`), per example or per user, in
  passes of one fixed shape (``dp.pad_to`` rows), compiled where ``dp.compile`` says; the accounting is
  DP-SGD's (Abadi et al. 2016) at the same q, σ and steps. Until ``dp.engine`` existed it was spelt
  ``dp.grad_sample_mode=fused`` (:data:`dpsweep.config.dp.RENAMED_MODES`).
- ``critic``: task=gan's critic step (:mod:`dpsweep.tasks.gan.critic`): per-example gradients of the whole
  WGAN-GP loss, gradient penalty included, by ``torch.func`` (a gradient of a gradient, which Opacus's hooks
  cannot take: Opacus #31, #548), each clipped to one fixed C and noised as DP-SGD's (Abadi et al. 2016;
  dp-GAN, Zhang, Ji & Wang 2018, Alg. 1); a step one pass, one process.
- ``sufficient_statistics``: DPALS's rounds (Chien et al. 2021, "Private Alternating Least Squares",
  Alg. 1; :mod:`dpsweep.tasks.recommender.als`): a Gaussian release of the items' sufficient statistics,
  no gradient, no sampling.

A new engine is one registry line (and a mechanism that declares it, and a task that takes it); for
task=classifier, with the function that builds its step (:attr:`Engine.steps`)::

    ENGINES.register("name")(Engine("name", "what it is", units=("example",), steps="package.module:build"))

A ``dp.grad_sample_mode`` other than its default given to an engine that reads none is ignored with one
line on stderr a process (it was ignored before the engines existed), and refused from the next release.

No torch here: the checks run before any job starts (the steps themselves import torch where a run trains).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpsweep.mechanisms.base import MECHANISMS, Mechanism, get
from dpsweep.registry import Registry

if TYPE_CHECKING:
    from dpsweep.config import Config, TaskConfig

AUDITS = ("white_box", "black_box")  # the audits (audit.mode) a step can let canaries into
CLIPPING = ("fixed", "quantile", "adaptive")  # the dp.clipping values (dpsweep.config.dp.Clipping)


@dataclass(frozen=True)
class Limit:
    """What one ``dp.grad_sample_mode`` of an engine cannot do that the engine otherwise can."""

    clipping: tuple[str, ...] | None = None  # None: the engine's
    audits: tuple[str, ...] | None = None  # None: the engine's
    why: str = ""


@dataclass(frozen=True)
class Engine:
    """What an engine needs of a run, stated once; :meth:`check` refuses a config that asks more."""

    name: str
    about: str  # what it is, in a few words (messages)
    units: tuple[str, ...] = ("example", "user")  # the dp.unit values its steps bound
    clipping: tuple[str, ...] = ("fixed",)  # the dp.clipping values it takes
    physical_batches: bool = False  # train.physical_batch_size may split a step into passes
    one_pass: str = "a step is one pass"  # why not, where it may not
    distributed: bool = False  # it has a path across train.devices x train.nodes ranks
    # the dp.grad_sample_mode values it reads, its default first; (): it reads none, the key stays at its default
    grad_sample_modes: tuple[str, ...] = ()
    limits: Mapping[str, Limit] = field(default_factory=dict)  # narrower limits of some grad_sample_modes
    audits: tuple[str, ...] = AUDITS  # the audits its steps let canaries into
    keys: Mapping[str, str] = field(default_factory=dict)  # dp.* keys only it reads (null under any other): why
    # its steps need a model whose layers treat the rows of a batch apart, checked before any job starts
    # (dpsweep.mechanisms.fused.check_planned_model)
    rows_apart: bool = False
    # how a task that builds its steps from its engine (TaskConfig.builds_steps: task=classifier) builds this
    # engine's: the function (the task's run -> what it checkpoints), or its "module:function", imported where
    # a run trains (torch); None: no such task can take it (refused before any run, naming dp.engine)
    steps: str | Callable[..., Any] | None = None

    def clipping_for(self, mode: str) -> tuple[str, ...]:
        limit = self.limits.get(mode)
        return limit.clipping if limit is not None and limit.clipping is not None else self.clipping

    def audits_for(self, mode: str) -> tuple[str, ...]:
        limit = self.limits.get(mode)
        return limit.audits if limit is not None and limit.audits is not None else self.audits

    def supports_audit(self, mode: str, grad_sample_mode: str) -> bool:
        """Whether its steps, with this ``dp.grad_sample_mode``, let ``audit.mode`` ``mode``'s canaries in."""
        return mode in self.audits_for(grad_sample_mode)

    def check(self, cfg: Config) -> None:
        """Refuse what this engine cannot run (ConfigError names the key, the value, and the engine)."""
        from dpsweep.config import ConfigError  # hydra: where a run is planned, not where ε is priced

        dp, t, what = cfg.dp, cfg.train, named(cfg, self)
        mode, default = dp.grad_sample_mode.value, type(dp).grad_sample_mode.value
        if self.grad_sample_modes and mode not in self.grad_sample_modes:
            raise ConfigError("dp.grad_sample_mode", mode, f"{_either(self.grad_sample_modes)} with {what}")
        if not self.grad_sample_modes and mode != default:
            _ignored(mode, self)
        limit = self.limits.get(mode, Limit())
        if dp.clipping.value not in self.clipping_for(mode):
            also = f" and dp.grad_sample_mode={mode}: {limit.why}" if limit.clipping is not None else ""
            raise ConfigError("dp.clipping", dp.clipping.value, f"{_either(self.clipping_for(mode))} with {what}{also}")
        if not self.physical_batches and t.physical_batch_size is not None:
            raise ConfigError("train.physical_batch_size", t.physical_batch_size, f"null with {what}: {self.one_pass}")
        for owner in ENGINES.names():
            for key, why in ENGINES.get(owner).keys.items():
                value = getattr(dp, key.removeprefix("dp."))
                if key not in self.keys and value is not None:
                    raise ConfigError(key, value, f"null unless dp.engine={owner} ({why})")
        self.check_own(cfg)
        if cfg.audit.enabled and not self.supports_audit(cfg.audit.mode, mode):
            also = f" and dp.grad_sample_mode={mode}: {limit.why}" if limit.audits is not None else ""
            takes = _either(audited(type(cfg.task), cfg.audit.mode)) or "no engine of this task"
            allowed = f"off with {what}{also}; {cfg.audit.mode} runs with {takes}"
            raise ConfigError("audit.mode", cfg.audit.mode, allowed)
        if t.devices * t.nodes > 1 and not self.distributed:
            across = _either([n for n in ENGINES.names() if ENGINES.get(n).distributed])
            allowed = f"1 with {what}: its steps are one process's (a run across devices trains through dp.engine="
            raise ConfigError("train.devices", t.devices, f"{allowed}{across})")

    def check_own(self, cfg: Config) -> None:
        """What else only this engine needs (its own keys' ranges)."""
        return None


@dataclass(frozen=True)
class FusedEngine(Engine):
    """The fused step: its passes are ``dp.pad_to`` rows, at least B (:func:`dpsweep.mechanisms.fused.pad_bound`)."""

    def check_own(self, cfg: Config) -> None:
        from dpsweep.config import ConfigError

        pad, b = cfg.dp.pad_to, cfg.train.batch_size
        if not (pad is None or (isinstance(pad, int) and not isinstance(pad, bool) and pad >= b)):
            allowed = f"an integer at least train.batch_size={b} (the rows of every pass), or null"
            raise ConfigError("dp.pad_to", pad, allowed)


ENGINES: Registry[Engine] = Registry("engine")
OPACUS_STEP = "dpsweep.tasks.classifier.task:opacus_step"  # a classifier's step through Opacus's make_private
OWN_STEP = "dpsweep.tasks.classifier.task:own_step"  # ... through its engine's rule (functional.RULES)

GHOST = "Opacus's ghost clipping has a fixed norm, and holds no per-sample gradient a canary row can join"
ENGINES.register("opacus")(
    Engine(
        "opacus", "Opacus's per-sample gradients", units=("example",), clipping=CLIPPING, physical_batches=True,
        distributed=True, grad_sample_modes=("hooks", "ghost", "functorch", "ew"),
        limits={"ghost": Limit(clipping=("fixed", "quantile"), audits=(), why=GHOST)}, steps=OPACUS_STEP,
    )
)  # fmt: skip
ENGINES.register("own_steps")(
    Engine("own_steps", "dpsweep's per-unit steps from torch.func gradients (the mechanism's own rule)", steps=OWN_STEP)
)
ENGINES.register("fused")(
    FusedEngine(
        "fused", "dpsweep's fused step, passes of one fixed shape", one_pass="dp.pad_to sets the rows of a pass",
        keys={"dp.pad_to": "the rows of every pass", "dp.compile": "whether its pass is compiled"}, rows_apart=True,
        steps=OWN_STEP,
    )
)  # fmt: skip
ENGINES.register("critic")(
    Engine("critic", "task=gan's critic step from torch.func gradients", units=("example",), one_pass="a critic "
           "step is one pass (its gradient penalty's gradient of a gradient, per example)")
)  # fmt: skip
ENGINES.register("sufficient_statistics")(
    Engine("sufficient_statistics", "DPALS's release of sufficient statistics", units=("user",), audits=())
)


def named(cfg: Config, engine: Engine) -> str:
    """How a message names the run's engine: ``dp.engine=fused``, or, where the mechanism chose it,
    ``dp.mechanism=dpftrl at dp.unit=example (its engine: own_steps)``."""
    dp = cfg.dp
    if dp.engine is not None:
        return f"dp.engine={engine.name}"
    return f"dp.mechanism={dp.mechanism} at dp.unit={dp.unit.value} (its engine: {engine.name})"


def engine_of(cfg: Config) -> Engine:
    """The run's engine: ``dp.engine``, or null: the mechanism's own (:func:`default_of`).
    UnknownNameError (key ``dp.engine`` or ``dp.mechanism``) for a name no registry holds."""
    dp = cfg.dp
    if dp.engine is not None:
        return ENGINES.get(dp.engine, key="dp.engine")
    return default_of(cfg)


def default_of(cfg: Config) -> Engine:
    """What ``dp.engine=null`` means: the first engine the mechanism declares at ``dp.unit`` that the task
    takes (the first it declares, where the task takes none: refused by :func:`check`)."""
    from dpsweep.config import ConfigError

    dp = cfg.dp
    mechanism, unit = get(dp.mechanism), dp.unit.value
    declared = mechanism.engines(unit)
    if not declared:
        units = [u for u in ("example", "user") if mechanism.engines(u)]
        raise ConfigError("dp.unit", unit, f"{_either(units)} with dp.mechanism={dp.mechanism}")
    taken = [name for name in declared if name in type(cfg.task).engines]
    return ENGINES.get((taken or list(declared))[0], key="dp.engine")


def check(cfg: Config) -> Engine:
    """What a private run needs of the owners, asked of each: the task takes the engine (and the
    mechanism, through one of its engines), the mechanism declares the engine at ``dp.unit``, and the
    engine's own requirements (:meth:`Engine.check`). Returns the engine; ConfigError names the key."""
    from dpsweep.config import ConfigError

    dp, task = cfg.dp, type(cfg.task)
    unit, mechanism = dp.unit.value, get(dp.mechanism)
    method = cfg.task.method_name()
    if method is not None and method not in mechanism.methods:
        named_by = [n for n in MECHANISMS.names() if method in MECHANISMS.get(n).methods]
        raise ConfigError("dp.mechanism", dp.mechanism, f"{_either(named_by)} with task.method={method}")
    if not set(mechanism.engines(unit)) & set(task.engines):
        fits = [n for n in MECHANISMS.names() if set(MECHANISMS.get(n).engines(unit)) & set(task.engines)]
        trains = mechanism.engines(unit)
        through = f" (it trains through dp.engine={_either(trains)})" if trains else ""
        raise ConfigError("dp.mechanism", dp.mechanism, f"{_either(fits)} with {task.label}{through}")
    engine = engine_of(cfg)
    if engine.name not in task.engines:
        raise ConfigError("dp.engine", engine.name, f"{_either(task.engines)} with {task_label(task)}")
    if unit not in engine.units:
        raise ConfigError("dp.unit", unit, f"{_either(engine.units)} with dp.engine={engine.name} ({engine.about})")
    if engine.name not in mechanism.engines(unit):
        declaring = [n for n in MECHANISMS.names() if engine.name in MECHANISMS.get(n).engines(unit)]
        raise ConfigError(
            "dp.mechanism", dp.mechanism, f"{_either(declaring)} with dp.engine={engine.name} at dp.unit={unit}"
        )
    if task.builds_steps and engine.steps is None:
        allowed = f"an engine that says how {task_label(task)} builds its step (Engine.steps): {engine.name} does not"
        raise ConfigError("dp.engine", engine.name, allowed)
    engine.check(cfg)
    _check_mechanism(cfg, mechanism, engine)
    return engine


def checked(cfg: Config) -> Engine | None:
    """Every entry point's checks before any data is read: the ranges (:func:`dpsweep.config.validate`),
    then, with DP, what the task, mechanism and engine declare (:func:`check`); ``dp.engine`` given as the
    mechanism's own is then set to null, so that it names the run (its config hash, its params) as null does.
    Returns the engine (None without DP)."""
    from dpsweep.config import validate

    validate(cfg)
    if not cfg.dp.enabled:
        return None
    engine = check(cfg)
    if cfg.dp.engine is not None and default_of(cfg) is engine:
        cfg.dp.engine = None
    return engine


def builder(engine: Engine) -> Callable[..., Any]:
    """How a task that builds its steps from its engine builds this one's (:attr:`Engine.steps`), imported."""
    steps = engine.steps
    if steps is None:
        raise ValueError(f"dp.engine={engine.name} says no way to build a step (Engine.steps)")
    if not isinstance(steps, str):
        return steps
    module, _, name = steps.partition(":")
    built: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return built


def _check_mechanism(cfg: Config, mechanism: Mechanism, engine: Engine) -> None:
    """What the mechanism declares of its steps: the audits they let canaries into (a rule without canary
    support declares no white_box) and whether they run across ranks."""
    from dpsweep.config import ConfigError

    dp, t, what = cfg.dp, cfg.train, named(cfg, engine)
    if cfg.audit.enabled and cfg.audit.mode not in mechanism.audits:
        takes = _either([n for n in MECHANISMS.names() if cfg.audit.mode in MECHANISMS.get(n).audits])
        allowed = f"off with {what}: its steps let no canary in ({cfg.audit.mode} runs with dp.mechanism={takes})"
        raise ConfigError("audit.mode", cfg.audit.mode, allowed)
    if t.devices * t.nodes > 1 and not mechanism.distributed:
        across = _either([n for n in MECHANISMS.names() if MECHANISMS.get(n).distributed])
        allowed = f"1 with dp.mechanism={dp.mechanism}: its steps are one process's (across devices: {across})"
        raise ConfigError("train.devices", t.devices, allowed)


_warned: set[tuple[str, str]] = set()  # the ignored dp.grad_sample_mode values warned of in this process


def _ignored(mode: str, engine: Engine) -> None:
    """One line on stderr a process: ``dp.grad_sample_mode`` given to an engine that reads none is ignored
    for one release (runs made before the engines existed ignored it), then refused."""
    if (mode, engine.name) in _warned:
        return
    _warned.add((mode, engine.name))
    said = f"dp.grad_sample_mode={mode} is ignored by dp.engine={engine.name} (it reads none); it is refused"
    print(f"dpsweep: {said} from the next release", file=sys.stderr)


def audited(task: type[TaskConfig], mode: str) -> list[str]:
    """The engines of ``task`` (and their grad_sample_modes) whose steps let ``audit.mode`` ``mode`` in, in words."""
    found = []
    for name in task.engines:
        engine = ENGINES.get(name)
        modes = [m for m in engine.grad_sample_modes if engine.supports_audit(mode, m)]
        if modes:
            found.append(f"dp.engine={name} with dp.grad_sample_mode={_either(modes)}")
        elif not engine.grad_sample_modes and mode in engine.audits:
            found.append(f"dp.engine={name}")
    return found


def task_label(task: type[TaskConfig]) -> str:
    return task.label or f"task={task.name}"


def _either(names: list[str] | tuple[str, ...]) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)
