"""The optimizer/ group: the optimizer of the trained parameters, and the checks of ``optimizer.*``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import MISSING

from dpsweep.config.checks import require

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = 0.05  # learning rate
    weight_decay: float = 0.0  # L2 penalty (not clipped per sample: it does not depend on the data)


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    momentum: float = 0.9  # heavy-ball momentum


@dataclass
class AdamConfig(OptimizerConfig):
    name: str = "adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's moment decay rates


def check(cfg: Config) -> None:
    """The learning rate, the L2 penalty, and SGD's momentum or Adam's decay rates."""
    opt = cfg.optimizer
    require(opt.lr > 0, "optimizer.lr", opt.lr, "a positive learning rate")
    require(opt.weight_decay >= 0, "optimizer.weight_decay", opt.weight_decay, "0 or a positive L2 penalty")
    if isinstance(opt, SGDConfig):
        require(0 <= opt.momentum < 1, "optimizer.momentum", opt.momentum, "a momentum in [0, 1)")
    if isinstance(opt, AdamConfig):
        betas = list(opt.betas)
        require(
            len(betas) == 2 and all(0 <= b < 1 for b in betas), "optimizer.betas", betas, "two decay rates in [0, 1)"
        )
