"""DP-SGD through Opacus (Abadi et al. 2016, "Deep Learning with Differential Privacy"): per-sample
clipping to C, Gaussian noise of std σ·C on the sum, Poisson sampling, every step accounted.

    made = make_private(cfg.dp, sigma, cfg.dp.max_grad_norm, model, optimizer, loader, criterion)
    engine, model, optimizer, criterion, loader = made

Only Poisson sampling is used: it is what the accountants analyse (amplification by Poisson
subsampling, Mironov, Talwar & Zhang 2019), so a run's ε is that of what ran.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DPOptimizer
from opacus.optimizers.adaclipoptimizer import AdaClipDPOptimizer
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from dpsweep.config import Clipping, DPConfig, GradSampleMode
from dpsweep.privacy import clipping

# Known, understood warnings: Opacus's secure_mode is off (dp.secure_mode seeds the generators instead), and Opacus's
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
    noise_generator: torch.Generator | None = None,
) -> tuple[PrivacyEngine, nn.Module, DPOptimizer, nn.Module, DataLoader[Any]]:
    """Opacus DP-SGD: per-sample clipping to C = ``max_grad_norm``, Gaussian noise of std σ·C,
    Poisson sampling at rate 1/len(loader), the noisy sum over the loader's batch size B (the config's,
    public; not Opacus's int(N/len(loader)): issue 58, item 5), every step recorded in Opacus's accountant history,
    which the run's ledger (``dpsweep.privacy.ledger``) accounts under ``dp.accountant``.

    The Poisson batches draw from the loader's generator, the noise from ``noise_generator`` (on the
    parameters' device; None: torch's default generator): a run gives each its own stream
    (``dpsweep.privacy.streams``). Opacus's own secure mode is not used: it needs torchcsprng, which has no
    build for today's torch; ``dp.secure_mode`` seeds these generators from the OS's entropy instead.

    ``dp.grad_sample_mode`` picks how per-sample gradients are obtained; ghost clipping also wraps the
    criterion (its loss runs Opacus's two backward passes), so the criterion to use is returned."""
    # Opacus's accountant only records the (σ, q, steps) history here; ε comes from the ledger.
    engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    batch_size = loader.batch_size  # the config's B (train.batch_size): the divisor of every release below
    if batch_size is None:
        raise ValueError("make_private needs a loader with a batch_size (B, the expected batch of its Poisson steps)")
    adaptive: dict[str, Any] = {}
    if dp.clipping == Clipping.adaptive:
        adaptive = {
            "clipping": "adaptive", "target_unclipped_quantile": dp.clip_quantile,
            "clipbound_learning_rate": dp.clip_lr, "max_clipbound": dp.clip_high,
            "min_clipbound": max(dp.clip_low, MIN_CLIP_NORM),
            "unclipped_num_std": clipping.count_noise(dp, loader.batch_size or 1),
        }  # fmt: skip
    made = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        poisson_sampling=True,  # the accountants analyse Poisson subsampling
        grad_sample_mode=dp.grad_sample_mode.value,
        criterion=criterion,
        noise_generator=noise_generator,
        **adaptive,
    )
    if dp.grad_sample_mode == GradSampleMode.ghost:
        private_model, private_optimizer, criterion, private_loader = made
    else:
        private_model, private_optimizer, private_loader = made
    # The noisy sum over B, a public constant (issue 58, item 5; cf. arXiv 2605.15648), not over Opacus's
    # int(N / len(loader)), a function of the private N (62 at N = 1437, B = 64; 61 at N = 1473): dividing a
    # release by a public constant is post-processing; the sample rate 1/len(loader) and the ledger are Opacus's.
    # Per rank as Opacus's own (its DistributedDPOptimizer averages the ranks' sums over the world size).
    world = torch.distributed.get_world_size() if isinstance(model, DPDDP | DDP) else 1
    private_optimizer.expected_batch_size = batch_size if world == 1 else batch_size / world
    if adaptive:  # Opacus's own AdaClipDPOptimizer replaced by dpsweep's subclass, built as Opacus builds it
        private_optimizer = adaptive_clipping(engine, private_optimizer, private_loader, adaptive, dp.clip_normalize)
    return engine, private_model, private_optimizer, criterion, private_loader


