"""The final ε computed ahead in a forked process (dpsweep.run.prefetch): the same values, or none."""

from __future__ import annotations

import os
import time

import pytest

from dpsweep.privacy import ledger, rdp
from dpsweep.run import prefetch

DELTA = 1e-5
ORDERS = rdp.DEFAULT_ORDERS


@pytest.fixture(autouse=True)
def nothing_remembered() -> None:
    ledger.forget()


def _bill(steps: int = 180) -> ledger.Ledger:
    return ledger.Ledger((ledger.dpsgd(noise_multiplier=0.9, sample_rate=64 / 1437, steps=steps),))


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_child_computes_what_this_process_would_have() -> None:
    bill = _bill()
    ahead = prefetch.start(bill, DELTA, ORDERS)
    assert ahead is not None
    assert not ledger.all_computed(bill, DELTA, ORDERS)  # nothing computed here
    assert ahead.collect() == 3  # rdp, pld and prv
    assert _reaped(ahead.pid)
    assert ledger.all_computed(bill, DELTA, ORDERS)
    served = ledger.epsilons(bill, DELTA, ORDERS)

    ledger.forget()
    computed_here = ledger.epsilons(bill, DELTA, ORDERS)
    assert served == computed_here  # exactly: the same function of the same leaves
    assert set(computed_here) == {"rdp", "pld", "prv"}


def test_another_ledger_is_not_served_from_the_prefetched_values() -> None:
    ahead = prefetch.start(_bill(180), DELTA, ORDERS)
    assert ahead is not None and ahead.collect() == 3
    shorter = _bill(179)  # a run stopped one step early
    assert not ledger.all_computed(shorter, DELTA, ORDERS)
    assert ledger.epsilons(shorter, DELTA, ORDERS)["rdp"] < ledger.epsilons(_bill(180), DELTA, ORDERS)["rdp"]


def test_nothing_is_forked_when_every_value_is_remembered_or_there_is_no_ledger() -> None:
    bill = _bill()
    ledger.epsilons(bill, DELTA, ORDERS)
    assert prefetch.start(bill, DELTA, ORDERS) is None
    assert prefetch.start(None, DELTA, ORDERS) is None


def test_a_failing_child_brings_nothing_and_the_run_computes_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> dict[str, float]:
        raise RuntimeError("accountant failed")

    bill = _bill()
    monkeypatch.setattr(ledger, "epsilons", fail)  # in the forked child too
    ahead = prefetch.start(bill, DELTA, ORDERS)
    assert ahead is not None
    assert ahead.collect() == 0 and ahead.values == {}
    assert _reaped(ahead.pid)
    assert not ledger.all_computed(bill, DELTA, ORDERS)


def test_cancel_ends_and_reaps_the_child_and_keeps_nothing() -> None:
    bill = _bill()  # PLD and PRV take most of a second: cancelled as it computes
    ahead = prefetch.start(bill, DELTA, ORDERS)
    assert ahead is not None
    ahead.cancel()
    assert _reaped(ahead.pid)
    assert ahead.collect() == 0  # after cancel: nothing, and no wait
    assert not ledger.all_computed(bill, DELTA, ORDERS)
    with pytest.raises(OSError):
        os.fstat(ahead.read_fd)  # the pipe is closed


def test_a_ledger_beyond_the_discretised_range_forks_nothing() -> None:
    bill = ledger.Ledger((ledger.dpsgd(noise_multiplier=0.2, sample_rate=0.5, steps=500),))
    assert prefetch.start(bill, DELTA, ORDERS) is None  # RDP alone is reported: computed to decide that
    assert ledger.beyond_discretised(bill, DELTA) and ledger.all_computed(bill, DELTA, ORDERS)


def test_a_child_that_does_not_finish_in_time_is_ended_and_the_run_computes_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def stuck(*args: object, **kwargs: object) -> dict[str, float]:
        time.sleep(60)  # as a child that waits on a lock another thread held when it was forked
        return {}

    bill = _bill()
    monkeypatch.setattr(ledger, "epsilons", stuck)  # in the forked child too
    ahead = prefetch.start(bill, DELTA, ORDERS)
    assert ahead is not None
    started = time.monotonic()
    assert ahead.collect(timeout_s=0.5) == 0 and ahead.values == {}
    assert time.monotonic() - started < 10  # not the child's 60 s
    assert _reaped(ahead.pid) and not ledger.all_computed(bill, DELTA, ORDERS)
    ahead.cancel()  # after collect: nothing to do


def test_cancel_after_an_interrupted_collect_reaps_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = prefetch.start(_bill(), DELTA, ORDERS)
    assert ahead is not None

    def interrupted(deadline: float) -> bytes | None:
        os.close(ahead.read_fd)  # as far as the read got: the pipe is closed
        raise KeyboardInterrupt

    monkeypatch.setattr(ahead, "_read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ahead.collect()
    ahead.cancel()  # the run's finally: no error from the closed pipe, the child reaped
    assert _reaped(ahead.pid) and ahead.collected == 0
