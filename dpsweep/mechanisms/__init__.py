"""DP mechanisms, in a registry by ``dp.mechanism``: each declares its ledger, its calibration, its
neighbouring relation, its labels and report note, and how it trains (:mod:`dpsweep.mechanisms.base`).

The registry and the built-in mechanisms' privacy import no torch; how they train does
(``opacus_engine``, ``functional``, ``ftrl``, ``batches``), and is imported where a run trains.
"""

from dpsweep.mechanisms import dpals, dpftrl, dpsgd
from dpsweep.mechanisms.base import MECHANISMS, Mechanism, Option, Setting, get

__all__ = ["MECHANISMS", "Mechanism", "Option", "Setting", "dpals", "dpftrl", "dpsgd", "get"]
