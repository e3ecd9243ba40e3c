"""Optimizers by ``optimizer.name``, in a registry: ``sgd`` and ``adam`` (torch.optim).

With DP, Opacus wraps the optimizer built here in a ``DPOptimizer`` (``dpsweep.mechanisms.opacus_engine``); weight decay
is applied by the wrapped optimizer after the noisy gradient, so it is not clipped per sample (it
does not depend on the data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dpsweep.config import AdamConfig, OptimizerConfig, SGDConfig
from dpsweep.registry import Registry

OptimizerFactory = Callable[[Any, Iterable[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: Registry[OptimizerFactory] = Registry("optimizer")


@OPTIMIZERS.register("sgd")
def _sgd(cfg: SGDConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


@OPTIMIZERS.register("adam")
def _adam(cfg: AdamConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    b1, b2 = cfg.betas
    return torch.optim.Adam(params, lr=cfg.lr, betas=(b1, b2), weight_decay=cfg.weight_decay)


def build_optimizer(cfg: OptimizerConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` names, over the model's trainable parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS.get(cfg.name, key="optimizer.name")(cfg, trainable)
