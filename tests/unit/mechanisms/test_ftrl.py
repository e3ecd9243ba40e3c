"""DP-FTRL: the variance and covariance of tree-aggregation noise, the sensitivity against a brute-force
count over explicit trees, ε against the exact (analytic) Gaussian mechanism, no Poisson events, exact
resume of the optimizer and its tree, calibration, and bad input."""

from __future__ import annotations

import io
import itertools
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting import rdp as dp_rdp
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy import optimize
from scipy.stats import norm

from dpsweep.errors import InputError
from dpsweep.mechanisms import dpftrl_accounting
from dpsweep.mechanisms.ftrl import FTRLOptimizer, TreeAggregator
from dpsweep.privacy import ledger, rdp
from dpsweep.privacy.schedule import epsilon, poisson_schedule


# ---------------------------------------------------------------------------------------------
# independent derivations (nothing here calls the code under test)
# ---------------------------------------------------------------------------------------------
def dyadic_nodes(t: int) -> list[tuple[int, int]]:
    """The nodes (first, last step, 1-based) whose noise makes up the prefix sum 1..t: the greedy
    dyadic decomposition of [1, t], largest block first."""
    nodes, start = [], 1
    for h in reversed(range(t.bit_length())):
        if t >> h & 1:
            nodes.append((start, start + 2**h - 1))
            start += 2**h
    return nodes


def trees_by_restart_rule(epochs: int, restart_every: int | None) -> list[int]:
    """Epochs per tree, from the rule of the reference's main.py: restart after epoch k (1-based) when
    restart_every divides k and k < epochs."""
    trees, current = [], 0
    for k in range(1, epochs + 1):
        current += 1
        if restart_every and k % restart_every == 0 and k < epochs:
            trees.append(current)
            current = 0
    trees.append(current)
    return trees


def brute_force_sensitivity_squared(
    steps_per_epoch: int, epochs: int, restart_every: int | None, tree_completion: bool, per_batch: int = 2
) -> int:
    """Squared sensitivity by counting: each tree is a list of steps (sets of examples, then empty
    virtual steps up to a power of two when completed before a restart), its nodes every complete
    interval [lo, lo + 2^h) of steps; an example's cost in a tree is Σ_nodes (its steps in the node)².
    The order is a fresh permutation in each tree (fixed across the tree's epochs), so an example's
    place differs between trees: the worst case over orders is the sum of each tree's worst example."""
    rng = np.random.default_rng(0)
    n = steps_per_epoch * per_batch
    trees = trees_by_restart_rule(epochs, restart_every)
    total = 0
    for i, tree_epochs in enumerate(trees):
        order = rng.permutation(n)
        batches = [set(order[j * per_batch : (j + 1) * per_batch].tolist()) for j in range(steps_per_epoch)]
        steps: list[set[int]] = [batches[j] for _ in range(tree_epochs) for j in range(steps_per_epoch)]
        if tree_completion and i < len(trees) - 1:
            size = 1
            while size < len(steps):
                size *= 2
            steps += [set()] * (size - len(steps))
        intervals, width = [], 1
        while width <= len(steps):
            intervals += [(lo, lo + width) for lo in range(0, len(steps) - width + 1, width)]
            width *= 2
        worst = 0
        for x in range(n):
            mine = [t for t, batch in enumerate(steps) if x in batch]
            worst = max(worst, sum(sum(lo <= t < hi for t in mine) ** 2 for lo, hi in intervals))
        total += worst
    return total


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε at δ of a Gaussian mechanism with sensitivity/std = mu (Balle & Wang 2018, "Improving the
    Gaussian Mechanism for Differential Privacy", Thm. 8):
    δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)."""

    def excess(eps: float) -> float:
        return float(norm.cdf(mu / 2 - eps / mu) - np.exp(eps + norm.logcdf(-mu / 2 - eps / mu))) - delta

    if excess(0.0) <= 0:
        return 0.0
    return float(optimize.brentq(excess, 0.0, 1000.0, xtol=1e-12, rtol=1e-12))


def rdp_gaussian_epsilon(mu: float, delta: float, orders: tuple[float, ...]) -> float:
    """RDP of the Gaussian mechanism, α·μ²/2 (Mironov 2017, Prop. 7), through the improved conversion
    (Balle et al. 2020, Prop. 12), minimised over ``orders``."""
    a = np.asarray(orders)
    return float(np.min(a * mu**2 / 2 + np.log1p(-1 / a) - (np.log(delta) + np.log(a)) / (a - 1)))


def event_types(event: object) -> set[type]:
    """Every DpEvent class in an event tree (composed, self-composed and sampled events walked)."""
    found: set[type] = set()
    if isinstance(event, dp_event.DpEvent):
        found.add(type(event))
        for name in ("event", "events"):
            child = getattr(event, name, None)
            for sub in child if isinstance(child, list) else [child]:
                found |= event_types(sub)
    return found


# ---------------------------------------------------------------------------------------------
# tree aggregation noise
# ---------------------------------------------------------------------------------------------
REPEATS = 20_000  # independent scalar trees: the coordinates of one (REPEATS,) tensor


def test_prefix_noise_has_the_covariance_of_its_tree_nodes() -> None:
    """Var of the prefix noise at t is popcount(t)·std², the covariance of two prefixes of one tree is
    the number of nodes they share times std², and a restart (without completion) starts a tree of
    independent noise and hands back the last prefix's noise."""
    std = 1.5
    tree = TreeAggregator([(REPEATS,)], std, torch.Generator().manual_seed(0), dtype=torch.float64)
    first = [tree.advance()[0].clone() for _ in range(16)]
    last = tree.restart()[0]
    assert torch.equal(last, first[-1]) and tree.step == 0
    second = [tree.advance()[0].clone() for _ in range(11)]

    labels = [(0, t) for t in range(1, 17)] + [(1, t) for t in range(1, 12)]
    x = torch.stack(first + second).numpy()
    cov = np.cov(x)
    for (i, (ti, a)), (j, (tj, b)) in itertools.product(enumerate(labels), repeat=2):
        shared = len(set(dyadic_nodes(a)) & set(dyadic_nodes(b))) if ti == tj else 0
        expected = shared * std**2
        var_a, var_b = len(dyadic_nodes(a)) * std**2, len(dyadic_nodes(b)) * std**2
        se = math.sqrt((var_a * var_b + expected**2) / REPEATS)
        assert abs(cov[i, j] - expected) < 5 * se, (labels[i], labels[j], cov[i, j], expected)
    for t in (1, 2, 4, 8, 16):  # powers of two: the root alone
        assert len(dyadic_nodes(t)) == 1 and np.var(first[t - 1].numpy()) == pytest.approx(std**2, rel=0.05)
    assert np.var(first[14].numpy()) == pytest.approx(4 * std**2, rel=0.05)  # 15 = 0b1111


