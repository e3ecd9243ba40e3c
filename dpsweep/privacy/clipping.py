"""Choosing the clipping norm C privately: ``dp.clipping=quantile`` (a release before training) and
``dp.clipping=adaptive`` (C moves at every step); their ledger entries and their checks.

    dpsweep dp.clipping=quantile dp.clip_quantile=0.5 dp.clip_epsilon=0.1   # C = private median norm
    dpsweep dp.clipping=adaptive dp.clip_quantile=0.5 dp.clip_lr=0.2        # Andrew et al. 2021

**quantile.**

Before training, the task computes the per-example gradient norms at initialisation on one Poisson
sample of the training set (rate q, the run's sample rate), and C is their ``dp.clip_quantile``
released by ``dp.clip_quantile_method`` (:mod:`dpsweep.privacy.stats`) with ``dp.clip_epsilon``-DP over
the public range [``dp.clip_low``, ``dp.clip_high``]. The norms are a function of one example each, so
each norm-count query has sensitivity 1 and the release is ``clip_epsilon``-DP on the sample; on the
training set, Poisson sampling amplifies it to ε' = log(1 + q(e^ε - 1))
(:func:`dpsweep.privacy.ledger.amplified_by_poisson`).
The ledger charges ε' as a pure-DP event (randomized-response RDP bound; exact PLD), planned before
training by :func:`planned` with the same numbers the run then records.

The release is a deterministic function of the data and the run's clipping stream
(``dpsweep.privacy.streams``; a secure run's entropy is kept in its checkpoint): a resumed run repeats it
with the same output, which reveals nothing more, so it is charged once.

**adaptive** (Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially Private Learning with Adaptive
Clipping", Alg. 1 and Thm. 1). At each step, besides the clipped gradients, the count of examples
whose norm is at most C is released, centred (each example adds b_i - 1/2, sensitivity 1/2, as TF
Privacy's ``QuantileEstimatorQuery`` does) and noised with std σ_b; the unclipped share is that over
the expected batch size (public) plus 1/2, and C <- C·exp(-η(share - γ)). The gradient noise is
σ_Δ·C with σ_Δ = (σ^-2 - (2σ_b)^-2)^(-1/2), so the pair is one Gaussian mechanism of noise multiplier σ
(1/σ² = 1/σ_Δ² + 1/(2σ_b)²): each step is charged as a Poisson-subsampled Gaussian at the full σ,
not at σ_Δ (which Opacus's AdaClip accounting did until its fix). σ >= 2σ_b leaves σ_Δ undefined.
Opacus's ``AdaClipDPOptimizer`` divides the raw noisy count by the actual (private) batch size;
:class:`dpsweep.mechanisms.opacus_engine.ExpectedBatchAdaClip` uses the centred count over the expected batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsweep.errors import InputError
from dpsweep.privacy import ledger, stats

if TYPE_CHECKING:  # the config module registers Hydra schemas: dpsweep-epsilon prices a release without it
    from dpsweep.config import DPConfig

RELEASE = "clip_quantile"  # the ledger entry's name
DEFAULT_EPSILON = 1.0  # dp.clip_epsilon's default (a test checks they agree): cheap once amplified by q


def release(epsilon: float, sample_rate: float, method: str, params: Mapping[str, Any] | None = None) -> ledger.Entry:
    """The ledger entry of an ``epsilon``-DP quantile release by ``method`` on a Poisson sample at
    ``sample_rate``: charged at ε' = log(1 + q(e^ε - 1)) (see the module docstring)."""
    note = (
        f"{epsilon:g}-DP quantile release ({method}) on a Poisson sample at rate q={sample_rate:.6g}, amplified "
        "to ε'=log(1+q(e^ε-1)) (Balle et al. 2018); pure DP accounted by the randomized-response bound (RDP), "
        "exactly (PLD), by basic composition (PRV)"
    )
    shown = {"method": method, "epsilon": epsilon, "sample_rate": sample_rate} | dict(params or {})
    return ledger.pure_release(RELEASE, ledger.amplified_by_poisson(epsilon, sample_rate), shown, note)


