"""dpsweep.tasks.gan.critic: the per-example WGAN-GP critic gradients (penalty included) equal those of an explicit
loop with double backward, clipping bounds each example's contribution, and the noise has std σ·C."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpsweep.tasks.gan.critic import CriticStep, clip_and_sum, per_example_critic_gradients, private_critic_gradient


class Critic(nn.Module):
    """A small conditional critic: image and label embedding to one score."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.body = nn.Sequential(nn.Linear(64 + 16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([x.flatten(1), self.embed(y)], dim=1)).squeeze(1)


def _batch(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 1, 8, 8, generator=g),
        torch.randint(0, 10, (n,), generator=g),
        torch.randn(n, 1, 8, 8, generator=g),
        torch.rand(n, 1, 1, 1, generator=g),
    )


def _loop_gradient(
    critic: Critic, x: torch.Tensor, y: torch.Tensor, f: torch.Tensor, r: torch.Tensor, lam: float
) -> dict[str, torch.Tensor]:
    """One example's gradient, by plain autograd with create_graph for the penalty."""
    critic.zero_grad()
    mixed = (r * x + (1 - r) * f).requires_grad_(True)
    (slope,) = torch.autograd.grad(critic(mixed[None], y[None]).sum(), mixed, create_graph=True)
    loss = critic(f[None], y[None]).sum() - critic(x[None], y[None]).sum() + lam * (slope.flatten().norm() - 1) ** 2
    loss.backward()
    return {k: p.grad.clone() for k, p in critic.named_parameters()}


def test_per_example_gradients_equal_an_explicit_loop_with_double_backward() -> None:
    torch.manual_seed(0)
    critic = Critic()
    x, y, f, r = _batch(5)
    ours = per_example_critic_gradients(critic, x, y, f, r, gp_weight=10.0)
    for i in range(5):
        theirs = _loop_gradient(critic, x[i], y[i], f[i], r[i], 10.0)
        for name, g in theirs.items():
            assert torch.allclose(ours[name][i], g, atol=1e-5, rtol=1e-4), name
    without_penalty = per_example_critic_gradients(critic, x, y, f, r, gp_weight=0.0)
    assert not torch.allclose(without_penalty["body.0.weight"], ours["body.0.weight"])  # the penalty counts


def test_clipping_bounds_each_examples_contribution_and_the_noise_is_sigma_c() -> None:
    torch.manual_seed(1)
    critic = Critic()
    x, y, f, r = _batch(6, seed=1)
    per_example = per_example_critic_gradients(critic, x, y, f, r, gp_weight=10.0)
    for i in range(6):  # one example's clipped contribution has norm at most C
        alone = clip_and_sum({k: g[i : i + 1] for k, g in per_example.items()}, max_grad_norm=0.1)
        assert torch.cat([g.flatten() for g in alone.values()]).norm() <= 0.1 + 1e-6
    step = CriticStep(gp_weight=10.0, max_grad_norm=0.5, noise_multiplier=2.0, expected_batch_size=1.0)
    empty, none = private_critic_gradient(
        critic, x[:0], y[:0], f[:0], r[:0], step, generator=torch.Generator().manual_seed(0)
    )  # an empty Poisson batch: noise only
    assert none.shape == (0,)
    noise = torch.cat([g.flatten() for g in empty.values()])
    assert noise.std().item() == pytest.approx(2.0 * 0.5, rel=0.05)
    noisy, losses = private_critic_gradient(critic, x, y, f, r, step, generator=torch.Generator().manual_seed(0))
    assert losses.shape == (len(y),)
    clipped = clip_and_sum(per_example, 0.5)
    assert all(torch.allclose(noisy[k] - clipped[k], empty[k], atol=1e-5) for k in noisy)  # the same draw added
