"""Choosing the clipping norm C privately (``dp.clipping=quantile``): the release and its ledger entry.

    dpsweep dp.clipping=quantile dp.clip_quantile=0.5 dp.clip_epsilon=0.1   # C = private median norm

Before training, the task computes the per-example gradient norms at initialisation on one Poisson
sample of the training set (rate q, the run's sample rate), and C is their ``dp.clip_quantile``
released by ``dp.clip_quantile_method`` (:mod:`dpsweep.mechanisms`) with ``dp.clip_epsilon``-DP over
the public range [``dp.clip_low``, ``dp.clip_high``]. The norms are a function of one example each, so
each norm-count query has sensitivity 1 and the release is ``clip_epsilon``-DP on the sample; on the
training set, Poisson sampling amplifies it to ε' = log(1 + q(e^ε - 1)) (:func:`dpsweep.ledger.amplified_by_poisson`).
The ledger charges ε' as a pure-DP event (randomized-response RDP bound; exact PLD), planned before
training by :func:`planned` with the same numbers the run then records.

The release is a deterministic function of the data and ``train.seed`` (its own generator): a
resumed run repeats it with the same output, which reveals nothing more, so it is charged once.
"""

from __future__ import annotations

import numpy as np

from dpsweep import ledger, mechanisms
from dpsweep.config import Clipping, DPConfig, QuantileMethod

RELEASE = "clip_quantile"  # the ledger entry's name
SEED_OFFSET = 7_919  # the release's generator: train.seed + this, apart from the training sampler's


def amplified_epsilon(dp: DPConfig, sample_rate: float) -> float:
    """ε' the ledger charges for the release (see the module docstring)."""
    return ledger.amplified_by_poisson(dp.clip_epsilon, sample_rate)


def entry(dp: DPConfig, sample_rate: float, chosen: float | None = None) -> ledger.Entry:
    """The ledger entry of the quantile release on a Poisson sample at ``sample_rate`` (``chosen``: the C released)."""
    params: dict[str, float | str | None] = {
        "quantile": dp.clip_quantile, "method": dp.clip_quantile_method.value, "epsilon": dp.clip_epsilon,
        "sample_rate": sample_rate, "low": dp.clip_low, "high": dp.clip_high, "max_grad_norm_chosen": chosen,
    }  # fmt: skip
    if dp.clip_quantile_method == QuantileMethod.histogram:
        params["steps"] = dp.clip_steps
    note = (
        f"{dp.clip_epsilon:g}-DP quantile release ({dp.clip_quantile_method.value}) on a Poisson sample at rate "
        f"q={sample_rate:.6g}, amplified to ε'=log(1+q(e^ε-1)) (Balle et al. 2018); pure DP accounted by the "
        "randomized-response bound (RDP), exactly (PLD), by basic composition (PRV)"
    )
    return ledger.pure_release(RELEASE, amplified_epsilon(dp, sample_rate), params, note)


def planned(dp: DPConfig, sample_rate: float) -> ledger.Ledger:
    """The releases a run makes before training, besides its DP-SGD steps (empty for fixed C)."""
    if not dp.enabled or dp.clipping != Clipping.quantile:
        return ledger.Ledger()
    return ledger.Ledger((entry(dp, sample_rate),))


def choose(norms: np.ndarray, dp: DPConfig, seed: int) -> float:
    """C: the private ``dp.clip_quantile`` of per-example gradient ``norms`` (one Poisson sample)."""
    rng = np.random.default_rng(seed + SEED_OFFSET)
    if dp.clip_quantile_method == QuantileMethod.exponential:
        c = mechanisms.exponential_quantile(
            norms, dp.clip_quantile, low=dp.clip_low, high=dp.clip_high, epsilon=dp.clip_epsilon, rng=rng
        )
    else:
        c = float(
            mechanisms.histogram_quantiles(
                norms, [dp.clip_quantile], low=dp.clip_low, high=dp.clip_high, steps=dp.clip_steps,
                epsilon=dp.clip_epsilon, rng=rng,
            )[0]
        )  # fmt: skip
    return max(c, 1e-6)  # a positive norm (post-processing): C = 0 would clip every gradient to nothing
