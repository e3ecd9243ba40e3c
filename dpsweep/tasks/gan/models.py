"""task=gan's networks: a conditional WGAN-GP generator and critic for 28x28 single-channel images.

    from dpsweep.tasks.gan.models import ConditionalGan
    gan = ConditionalGan(latent_dim=64, generator_width=64, critic_width=32, num_classes=10, value_range=(-1, 1))
    images = gan.generator(torch.randn(8, 64), torch.arange(8) % 10)      # (8, 1, 28, 28)
    scores = gan.critic(images, torch.arange(8) % 10)                     # (8,)

DCGAN-shaped (Radford et al. 2016) at 28x28, as in the WGAN-GP MNIST reference (Gulrajani et al.
2017, ``gan_mnist.py``). No batch normalisation anywhere: the critic's per-example gradients and
gradient penalty must not mix examples (Gulrajani et al. §4 drop it from the critic for the
penalty's sake), and a normalisation layer's running statistics in the generator, updated on fakes
made from the private labels of a Poisson batch, would be an un-noised release of them. The
critic is conditioned by projection (Miyato & Koyama 2018, "cGANs with Projection Discriminator"):
D(x, y) = w·h(x) + e_y·h(x); the generator by a learned class embedding concatenated to z.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dpsweep.interop import torch_private

SIDE = 28  # pixels: 7 -> 14 -> 28 through two stride-2 layers
BASE = 7


class Generator(nn.Module):
    """G(z, y): a 28x28 image of class y, in ``value_range`` (the dataset's normalised pixel range)."""

    low: torch.Tensor  # buffers: the output range
    high: torch.Tensor

    def __init__(
        self, latent_dim: int, width: int, num_classes: int, value_range: tuple[float, float] = (-1.0, 1.0)
    ) -> None:
        super().__init__()
        self.latent_dim, self.num_classes, self.width = latent_dim, num_classes, width
        self.embed = nn.Embedding(num_classes, latent_dim)
        self.project = nn.Sequential(nn.Linear(2 * latent_dim, 2 * width * BASE * BASE), nn.ReLU())
        self.up = nn.Sequential(
            nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(width, 1, 4, stride=2, padding=1),
            nn.Tanh(),
        )
        low, high = value_range
        self.register_buffer("low", torch.tensor(float(low)))
        self.register_buffer("high", torch.tensor(float(high)))

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.project(torch.cat([z, self.embed(labels)], dim=1)).view(-1, 2 * self.width, BASE, BASE)
        unit = (self.up(h) + 1) / 2  # [0, 1]
        return self.low + (self.high - self.low) * unit


class Critic(nn.Module):
    """D(x, y): a real-valued score (no sigmoid: the Wasserstein critic), conditioned by projection."""

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
        )
        features = 2 * width * BASE * BASE
        self.score = nn.Linear(features, 1)
        self.embed = nn.Embedding(num_classes, features)
        nn.init.zeros_(self.embed.weight)  # starts unconditional; the projection is learned

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        return self.score(h).squeeze(1) + (self.embed(labels) * h).sum(dim=1)


class ConditionalGan(nn.Module):
    """Both networks in one module (what checkpoints save), with the count of private critic steps
    taken (``critic_steps``, a buffer: saved and restored with the weights, so a resumed run's ledger
    counts exactly the steps taken), and with ``generator_ema`` > 0 a moving average of the
    generator's weights (``average``, no gradients), which is then what :attr:`sampler` returns."""

    critic_steps: torch.Tensor
    generator_steps: torch.Tensor
    snapshots_taken: torch.Tensor

    def __init__(
        self,
        latent_dim: int,
        generator_width: int,
        critic_width: int,
        num_classes: int,
        value_range: tuple[float, float] = (-1.0, 1.0),
        generator_ema: float = 0.0,
        snapshots: int = 1,
    ) -> None:
        super().__init__()
        self.generator = Generator(latent_dim, generator_width, num_classes, value_range)
        self.critic = Critic(critic_width, num_classes)
        self.register_buffer("critic_steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("generator_steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("snapshots_taken", torch.zeros((), dtype=torch.int64))
        self.ema = generator_ema
        self.average: Generator | None = None
        if generator_ema > 0:
            self.average = copy.deepcopy(self.generator).requires_grad_(False)
        # a ring of the sampler's past weights (saved with the module, so a resume keeps them)
        self.snapshots = nn.ModuleList(
            [copy.deepcopy(self.generator).requires_grad_(False) for _ in range(snapshots if snapshots > 1 else 0)]
        )

    @torch.no_grad()
    def take_snapshot(self) -> None:
        """Keep the sampler's weights now, in place of the oldest kept (with ``snapshots`` > 1)."""
        if len(self.snapshots) == 0:
            return
        slot = int(self.snapshots_taken) % len(self.snapshots)
        self.snapshots[slot].load_state_dict(self.sampler.state_dict())
        self.snapshots_taken += 1

    @property
    def mixture(self) -> list[Generator]:
        """The generators that make the synthetic set: the snapshots taken (oldest first), or the sampler."""
        taken, ring = int(self.snapshots_taken), len(self.snapshots)
        if ring == 0 or taken == 0:
            return [self.sampler]
        slots = range(taken - min(taken, ring), taken)
        return [self.snapshots[slot % ring] for slot in slots]  # type: ignore[misc]

    @property
    def sampler(self) -> Generator:
        """The generator that samples and is released: the average when there is one."""
        return self.average if self.average is not None else self.generator

    @torch.no_grad()
    def update_average(self) -> None:
        """Count a generator step and move the average towards the generator's weights, with decay
        min(ema, (1 + t) / (10 + t)) at step t: the warm-up of TensorFlow's
        ``tf.train.ExponentialMovingAverage(num_updates=t)``, so early iterates fade fast."""
        t = int(self.generator_steps)
        self.generator_steps += 1
        if self.average is None:
            return
        decay = min(self.ema, (1 + t) / (10 + t))
        torch_private.lerp_all_(list(self.average.parameters()), list(self.generator.parameters()), 1 - decay)


class CodeGenerator(nn.Module):
    """The released generator(s) as a one-input module (MLflow's signature): a row is [z | class index],
    and for a mixture of K generators [z | class index | member index in 0..K-1]."""

    def __init__(self, generators: list[Generator]) -> None:
        super().__init__()
        self.members = nn.ModuleList(generators)
        self.latent_dim = generators[0].latent_dim

    @property
    def code_width(self) -> int:
        return self.latent_dim + (1 if len(self.members) == 1 else 2)

    def forward(self, code: torch.Tensor) -> torch.Tensor:
        z, labels = code[:, : self.latent_dim], code[:, self.latent_dim].long()
        if len(self.members) == 1:
            return self.members[0](z, labels)
        member = code[:, self.latent_dim + 1].long()
        out = torch.empty(len(code), 1, SIDE, SIDE, dtype=z.dtype, device=z.device)
        for k, generator in enumerate(self.members):
            rows = member == k
            out[rows] = generator(z[rows], labels[rows])
        return out
