"""User-level DP (dpsweep.data.users): the Dirichlet partition into users, Poisson batches of users, and the
user-level gradient, whose sum of clipped contributions moves by at most C when one user comes or goes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpsweep.config import DigitsConfig
from dpsweep.data import loaders
from dpsweep.data.resident import device_generator, materialize
from dpsweep.data.users import (
    UserBatch,
    UserBatches,
    _log_dirichlet_proportions,
    check_max_examples,
    check_users,
    dirichlet_partition,
    natural_users,
    segment_count,
    user_contributions,
    user_level_gradient,
)
from dpsweep.errors import InputError
from dpsweep.privacy.schedule import poisson_schedule

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def digits() -> tuple[Tensor, Tensor]:
    """The digits training split as float64 features (N, 64) in [-1, 1] and labels (N,)."""
    x, y = materialize(loaders.build(DigitsConfig(image_size=8)).train)
    return x.flatten(1).double(), y


class ScaledMLP(nn.Module):
    """A small MLP on 64 features, with a buffer (passed through functional_call, never trained)."""

    scale: Tensor

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():  # seeded weights, the global generator left as it was
            torch.manual_seed(seed)
            self.hidden = nn.Linear(64, 16)
            self.out = nn.Linear(16, 10)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(x * self.scale)))


def _flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


# ---------------------------------------------------------------------------------------------
# the partition
# ---------------------------------------------------------------------------------------------
def test_partition_is_a_valid_seeded_pure_function(digits: tuple[Tensor, Tensor]) -> None:
    labels = digits[1].numpy()
    users = dirichlet_partition(labels, num_users=25, alpha=0.5, seed=3)
    assert users.dtype == np.int64 and users.shape == labels.shape
    sizes = np.bincount(users, minlength=25)
    assert len(sizes) == 25 and sizes.min() >= 1 and sizes.sum() == len(labels)
    assert np.array_equal(users, dirichlet_partition(labels, 25, 0.5, 3))  # stable across calls
    assert np.array_equal(users, dirichlet_partition(torch.from_numpy(labels), 25, 0.5, 3))  # tensor labels
    assert np.array_equal(users, dirichlet_partition(labels.astype(np.int32), 25, 0.5, 3))  # label dtype
    assert not np.array_equal(users, dirichlet_partition(labels, 25, 0.5, 4))  # another seed, another split
    # only the classes' order matters, not their values
    assert np.array_equal(users, dirichlet_partition(labels * 7 + 100, 25, 0.5, 3))


def test_partition_golden_small_case() -> None:
    """Labels 0,1,2,0,1,2,… (30 examples), 3 users, α = 0.5, seed 0. Checked by hand: class c holds
    indices c, c+3, …, c+27; the seeded draws give class 0 the proportions (0.391, 0.523, 0.087) and
    the permutation [4 6 2 7 3 5 9 0 8 1] of its members, so cut points ⌊10·(0.391, 0.914)⌋ = (3, 9)
    give user 0 the indices 12, 18, 6, user 1 the indices 21, 9, 15, 27, 0, 24 and user 2 index 3;
    class 1 gets (0.066, 0.338, 0.595) → pieces 0/4/6, class 2 (0.978, 0.002, 0.020) → 9/0/1.
    Every user is non-empty, so no fix-up applies. This guards the split against library changes."""
    labels = np.arange(30) % 3
    users = dirichlet_partition(labels, num_users=3, alpha=0.5, seed=0)
    golden = [1, 2, 0, 2, 2, 0, 0, 2, 0, 1, 2, 2, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 2, 0, 1, 2, 0]
    assert users.tolist() == golden
    per_user_class = [np.bincount(labels[users == u], minlength=3).tolist() for u in range(3)]
    assert per_user_class == [[3, 0, 9], [6, 4, 0], [1, 6, 1]]


def _max_class_share(labels: np.ndarray, users: np.ndarray, num_users: int) -> float:
    """The mean over users of the share of a user's examples in their most frequent class."""
    return float(np.mean([np.bincount(labels[users == u]).max() / np.sum(users == u) for u in range(num_users)]))


def test_label_skew_follows_alpha(digits: tuple[Tensor, Tensor]) -> None:
    labels = digits[1].numpy()
    global_hist = np.bincount(labels, minlength=10) / len(labels)
    near_iid = dirichlet_partition(labels, 20, alpha=1000.0, seed=0)
    for u in range(20):
        hist = np.bincount(labels[near_iid == u], minlength=10) / np.sum(near_iid == u)
        assert 0.5 * np.abs(hist - global_hist).sum() < 0.1  # total variation to the global histogram
    skewed = dirichlet_partition(labels, 20, alpha=0.05, seed=0)
    iid_share, skewed_share = _max_class_share(labels, near_iid, 20), _max_class_share(labels, skewed, 20)
    assert iid_share < 0.15  # ≈ 1/10 for near-iid users
    assert skewed_share > 0.6  # a few classes dominate each user
    classes_held = [len(np.unique(labels[skewed == u])) for u in range(20)]
    assert np.mean(classes_held) < 5


