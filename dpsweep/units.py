"""Memory figures with units: ``"16GiB"`` -> bytes, and bytes -> ``"1.92 MiB"``.

    parse_bytes("16GiB", key="launcher.gpu_memory")   # 17179869184
    format_bytes(2_013_265)                           # '1.92 MiB'

No torch here: the config's checks (``launcher.gpu_memory``) and every report use it.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from dpsweep.errors import InputError

# Units of memory figures (IEC 80000-13): SI prefixes are powers of 1000 ("80GB" on a datasheet),
# binary ones powers of 1024 ("16GiB" from nvidia-smi); B is bytes.
BYTE_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 1000, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
}  # fmt: skip
_BINARY_PREFIXES = ("B", "KiB", "MiB", "GiB", "TiB")
_FIGURE = re.compile(r"^\s*(?P<number>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float, key: str = "memory") -> int:
    """Bytes in a memory figure with units: ``"16GiB"`` -> 17179869184, ``"80 GB"`` -> 80000000000.

    A bare number is refused (is 16 GiB, GB or bytes?), as are unknown units and figures <= 0;
    the :class:`~dpsweep.errors.InputError` names ``key``, the figure and the units allowed.
    """
    units = ", ".join(BYTE_UNITS)
    match = _FIGURE.match(str(text))
    if match is None:
        raise InputError(key, text, f"a number with a unit, e.g. 16GiB or 80GB (units: {units})")
    unit = match["unit"]
    if not unit:
        raise InputError(key, text, f"units are required, e.g. {text}GiB or {text}GB; units: {units}")
    if unit not in BYTE_UNITS:
        raise InputError(key, text, f"unknown unit {unit!r}; one of {units} (SI powers of 1000, IEC of 1024)")
    count = int((Decimal(match["number"]) * BYTE_UNITS[unit]).to_integral_value())  # exact: no float rounding
    if count <= 0:
        raise InputError(key, text, "a positive amount of memory (at least 1 B), e.g. 16GiB")
    return count


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary prefix and 3 significant digits: ``4 B``, ``2.1 KiB``, ``1.92 MiB``."""
    if not math.isfinite(n):
        return f"{n} B"
    value = abs(float(n))
    unit = _BINARY_PREFIXES[0]
    for unit in _BINARY_PREFIXES:
        if value < 1024 or unit == _BINARY_PREFIXES[-1]:
            break
        value /= 1024
    text = f"{value:.3g}"
    if "e" in text and value >= 1:
        text = f"{value:.0f}"
    return f"{'-' if n < 0 else ''}{text} {unit}"


def rounded_up(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, never less than it: ``rounded_up(6.483, 3)`` is ``'6.49'``,
    ``rounded_up(1.3, 4)`` ``'1.3'``. For figures whose reader must not be told less than the truth: a σ
    (more noise than shown is never less private) and an ε in a name (never less than the ε spent)."""
    if not math.isfinite(value) or value <= 0:
        return f"{value:g}"
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(value)))
    steps = math.ceil(round(value * scale, 6))  # round(): 1.3 * 1000 is 1300.0000000000002, not 1301 steps
    while float(f"{steps / scale:.{digits}g}") < value:  # what round() took down: 1.1540000003 is 1.155
        steps += 1
    return f"{steps / scale:.{digits}g}"