def adaptive_clipping(
    engine: PrivacyEngine, made: DPOptimizer, loader: DataLoader[Any], adaptive: dict[str, Any], normalize: bool
) -> ExpectedBatchAdaClip:
    """dpsweep's adaptive-clipping optimizer in place of the one ``engine.make_private`` made (``made``):
    built from the same optimizer, σ, C, expected batch size, loss reduction and noise generator, with
    the same adaptive-clipping arguments, and the engine's accountant hook attached at the loader's
    sample rate, as ``make_private`` does for its own (Opacus's public constructor and
    ``attach_step_hook``; PrivacyEngine has no public way to choose the optimizer's class)."""
    options = {k: v for k, v in adaptive.items() if k != "clipping"}
    optimizer = ExpectedBatchAdaClip(
        made.original_optimizer,
        noise_multiplier=made.noise_multiplier,
        max_grad_norm=made.max_grad_norm,
        expected_batch_size=made.expected_batch_size,
        loss_reduction=made.loss_reduction,
        generator=made.generator,
        secure_mode=made.secure_mode,
        normalize=normalize,
        **options,
    )
    optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=1 / len(loader)))
    return optimizer


STATE_KEY = "dpsweep.max_grad_norm"  # adaptive clipping's current C in the optimizer's state_dict
MIN_CLIP_NORM = 1e-6  # adaptive clipping's floor when dp.clip_low is 0: a norm of 0 clips every gradient away


class ExpectedBatchAdaClip(AdaClipDPOptimizer):
    """Opacus's adaptive clipping with the clipping-norm update of Andrew et al. 2021 and TF Privacy:
    the unclipped share is the noisy count centred by 1/2 per example (sensitivity 1/2, the count noise
    the accounting assumes) over the expected batch size B (the config's, public: :func:`make_private`),
    plus 1/2. Opacus's own update divides the raw noisy count by the actual batch size, which is private
    and not noised. See dpsweep.privacy.clipping.

    With ``normalize`` (``dp.clip_normalize``), the noisy clipped sum is divided by the C it was
    clipped at, so the step does not grow with C. C is part of the optimizer's state_dict (checkpoints,
    and the memory iteration that is undone)."""

    def __init__(self, *args: Any, normalize: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.normalize = normalize
        self.passes_go_on = False  # the last step only accumulated: a logical batch's passes go on

    def pre_step(self, closure: Callable[[], float] | None = None) -> bool | None:
        """Opacus's step; whether it only accumulated is kept for :meth:`zero_grad` (``pre_step`` answers
        False for a step skipped between the passes of a logical batch)."""
        stepped = super().pre_step(closure)
        self.passes_go_on = stepped is False
        return stepped

    def add_noise(self) -> None:
        super().add_noise()
        if self.normalize:
            clip = float(self.max_grad_norm)  # the C of this step's clipping
            for p in self.params:
                p.grad /= clip

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Opacus's AdaClip resets its counts at every ``zero_grad``, so that with physical batches
        (``train.physical_batch_size``: a logical batch in several passes, each step but the last
        skipped) the update saw the last pass's count only, over the whole expected batch: C barely
        moved. The counts are kept across the passes of one logical batch (``pre_step``'s answer)."""
        passes_go_on = self.passes_go_on
        sample_size: int = self.sample_size  # type: ignore[has-type]  # (Opacus's untyped attributes)
        unclipped: Any = self.unclipped_num  # type: ignore[has-type]  # a tensor once counted
        super().zero_grad(set_to_none)
        if passes_go_on:
            self.sample_size, self.unclipped_num = sample_size, unclipped

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), STATE_KEY: float(self.max_grad_norm)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        clip = state.pop(STATE_KEY, None)
        super().load_state_dict(state)
        if clip is not None:
            self.max_grad_norm = clip

    def update_max_grad_norm(self) -> None:
        # unclipped_num is (#unclipped + N(0, σ_b²)) after add_noise; minus n/2 it is the centred release
        centred = float(self.unclipped_num) - self.sample_size / 2
        share = centred / max(self.expected_batch_size, 1) + 0.5
        current = float(self.max_grad_norm)  # set by Opacus in __init__
        norm = current * math.exp(-self.clipbound_learning_rate * (share - self.target_unclipped_quantile))
        self.max_grad_norm = min(max(norm, self.min_clipbound), self.max_clipbound)