def entry(dp: DPConfig, sample_rate: float, chosen: float | None = None) -> ledger.Entry:
    """The ledger entry of the run's quantile release (``chosen``: the C released)."""
    params: dict[str, float | str | None] = {
        "quantile": dp.clip_quantile, "low": dp.clip_low, "high": dp.clip_high, "max_grad_norm_chosen": chosen,
    }  # fmt: skip
    if dp.clip_quantile_method == "histogram":
        params["steps"] = dp.clip_steps
    return release(dp.clip_epsilon, sample_rate, dp.clip_quantile_method.value, params)


def count_noise(dp: DPConfig, batch_size: int) -> float:
    """σ_b of adaptive clipping: ``dp.clip_count_noise``, or B/20 (Andrew et al. 2021, Sec. 3)."""
    return dp.clip_count_noise if dp.clip_count_noise is not None else batch_size / 20


def gradient_noise(noise_multiplier: float, sigma_b: float) -> float:
    """σ_Δ = (σ^-2 - (2σ_b)^-2)^(-1/2), the gradient's noise multiplier under adaptive clipping
    (Andrew et al. 2021, Thm. 1); ValueError when σ >= 2σ_b, where it is undefined."""
    if noise_multiplier >= 2 * sigma_b:
        raise ValueError(f"σ={noise_multiplier:g} >= 2σ_b={2 * sigma_b:g}")
    return float((noise_multiplier**-2 - (2 * sigma_b) ** -2) ** -0.5)


def check_adaptive(dp: DPConfig, noise_multiplier: float, batch_size: int) -> None:
    """Adaptive clipping needs σ < 2σ_b (InputError naming dp.clip_count_noise otherwise)."""
    if dp.clipping != "adaptive":
        return
    sigma_b = count_noise(dp, batch_size)
    given = dp.clip_count_noise if dp.clip_count_noise is not None else f"null (B/20={sigma_b:g})"
    if noise_multiplier >= 2 * sigma_b:
        raise InputError(
            "dp.clip_count_noise", given,
            f"a count-noise std σ_b above σ/2 = {noise_multiplier / 2:g}: with σ >= 2σ_b the gradient noise "
            "σ_Δ = (σ^-2 - (2σ_b)^-2)^(-1/2) of adaptive clipping is undefined (Andrew et al. 2021, Thm. 1)",
        )  # fmt: skip


def adaptive_steps(noise_multiplier: float, sample_rate: float, steps: int, sigma_b: float) -> ledger.Entry:
    """The ledger entry of ``steps`` adaptive-clipping steps: DP-SGD at the full σ (see the module docstring)."""
    base = ledger.dpsgd(noise_multiplier, sample_rate, steps)
    params = dict(base.params) | {
        "clipping": "adaptive", "count_noise": sigma_b, "gradient_noise": gradient_noise(noise_multiplier, sigma_b),
    }  # fmt: skip
    note = (
        "adaptive clipping (Andrew et al. 2021): gradient noise σ_Δ and count noise σ_b (sensitivity 1/2) "
        "form one Gaussian mechanism at σ, charged as a Poisson-subsampled Gaussian step at σ"
    )
    return ledger.Entry(base.name, base.event, params, note)


def planned(dp: DPConfig, sample_rate: float) -> ledger.Ledger:
    """The releases a run makes before training, besides its DP-SGD steps (empty for fixed C)."""
    if not dp.enabled or dp.clipping != "quantile":
        return ledger.Ledger()
    return ledger.Ledger((entry(dp, sample_rate),))


def choose(norms: np.ndarray, dp: DPConfig, seed: int) -> float:
    """C: the private ``dp.clip_quantile`` of per-example gradient ``norms`` (one Poisson sample), its noise
    drawn from ``seed`` (a run's clipping stream, ``dpsweep.privacy.streams``)."""
    rng = np.random.default_rng(seed)
    if dp.clip_quantile_method == "exponential":
        c = stats.exponential_quantile(
            norms, dp.clip_quantile, low=dp.clip_low, high=dp.clip_high, epsilon=dp.clip_epsilon, rng=rng
        )
    else:
        c = float(
            stats.histogram_quantiles(
                norms, [dp.clip_quantile], low=dp.clip_low, high=dp.clip_high, steps=dp.clip_steps,
                epsilon=dp.clip_epsilon, rng=rng,
            )[0]
        )  # fmt: skip
    return max(c, 1e-6)  # a positive norm (post-processing): C = 0 would clip every gradient to nothing
