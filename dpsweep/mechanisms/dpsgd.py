"""``dp.mechanism=dpsgd``: DP-SGD with Poisson sampling (Abadi et al. 2016, "Deep Learning with
Differential Privacy"), one Poisson-subsampled Gaussian mechanism per step; trained through Opacus
(:mod:`dpsweep.mechanisms.opacus_engine`), or by :mod:`dpsweep.mechanisms.functional` at user level, or by
the fused step at either (``dp.engine=fused``; :mod:`dpsweep.mechanisms.engines`), or, for task=gan, by its
critic's own step (``critic``: :mod:`dpsweep.tasks.gan.critic`).

    dpsweep dp.mechanism=dpsgd dp.noise_multiplier=1.1   # the default mechanism
    dpsweep-epsilon -s 60000 -b 256 -n 1.1 -e 10
"""

from __future__ import annotations

from typing import Any, ClassVar

from dpsweep.mechanisms.base import MECHANISMS, EngineTable, Mechanism, Setting
from dpsweep.privacy import ledger
from dpsweep.privacy.ledger import Ledger
from dpsweep.privacy.schedule import CONVENTIONS, PoissonSchedule, run_ledger


class DPSGD(Mechanism):
    name = "dpsgd"
    label = "DP-SGD"
    neighbours = ledger.NEIGHBOURS  # add or remove one example (or user)
    sampled = True
    note = "Poisson-sampled batches, amplified by sampling"
    # per example through Opacus, per user by its own steps (Opacus's hooks clip examples, not users);
    # either by the fused step; task=gan's critic per example
    engines_at: ClassVar[EngineTable] = {"example": ("opacus", "fused", "critic"), "user": ("own_steps", "fused")}
    audits: ClassVar[tuple[str, ...]] = ("white_box", "black_box")  # every engine's release takes canaries
    distributed: ClassVar[bool] = True  # through Opacus's distributed optimizers (its engine's to say too)
    methods: ClassVar[tuple[str, ...]] = ("dpam", "sgd")  # task=recommender's items by user-level DP-SGD
    citation = "Abadi et al. 2016; Mironov, Talwar & Zhang 2019 (the subsampled Gaussian's RDP)"
    conventions = tuple(CONVENTIONS)  # Opacus's, as runs train, and TF Privacy's (its published ε)

    def schedule(self, s: Setting) -> PoissonSchedule:
        return CONVENTIONS[s.convention](s.population, s.batch_size)

    def sample_rate(self, s: Setting) -> float:
        return self.schedule(s).sample_rate

    def steps(self, s: Setting) -> int:
        return s.steps if s.steps is not None else self.schedule(s).steps(s.epochs or 0)

    def ledger(self, s: Setting, noise_multiplier: float) -> Ledger:
        return run_ledger(self.schedule(s), noise_multiplier, self.steps(s), s.extra)

    def own_steps(self) -> Any:
        """At user level: users Poisson-sampled, noise on the sum of their clipped contributions."""
        from dpsweep.mechanisms.functional import PoissonUnits  # torch: where a run trains

        return PoissonUnits()


MECHANISMS.register(DPSGD.name)(DPSGD())
