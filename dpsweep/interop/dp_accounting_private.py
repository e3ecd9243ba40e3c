"""dp-accounting's private names: the door to them.

A private tuning's ε under the ``mixture`` analysis (:mod:`dpsweep.privacy.tuning`) applies Papernot &
Steinke's repeat-and-select bound to an RDP curve that no dp-accounting event describes (a uniform
draw over candidates whose costs differ).
"""

from __future__ import annotations

from collections.abc import Sequence

from dp_accounting.rdp import rdp_privacy_accountant

PRIVATE_NAMES = (  # (module, attribute path): what tests/unit/interop checks still exists
    ("dp_accounting.rdp.rdp_privacy_accountant", "_compute_rdp_repeat_and_select"),
)


def repeat_and_select_rdp(orders: Sequence[float], rdp: Sequence[float], mean: float, shape: float) -> list[float]:
    """The RDP at ``orders`` of running a mechanism of RDP ``rdp`` K times (K of mean ``mean``, shape
    ``shape``: ∞ Poisson, 1 geometric, else truncated negative binomial) and releasing the best run:
    Papernot & Steinke 2022, Thms. 2 and 6, as dp-accounting's ``RdpAccountant`` computes them for a
    ``RepeatAndSelectDpEvent``.

    Private name: ``dp_accounting.rdp.rdp_privacy_accountant._compute_rdp_repeat_and_select``. The
    public way is the event, whose inner mechanism must be a dp-accounting event; a mixture of
    candidates with different costs is none, so the function is given the curve directly."""
    return list(rdp_privacy_accountant._compute_rdp_repeat_and_select(orders, rdp, mean, shape))
