"""The names runs log their memory under, as tests read them: in MiB under MLflow's ``system/`` prefix
(``system/memory/backward_mib``, :func:`dpsweep.memory.tables.metric`), spelled out here so that a test
fails when a run logs them under any other name (issue 56, item 2)."""

from __future__ import annotations

from collections.abc import Mapping

MIB = 2**20
PREFIX = "system/memory/"


def memory_metric(name: str) -> str:
    """``backward`` -> ``system/memory/backward_mib``."""
    return f"{PREFIX}{name}_mib"


def memory_bytes(metrics: Mapping[str, float], name: str) -> float:
    """Memory figure ``name`` (``backward``, ``iteration_peak``, ``batch_load_delta``) of a run's
    ``metrics``, in bytes: its ``system/memory/<name>_mib`` times 2**20 (KeyError when not logged so)."""
    return metrics[memory_metric(name)] * MIB