def test_tree_completion_hands_back_the_root_noise() -> None:
    std = 2.0
    tree = TreeAggregator([(REPEATS,)], std, torch.Generator().manual_seed(1), tree_completion=True)
    prefix5 = [tree.advance()[0].clone() for _ in range(5)][-1]  # nodes [1, 4] and [5]: 2·std²
    root = tree.restart()[0]  # virtual steps 6..8: the root [1, 8], one fresh node
    assert tree.step == 0 and tree.restarts == 1
    assert float(prefix5.var()) == pytest.approx(2 * std**2, rel=0.05)
    assert float(root.var()) == pytest.approx(std**2, rel=0.05)
    assert abs(float(np.corrcoef(prefix5.numpy(), root.numpy())[0, 1])) < 5 / math.sqrt(REPEATS)
    # a tree already at a power of two needs no virtual step: its last prefix is its root
    eight = [tree.advance()[0].clone() for _ in range(8)][-1]
    assert torch.equal(tree.restart()[0], eight) and tree.restarts == 2


def test_aggregator_state_dict_resumes_exactly() -> None:
    shapes = [(3, 2), (4,)]
    a = TreeAggregator(shapes, 0.7, torch.Generator().manual_seed(5), tree_completion=True)
    for _ in range(11):
        a.advance()
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    b = TreeAggregator(shapes, 0.7, torch.Generator().manual_seed(99), tree_completion=True)
    buffer.seek(0)
    b.load_state_dict(torch.load(buffer, weights_only=True))
    for k in range(30):
        if k == 9:
            for x, y in zip(a.restart(), b.restart(), strict=True):
                assert torch.equal(x, y)
        for x, y in zip(a.advance(), b.advance(), strict=True):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="std"):
        TreeAggregator(shapes, 0.8, torch.Generator(), tree_completion=True).load_state_dict(a.state_dict())


