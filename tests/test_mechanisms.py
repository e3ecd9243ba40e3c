"""dpsweep.mechanisms: privacy (exact output distributions on neighbouring datasets against e^ε) and
accuracy (AboveThreshold's (α, β) bound, empirically)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from dpsweep import mechanisms

EPS = 0.7


def _above_threshold_distribution(answers: np.ndarray, threshold: float, epsilon: float) -> np.ndarray:
    """Exact P[AboveThreshold returns i] for i = 0..k-1 and P[None] (last), by quadrature over the
    noisy threshold: the queries' Laplace(4/ε) noises are independent given it."""
    t_noise = stats.laplace(scale=2 / epsilon)
    q_noise = stats.laplace(scale=4 / epsilon)

    def p_index(i: int | None) -> float:
        def integrand(t: float) -> float:
            below = np.prod([q_noise.cdf(t - a) for a in answers[: len(answers) if i is None else i]])
            hit = 1.0 if i is None else q_noise.sf(t - answers[i])
            return float(t_noise.pdf(t - threshold) * below * hit)

        points = sorted({threshold, *answers.tolist()})
        return integrate.quad(integrand, -80, 80, points=points, limit=400, epsabs=1e-13)[0]

    return np.array([p_index(i) for i in range(len(answers))] + [p_index(None)])


def test_above_threshold_output_distributions_of_neighbours_are_within_e_to_the_epsilon() -> None:
    # Neighbouring datasets: the histogram method's queries f_i = #{x < t_i} - γ·n, with one example
    # added (every count at or above it +1, n +1), γ = 0.5, so each answer moves by at most 0.5.
    edges = np.array([1.0, 2.0, 3.0, 4.0])
    x = np.array([0.5, 1.5, 1.7, 3.2])
    x_added = np.append(x, 0.2)
    f = np.searchsorted(np.sort(x), edges) - 0.5 * len(x)
    g = np.searchsorted(np.sort(x_added), edges) - 0.5 * len(x_added)
    assert np.max(np.abs(f - g)) <= 1  # sensitivity 1, the mechanism's premise
    p, q = _above_threshold_distribution(f, 0.0, EPS), _above_threshold_distribution(g, 0.0, EPS)
    assert p.sum() == pytest.approx(1, abs=1e-6) and q.sum() == pytest.approx(1, abs=1e-6)
    ratio = np.max(np.maximum(p / q, q / p))
    assert ratio <= math.exp(EPS) * (1 + 1e-6)
    assert ratio > 1.05  # the outputs do depend on the data: the test can fail


def test_the_sampler_draws_the_exact_distribution() -> None:
    # The quadrature above is AboveThreshold's distribution; the sampler must draw it (chi-square test,
    # 20,000 draws, rejects a correct sampler with probability 0.001).
    answers = np.array([-1.5, -0.5, 0.0, 0.5])
    p = _above_threshold_distribution(answers, 0.0, EPS)
    rng = np.random.default_rng(1)
    draws = [mechanisms.above_threshold(answers, 0.0, EPS, rng) for _ in range(20_000)]
    counts = np.array([sum(d == i for d in draws) for i in range(len(answers))] + [sum(d is None for d in draws)])
    assert stats.chisquare(counts, p * len(draws)).pvalue > 0.001


def test_exponential_quantile_densities_of_neighbours_are_within_e_to_the_epsilon() -> None:
    low, high = 0.0, 5.0
    x = np.array([0.3, 0.9, 1.4, 2.2, 2.5, 4.1])
    t = np.linspace(low + 1e-6, high - 1e-6, 4001)  # the output density on a fine grid of points
    for neighbour in (np.append(x, 1.0), np.append(x, 4.9), x[1:]):
        for gamma in (0.1, 0.5, 0.9):
            dp, dq = (_density(v, gamma, low, high, t) for v in (x, neighbour))
            ratio = np.max(np.maximum(dp / dq, dq / dp))
            assert 1.05 < ratio <= math.exp(EPS) * (1 + 1e-9), (gamma, ratio)