def test_log_space_dirichlet_has_the_dirichlet_moments() -> None:
    """Dir(α·1_K): mean 1/K, variance (1/K)(1 − 1/K)/(Kα + 1), and P(p_1 < t) as numpy's Dirichlet."""
    rng = np.random.RandomState(np.random.PCG64(np.random.SeedSequence(5)))
    k, alpha, n = 3, 0.5, 20_000
    draws = np.array([_log_dirichlet_proportions(rng, alpha, k) for _ in range(n)])
    assert np.allclose(draws.sum(axis=1), 1.0)
    var = (1 / k) * (1 - 1 / k) / (k * alpha + 1)
    assert np.all(np.abs(draws.mean(axis=0) - 1 / k) < 5 * math.sqrt(var / n))
    assert np.all(np.abs(draws.var(axis=0) - var) < 0.05 * var)
    reference = np.random.default_rng(1).dirichlet([alpha] * k, size=n)
    assert abs((draws[:, 0] < 0.01).mean() - (reference[:, 0] < 0.01).mean()) < 0.015
    tiny = _log_dirichlet_proportions(rng, 1e-6, 50)  # plain gammas would underflow to 0/0 here
    assert np.isfinite(tiny).all() and math.isclose(tiny.sum(), 1.0)


@pytest.mark.parametrize(("n", "num_users", "alpha"), [(40, 40, 0.01), (200, 150, 0.05), (50, 2, 1e-4)])
def test_every_user_gets_an_example(n: int, num_users: int, alpha: float) -> None:
    labels = np.arange(n) % 4
    users = dirichlet_partition(labels, num_users, alpha, seed=1)
    sizes = np.bincount(users, minlength=num_users)
    assert len(sizes) == num_users and sizes.min() >= 1 and sizes.sum() == n
    assert np.array_equal(users, dirichlet_partition(labels, num_users, alpha, seed=1))


def test_natural_users_number_sorted_ids() -> None:
    assert natural_users(["b", "a", "c", "a"]).tolist() == [1, 0, 2, 0]
    assert natural_users(np.array([10, 3, 10, 7])).tolist() == [2, 0, 2, 1]
    ids = natural_users(torch.tensor([5, 5, -1]))
    assert ids.dtype == np.int64 and ids.tolist() == [1, 1, 0]
    with pytest.raises(ValueError):
        natural_users([])


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_users", [1, 0, -3, 101, 2.0, True, "4"])
def test_bad_num_users_names_its_key(num_users: object) -> None:
    with pytest.raises(InputError) as err:
        check_users(num_users, 100, 0.5)
    assert err.value.key == "dataset.num_users" and str(err.value).startswith("dataset.num_users=")


@pytest.mark.parametrize("alpha", [0, 0.0, -1.0, math.nan, math.inf, None, True])
def test_bad_label_skew_names_its_key(alpha: object) -> None:
    with pytest.raises(InputError) as err:
        check_users(10, 100, alpha)
    assert err.value.key == "dataset.user_label_skew" and "dataset.user_label_skew=" in str(err.value)


@pytest.mark.parametrize("value", [0, -1, 2.5, None, False])
def test_bad_max_examples_names_its_key(value: object) -> None:
    with pytest.raises(InputError) as err:
        check_max_examples(value)
    assert err.value.key == "dp.max_examples_per_user" and str(err.value).startswith("dp.max_examples_per_user=")


