"""Planning's accounting: exact reference vectors (on Opacus's orders), the step convention of Opacus's
Poisson loader, monotonicity, PRV <= RDP, and calibration that never lands over the target."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader, TensorDataset

from dpsweep.privacy import ledger, rdp
from dpsweep.privacy.ledger import Accounting, Ledger
from dpsweep.privacy.schedule import (
    GridAxes,
    calibrate_epochs,
    calibrate_noise,
    epsilon,
    epsilon_curve,
    epsilon_grid,
    poisson_schedule,
)

OPACUS = Accounting(orders=rdp.OPACUS_ORDERS)  # Opacus's and TF Privacy's orders: published figures


def epsilon_from_history(
    history: list[tuple[float, float, int]], delta: float, orders: tuple[float, ...] = rdp.OPACUS_ORDERS
) -> tuple[float, float | None]:
    spent = ledger.epsilon(ledger.from_history(history), delta, Accounting(orders=orders))
    return spent.epsilon, spent.order


def test_opacus_reference_vector_rdp_improved() -> None:
    # Opacus's own test: q=0.04, σ=1.5, 2250 steps, δ=1e-5 -> ε = 7.32911117143
    eps, _ = epsilon_from_history([(1.5, 0.04, 2250)], delta=1e-5)
    assert eps == pytest.approx(7.32911117143, rel=1e-6)


@pytest.mark.parametrize(("conversion", "expected"), [("classic", 0.941870567), ("improved", 0.7242234026)])
def test_mnist_reference_vector(conversion: str, expected: float) -> None:
    # N=60000, B=150, σ=1.3, 15 epochs, δ=1e-5
    accounting = Accounting(conversion=conversion, orders=rdp.OPACUS_ORDERS)
    r = epsilon(poisson_schedule(60000, 150), 1.3, 1e-5, epochs=15, accounting=accounting)
    assert r.steps == 6000 and r.sample_rate == 150 / 60000
    assert r.epsilon == pytest.approx(expected, rel=1e-6)
    assert r.alpha == 19
    # the default grid holds Opacus's: the optimum, inside it, is unchanged or lower
    default = epsilon(poisson_schedule(60000, 150), 1.3, 1e-5, epochs=15, accounting=Accounting(conversion=conversion))
    assert default.epsilon <= r.epsilon and default.epsilon == pytest.approx(expected, rel=1e-3)


def test_reference_vector_with_custom_orders() -> None:
    eps, alpha = epsilon_from_history([(1.0, 0.01, 300)], delta=1e-5, orders=(2, 5, 10, 20, 100))
    assert round(eps, 2) == 2.39 and alpha == 5


def test_classic_conversion_is_never_tighter_than_improved() -> None:
    for sigma in (0.6, 1.0, 2.0):
        schedule = poisson_schedule(10000, 100)
        classic = epsilon(schedule, sigma, 1e-6, epochs=5, accounting=Accounting(conversion="classic"))
        assert classic.epsilon >= epsilon(schedule, sigma, 1e-6, epochs=5).epsilon


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 200_000), b=st.integers(1, 5_000))
def test_schedule_matches_opacus_poisson_loader(n: int, b: int) -> None:
    """Our step convention equals what DPDataLoader and PrivacyEngine.make_private use."""
    b = min(b, n)
    loader = DataLoader(TensorDataset(torch.empty(n, 0)), batch_size=b)
    dp_loader = DPDataLoader.from_data_loader(loader)
    s = poisson_schedule(n, b)
    assert s.steps_per_epoch == len(dp_loader)
    assert s.inclusion_probability == dp_loader.sample_rate
    assert s.sample_rate == 1 / len(dp_loader)  # what make_private gives the accountant
    assert s.sample_rate >= s.inclusion_probability  # accounting never under-states q


def test_schedule_float_quirk_is_kept() -> None:
    # 1 / (1 / 93) rounds below 93: Opacus's loader then yields 92 steps per epoch.
    s = poisson_schedule(93 * 10, 10)
    assert s.steps_per_epoch == 92 and s.sample_rate == 1 / 92


def test_epsilon_grows_with_epochs_and_shrinks_with_sigma() -> None:
    schedule = poisson_schedule(1437, 64)
    by_epochs = [epsilon(schedule, 1.0, 1e-5, epochs=e).epsilon for e in (1, 2, 5, 10, 20)]
    by_sigma = [epsilon(schedule, s, 1e-5, epochs=5).epsilon for s in (0.6, 0.8, 1.0, 1.5, 3.0)]
    assert all(a < b for a, b in itertools.pairwise(by_epochs))
    assert all(a > b for a, b in itertools.pairwise(by_sigma))


@pytest.mark.parametrize(("sigma", "epochs"), [(0.8, 5), (1.0, 10), (1.5, 20)])
def test_prv_is_no_looser_than_rdp(sigma: float, epochs: int) -> None:
    schedule = poisson_schedule(10000, 128)
    prv, rdp = (epsilon(schedule, sigma, 1e-5, epochs=epochs, accounting=Accounting(a)) for a in ("prv", "rdp"))
    assert prv.epsilon <= rdp.epsilon
    assert prv.alpha is None and prv.conversion is None


def test_epochs_and_steps_are_exclusive() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        epsilon(poisson_schedule(100, 10), 1.0, 1e-3)
    with pytest.raises(ValueError, match="exactly one"):
        epsilon(poisson_schedule(100, 10), 1.0, 1e-3, epochs=1, steps=10)


def test_steps_and_epochs_agree() -> None:
    a = epsilon(poisson_schedule(1000, 50), 1.1, 1e-5, epochs=3)
    b = epsilon(poisson_schedule(1000, 50), 1.1, 1e-5, steps=60)
    assert a.epsilon == b.epsilon and a.steps == 60


def test_no_steps_costs_nothing() -> None:
    assert epsilon_from_history([], 1e-5) == (0.0, None)
    assert epsilon_from_history([(1.0, 0.01, 0)], 1e-5) == (0.0, None)


def test_unknown_accountant_lists_valid_ones() -> None:
    with pytest.raises(KeyError, match="valid: pld, prv, rdp"):
        ledger.epsilon(Ledger((ledger.dpsgd(1.0, 0.01, 10),)), 1e-5, Accounting("gdp"))
    with pytest.raises(KeyError, match="valid: pld, prv, rdp"):
        epsilon(poisson_schedule(100, 10), 1.0, 1e-3, epochs=1, accounting=Accounting("gdp"))
    with pytest.raises(KeyError, match="valid: classic, improved"):
        epsilon(poisson_schedule(100, 10), 1.0, 1e-3, epochs=1, accounting=Accounting(conversion="tight"))


@pytest.mark.parametrize("accountant", ["rdp", "prv", pytest.param("pld", marks=pytest.mark.slow)])
@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_calibration_lands_just_under_target(accountant: str, target: float) -> None:
    schedule = poisson_schedule(1437, 64)
    sigma = calibrate_noise(schedule, target, 1e-5, epochs=8, accounting=Accounting(accountant))
    eps = epsilon(schedule, sigma, 1e-5, epochs=8, accounting=Accounting(accountant)).epsilon
    assert eps <= target
    assert target - eps <= 0.01  # Opacus's tolerance; the bisection stops at a relative σ of 1e-4


@pytest.mark.slow  # 19 s on a loaded 2-core VM: PLD's exact search, for the comparison
def test_pld_calibration_searches_coarse_and_keeps_only_what_the_runs_accounting_confirms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PLD's search runs on a coarser discretisation (also an upper bound on ε), and its σ is kept
    only once the run's own accounting says it spends at most the target."""
    from dpsweep.privacy import calibrate

    def ledger_of(sigma: float) -> Ledger:
        return Ledger((ledger.dpsgd(sigma, 64 / 1437, 23),))

    fine = Accounting("pld")
    exact = calibrate.smallest_sigma(lambda s: ledger.epsilon(ledger_of(s), 1e-5, fine).epsilon, 0.5)
    sigma = calibrate.noise_multiplier(ledger_of, 0.5, 1e-5, fine)
    assert ledger.epsilon(ledger_of(sigma), 1e-5, fine).epsilon <= 0.5
    assert exact <= sigma <= exact * (1 + 3 * calibrate.RTOL)

    seen: list[float] = []
    real = calibrate.epsilon

    def coarse_too_low(book: Ledger, delta: float, a: Accounting) -> ledger.Spent:
        """A coarse accounting that under-states ε: its σ must not be kept."""
        spent = real(book, delta, a)
        seen.append(a.pld_discretization)
        if a.pld_discretization == ledger.COARSE_PLD_DISCRETIZATION:
            return ledger.Spent(spent.epsilon * 0.8, delta, "pld", None, None)
        return spent

    monkeypatch.setattr(calibrate, "epsilon", coarse_too_low)
    again = calibrate.noise_multiplier(ledger_of, 0.5, 1e-5, fine)  # searched again, on the run's own
    assert real(ledger_of(again), 1e-5, fine).epsilon <= 0.5 and abs(again - exact) <= 2 * calibrate.RTOL * exact
    assert ledger.COARSE_PLD_DISCRETIZATION in seen and ledger.PLD_DISCRETIZATION in seen


