"""``dp.mechanism=dpftrl``: DP-FTRL (Kairouz et al. 2021, "Practical and Private (Deep) Learning
without Sampling or Shuffling"): tree-aggregation noise on the prefix sums of the clipped gradients,
batches in a fixed order, no sampling and so no amplification. Accounted as one Gaussian mechanism of
the tree's sensitivity (:mod:`dpsweep.mechanisms.dpftrl_accounting`); trained by :mod:`dpsweep.mechanisms.functional`
with :mod:`dpsweep.mechanisms.ftrl`'s tree and optimizer.

    dpsweep dp.mechanism=dpftrl optimizer.momentum=0.9 dp.ftrl_restart_every=5
    dpsweep-epsilon --mechanism dpftrl -s 60000 -b 250 -e 100 -n 46.3 --restart-every 20 --tree-completion
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from dpsweep.errors import InputError
from dpsweep.mechanisms import dpftrl_accounting
from dpsweep.mechanisms.base import MECHANISMS, EngineTable, Mechanism, Option, Setting
from dpsweep.privacy.ledger import Ledger

if TYPE_CHECKING:
    from dpsweep.config import Config


class DPFTRL(Mechanism):
    name = "dpftrl"
    label = "DP-FTRL"
    neighbours = "replace_one_with_zero"  # the paper's Def. 1.1; dp-accounting's REPLACE_SPECIAL
    sampled = False
    note = "tree aggregation over batches in a fixed order, no sampling and no amplification"
    # torch.func steps (dpsweep.mechanisms.functional), the tree's noise on their prefix sums
    engines_at: ClassVar[EngineTable] = {"example": ("own_steps",), "user": ("own_steps",)}
    audits: ClassVar[tuple[str, ...]] = ("white_box", "black_box")  # TreeAggregation.release takes canaries
    accountants = dpftrl_accounting.ACCOUNTANTS
    options = (
        Option("ftrl_restart_every", "--restart-every", "restart the tree every this many epochs (default: never)"),
        Option("ftrl_tree_completion", "--tree-completion", "complete each tree with virtual steps before a restart",
               bool),
    )  # fmt: skip
    citation = "Kairouz et al. 2021 (ICML), errata applied; google-research/DP-FTRL's privacy.py"

    def _shape(self, s: Setting) -> tuple[int, int, int | None, bool]:
        return (
            s.steps_per_epoch, s.epochs or 0, s.options.get("ftrl_restart_every"),
            bool(s.options.get("ftrl_tree_completion", False)),
        )  # fmt: skip

    def ledger(self, s: Setting, noise_multiplier: float) -> Ledger:
        return s.extra + Ledger((dpftrl_accounting.ftrl_entry(noise_multiplier, *self._shape(s)),))

    def check(self, s: Setting) -> None:
        super().check(s)
        if s.steps is not None:
            raise InputError("train.steps", s.steps, "left out with DP-FTRL: whole epochs (its tree covers each epoch)")
        if s.extra.entries:
            raise InputError("dp.clipping", s.extra.entries[0].name, "fixed with DP-FTRL (no release besides the tree)")
        dpftrl_accounting.ftrl_sensitivity_squared(*self._shape(s))  # checks the restart period against the run

    def check_config(self, cfg: Config) -> None:
        """SGD only (its tree noises a fixed linear workload: the prefix sums), and a restart period
        within the run."""
        from dpsweep.config import ConfigError

        super().check_config(cfg)
        if cfg.optimizer.name != "sgd":
            raise ConfigError(
                "optimizer.name", cfg.optimizer.name,
                "sgd with dp.mechanism=dpftrl: its tree adds noise to the prefix sums of the gradients, a fixed "
                "linear workload; an adaptive optimizer (adam) is not that workload (Kairouz et al. 2021)",
            )  # fmt: skip
        restart, epochs = cfg.dp.ftrl_restart_every, cfg.train.epochs
        if restart is not None and not 1 <= restart <= epochs:
            raise ConfigError(
                "dp.ftrl_restart_every", restart,
                f"a whole number of epochs from 1 to train.epochs={epochs} (a longer period never restarts), or null",
            )  # fmt: skip

    def guess(self, s: Setting, target_epsilon: float) -> float:
        return dpftrl_accounting.zcdp_sigma(
            dpftrl_accounting.ftrl_sensitivity_squared(*self._shape(s)), target_epsilon, s.delta
        )

    def ledger_taken(self, s: Setting, noise_multiplier: float, steps: int) -> Ledger:
        """Over the epochs begun (a unit's sensitivity only grows with steps), and a restart only where
        one has happened."""
        if steps == 0:
            return Ledger()
        epochs = math.ceil(steps / s.steps_per_epoch)
        restart = s.options.get("ftrl_restart_every")
        options = dict(s.options) | {
            "ftrl_restart_every": restart if restart is not None and restart <= epochs else None
        }
        return self.ledger(replace(s, epochs=epochs, steps=None, extra=Ledger(), options=options), noise_multiplier)

    def own_steps(self) -> Any:
        """The fixed order's batches; the FTRL optimizer's tree noises the prefix sums."""
        from dpsweep.mechanisms.functional import TreeAggregation  # torch: where a run trains

        return TreeAggregation()

    def details(self, s: Setting) -> dict[str, Any]:
        steps_per_epoch, _, restart_every, completion = self._shape(s)
        return {
            "steps_per_epoch": steps_per_epoch, "restart_every": restart_every, "tree_completion": completion,
            "sensitivity_squared": dpftrl_accounting.ftrl_sensitivity_squared(*self._shape(s)),
        }  # fmt: skip

    def describe(self, s: Setting, noise_multiplier: float) -> str:
        steps_per_epoch, epochs, restart_every, completion = self._shape(s)
        restarts = f", the tree restarted every {restart_every} epochs" if restart_every else ""
        completed = " with tree completion" if completion and restart_every else ""
        s2 = dpftrl_accounting.ftrl_sensitivity_squared(*self._shape(s))
        return (
            f"DP-FTRL with noise multiplier σ = {noise_multiplier:.6g} over {self.steps(s)} steps ({epochs} epochs "
            f"of {steps_per_epoch} batches in a fixed order{restarts}{completed}; no sampling, no amplification; "
            f"tree sensitivity Δ² = {s2})"
        )


MECHANISMS.register(DPFTRL.name)(DPFTRL())