# ---------------------------------------------------------------------------------------------
# the optimizer
# ---------------------------------------------------------------------------------------------
def test_ftrl_update_follows_the_reference_with_momentum_and_restarts() -> None:
    """θ_t = θ_0 − lr·m_t, m_t = γ·m_{t−1} + G_t + N_t; at a restart G takes the completed tree's root
    noise. Two parameter groups with their own lr; the noise replayed from the same seed."""
    torch.manual_seed(0)
    w, v = (
        torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64)),
        torch.nn.Parameter(torch.randn(4, dtype=torch.float64)),
    )
    std, gamma, lrs = 0.3, 0.9, (0.1, 0.05)
    tree = TreeAggregator.for_params([w, v], std, torch.Generator().manual_seed(3), tree_completion=True)
    groups: list[dict[str, Any]] = [{"params": [w]}, {"params": [v], "lr": lrs[1]}]
    opt = FTRLOptimizer(groups, lr=lrs[0], momentum=gamma, noise=tree)
    replay = TreeAggregator([(3, 2), (4,)], std, torch.Generator().manual_seed(3), dtype=torch.float64,
                            tree_completion=True)  # fmt: skip
    theta0 = [w.detach().clone(), v.detach().clone()]
    grad_sum = [torch.zeros_like(t) for t in theta0]
    m = [torch.zeros_like(t) for t in theta0]
    for k in range(1, 14):
        grads = [torch.randn_like(t) for t in theta0]
        w.grad, v.grad = grads[0].clone(), grads[1].clone()
        opt.step()
        noise = replay.advance()
        for i in range(2):
            grad_sum[i] += grads[i]
            m[i] = gamma * m[i] + grad_sum[i] + noise[i]
        assert torch.allclose(w, theta0[0] - lrs[0] * m[0], atol=1e-12)
        assert torch.allclose(v, theta0[1] - lrs[1] * m[1], atol=1e-12)
        if k in (5, 9):  # restarts after 5 steps (completed to 8) and after 4 more (a power of two)
            opt.restart()
            for i, last in enumerate(replay.restart()):
                grad_sum[i] += last


def test_ftrl_without_noise_or_momentum_is_gradient_descent() -> None:
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    models = [torch.nn.Linear(3, 1).double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [FTRLOptimizer(models[0].parameters(), lr=0.01), torch.optim.SGD(models[1].parameters(), lr=0.01)]
    for _ in range(20):
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            ((model(x) - y) ** 2).sum().backward()
            opt.step()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-10)


def _train(
    model: torch.nn.Module, opt: FTRLOptimizer, steps: range, steps_per_epoch: int, epochs: int, restart_every: int
) -> list[list[torch.Tensor]]:
    """Global steps ``steps`` of a run on fixed batches (the same order every epoch), restarting the tree
    after every restart_every-th epoch; the parameters and the tree's noise after each step."""
    data = torch.Generator().manual_seed(123)
    batches = [(torch.randn(4, 3, generator=data), torch.randn(4, 2, generator=data)) for _ in range(steps_per_epoch)]
    assert opt.noise is not None
    trace = []
    for k in steps:
        x, y = batches[k % steps_per_epoch]
        opt.zero_grad()
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.noise.noise])
        if (k + 1) % steps_per_epoch == 0 and dpftrl_accounting.restart_after_epoch(
            (k + 1) // steps_per_epoch, epochs, restart_every
        ):
            opt.restart()
    return trace


