"""A run's random streams: one per purpose, so that nothing public (the initial weights) tells a private
draw (which examples were sampled, the noise), and two runs of a sweep never share their noise.

    streams = Streams.of_run(seed=0, config_hash="0f3c…", secure=False)
    private_generator("cpu", streams.seed(Purpose.sampling))      # the Poisson batches (dpsweep.data.resident)
    private_generator(device, streams.seed(Purpose.noise, rank))  # a rank's noise

- **Public** randomness (the model's initialisation, the non-private shuffles, a memory probe's batch)
  comes from ``train.seed`` itself, as before: DP-SGD's threat model takes the initial weights as
  public (Abadi et al. 2016), and anyone who sees them can find a small seed by trying them all.
- **Private** randomness (Poisson sampling, the mechanisms' noise, the canaries of an audit, a private
  clipping norm's sample and noise) comes from streams that are children of one entropy that is not
  the init's, one child per purpose and rank (NumPy's ``SeedSequence`` with a ``spawn_key``: NumPy's
  documented way to derive independent streams, NEP 19 and ``numpy.random.SeedSequence``):

  - by default that entropy is ``(train.seed, the run's config hash)``: a run reproduces from its
    seed, and two configs of a sweep that share ``train.seed`` but differ in σ (or anything else)
    draw independent batches and noise, so no combination of their releases cancels the noise;
  - ``dp.stream_seed`` asks for shared streams explicitly: every run with the same value draws the
    same batches and noise (common random numbers, to compare σ on the same draws);
  - ``dp.secure_mode=true``: 128 bits of the operating system's entropy (:mod:`secrets`; each stream's
    seed is 63 bits derived from them), drawn when the run starts and never logged, so nothing public
    regenerates the draws and the run does not reproduce bit for bit. A checkpoint (a local file, not
    logged) keeps the generators' states and the entropy, so a resumed run continues its streams rather
    than starting them again.

The seeds are integers below 2**63. ``dpsweep.data.resident.private_generator`` puts every bit of one into a
torch generator: CUDA's Philox takes 64 bits, but the CPU's mt19937 keeps only the low 32 bits of
``manual_seed``'s argument, so its whole state is set from the seed instead.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

ENTROPY_BITS = 128  # a secure run's private entropy (NumPy's SeedSequence pools 128 bits and more)
SEED_BITS = 63  # a derived seed: what torch.Generator.manual_seed accepts on every device


class Purpose(IntEnum):
    """What a private stream draws; its value is the stream's ``spawn_key`` (stable: never renumber)."""

    sampling = 1  # Poisson sampling of examples or users (each rank its own)
    noise = 2  # the mechanisms' Gaussian noise (DP-SGD, DP-FTRL's tree, DPALS and DPAM, the GAN's critic)
    canaries = 3  # an audit's canaries: their coordinates, inclusion and sampling
    clipping = 4  # a private clipping norm: its sample of gradient norms and its quantile's noise
    mechanism = 5  # a private step's other draws, as many as its batch is large (the GAN critic's fakes and ρ)


@dataclass(frozen=True)
class Streams:
    """The private streams of one run (module docstring). ``secure``: the entropy is the OS's, unlogged."""

    entropy: tuple[int, ...]
    secure: bool = False

    @classmethod
    def of_run(cls, seed: int, config_hash: str, secure: bool = False, shared_seed: int | None = None) -> Streams:
        """The streams of a run of ``train.seed`` ``seed`` and config hash ``config_hash`` (hex); with
        ``shared_seed`` (``dp.stream_seed``) those of every run that sets it; ``secure``: fresh entropy."""
        if secure:
            return cls((secrets.randbits(ENTROPY_BITS),), secure=True)
        if shared_seed is not None:
            return cls((_nonnegative(shared_seed),))
        return cls((_nonnegative(seed), int(config_hash, 16)))

    def seed(self, purpose: Purpose, index: int = 0) -> int:
        """A seed for ``purpose``'s stream, number ``index`` (a rank, or a second stream of the purpose)."""
        child = np.random.SeedSequence(self.entropy, spawn_key=(int(purpose), int(index)))
        return int(child.generate_state(1, np.uint64)[0]) >> (64 - SEED_BITS)

    def numpy(self, purpose: Purpose, index: int = 0) -> np.random.Generator:
        """A NumPy generator on ``purpose``'s stream ``index``."""
        return np.random.default_rng(self.seed(purpose, index))


def described(secure: bool, shared_seed: int | None) -> str:
    """How a run's private streams are seeded (:meth:`Streams.of_run`), for its tag ``dp.streams``."""
    if secure:
        return "os-entropy (not logged; the run does not reproduce)"
    if shared_seed is not None:
        return "dp.stream_seed (shared with every run that sets it; reproducible: not for release)"
    return "train.seed and the config hash (reproducible: not for release)"


def _nonnegative(seed: int) -> int:
    """SeedSequence takes non-negative entropy: a negative seed maps to its two's complement."""
    return int(seed) % (1 << 64)
