"""The private critic step of DP-WGAN-GP (dp-GAN: Zhang, Ji & Wang 2018, "Differentially Private
Releasing via Deep Generative Model", Alg. 1; WGAN-GP: Gulrajani et al. 2017, "Improved Training of
Wasserstein GANs"), with per-example gradients from ``torch.func``.

    grads = private_critic_gradient(critic, real_x, real_y, fake_x, rho, CriticStep(gp_weight=10.0,
                                    max_grad_norm=1.0, noise_multiplier=1.1, expected_batch_size=64))

For each real example i (a Poisson sample of the training set), with a generated example G(z_i) of
the same label and ρ_i ~ U[0, 1], x̂_i = ρ_i x_i + (1 - ρ_i) G(z_i):

    ℓ_i = D(G(z_i)) - D(x_i) + λ (‖∇_x̂ D(x̂_i)‖ - 1)²

The gradient of the whole ℓ_i with respect to the critic's weights, gradient penalty included (it
involves the real example), is clipped to C; the clipped gradients are summed, Gaussian noise of std
σ·C is added, and the sum is divided by the expected batch size (public). That is one
Poisson-subsampled Gaussian mechanism per critic step, however many terms the loss has (the mistake
of Opacus #418, fixed in PR #474, was to charge one per term). The penalty needs a gradient of a
gradient, which Opacus's hooks cannot take (Opacus #31, #548): here ``torch.func.grad`` nests
inside ``vmap`` instead. The generator's step never touches real data: it is post-processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vmap

from dpsweep.data.users import clip_factors


@dataclass(frozen=True)
class CriticStep:
    """One private critic step: λ, C, σ, and the expected (public) Poisson batch size B, the config's."""

    gp_weight: float
    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: float


def per_example_critic_gradients(
    critic: nn.Module,
    real_x: torch.Tensor,
    labels: torch.Tensor,
    fake_x: torch.Tensor,
    rho: torch.Tensor,
    gp_weight: float,
) -> dict[str, torch.Tensor]:
    """Each example's gradient of its WGAN-GP critic loss ℓ_i (penalty included) with respect to the
    critic's trainable parameters: ``{name: (n, *shape)}``. ``critic(x, labels)`` scores images."""
    return critic_gradients_and_losses(critic, real_x, labels, fake_x, rho, gp_weight)[0]


def critic_gradients_and_losses(
    critic: nn.Module,
    real_x: torch.Tensor,
    labels: torch.Tensor,
    fake_x: torch.Tensor,
    rho: torch.Tensor,
    gp_weight: float,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`per_example_critic_gradients` and each example's loss ℓ_i (n,), from one pass."""
    params = {k: p.detach() for k, p in critic.named_parameters() if p.requires_grad}
    buffers = {k: b.detach() for k, b in critic.named_buffers()}

    def score(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(critic, (p, buffers), (x.unsqueeze(0), y.unsqueeze(0)))
        return out.sum()

    def loss(
        p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, f: torch.Tensor, r: torch.Tensor
    ) -> torch.Tensor:
        mixed = r * x + (1 - r) * f
        slope = grad(score, argnums=1)(p, mixed, y)  # ∇_x̂ D(x̂), differentiable in p
        penalty = (slope.flatten().norm(2) - 1) ** 2
        return score(p, f, y) - score(p, x, y) + gp_weight * penalty

    grads, losses = vmap(grad_and_value(loss), in_dims=(None, 0, 0, 0, 0))(params, real_x, labels, fake_x.detach(), rho)
    return dict(grads), losses.detach()


def clip_and_sum(per_example: dict[str, torch.Tensor], max_grad_norm: float) -> dict[str, torch.Tensor]:
    """Σ_i g_i · min(1, C / ‖g_i‖), the norm over all the critic's parameters (flat clipping, as Opacus)."""
    norms = torch.stack([g.flatten(1).norm(2, dim=1) for g in per_example.values()], dim=1).norm(2, dim=1)
    factor = clip_factors(norms, max_grad_norm)
    return {k: torch.einsum("i,i...->...", factor, g) for k, g in per_example.items()}


def private_critic_gradient(
    critic: nn.Module,
    real_x: torch.Tensor,
    labels: torch.Tensor,
    fake_x: torch.Tensor,
    rho: torch.Tensor,
    step: CriticStep,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The noisy critic gradient of one private step (see the module docstring): clipped per example,
    summed, N(0, σ²C²) added per coordinate, over the expected batch size; and the examples' losses
    ℓ_i (un-noised: not for release). An empty Poisson batch still gets its noise (the accountant
    counts the step)."""
    _, noisy, losses = private_critic_release(critic, real_x, labels, fake_x, rho, step, generator)
    return noisy, losses


def private_critic_release(
    critic: nn.Module,
    real_x: torch.Tensor,
    labels: torch.Tensor,
    fake_x: torch.Tensor,
    rho: torch.Tensor,
    step: CriticStep,
    generator: torch.Generator | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """:func:`private_critic_gradient` with ``extra`` per-example rows ``{name: (k, *shape)}`` (a white-box
    audit's canaries, ``dpsweep.mechanisms.private_step``) clipped and summed with the examples' before the
    noise: the clipped sum and the noisy one, both over the expected batch size, and the losses."""
    params = {k: p for k, p in critic.named_parameters() if p.requires_grad}
    if len(real_x):
        per_example, losses = critic_gradients_and_losses(critic, real_x, labels, fake_x, rho, step.gp_weight)
    else:
        per_example, losses = {k: p.new_zeros((0, *p.shape)) for k, p in params.items()}, real_x.new_zeros(0)
    if extra is not None:
        per_example = {k: torch.cat([g, extra[k].to(g.device, g.dtype)]) for k, g in per_example.items()}
    if len(next(iter(per_example.values()))):
        summed = clip_and_sum(per_example, step.max_grad_norm)
    else:
        summed = {k: torch.zeros_like(p) for k, p in params.items()}
    std = step.noise_multiplier * step.max_grad_norm
    noisy = {
        k: (g + std * torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype))
        / step.expected_batch_size
        for k, g in summed.items()
    }
    clipped = {k: g / step.expected_batch_size for k, g in summed.items()}
    return clipped, noisy, losses


def critic_gradient(
    critic: nn.Module,
    real_x: torch.Tensor,
    labels: torch.Tensor,
    fake_x: torch.Tensor,
    rho: torch.Tensor,
    gp_weight: float,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Without DP: the plain gradient of the batch's mean WGAN-GP critic loss, and the examples' losses."""
    per_example, losses = critic_gradients_and_losses(critic, real_x, labels, fake_x, rho, gp_weight)
    return {k: g.mean(dim=0) for k, g in per_example.items()}, losses
