"""What a DP mechanism declares, and the registry of mechanisms by ``dp.mechanism`` (no torch).

A mechanism is a ledger for a setting plus one calibration, as in dp-accounting (an event and
``calibrate_dp_mechanism``): :meth:`Mechanism.ledger` maps a noise multiplier to the ledger of the
whole run, and :meth:`Mechanism.calibrate` bisects over that map (:mod:`dpsweep.privacy.calibrate`).
Besides, it names its neighbouring relation, whether it samples (and so is amplified), its labels and
report note, the accountants that price it, and the engines that take its steps at each privacy unit
(:meth:`Mechanism.engines`, asked by :mod:`dpsweep.mechanisms.engines`).

A new mechanism is one module that subclasses :class:`Mechanism` and registers an instance::

    MECHANISMS.register("name")(MyMechanism())

``dpsweep.plan``, ``dpsweep-epsilon``, ``dpsweep-plan`` and the report ask this registry; none of them
names a mechanism.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from dpsweep.errors import InputError
from dpsweep.privacy import calibrate
from dpsweep.privacy.ledger import Accounting, Ledger
from dpsweep.registry import Registry

if TYPE_CHECKING:
    from dpsweep.config import Config


EngineTable = Mapping[str, tuple[str, ...]]  # dp.unit -> engine names (dpsweep.mechanisms.engines)


@dataclass(frozen=True)
class Setting:
    """What a run's privacy depends on besides σ, from a config (``dpsweep.plan``) or a command line
    (``dpsweep-epsilon``): N (examples, or users with ``dp.unit=user``), the batch size B, the length
    (epochs, or steps where a mechanism counts them), δ, the accounting, the releases made besides
    the mechanism's own (``extra``: a private clipping norm) and the mechanism's own options."""

    population: int
    batch_size: int
    epochs: int | None
    delta: float
    accounting: Accounting = Accounting()
    steps: int | None = None  # a length in steps instead of epochs (dpsweep-epsilon --steps)
    extra: Ledger = Ledger()
    options: Mapping[str, Any] = field(default_factory=dict)
    # how a sampled mechanism counts q and steps (dpsweep.privacy.schedule.CONVENTIONS): opacus, as runs
    # train; tf_privacy only for dpsweep-epsilon --convention (reproducing TF Privacy's figures)
    convention: str = "opacus"

    @property
    def steps_per_epoch(self) -> int:
        """ceil(N/B): one step per logical batch, each example (or user) in one batch per epoch in
        expectation (Opacus's Poisson loader, and every mechanism here)."""
        return math.ceil(self.population / self.batch_size)


@dataclass(frozen=True)
class Option:
    """A mechanism's own setting: its ``dp.<key>`` config key and its ``dpsweep-epsilon`` flag."""

    key: str  # under dp.
    flag: str  # dpsweep-epsilon's
    help: str
    kind: type = int  # int, or bool for a switch


class Mechanism(ABC):
    """A DP mechanism: its privacy (ledger, calibration, neighbours) and how a run names it."""

    label: ClassVar[str]  # e.g. "DP-SGD"
    neighbours: ClassVar[str]  # the neighbouring relation of its ε: add_or_remove_one, replace_one_with_zero
    sampled: ClassVar[bool]  # Poisson-sampled batches: amplified by sampling, and a sample rate q
    note: ClassVar[str]  # the report's one line on how it is accounted
    # dp.unit -> the engines (dpsweep.mechanisms.engines) that take its steps there, its default first
    engines_at: ClassVar[EngineTable]
    # the audit.mode values its steps let canaries into: black_box trains on another set and needs nothing
    # of the step; white_box needs a rule whose release takes the canaries' units (OwnRule.release), which a
    # rule that says only its gradient does not
    audits: ClassVar[tuple[str, ...]] = ("black_box",)
    distributed: ClassVar[bool] = False  # its steps run across train.devices x train.nodes ranks
    # the task.method values it trains (a task with methods, task=recommender: TaskConfig.method_name)
    methods: ClassVar[tuple[str, ...]] = ()
    accountants: ClassVar[tuple[str, ...]] = ("rdp", "prv", "pld")
    # how it counts q and steps (Setting.convention): dpsweep's as runs train, and for DP-SGD TF Privacy's too
    conventions: ClassVar[tuple[str, ...]] = ("opacus",)
    options: ClassVar[tuple[Option, ...]] = ()
    citation: ClassVar[str] = ""

    @abstractmethod
    def ledger(self, s: Setting, noise_multiplier: float) -> Ledger:
        """Every release of a whole run at noise multiplier σ, ``s.extra`` included."""

    def steps(self, s: Setting) -> int:
        """The optimizer steps of the run (every step, with or without DP)."""
        return s.steps if s.steps is not None else s.steps_per_epoch * (s.epochs or 0)

    def sample_rate(self, s: Setting) -> float | None:
        """q of a sampled mechanism; None for one that samples nothing."""
        return 1 / s.steps_per_epoch if self.sampled else None

    def guess(self, s: Setting, target_epsilon: float) -> float:
        """Where the calibration's bracket search starts."""
        return 1.0

    def calibrate(self, s: Setting, target_epsilon: float) -> float:
        """The smallest σ whose ledger spends at most ``target_epsilon`` (one bisection for all)."""
        return calibrate.noise_multiplier(
            lambda sigma: self.ledger(s, sigma), target_epsilon, s.delta, s.accounting, self.guess(s, target_epsilon)
        )

    def check(self, s: Setting) -> None:
        """Refuse what this mechanism cannot price (InputError names the key)."""
        if s.accounting.accountant not in self.accountants:
            allowed = f"one of {', '.join(self.accountants)} for {self.label}"
            raise InputError("dp.accountant", s.accounting.accountant, allowed)

    def check_config(self, cfg: Config) -> None:
        """What a run of this mechanism needs of the rest of its config besides its engine's requirements
        (:func:`dpsweep.mechanisms.engines.check`): the accountants that price it (ConfigError names the key)."""
        from dpsweep.config import ConfigError  # hydra: where a run is planned, not where ε is priced

        dp, name = cfg.dp, str(cfg.dp.mechanism)
        if dp.accountant.value not in self.accountants:
            allowed = f"{' or '.join(self.accountants)} with dp.mechanism={name}"
            raise ConfigError("dp.accountant", dp.accountant.value, allowed)

    def engines(self, unit: str) -> tuple[str, ...]:
        """The engines that take its steps at ``dp.unit`` ``unit``, its default first (``dp.engine=null``);
        (): none, it does not run at that unit."""
        return tuple(self.engines_at.get(unit, ()))

    def describe(self, s: Setting, noise_multiplier: float) -> str:
        """One sentence on what ran, for ``dpsweep-epsilon``'s statement."""
        q = self.sample_rate(s)
        return (
            f"{self.label} with "
            + (f"sample rate q = {q:.6g} and " if q is not None else "")
            + f"noise multiplier σ = {noise_multiplier:.6g}, iterated over {self.steps(s)} steps"
            + (f" ({s.epochs} epochs)" if s.epochs is not None and s.steps is None else "")
            + ("" if self.sampled else " (no sampling, no amplification)")
        )

    def ledger_taken(self, s: Setting, noise_multiplier: float, steps: int) -> Ledger:
        """The ledger of the ``steps`` a run took (an early stop, a resume): the mechanism's own events
        only; the releases before training (``s.extra``) are the run's to add."""
        return Ledger() if steps == 0 else self.ledger(replace(s, steps=steps, extra=Ledger()), noise_multiplier)

    def own_steps(self) -> Any:
        """How it trains when its engine is dpsweep's own steps (``own_steps``: :mod:`dpsweep.mechanisms.engines`):
        a ``dpsweep.mechanisms.functional.OwnRule``; imported here, where a run trains (torch)."""
        raise NotImplementedError(f"{self.label} has no rule for its own steps")

    def details(self, s: Setting) -> dict[str, Any]:
        """What else ``dpsweep-epsilon --json`` reports of this mechanism's setting."""
        return {}


MECHANISMS: Registry[Mechanism] = Registry("mechanism")


def get(name: str, key: str = "dp.mechanism") -> Mechanism:
    """The mechanism registered as ``name``; InputError naming ``key`` and the valid names otherwise."""
    return MECHANISMS.get(name, key=key)
