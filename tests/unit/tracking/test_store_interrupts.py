"""A SIGTERM (scancel, a local sweep's driver gone) never cuts a store call in the middle
(dpsweep.tracking.store.retry_busy): it is delivered when the call returns. An interrupt raised inside a
SQLite statement left its cursor alive in the traceback, holding the database's lock, so the run's later
writes, its KILLED status among them, failed as "database is locked" for minutes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dpsweep.process.shutdown import Terminated
from dpsweep.tracking import terminate_as_interrupt
from dpsweep.tracking.store import retry_busy


def test_a_sigterm_during_a_store_call_is_raised_when_the_call_has_returned() -> None:
    steps: list[str] = []

    def call() -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the signal arrives here, in the middle of the call
        steps.append("returned")
        return "stored"

    with pytest.raises(Terminated), terminate_as_interrupt():
        retry_busy(call)
    assert steps == ["returned"]
