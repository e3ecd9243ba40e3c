"""The allowed range of every DP parameter, stated once for the config and for every command.

The trainer names config keys (``dp.noise_multiplier``), ``dpsweep-epsilon`` names its flags
(``-n/--noise-multiplier``); both check the same rule and raise the same
:class:`~dpsweep.errors.InputError`::

    check("noise_multiplier", "dp.noise_multiplier", -1.0)
    # dp.noise_multiplier=-1.0 is invalid: a positive, finite noise multiplier σ

Non-finite values (nan, inf) are refused everywhere: an infinite σ or C trains nothing useful and
an infinite σ makes the accountants loop. So are finite values that break the arithmetic that uses
them: a C that float32, the type training computes in, cannot hold with its noise σ·C (1e39 is finite
in float64 and infinite in float32: the run trained at chance), and a σ whose square the accountants'
float64 arithmetic overflows or underflows (1e300 gave a traceback).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpsweep.errors import InputError
from dpsweep.registry import Registry


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Rule:
    allowed: str  # what is allowed, as the error message says it
    ok: Callable[[Any], bool]


RULES: Registry[Rule] = Registry("range rule")
SIGMA_RANGE = (1e-6, 1e6)  # below, one step's RDP exceeds 1e11 (no guarantee); above, ε is 0 to float precision
MAX_CLIP_NORM = 1e30  # float32 holds C and its noise σ·C (σ ≤ 1e6): 1e36 < 3.4e38
RULES.register("noise_multiplier")(
    Rule(
        f"a positive, finite noise multiplier σ from {SIGMA_RANGE[0]:g} to {SIGMA_RANGE[1]:g}",
        lambda v: _finite(v) and SIGMA_RANGE[0] <= v <= SIGMA_RANGE[1],
    )
)
RULES.register("max_grad_norm")(
    Rule(
        f"a positive, finite clipping norm C of at most {MAX_CLIP_NORM:g} (float32 must hold C and σ·C)",
        lambda v: _finite(v) and 0 < v <= MAX_CLIP_NORM,
    )
)
RULES.register("delta")(Rule("a probability δ in the open interval (0, 1)", lambda v: _finite(v) and 0 < v < 1))
RULES.register("target_epsilon")(Rule("a positive, finite ε", lambda v: _finite(v) and v > 0))
RULES.register("dataset_size")(Rule("a positive number of examples N", lambda v: _finite(v) and v > 0))
RULES.register("batch_size")(Rule("a positive integer (at most N)", lambda v: _finite(v) and v > 0))
RULES.register("epochs")(Rule("a positive integer", lambda v: _finite(v) and v > 0))
RULES.register("steps")(Rule("a positive number of optimizer steps", lambda v: _finite(v) and v > 0))
RULES.register("rdp_orders")(Rule("RDP orders α > 1, finite", lambda v: all(_finite(a) and a > 1 for a in v)))


def check(rule: str, key: str, value: Any) -> None:
    """Raise InputError(key, value, <the rule's allowed range>) unless ``value`` satisfies ``rule``."""
    spec = RULES.get(rule)
    if not spec.ok(value):
        raise InputError(key, value, spec.allowed)


def check_batch_size(key: str, batch_size: int, n: int) -> None:
    """B must be positive and at most N: the sample rate B/N is a probability."""
    check("batch_size", key, batch_size)
    if batch_size > n:
        raise InputError(key, batch_size, f"at most the training-set size N={n} (the sample rate B/N is above 1)")


def check_delta(key: str, delta: float, n: int, allow_large: bool, allow_flag: str) -> None:
    """δ in (0, 1) and below 1/N, unless ``allow_large`` (``allow_flag`` names the switch that allows it)."""
    check("delta", key, delta)
    if delta >= 1.0 / n and not allow_large:
        raise InputError(
            key,
            delta,
            f"a δ below 1/N = {1.0 / n:.3g} (N={n}); a larger δ makes the guarantee void ({allow_flag} allows it)",
        )
