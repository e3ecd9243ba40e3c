"""dpsweep.process.shutdown.signals_deferred: a signal that arrives while a run is being ended waits
for the end, then reaches the handler it would have reached (here a Terminated, as under
dpsweep.tracking.terminate_as_interrupt)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from dpsweep.process.shutdown import Terminated, signals_deferred


def test_a_sigterm_inside_the_block_is_delivered_to_its_handler_once_the_block_ends() -> None:
    def interrupt(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    ended = []
    try:
        with pytest.raises(Terminated), signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecodes enough for a pending handler to run
                pass
            ended.append("the run's end, written whole")
        assert ended == ["the run's end, written whole"]
        assert signal.getsignal(signal.SIGTERM) is interrupt  # the handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_a_signal_the_block_raises_nothing_and_restores_the_handlers() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with signals_deferred():
        pass
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_sigterm_whose_exception_python_ignored_still_ends_the_block() -> None:
    """Its Terminated may land in a __del__ or a weakref callback, where Python prints it and goes on (a
    sweep's SIGTERM was lost so, and its job trained to the end): the block raises it again as it ends,
    and the runner at its next epoch (TERMINATED)."""
    from dpsweep.tracking import TERMINATED, terminate_as_interrupt

    class Swallowing:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside __del__: its exception is ignored
                pass

    went_on = []
    with pytest.raises(Terminated), terminate_as_interrupt():
        Swallowing()  # deleted at once
        went_on.append(True)
    assert went_on == [True] and TERMINATED.is_set()