def test_calibration_to_an_unreachable_target_raises() -> None:
    with pytest.raises(ValueError, match="too low"):
        calibrate_noise(poisson_schedule(100, 100), target_epsilon=1e-9, delta=1e-10, epochs=1000)


def test_opacus_orders_are_opacus_defaults_and_the_default_grid_holds_them() -> None:
    from opacus.accountants import RDPAccountant

    assert list(rdp.OPACUS_ORDERS) == RDPAccountant.DEFAULT_ALPHAS
    assert set(rdp.OPACUS_ORDERS) <= set(rdp.DEFAULT_ORDERS) and max(rdp.DEFAULT_ORDERS) == 1024
    assert Accounting().orders == rdp.DEFAULT_ORDERS == rdp.ORDER_GRIDS.get("default")
    assert not math.isnan(epsilon(poisson_schedule(100, 10), 1, 1e-3, epochs=1).epsilon)


def test_grid_equals_pointwise_epsilon_serial_and_parallel() -> None:
    axes = GridAxes(batch_sizes=[50, 100, 250, 500], noise_multipliers=[0.7, 1.0, 1.3, 2.0], epochs=[1, 3, 7])
    serial = epsilon_grid(5000, axes, 1e-5, workers=1)
    parallel = epsilon_grid(5000, axes, 1e-5, workers=2)  # 16 pairs: the process pool
    assert serial.shape == (4, 4, 3)
    assert (serial == parallel).all()
    classic = Accounting(conversion="classic", orders=(2, 5, 10, 20, 100))
    other = epsilon_grid(5000, axes, 1e-5, accounting=classic)
    for i, b in enumerate(axes.batch_sizes):
        for j, s in enumerate(axes.noise_multipliers):
            schedule = poisson_schedule(5000, b)
            assert serial[i, j, 2] == epsilon(schedule, s, 1e-5, epochs=7).epsilon
            assert other[i, j, 2] == epsilon(schedule, s, 1e-5, epochs=7, accounting=classic).epsilon


def test_grid_is_rdp_only() -> None:
    axes = GridAxes(batch_sizes=[50], noise_multipliers=[1.0], epochs=[1])
    with pytest.raises(ValueError, match="RDP"):
        epsilon_grid(5000, axes, 1e-5, accounting=Accounting("prv"))


def test_epsilon_curve_and_epoch_calibration_agree() -> None:
    schedule = poisson_schedule(1437, 64)
    curve = epsilon_curve(schedule, 1.0, 1e-5, 12)
    assert all(a < b for a, b in itertools.pairwise(curve))
    assert curve[6] == epsilon(schedule, 1.0, 1e-5, epochs=7).epsilon
    assert calibrate_epochs(schedule, curve[6] + 1e-9, 1.0, 1e-5) == 7
    assert calibrate_epochs(schedule, curve[0] / 2, 1.0, 1e-5) == 0
    assert calibrate_epochs(schedule, curve[11] + 1e-9, 1.0, 1e-5, max_epochs=5) == 5