def test_entry_points_check_their_input() -> None:
    labels = np.arange(10) % 2
    with pytest.raises(InputError, match=r"^dataset\.num_users=11 is invalid"):
        dirichlet_partition(labels, 11, 0.5, seed=0)
    with pytest.raises(InputError, match=r"^dataset\.user_label_skew=-0\.5 is invalid"):
        dirichlet_partition(labels, 2, -0.5, seed=0)
    check_users(10, 10, 0.1)  # K = N is allowed: one example each
    check_max_examples(np.int64(1))
    x, y = torch.zeros(10, 2), torch.zeros(10, dtype=torch.int64)
    with pytest.raises(InputError, match=r"^dp\.max_examples_per_user=0 is invalid"):
        UserBatches(
            x, y, labels, expected_users_per_step=1, max_examples_per_user=0, device=CPU, generator=torch.Generator()
        )
    with pytest.raises(ValueError, match="natural_users"):  # user 1 of 0..2 holds nothing
        UserBatches(
            x,
            y,
            labels * 2,
            expected_users_per_step=1,
            max_examples_per_user=1,
            device=CPU,
            generator=torch.Generator(),
        )


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------
def _staircase(num_users: int = 30, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """User u holds u + 1 examples, in shuffled positions; x names the example (its index)."""
    users = torch.repeat_interleave(torch.arange(num_users), torch.arange(1, num_users + 1))
    users = users[torch.randperm(len(users), generator=torch.Generator().manual_seed(seed))]
    x = torch.arange(len(users), dtype=torch.float32).unsqueeze(1)
    return x, torch.arange(len(users)) % 10, users


def _batches(device: torch.device, expected: int = 6, m: int = 5, seed: int = 0) -> UserBatches:
    x, y, users = _staircase()
    return UserBatches(
        x,
        y,
        users,
        expected_users_per_step=expected,
        max_examples_per_user=m,
        device=device,
        generator=device_generator(device, seed),
    )


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_batches_sample_users_at_rate_q(device: torch.device) -> None:
    batches = _batches(device)  # U = 30, B = 6: q = 1/5, 5 steps per epoch
    schedule = poisson_schedule(30, 6)
    assert len(batches) == schedule.steps_per_epoch == 5
    assert batches.sample_rate == schedule.inclusion_probability == 0.2
    assert batches.expected_users == pytest.approx(6.0)
    epochs, q = 300, batches.sample_rate
    included = torch.zeros(30, dtype=torch.int64)
    steps = 0
    for _ in range(epochs):
        for batch in batches:
            users = batches.users[batch.x[:, 0].long()].cpu()
            included[users.unique()] += 1
            steps += 1
    assert steps == epochs * len(batches)
    sd = math.sqrt(q * (1 - q) / (steps * 30))
    assert abs(included.sum().item() / (steps * 30) - q) < 5 * sd
    per_user_sd = math.sqrt(q * (1 - q) / steps)
    assert ((included.double() / steps - q).abs() < 5 * per_user_sd).all()


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_batches_cap_each_user_and_choose_uniformly(device: torch.device) -> None:
    m = 5
    batches = _batches(device, m=m)
    users_of, counts = batches.users.cpu(), torch.bincount(batches.users.cpu())
    chosen = torch.zeros(len(users_of), dtype=torch.int64)
    sampled = torch.zeros(30, dtype=torch.int64)
    for _ in range(200):
        for xb, yb, segment in batches:
            assert xb.device.type == device.type and yb.device.type == segment.device.type == device.type
            example = xb[:, 0].long().cpu()
            segment = segment.cpu()
            assert torch.equal(yb.cpu(), example % 10)
            assert len(example.unique()) == len(example)  # no example twice
            if len(segment) == 0:
                continue
            assert (segment.diff() >= 0).all() and segment[0] == 0
            assert segment_count(segment) == len(segment.unique())
            user = users_of[example]
            in_batch = user.unique()  # increasing user ids, one per segment
            for s, u in enumerate(in_batch.tolist()):
                rows = segment == s
                assert (user[rows] == u).all()
                assert rows.sum() == min(m, counts[u].item())  # all of a small user, m of a large one
            sampled[in_batch] += 1
            chosen[example] += 1
    # a sampled user with n > m examples brings each one with probability m / n
    large = (counts > m).nonzero().squeeze(1)
    rate = chosen.double() / sampled[users_of].double()
    for u in large.tolist():
        expected = m / counts[u].item()
        sd = math.sqrt(expected * (1 - expected) / sampled[u].item())
        assert ((rate[users_of == u] - expected).abs() < 5 * sd).all()


def test_restoring_the_generator_replays_the_batches() -> None:
    batches = _batches(CPU)
    next(iter(batches))  # not at the start of the stream
    state = batches.generator.get_state()
    first = [tuple(t.clone() for t in batch) for _ in range(3) for batch in batches]
    batches.generator.set_state(state)
    again = [tuple(batch) for _ in range(3) for batch in batches]
    assert len(first) == len(again) == 15
    for a, b in zip(first, again, strict=True):
        assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    other = _batches(CPU, seed=1)
    assert any(not torch.equal(a[0], b.x) for a, b in zip(first, other, strict=False))


def test_all_users_every_step_when_q_is_one() -> None:
    batches = _batches(CPU, expected=30, m=100)
    assert batches.sample_rate == 1.0 and len(batches) == 1
    (batch,) = list(batches)
    assert isinstance(batch, UserBatch) and batch.num_users == 30
    assert sorted(batch.x[:, 0].long().tolist()) == list(range(len(batches.users)))


# ---------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------
def _all_users_batch(x: Tensor, y: Tensor, users: np.ndarray, m: int) -> UserBatch:
    """One step with every user (q = 1), at most m examples each (the seeded choice)."""
    batches = UserBatches(
        x, y, users, expected_users_per_step=int(users.max()) + 1, max_examples_per_user=m, device=CPU,
        generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    return batches.sample()


def _summed(model: nn.Module, x: Tensor, y: Tensor, segment: Tensor, num_segments: int, clip: float) -> Tensor:
    """The sum of the clipped user contributions: the gradient with σ = 0 and a denominator of 1."""
    grads = user_level_gradient(model, F.cross_entropy, x, y, segment, num_segments, clip, 0.0, expected_users=1.0)
    return _flat(grads)


def test_one_user_moves_the_sum_by_at_most_c(digits: tuple[Tensor, Tensor]) -> None:
    """Neighbouring datasets differ by all the examples of one user. The sum of clipped contributions
    (σ = 0) over the data with and without user u differs by u's one clipped term: at most C, and
    exactly C (up to the 1e-6 of the clipping factor) when u's mean gradient is longer than C."""
    x, y = digits
    model = ScaledMLP().double()
    users = dirichlet_partition(y.numpy(), num_users=60, alpha=0.2, seed=0)
    m = 8
    batch = _all_users_batch(x, y, users, m)
    k = batch.num_users
    assert k == 60
    norms = _flat_norms(user_contributions(model, F.cross_entropy, *batch, k, max_grad_norm=1e9))
    clip = float(norms.median())  # some users clipped, some not
    full = _summed(model, *batch, k, clip)
    sizes = np.bincount(users)
    large = np.argsort(-sizes)[:4].tolist()  # users with many more than m examples
    small = [u for u in range(60) if sizes[u] <= m][:3]
    assert min(sizes[large]) > 5 * m and small, (sizes[large], small)
    checked_attained = checked_large_attained = 0
    for u in sorted({*large, *small, 0, 59}):
        keep = batch.segment != u
        segment = batch.segment[keep] - (batch.segment[keep] > u).long()  # the others, renumbered 0..k-2
        without = _summed(model, batch.x[keep], batch.y[keep], segment, k - 1, clip)
        distance = (full - without).norm().item()
        assert distance <= clip + 1e-6
        assert distance == pytest.approx(min(norms[u].item(), clip), rel=1e-5)  # u's clipped term
        if norms[u] > clip:  # attained
            checked_attained += 1
            checked_large_attained += u in large
    assert checked_attained >= 2 and checked_large_attained >= 1


def _flat_norms(per_user: dict[str, Tensor]) -> Tensor:
    return torch.stack([g.flatten(1).norm(dim=1) for g in per_user.values()], dim=1).norm(dim=1)


def test_user_contribution_is_the_clipped_mean_of_their_gradients(digits: tuple[Tensor, Tensor]) -> None:
    """Against a loop with plain autograd: the gradient of the mean loss over the user's examples (the
    mean of their per-example gradients), then clipped to C as a whole."""
    x, y = digits
    model = ScaledMLP(seed=1).double()
    users = dirichlet_partition(y.numpy(), num_users=12, alpha=1.0, seed=2)
    batch = _all_users_batch(x, y, users, m=6)
    unclipped = user_contributions(model, F.cross_entropy, *batch, batch.num_users, max_grad_norm=1e9)
    clip = float(_flat_norms(unclipped).median())  # some users clipped, some not
    got = user_contributions(model, F.cross_entropy, *batch, batch.num_users, clip)
    assert set(got) == {n for n, _ in model.named_parameters()}
    clipped = 0
    per_example_clipped_differs = False
    for s in range(batch.num_users):
        rows = batch.segment == s
        mean = _autograd(model, batch.x[rows], batch.y[rows])
        factor = min(1.0, clip / (mean.norm().item() + 1e-6))
        clipped += factor < 1
        expected = mean * factor
        assert torch.allclose(_flat({k: g[s] for k, g in got.items()}), expected, rtol=1e-9, atol=1e-12)
        # clipping each example, then averaging, is a different (example-level) rule
        per_example = torch.stack(
            [_autograd(model, xi[None], yi[None]) for xi, yi in zip(batch.x[rows], batch.y[rows], strict=True)]
        )
        scale = (clip / (per_example.norm(dim=1) + 1e-6)).clamp(max=1.0)
        per_example_clipped_differs |= not torch.allclose((per_example * scale[:, None]).mean(0), expected)
    assert 0 < clipped < batch.num_users  # some users clipped, some not
    assert per_example_clipped_differs


def _autograd(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The flat gradient of the mean cross-entropy of (x, y), by plain autograd."""
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    return torch.cat([g.flatten() for g in grads])


def test_noise_of_an_empty_batch(digits: tuple[Tensor, Tensor]) -> None:
    """No user sampled: the gradient is N(0, σ²C²)/(q·U) per coordinate."""
    model = nn.Linear(64, 10).double()
    sigma, clip, expected = 1.3, 0.7, 25.0
    generator = torch.Generator().manual_seed(0)
    empty_x, empty_y, empty_s = torch.zeros(0, 64).double(), torch.zeros(0, dtype=torch.int64), torch.zeros(0).long()
    draws = []
    for _ in range(100):
        grads = user_level_gradient(
            model, F.cross_entropy, empty_x, empty_y, empty_s, 0, clip, sigma, expected, generator=generator
        )
        assert {k: g.shape for k, g in grads.items()} == {k: p.shape for k, p in model.named_parameters()}
        draws.append(_flat(grads))
    noise = torch.cat(draws)  # 65,000 coordinates
    std = sigma * clip / expected
    assert abs(noise.mean().item()) < 5 * std / math.sqrt(len(noise))
    assert noise.std().item() == pytest.approx(std, rel=0.02)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_noisy_gradient_is_the_sum_plus_noise_over_expected_users(
    digits: tuple[Tensor, Tensor], device: torch.device
) -> None:
    x, y = digits
    model = ScaledMLP(seed=2).double().to(device)
    users = dirichlet_partition(y.numpy(), num_users=30, alpha=0.5, seed=1)
    batches = UserBatches(
        x, y, users, expected_users_per_step=10, max_examples_per_user=4, device=device,
        generator=device_generator(device, 3),
    )  # fmt: skip
    batch = next(b for b in batches if b.num_users > 0)
    sigma, clip = 0.8, 0.5
    summed = _summed(model, *batch, batch.num_users, clip)
    noise_generator = device_generator(device, 11)
    state = noise_generator.get_state()
    got = user_level_gradient(
        model, F.cross_entropy, *batch, batch.num_users, clip, sigma, batches.expected_users, generator=noise_generator
    )
    noise_generator.set_state(state)
    noise = torch.cat(
        [
            torch.randn(p.shape, generator=noise_generator, device=device, dtype=p.dtype).flatten()
            for p in model.parameters()
        ]
    )
    expected = (summed + sigma * clip * noise) / batches.expected_users
    assert torch.allclose(_flat(got), expected, rtol=1e-9, atol=1e-12)
    assert batches.expected_users == 10  # the config's users per step B, a public constant (issue 58, item 5)


def test_segments_are_checked_and_an_empty_one_contributes_zeros(digits: tuple[Tensor, Tensor]) -> None:
    x, y = digits[0][:6], digits[1][:6]
    model = ScaledMLP().double()
    segment = torch.tensor([0, 0, 2, 2, 2, 0])  # user 1 of 0..2 has no example in this batch
    got = user_contributions(model, F.cross_entropy, x, y, segment, 3, max_grad_norm=1e9)
    assert all(g.shape[0] == 3 and not g[1].any() for g in got.values())
    assert torch.allclose(_flat({k: g[2] for k, g in got.items()}), _autograd(model, x[2:5], y[2:5]))
    with pytest.raises(ValueError, match="segment ids"):
        user_contributions(model, F.cross_entropy, x, y, segment, 2, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="one segment id per input"):
        user_contributions(model, F.cross_entropy, x, y, segment[:5], 3, max_grad_norm=1.0)


def test_users_are_sampled_at_the_rate_of_the_users_the_ledger_priced() -> None:
    """priced_users (a black-box audit's canary users added to the plan's U): q = 1/ceil(U/B) and the
    steps of the priced U, and the expected users q·U that the noisy sum is divided by."""
    users = torch.arange(130)  # 100 priced users and 30 more
    g = torch.Generator().manual_seed(0)
    batches = UserBatches(torch.zeros(130, 1), torch.zeros(130, dtype=torch.int64), users, expected_users_per_step=10,
                          max_examples_per_user=1, device="cpu", generator=g, priced_users=100)  # fmt: skip
    assert batches.sample_rate == 0.1 and len(batches) == 10 and batches.expected_users == pytest.approx(10.0)
    assert batches.num_users == 130  # every user can be drawn
