"""Gone: the tracking process (issue 57; :mod:`dpsweep.tracking` says why, with the figure). A run logs in
its own process, on MLflow's asynchronous logging, and flushes before it ends.

The names that ``launchers/`` and ``tests/`` still import from it, doing nothing, until their next edit
drops the calls; then this module goes too.
"""

from __future__ import annotations

from typing import Any

CHILD_MODULE = "dpsweep.tracking.child"  # (no such module: no process runs it)


class TrackingError(RuntimeError):
    """Never raised: MLflow's errors now reach a run as themselves."""


class _Gone:
    def post(self, op: str, *args: Any, **kwargs: Any) -> None:
        """Nothing: the only op posted from outside, ``warm_store``, warmed the tracking process."""

    def flush(self) -> None:
        """Nothing: a run waits for its own writes (:meth:`dpsweep.tracking.Tracker.flush`)."""


def serve_in_process() -> None:
    """Nothing: every process logs in process."""


def start() -> None:
    """Nothing: there is no tracking process to start."""


def service() -> _Gone:
    return _Gone()
