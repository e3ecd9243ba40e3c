"""DP-SGD through Opacus (Abadi et al. 2016, "Deep Learning with Differential Privacy"): per-sample
clipping to C, Gaussian noise of std σ·C on the sum, Poisson sampling, every step accounted.

    made = make_private(cfg.dp, sigma, cfg.dp.max_grad_norm, model, optimizer, loader, criterion)
    engine, model, optimizer, criterion, loader = made

Only Poisson sampling is used: it is what the accountants analyse (amplification by Poisson
subsampling, Mironov, Talwar & Zhang 2019), so a run's ε is that of what ran.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader

from dpsweep.config import DPConfig, GradSampleMode

# Known, understood warnings: secure_mode is off (recorded as the tag dp.secure_mode), and Opacus's
# backward hooks fire on modules whose inputs need no gradient (the images).
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


def make_private(
    dp: DPConfig,
    noise_multiplier: float,
    max_grad_norm: float,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    criterion: nn.Module,
) -> tuple[PrivacyEngine, nn.Module, DPOptimizer, nn.Module, DataLoader[Any]]:
    """Opacus DP-SGD: per-sample clipping to C = ``max_grad_norm``, Gaussian noise of std σ·C,
    Poisson sampling at rate 1/len(loader), every step recorded in Opacus's accountant history,
    which the run's ledger (``dpsweep.ledger``) accounts under ``dp.accountant``.

    ``dp.grad_sample_mode`` picks how per-sample gradients are obtained; ghost clipping also wraps the
    criterion (its loss runs Opacus's two backward passes), so the criterion to use is returned."""
    # Opacus's accountant only records the (σ, q, steps) history here; ε comes from the ledger.
    engine = PrivacyEngine(accountant="rdp", secure_mode=dp.secure_mode)
    made = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        poisson_sampling=True,  # the accountants analyse Poisson subsampling
        grad_sample_mode=dp.grad_sample_mode.value,
        criterion=criterion,
    )
    if dp.grad_sample_mode == GradSampleMode.ghost:
        private_model, private_optimizer, criterion, private_loader = made
    else:
        private_model, private_optimizer, private_loader = made
    return engine, private_model, private_optimizer, criterion, private_loader