def _fresh(seed: int) -> tuple[torch.nn.Module, FTRLOptimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    tree = TreeAggregator.for_params(model.parameters(), 0.5, torch.Generator().manual_seed(seed), tree_completion=True)
    return model, FTRLOptimizer(model.parameters(), lr=0.05, momentum=0.5, noise=tree)


@pytest.mark.parametrize("stop", [5, 6, 9])  # mid-epoch, at a restart (after epoch 2 of 3 steps), in tree 2
def test_resume_continues_exactly(stop: int) -> None:
    b, epochs, restart_every, total = 3, 5, 2, 15
    model, opt = _fresh(0)
    _train(model, opt, range(stop), b, epochs, restart_every)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    straight = _train(model, opt, range(stop, total), b, epochs, restart_every)

    model2, opt2 = _fresh(42)  # other weights, other noise seed: everything must come from the checkpoint
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    resumed = _train(model2, opt2, range(stop, total), b, epochs, restart_every)
    for a, c in zip(straight, resumed, strict=True):
        for x, y in zip(a, c, strict=True):
            assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# sensitivity and ε
# ---------------------------------------------------------------------------------------------
def test_sensitivity_matches_brute_force_over_explicit_trees() -> None:
    for b, epochs, restart_every, completion in itertools.product(
        (1, 2, 3, 5, 8), (1, 2, 3, 4, 5, 7), (None, 1, 2, 3), (False, True)
    ):
        if restart_every is not None and restart_every > epochs:
            continue
        expected = brute_force_sensitivity_squared(b, epochs, restart_every, completion)
        got = dpftrl_accounting.ftrl_sensitivity_squared(b, epochs, restart_every, completion)
        assert got == expected, (b, epochs, restart_every, completion)
    # a larger tree, one example per batch
    assert dpftrl_accounting.ftrl_sensitivity_squared(20, 6, 4, True) == brute_force_sensitivity_squared(
        20, 6, 4, True, per_batch=1
    )


def test_one_epoch_per_tree_is_dp_accountings_single_epoch_tree() -> None:
    """A restart every epoch without completion: E trees of b steps, each of depth ⌊log2 b⌋ + 1, which is
    dp-accounting's own SingleEpochTreeAggregationDpEvent, self-composed E times (which dp-accounting
    accounts only for replace-special neighbours, the paper's Definition 1.1)."""
    sigma, delta = 3.0, 1e-5
    for b, epochs in ((1, 3), (7, 4), (100, 10), (128, 2)):
        assert dpftrl_accounting.ftrl_sensitivity_squared(b, epochs, 1) == epochs * (int(math.log2(b)) + 1)
        acc = dp_rdp.RdpAccountant(list(rdp.DEFAULT_ORDERS), NeighboringRelation.REPLACE_SPECIAL)
        acc.compose(dp_event.SelfComposedDpEvent(dp_event.SingleEpochTreeAggregationDpEvent(sigma, b), epochs))
        assert dpftrl_accounting.ftrl_epsilon(sigma, b, epochs, delta, 1) == pytest.approx(
            acc.get_epsilon(delta), rel=1e-12
        )


CONFIGS = [  # (σ, b, E, restart_every, tree_completion, δ)
    (8.0, 10, 6, None, False, 1e-5),
    (6.0, 10, 6, 2, False, 1e-5),
    (10.0, 12, 7, 3, True, 1e-6),
    (5.0, 20, 6, 4, True, 1e-5),
]


@pytest.mark.parametrize(("sigma", "b", "epochs", "restart_every", "completion", "delta"), CONFIGS)
def test_epsilon_is_the_gaussian_mechanism_of_the_brute_force_sensitivity(
    sigma: float, b: int, epochs: int, restart_every: int | None, completion: bool, delta: float
) -> None:
    s2 = brute_force_sensitivity_squared(b, epochs, restart_every, completion, per_batch=1)
    mu = math.sqrt(s2) / sigma
    exact = analytic_gaussian_epsilon(mu, delta)
    eps_rdp = dpftrl_accounting.ftrl_epsilon(sigma, b, epochs, delta, restart_every, completion)
    eps_pld = dpftrl_accounting.ftrl_epsilon(sigma, b, epochs, delta, restart_every, completion, accountant="pld")
    # RDP: exactly the Gaussian's α·μ²/2 on dpsweep's orders, improved conversion; an upper bound of the exact ε
    assert eps_rdp == pytest.approx(rdp_gaussian_epsilon(mu, delta, rdp.DEFAULT_ORDERS), rel=1e-9)
    assert exact < eps_rdp < 1.5 * exact
    # PLD: tight for one Gaussian mechanism, up to its (pessimistic) discretisation
    assert eps_pld == pytest.approx(exact, rel=0.01, abs=1e-3)
    assert eps_pld >= exact - 1e-6
    # the project's ledger holds the same event and gets the same ε
    entry = dpftrl_accounting.ftrl_entry(sigma, b, epochs, restart_every, completion)
    assert entry.params["sensitivity_squared"] == s2
    spent = ledger.epsilon(ledger.Ledger((entry,)), delta)
    assert spent.epsilon == pytest.approx(eps_rdp, rel=1e-9)


def test_no_poisson_event_and_more_epsilon_than_amplified_dpsgd() -> None:
    n, batch, sigma, epochs, delta = 1000, 100, 1.0, 5, 1e-5
    schedule = poisson_schedule(n, batch)
    b = schedule.steps_per_epoch
    for restart_every, completion in ((None, False), (1, False), (2, True)):
        event = dpftrl_accounting.ftrl_event(sigma, b, epochs, restart_every, completion)
        types = event_types(event) | event_types(
            dpftrl_accounting.ftrl_entry(sigma, b, epochs, restart_every, completion).event
        )
        assert dp_event.PoissonSampledDpEvent not in types
        assert types == {dp_event.GaussianDpEvent}
        eps_ftrl = dpftrl_accounting.ftrl_epsilon(sigma, b, epochs, delta, restart_every, completion)
        eps_dpsgd = epsilon(schedule, sigma, delta, epochs=epochs).epsilon
        assert eps_ftrl > eps_dpsgd
    assert dpftrl_accounting.ftrl_epsilon(0.0, b, epochs, delta) == math.inf


@pytest.mark.parametrize(
    ("target", "b", "epochs", "restart_every", "completion", "accountant"),
    [(2.0, 100, 20, None, False, "rdp"), (8.0, 100, 100, 20, True, "rdp"), (1.0, 50, 10, 3, True, "pld")],
)
def test_calibration_lands_just_under_the_target(
    target: float, b: int, epochs: int, restart_every: int | None, completion: bool, accountant: str
) -> None:
    sigma = dpftrl_accounting.calibrate_ftrl_noise(
        target, b, epochs, 1e-5, restart_every, completion, accountant=accountant
    )
    assert (
        dpftrl_accounting.ftrl_epsilon(sigma, b, epochs, 1e-5, restart_every, completion, accountant=accountant)
        <= target
    )
    assert (
        dpftrl_accounting.ftrl_epsilon(0.99 * sigma, b, epochs, 1e-5, restart_every, completion, accountant=accountant)
        > target
    )
    assert (
        dpftrl_accounting.ftrl_epsilon(
            0.9999 * sigma, b, epochs, 1e-5, restart_every, completion, accountant=accountant
        )
        > target
    )


def test_schedule_helpers() -> None:
    assert (
        dpftrl_accounting.tree_segments(5, 2) == (2, 2, 1)
        and dpftrl_accounting.tree_segments(6, 2) == (2, 2, 2)
        and dpftrl_accounting.tree_segments(3, None) == (3,)
    )
    assert [dpftrl_accounting.restart_after_epoch(k, 6, 2) for k in range(1, 7)] == [
        False,
        True,
        False,
        True,
        False,
        False,
    ]
    for epochs, restart_every in ((5, 2), (6, 2), (7, 3), (4, 4), (4, None)):
        assert list(dpftrl_accounting.tree_segments(epochs, restart_every)) == trees_by_restart_rule(
            epochs, restart_every
        )
    assert [dpftrl_accounting.completion_steps(n) for n in (1, 2, 3, 5, 8, 2000)] == [0, 0, 1, 3, 0, 48]


# ---------------------------------------------------------------------------------------------
# bad input, and planning without torch
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "key"),
    [
        (lambda: dpftrl_accounting.ftrl_epsilon(1.0, 10, 3, 1e-5, restart_every=4), "dp.ftrl_restart_every"),
        (lambda: dpftrl_accounting.ftrl_sensitivity_squared(10, 3, restart_every=0), "dp.ftrl_restart_every"),
        (lambda: dpftrl_accounting.calibrate_ftrl_noise(1.0, 10, 3, 1e-5, restart_every=5), "dp.ftrl_restart_every"),
        (lambda: dpftrl_accounting.ftrl_epsilon(1.0, 10, 0, 1e-5), "train.epochs"),
        (lambda: dpftrl_accounting.ftrl_sensitivity_squared(10, -2), "train.epochs"),
        (lambda: dpftrl_accounting.ftrl_epsilon(1.0, 0, 3, 1e-5), "steps_per_epoch"),
        (lambda: dpftrl_accounting.ftrl_event(1.0, -1, 3), "steps_per_epoch"),
        (lambda: dpftrl_accounting.ftrl_epsilon(-1.0, 10, 3, 1e-5), "dp.noise_multiplier"),
        (lambda: dpftrl_accounting.ftrl_epsilon(1.0, 10, 3, 0.0), "dp.delta"),
        (lambda: dpftrl_accounting.ftrl_epsilon(1.0, 10, 3, 1e-5, accountant="prv"), "dp.accountant"),
        (lambda: dpftrl_accounting.calibrate_ftrl_noise(0.0, 10, 3, 1e-5), "dp.target_epsilon"),
        (lambda: dpftrl_accounting.calibrate_ftrl_noise(1e-6, 10, 3, 1e-12), "dp.target_epsilon"),
    ],
)
def test_bad_input_names_the_key(call: Callable[[], object], key: str) -> None:
    with pytest.raises(InputError) as err:
        call()
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}=")


def test_optimizer_rejects_a_tree_of_other_shapes() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="shapes"):
        FTRLOptimizer(model.parameters(), lr=0.1, noise=TreeAggregator([(3, 2), (2,)], 1.0, torch.Generator()))


def test_planning_imports_no_torch() -> None:
    code = "import sys, dpsweep.mechanisms.dpftrl_accounting as f; f.calibrate_ftrl_noise(3.0, 10, 4, 1e-5, 2, True); "
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
