"""Accounting: exact reference vectors, the step convention of Opacus's Poisson loader,
monotonicity, PRV <= RDP, and calibration that never lands over the target."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader, TensorDataset

from dpsweep import privacy
from dpsweep.privacy import calibrate_noise, epsilon, epsilon_from_history, poisson_schedule


def test_opacus_reference_vector_rdp_improved() -> None:
    # Opacus's own test: q=0.04, σ=1.5, 2250 steps, δ=1e-5 -> ε = 7.32911117143
    eps, _ = epsilon_from_history([(1.5, 0.04, 2250)], delta=1e-5)
    assert eps == pytest.approx(7.32911117143, rel=1e-6)


@pytest.mark.parametrize(("conversion", "expected"), [("classic", 0.941870567), ("improved", 0.7242234026)])
def test_mnist_reference_vector(conversion: str, expected: float) -> None:
    # N=60000, B=150, σ=1.3, 15 epochs, δ=1e-5
    r = epsilon(n=60000, batch_size=150, noise_multiplier=1.3, epochs=15, delta=1e-5, conversion=conversion)
    assert r.steps == 6000 and r.sample_rate == 150 / 60000
    assert r.epsilon == pytest.approx(expected, rel=1e-6)
    assert r.alpha == 19


def test_reference_vector_with_custom_orders() -> None:
    eps, alpha = epsilon_from_history([(1.0, 0.01, 300)], delta=1e-5, alphas=[2, 5, 10, 20, 100])
    assert round(eps, 2) == 2.39 and alpha == 5


def test_classic_conversion_is_never_tighter_than_improved() -> None:
    for sigma in (0.6, 1.0, 2.0):
        kw = dict(n=10000, batch_size=100, noise_multiplier=sigma, epochs=5, delta=1e-6)
        assert epsilon(**kw, conversion="classic").epsilon >= epsilon(**kw).epsilon  # type: ignore[arg-type]


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
    base = dict(n=1437, batch_size=64, delta=1e-5)
    by_epochs = [epsilon(**base, noise_multiplier=1.0, epochs=e).epsilon for e in (1, 2, 5, 10, 20)]  # type: ignore[arg-type]
    by_sigma = [epsilon(**base, noise_multiplier=s, epochs=5).epsilon for s in (0.6, 0.8, 1.0, 1.5, 3.0)]  # type: ignore[arg-type]
    assert all(a < b for a, b in itertools.pairwise(by_epochs))
    assert all(a > b for a, b in itertools.pairwise(by_sigma))


@pytest.mark.parametrize(("sigma", "epochs"), [(0.8, 5), (1.0, 10), (1.5, 20)])
def test_prv_is_no_looser_than_rdp(sigma: float, epochs: int) -> None:
    kw = dict(n=10000, batch_size=128, noise_multiplier=sigma, epochs=epochs, delta=1e-5)
    prv, rdp = epsilon(**kw, accountant="prv"), epsilon(**kw, accountant="rdp")  # type: ignore[arg-type]
    assert prv.epsilon <= rdp.epsilon
    assert prv.alpha is None and prv.conversion is None


def test_epochs_and_steps_are_exclusive() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        epsilon(n=100, batch_size=10, noise_multiplier=1.0, delta=1e-3)
    with pytest.raises(ValueError, match="exactly one"):
        epsilon(n=100, batch_size=10, noise_multiplier=1.0, delta=1e-3, epochs=1, steps=10)


def test_steps_and_epochs_agree() -> None:
    a = epsilon(n=1000, batch_size=50, noise_multiplier=1.1, delta=1e-5, epochs=3)
    b = epsilon(n=1000, batch_size=50, noise_multiplier=1.1, delta=1e-5, steps=60)
    assert a.epsilon == b.epsilon and a.steps == 60


def test_no_steps_costs_nothing() -> None:
    assert epsilon_from_history([], 1e-5) == (0.0, None)


def test_unknown_accountant_lists_valid_ones() -> None:
    with pytest.raises(KeyError, match="valid: prv, rdp"):
        epsilon_from_history([(1.0, 0.01, 10)], 1e-5, accountant="gdp")


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_calibration_lands_just_under_target(accountant: str, target: float) -> None:
    kw = dict(n=1437, batch_size=64, delta=1e-5, epochs=8)
    sigma = calibrate_noise(target_epsilon=target, accountant=accountant, **kw)  # type: ignore[arg-type]
    eps = epsilon(noise_multiplier=sigma, accountant=accountant, **kw).epsilon  # type: ignore[arg-type]
    assert eps <= target
    assert target - eps <= 0.01


def test_calibration_to_an_unreachable_target_raises() -> None:
    with pytest.raises(ValueError, match="too low"):
        calibrate_noise(target_epsilon=1e-9, n=100, batch_size=100, delta=1e-3, epochs=1000)


def test_default_alphas_are_opacus_defaults() -> None:
    from opacus.accountants import RDPAccountant

    assert list(privacy.DEFAULT_ALPHAS) == RDPAccountant.DEFAULT_ALPHAS
    assert not math.isnan(epsilon(n=100, batch_size=10, noise_multiplier=1, delta=1e-3, epochs=1).epsilon)


def test_grid_equals_pointwise_epsilon_serial_and_parallel() -> None:
    kw = dict(
        n=5000, batch_sizes=[50, 100, 250, 500], noise_multipliers=[0.7, 1.0, 1.3, 2.0], epochs=[1, 3, 7], delta=1e-5
    )
    serial = privacy.epsilon_grid(**kw, workers=1)  # type: ignore[arg-type]
    parallel = privacy.epsilon_grid(**kw, workers=2)  # type: ignore[arg-type]  # 16 pairs: the process pool
    assert serial.shape == (4, 4, 3)
    assert (serial == parallel).all()
    for i, b in enumerate(kw["batch_sizes"]):  # type: ignore[arg-type]
        for j, s in enumerate(kw["noise_multipliers"]):  # type: ignore[arg-type]
            assert serial[i, j, 2] == epsilon(n=5000, batch_size=b, noise_multiplier=s, epochs=7, delta=1e-5).epsilon


def test_epsilon_curve_and_epoch_calibration_agree() -> None:
    curve = privacy.epsilon_curve(n=1437, batch_size=64, noise_multiplier=1.0, delta=1e-5, epochs=12)
    assert all(a < b for a, b in itertools.pairwise(curve))
    e = privacy.calibrate_epochs(
        target_epsilon=curve[6] + 1e-9, n=1437, batch_size=64, noise_multiplier=1.0, delta=1e-5
    )
    assert e == 7
    assert (
        privacy.calibrate_epochs(target_epsilon=curve[0] / 2, n=1437, batch_size=64, noise_multiplier=1.0, delta=1e-5)
        == 0
    )
