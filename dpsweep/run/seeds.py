"""What a run draws its randomness from: ``train.seed`` for what is public (the initial model), and the
private streams of :mod:`dpsweep.privacy.streams` for sampling, noise, canaries and a private clipping
norm. A secure run's entropy is kept in its checkpoint (a local file, never logged), so that a resumed
run derives at its start what it derived before (a private clipping norm, an audit's canaries): one
release, charged once, rather than a second one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from dpsweep import distributed
from dpsweep.config import Config, ConfigError
from dpsweep.plan import RunPlan
from dpsweep.privacy.streams import Streams
from dpsweep.run import checkpoint

STREAMS_KEY = "streams"  # a secure run's private entropy (hex) in its checkpoint's RNG states: never logged


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's global generators: the initial model's (public) draws."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def streams_of(
    config: Config, plan: RunPlan, resume: checkpoint.TrainingState | None, ranks: distributed.Ranks
) -> Streams:
    """The run's private streams; a resumed secure run's are the entropy its checkpoint kept (one that kept
    none is refused: fresh entropy would derive a second clipping norm and other canaries, charged once)."""
    dp = config.dp
    if resume is not None and dp.secure_mode:
        kept: Any = (resume.rng["ranks"][ranks.rank] if ranks.distributed else resume.rng).get(STREAMS_KEY)
        try:
            return Streams((int(kept, 16),), secure=True)
        except (TypeError, ValueError):
            raise ConfigError(
                "train.checkpoint_dir", config.train.checkpoint_dir,
                "a secure run's checkpoint, which keeps its streams' entropy (this one keeps none): remove it to "
                "start afresh",
            ) from None  # fmt: skip
    return Streams.of_run(config.train.seed, plan.config_hash, dp.secure_mode, dp.stream_seed)


def keep_entropy(rng: dict[str, Any], streams: Streams) -> None:
    """A secure run's entropy into the RNG states its checkpoint saves (:func:`streams_of` reads it)."""
    if streams.secure:
        rng[STREAMS_KEY] = format(streams.entropy[0], "x")
