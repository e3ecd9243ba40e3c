"""Device-resident data with on-device Poisson sampling, for datasets that fit in device memory.

For small datasets (digits, MNIST, CIFAR-10 as tensors, cached VGG16 features) a DataLoader spends
most of a step collating and copying. Here the whole training split is copied to the device once
and each step's batch is drawn there::

    x, y = materialize(data.train)
    batches = PoissonBatches(x, y, sample_rate=1 / len(loader), device=device,
                             generator=device_generator(device, seed=cfg.train.seed))
    for xb, yb in batches:  # len(batches) steps per epoch; xb, yb already on the device
        ...

Sampling semantics: those of Opacus's Poisson loader (``opacus/data_loader.py``, ``DPDataLoader``,
with ``opacus/utils/uniform_sampler.py``, ``UniformWithReplacementSampler``):

- an epoch has ``steps_per_epoch = int(1 / sample_rate)`` steps (the sampler's ``__len__``;
  ``dpsweep.privacy.schedule.poisson_schedule`` documents the float quirk, e.g. ``int(1 / (1 / 93)) = 92``);
- at each step every example is included independently with probability ``sample_rate``:
  ``mask = torch.rand(N, generator=generator) < sample_rate``, the batch is ``(x[mask], y[mask])``,
  in index order; its size is Binomial(N, q), mean N·q, variance N·q·(1 − q);
- a batch may be empty: then ``x[mask]`` has shape (0, ...), as Opacus's empty-batch collate gives.

On the CPU with the same seed, the batches are exactly the index lists of
``UniformWithReplacementSampler(num_samples=N, sample_rate=q, generator=...)``. The generator must
live on the sampling device (:func:`device_generator`): ``torch.rand(..., device=cuda)`` refuses a
CPU generator, and drawing on the device avoids a host-to-device copy of the mask. Boolean indexing
synchronises with the host once per step (the batch size must be known), which is cheap next to
a training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device``, seeded with ``seed``: what :class:`PoissonBatches` needs."""
    return torch.Generator(device=device).manual_seed(seed)


MT_WORDS = 624  # mt19937's state words (19,968 bits)
# torch's CPU generator state (aten/src/ATen/CPUGeneratorImpl.cpp, CPUGeneratorImplState): the initial seed
# (uint64), left and seeded (int32), next (uint64), then mt19937's 624 words, each held in a uint64
MT_WORDS_OFFSET = 24