def _density(values: np.ndarray, gamma: float, low: float, high: float, t: np.ndarray) -> np.ndarray:
    edges, p = mechanisms.exponential_intervals(values, gamma, low, high, EPS)
    i = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, len(p) - 1)
    return p[i] / np.diff(edges)[i]


def test_exponential_sampler_draws_its_intervals_probabilities() -> None:
    x = np.array([0.3, 0.9, 1.4, 2.2, 2.5, 4.1])
    edges, p = mechanisms.exponential_intervals(x, 0.5, 0.0, 5.0, EPS)
    rng = np.random.default_rng(2)
    draws = np.array(
        [mechanisms.exponential_quantile(x, 0.5, low=0.0, high=5.0, epsilon=EPS, rng=rng) for _ in range(20_000)]
    )
    counts = np.histogram(draws, bins=edges)[0]
    assert stats.chisquare(counts, p * len(draws)).pvalue > 0.001


@pytest.mark.parametrize("beta", [0.05, 0.2])
def test_above_threshold_is_alpha_beta_accurate(beta: float) -> None:
    # Dwork & Roth Thm. 3.24: with probability >= 1 - β, the returned k has f_k >= T - α and every earlier
    # query f_i <= T + α, α = 8(log k + log(2/β))/ε. Counted over 2,000 trials; the bound must hold in at
    # least a 1 - β share (a 3-sigma binomial margin allows for sampling error).
    rng = np.random.default_rng(3)
    answers = np.linspace(-40, 40, 50)  # sensitivity-1 queries crossing the threshold at 0
    trials, failures = 2000, 0
    for _ in range(trials):
        k = mechanisms.above_threshold(answers, 0.0, 1.0, rng)
        if k is None:
            failures += 1
            continue
        alpha = mechanisms.above_threshold_alpha(k + 1, beta, 1.0)
        if answers[k] < -alpha or np.any(answers[:k] > alpha):
            failures += 1
    assert failures / trials <= beta + 3 * math.sqrt(beta * (1 - beta) / trials)


def test_histogram_and_exponential_quantiles_find_the_median() -> None:
    rng = np.random.default_rng(4)
    values = rng.gamma(2.0, 0.5, size=2000)
    truth = float(np.median(values))
    hist = mechanisms.histogram_quantiles(values, [0.5], low=0.0, high=5.0, steps=100, epsilon=1.0, rng=rng)
    expo = mechanisms.exponential_quantile(values, 0.5, low=0.0, high=5.0, epsilon=1.0, rng=rng)
    assert abs(hist[0] - truth) < 0.15 and abs(expo - truth) < 0.05
    deciles = mechanisms.histogram_quantiles(
        values, [d / 10 for d in range(1, 10)], low=0.0, high=5.0, steps=100, epsilon=9.0, rng=rng
    )
    assert np.all(np.diff(deciles) >= -0.1)  # nine AboveThresholds, each at ε/9, in order


def test_the_same_seed_gives_the_same_release() -> None:
    values = np.random.default_rng(5).gamma(2.0, 0.5, size=300)
    a, b = (
        mechanisms.histogram_quantiles(values, [0.5], low=0, high=5, steps=50, epsilon=1, rng=np.random.default_rng(9))
        for _ in range(2)
    )
    assert a == b


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"low": 2.0, "high": 1.0}, "low < high"),
        ({"epsilon": 0.0}, "epsilon must be > 0"),
        ({"quantile": 1.0}, r"in \(0, 1\)"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float], message: str) -> None:
    args = {"quantile": 0.5, "low": 0.0, "high": 5.0, "epsilon": 1.0} | kwargs
    with pytest.raises(ValueError, match=message):
        mechanisms.exponential_quantile(np.ones(5), args["quantile"], low=args["low"], high=args["high"],
                                        epsilon=args["epsilon"], rng=np.random.default_rng(0))  # fmt: skip