def private_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on ``device`` that holds every bit of ``seed`` (a private stream's, below 2**63:
    ``dpsweep.privacy.streams``). torch's CPU generator (mt19937) keeps only the low 32 bits of
    ``manual_seed``'s argument, so 2**32 guesses, each checked by replaying a run, would regenerate
    its draws: here its 624 state words are NumPy's ``SeedSequence(seed)`` instead (NumPy seeds its own
    MT19937 so). CUDA's Philox takes the whole 64-bit seed. The state layout is checked on every call:
    a torch that changes it fails here, not silently."""
    generator = torch.Generator(device=device)
    if generator.device.type != "cpu":
        return generator.manual_seed(seed)
    low = seed & 0xFFFFFFFF
    generator.manual_seed(low)  # left, seeded and next as after a seeding
    state = generator.get_state().clone()
    words = state.numpy()[MT_WORDS_OFFSET : MT_WORDS_OFFSET + 8 * MT_WORDS].view(np.uint64)
    if len(words) != MT_WORDS or int(words[0]) != low:
        raise RuntimeError(f"torch {torch.__version__}'s CPU generator state is not laid out as dpsweep reads it")
    words[:] = np.random.SeedSequence(seed).generate_state(MT_WORDS, np.uint32)
    return generator.set_state(state)


class Generators:
    """A run's generators by purpose (``dpsweep.privacy.streams``: sampling, noise, ...) as one checkpointed
    state: :meth:`get_state` concatenates their states and :meth:`set_state` splits it by their lengths,
    the interface of one ``torch.Generator`` that a checkpoint saves (``dpsweep.run.checkpoint``)."""

    def __init__(self, **by_purpose: torch.Generator) -> None:
        self.by_purpose = by_purpose

    def __getitem__(self, purpose: str) -> torch.Generator:
        return self.by_purpose[purpose]

    def get_state(self) -> Tensor:
        return torch.cat([g.get_state() for g in self.by_purpose.values()])

    def set_state(self, state: Tensor) -> None:
        sizes = [len(g.get_state()) for g in self.by_purpose.values()]
        if len(state) != sum(sizes):
            raise ValueError(f"a state of {len(state)} bytes for generators of {sizes} bytes")
        for g, part in zip(self.by_purpose.values(), torch.split(state, sizes), strict=True):
            g.set_state(part.clone())


def materialize(dataset: Dataset[Any], *, batch_size: int = 1024) -> tuple[Tensor, Tensor]:
    """All examples of ``dataset`` as one tensor (N, ...) and int64 labels (N,), in dataset order.

    A two-tensor ``TensorDataset`` gives its own tensors (no copy when the labels are already
    int64); any other dataset of (input, label) pairs is read once through a non-shuffling
    DataLoader of ``batch_size`` into preallocated tensors (inputs keep their dtype).
    """
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        x, y = dataset.tensors
        return x, y.to(torch.int64)
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("cannot materialize an empty dataset")
    xs: Tensor | None = None
    ys = torch.empty(n, dtype=torch.int64)
    row = 0
    # a generator of its own: iterating a loader draws a seed, which must not shift training's RNG
    for xb, yb in DataLoader(dataset, batch_size=batch_size, shuffle=False, generator=torch.Generator()):
        if xs is None:
            xs = torch.empty((n, *xb.shape[1:]), dtype=xb.dtype)
        xs[row : row + len(xb)] = xb
        ys[row : row + len(xb)] = torch.as_tensor(yb, dtype=torch.int64)
        row += len(xb)
    if xs is None or row != n:
        raise RuntimeError(f"dataset yielded {row} examples, but len(dataset) = {n}")
    return xs, ys


class PoissonBatches:
    """Poisson-sampled batches of device-resident ``x``, ``y`` (Opacus's ``DPDataLoader`` semantics).

    ``sample_rate`` is the inclusion probability q, for Opacus ``1 / len(DataLoader(train, B))``;
    one epoch (one ``iter``) yields ``len(self) = int(1 / q)`` batches. ``generator`` must be on
    ``device`` (see :func:`device_generator`); it carries the sampling state across epochs.
    """

    def __init__(
        self, x: Tensor, y: Tensor, *, sample_rate: float, device: torch.device, generator: torch.Generator
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate={sample_rate}: expected 0 < q <= 1")
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(f"need the same, positive number of inputs and labels, got {len(x)} and {len(y)}")
        device = torch.device(device)
        if generator.device.type != device.type or (
            generator.device.index is not None and device.index is not None and generator.device.index != device.index
        ):
            raise ValueError(
                f"generator is on {generator.device} but sampling runs on {device}: "
                f"use device_generator({str(device)!r}, seed)"
            )
        self.x = x.to(device)
        self.y = y.to(device)
        self.sample_rate = sample_rate
        self.device = device
        self.generator = generator
        self.steps_per_epoch = int(1 / sample_rate)  # UniformWithReplacementSampler.__len__

    @property
    def num_samples(self) -> int:
        """N, the number of examples sampled from."""
        return len(self.x)

    @property
    def expected_batch_size(self) -> float:
        """N·q, the mean batch size."""
        return self.num_samples * self.sample_rate

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for _ in range(self.steps_per_epoch):
            mask = torch.rand(self.num_samples, generator=self.generator, device=self.device) < self.sample_rate
            yield self.x[mask], self.y[mask]


class ShuffledBatches:
    """Non-private batches of device-resident ``x``, ``y``: a fresh permutation per epoch, drawn on
    the device, cut into ``ceil(N / batch_size)`` batches (a shuffling DataLoader's semantics)."""

    def __init__(
        self, x: Tensor, y: Tensor, *, batch_size: int, device: torch.device, generator: torch.Generator
    ) -> None:
        self.x, self.y = x.to(device), y.to(device)
        self.batch_size, self.device, self.generator = batch_size, torch.device(device), generator

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        order = torch.randperm(len(self.x), generator=self.generator, device=self.device)
        for start in range(0, len(order), self.batch_size):
            index = order[start : start + self.batch_size]
            yield self.x[index], self.y[index]
