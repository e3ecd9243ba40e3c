"""User-level differential privacy: users of a dataset, their Poisson batches, and the user-level
DP-SGD gradient (DP-FedSGD: DP-FedAvg with one local gradient step), with per-example gradients
from ``torch.func``.

    users = dirichlet_partition(labels, num_users=100, alpha=0.5, seed=0)  # or natural_users(ids)
    batches = UserBatches(x, y, users, expected_users_per_step=10, max_examples_per_user=16,
                          device=device, generator=device_generator(device, seed))
    for xb, yb, segment in batches:  # len(batches) steps per epoch, all on the device
        grads = user_level_gradient(model, F.cross_entropy, xb, yb, segment, segment_count(segment),
                                    max_grad_norm=1.0, noise_multiplier=1.1,
                                    expected_users=batches.expected_users)
        for name, p in model.named_parameters():
            p.grad = grads[name]
        optimizer.step()

What a run means (the config keys the integration uses; not yet wired into a task). The unit of
privacy is a *user*: two datasets are neighbours when one holds all the examples of one user more
than the other (add/remove one user, every example of them at once). Users come from

- ``natural``: the data carries a user id per example; :func:`natural_users` numbers the distinct ids
  0..U−1 in sorted order;
- ``partition``: ``dataset.num_users`` = K users (2 ≤ K ≤ N) drawn by :func:`dirichlet_partition` with
  label skew ``dataset.user_label_skew`` = α > 0, after Hsu, Qi & Brown 2019 ("Measuring the Effects of
  Non-Identical Data Distribution for Federated Visual Classification", arXiv:1909.06335), in the
  per-class form commonly implemented under their name (they phrase it per user, each user's class
  distribution drawn from a Dirichlet): for each class c, proportions p_c ~ Dir(α·1_K) over the K users,
  and class c's examples, in a seeded random order, are cut into K consecutive pieces of sizes
  ⌊n_c·(p_1+…+p_k)⌋ − ⌊n_c·(p_1+…+p_{k−1})⌋. Small α gives each user few classes; α → ∞ gives near-iid
  users. Every user is made non-empty by a deterministic fix-up (not a re-draw, which may never end when
  K is close to N): each empty user, in increasing id order, takes one example from the user that then
  holds the most (the smallest id on a tie), namely that user's example of the largest index. The
  partition is a pure function of (labels, K, α, seed): numpy's legacy ``RandomState`` distributions,
  whose streams numpy keeps fixed across versions (NEP 19), on a PCG64 seeded through
  ``SeedSequence(seed)``; Dir(α) is drawn in log space (log G(α) = log G(α+1) + log(U)/α, U ~ U(0, 1],
  normalised by a softmax), so that no α, however small, makes the proportions underflow to 0/0. Such
  users are a simulation: the guarantee below is about the users as assigned (the assignment, a function
  of the labels, is never released).

User-level DP-SGD (McMahan, Ramage, Talwar & Zhang, ICLR 2018, "Learning Differentially Private
Recurrent Language Models", arXiv:1710.06963, Algorithm 1 with flat clipping, equal user weights and
the fixed-denominator estimator f̃_f; each user's update is one gradient of their loss, as in
DP-FedSGD), at each step:

1. every user is included independently with probability q (:class:`UserBatches`); q follows the
   project's Opacus loader convention (:func:`dpsweep.privacy.schedule.poisson_schedule` with N = the number
   of users U and B = the expected users per step): q = 1 / ⌈U/B⌉ and ``int(1/q)`` steps per epoch
   (``dpsweep.privacy.schedule`` documents why ``int``: the accountant's rate 1/steps_per_epoch is then never
   below q);
2. of each sampled user, at most ``dp.max_examples_per_user`` = m examples are used, a uniformly random
   m-subset drawn by the batches' generator when the user has more (all of them otherwise); the user's
   contribution is the mean of those examples' gradients Δ_u, clipped as a whole to norm C over all
   trainable parameters: Δ_u · min(1, C / (‖Δ_u‖ + 1e-6)) (the 1e-6 as Opacus and dpsweep.tasks.gan.critic);
3. the clipped contributions are summed, N(0, σ²C²) is added per coordinate, and the sum is divided by
   B, the expected number of users per step of the config (public, not the realised count, nor q·U, a
   function of U: issue 58, item 5, cf. arXiv 2605.15648): an empty sample still
   releases pure noise, and the accountant counts the step.

Adding or removing one user changes the sum of step 3 by their one clipped term, of norm at most C,
whatever the number of their examples (tests/unit/data/test_users.py checks this on a real model), so ε is that
of DP-SGD with U in place of N: the same Poisson-subsampled Gaussian mechanism with rate q and noise
multiplier σ, over ``epochs · int(1/q)`` steps (``dpsweep.privacy.schedule.epsilon(poisson_schedule(U, B), ...)``),
and δ should be below 1/U. The choice of a user's m examples depends on no other user, and the
bound holds whichever examples are chosen. Models must be per-example
(no BatchNorm, as for Opacus); dropout is drawn per example (``vmap(randomness="different")``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dpsweep.errors import InputError
from dpsweep.privacy.schedule import PoissonSchedule, poisson_schedule

LossFn = Callable[[Tensor, Tensor], Tensor]  # (outputs of one example (1, ...), its label (1,)) -> scalar loss


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def check_users(num_users: Any, n_examples: int, alpha: Any) -> None:
    """Raise :class:`InputError` naming ``dataset.num_users`` unless 2 ≤ K ≤ N (an integer), or naming
    ``dataset.user_label_skew`` unless α is a positive, finite number."""
    if not _is_int(num_users) or not 2 <= num_users <= n_examples:
        raise InputError(
            "dataset.num_users",
            num_users,
            f"an integer number of users between 2 and the N={n_examples} training examples (each holds one or more)",
        )
    if (
        not isinstance(alpha, int | float | np.integer | np.floating)
        or isinstance(alpha, bool | np.bool_)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise InputError(
            "dataset.user_label_skew",
            alpha,
            "a positive, finite Dirichlet concentration α (small: each user holds few classes; large: near-iid users)",
        )


def check_max_examples(value: Any) -> None:
    """Raise :class:`InputError` naming ``dp.max_examples_per_user`` unless it is an integer ≥ 1."""
    if not _is_int(value) or value < 1:
        raise InputError(
            "dp.max_examples_per_user", value, "a positive integer: the most examples of one user used in a step"
        )


# ---------------------------------------------------------------------------------------------
# users
# ---------------------------------------------------------------------------------------------
def natural_users(user_ids: np.ndarray | Tensor | list[Any]) -> np.ndarray:
    """The data's own user ids, numbered 0..U−1 in the order of the sorted distinct ids (int64, one per example)."""
    ids = user_ids.cpu().numpy() if isinstance(user_ids, Tensor) else np.asarray(user_ids)
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"need a non-empty 1-D array of user ids, got shape {ids.shape}")
    _, inverse = np.unique(ids, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64)


def _log_dirichlet_proportions(rng: np.random.RandomState, alpha: float, k: int) -> np.ndarray:
    """p ~ Dir(α·1_k), computed from log-gammas (no underflow for small α): a softmax of
    log G(α+1) + log(U)/α, U ~ U(0, 1] (G(α+1)·U^(1/α) ~ Gamma(α))."""
    log_gamma = np.log(rng.standard_gamma(alpha + 1.0, size=k)) + np.log(1.0 - rng.random_sample(k)) / alpha
    weights = np.exp(log_gamma - log_gamma.max())
    proportions: np.ndarray = weights / weights.sum()
    return proportions


def dirichlet_partition(labels: np.ndarray | Tensor, num_users: int, alpha: float, seed: int) -> np.ndarray:
    """A user id (int64, 0..num_users−1, every user holding at least one example) for each example:
    Hsu et al. 2019's Dirichlet label skew (see the module docstring for the exact recipe and the
    non-empty fix-up). A pure function of (labels, num_users, α, seed)."""
    y = labels.cpu().numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"need 1-D labels, got shape {y.shape}")
    n = len(y)
    check_users(num_users, n, alpha)
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed={seed!r}: expected a non-negative integer")
    k = int(num_users)
    rng = np.random.RandomState(np.random.PCG64(np.random.SeedSequence(int(seed))))
    users = np.empty(n, dtype=np.int64)
    classes, class_of = np.unique(y, return_inverse=True)
    class_of = class_of.reshape(-1)
    for c in range(len(classes)):
        members = np.flatnonzero(class_of == c)  # in index order, then shuffled: independent of how y is stored
        members = members[rng.permutation(len(members))]
        p = _log_dirichlet_proportions(rng, float(alpha), k)
        cuts = np.clip(np.floor(np.cumsum(p)[:-1] * len(members)).astype(np.int64), 0, len(members))
        for user, piece in enumerate(np.split(members, cuts)):
            users[piece] = user
    _fill_empty_users(users, k)
    return users


def _fill_empty_users(users: np.ndarray, k: int) -> None:
    """In place: each empty user, in increasing id order, takes the largest-index example of the user
    then holding the most (smallest id on a tie). Since N ≥ k, that donor holds two or more."""
    counts = np.bincount(users, minlength=k)
    empty = np.flatnonzero(counts == 0)
    if len(empty) == 0:
        return
    order = np.argsort(users, kind="stable")  # examples grouped by user, in index order
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    heap = [(-int(counts[u]), int(u)) for u in range(k) if counts[u] > 0]
    heapq.heapify(heap)
    for user in empty:
        negative, donor = heapq.heappop(heap)
        held = -negative
        example = order[starts[donor] + held - 1]  # the donor's largest index not yet given away
        users[example] = user
        heapq.heappush(heap, (-(held - 1), donor))
        heapq.heappush(heap, (-1, int(user)))


def check_user_ids(users: Tensor) -> int:
    """U, the number of users, for ids that number every user 0..U−1 with at least one example each
    (what :func:`natural_users` and :func:`dirichlet_partition` return); ``ValueError`` otherwise."""
    if users.ndim != 1 or len(users) == 0 or users.dtype.is_floating_point or users.dtype == torch.bool:
        raise ValueError(f"need a non-empty 1-D integer tensor of user ids, got {users.dtype} {tuple(users.shape)}")
    if int(users.min()) < 0:
        raise ValueError("user ids must be 0..U-1: number them with natural_users")
    counts = torch.bincount(users)
    if bool((counts == 0).any()):
        raise ValueError("every user id 0..U-1 must hold an example: number them with natural_users")
    return len(counts)


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------
class UserBatch(NamedTuple):
    """One step's examples: inputs, labels and each example's user index within the batch (0..b−1,
    non-decreasing: the b sampled users in increasing user id)."""

    x: Tensor
    y: Tensor
    segment: Tensor

    @property
    def num_users(self) -> int:
        """b, the number of users sampled in this step (each contributes at least one example)."""
        return segment_count(self.segment)


def segment_count(segment: Tensor) -> int:
    """The number of users in a batch whose non-decreasing segment ids are 0..b−1 (0 for an empty batch)."""
    return int(segment[-1]) + 1 if len(segment) else 0


class UserBatches:
    """Poisson-sampled users of device-resident ``x``, ``y`` (the user-level analogue of
    :class:`dpsweep.data.resident.PoissonBatches`).

    ``users`` numbers each example's user 0..U−1 (every user non-empty). Each step includes every user
    independently with probability q = ``schedule.inclusion_probability`` = 1/⌈U/B⌉, B =
    ``expected_users_per_step``; one epoch (one ``iter``) yields ``len(self) = schedule.steps_per_epoch
    = int(1/q)`` steps. A sampled user brings all their examples when they have at most
    ``max_examples_per_user`` = m, else a uniformly random m-subset. ``generator`` must be on ``device``
    and carries all the sampling state: save ``generator.get_state()`` with a checkpoint and
    ``set_state`` it back to replay the same batches.

    Each step draws U uniforms (the users' inclusion) and, when some user holds more than m
    examples, one uniform per example of the sampled users (their order: the m smallest are kept).
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        users: Tensor | np.ndarray,
        *,
        expected_users_per_step: int,
        max_examples_per_user: int,
        device: torch.device | str,
        generator: torch.Generator,
        priced_users: int | None = None,
    ) -> None:
        check_max_examples(max_examples_per_user)
        device = torch.device(device)
        if generator.device.type != device.type or (
            generator.device.index is not None and device.index is not None and generator.device.index != device.index
        ):
            raise ValueError(f"generator is on {generator.device} but sampling runs on {device}")
        user_ids = torch.as_tensor(users).to(device=device, dtype=torch.int64)
        if not len(x) == len(y) == len(user_ids):
            raise ValueError(f"need one label and one user per input, got {len(x)}, {len(y)} and {len(user_ids)}")
        num_users = check_user_ids(user_ids)
        if not _is_int(expected_users_per_step) or not 0 < expected_users_per_step <= num_users:
            raise ValueError(
                f"expected_users_per_step={expected_users_per_step!r}: expected an integer in 1..U={num_users}"
            )
        self.x = x.to(device)
        self.y = y.to(device)
        self.users = user_ids
        self.device = device
        self.generator = generator
        self.max_examples_per_user = int(max_examples_per_user)
        # q and the steps of the U users the ledger priced (``priced_users``: a black-box audit's canary
        # users are sampled at the plain run's q), else of these
        self.priced_users = num_users if priced_users is None else priced_users
        self.expected_users_per_step = int(expected_users_per_step)
        self.schedule: PoissonSchedule = poisson_schedule(self.priced_users, self.expected_users_per_step)
        self.sample_rate = self.schedule.inclusion_probability
        # examples grouped by user (index order within a user), where each user starts, and how many
        self.order = torch.argsort(user_ids, stable=True)
        self.counts = torch.bincount(user_ids, minlength=num_users)
        self.starts = torch.cumsum(self.counts, 0) - self.counts
        self.needs_choice = int(self.counts.max()) > self.max_examples_per_user

    @property
    def num_users(self) -> int:
        """U, the number of users sampled from."""
        return len(self.counts)

    @property
    def expected_users(self) -> float:
        """B = ``expected_users_per_step``, what :func:`user_level_gradient` divides by: a public constant,
        not q·U of the priced U (q·U = U/⌈U/B⌉ ≤ B is a function of U; issue 58, item 5, cf. arXiv
        2605.15648). Post-processing of the noisy sum: q and the ledger are U's."""
        return float(self.expected_users_per_step)

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    def __iter__(self) -> Iterator[UserBatch]:
        for _ in range(len(self)):
            yield self.sample()

    def sample(self) -> UserBatch:
        """One step's batch (what each iteration yields)."""
        mask = torch.rand(self.num_users, generator=self.generator, device=self.device) < self.sample_rate
        sampled = mask.nonzero().squeeze(1)
        counts = self.counts[sampled]
        segment = torch.repeat_interleave(torch.arange(len(sampled), device=self.device), counts)
        first = torch.cumsum(counts, 0) - counts  # each sampled user's first row in the batch
        rank = torch.arange(len(segment), device=self.device) - first[segment]  # position within the user
        examples = self.order[self.starts[sampled][segment] + rank]
        if self.needs_choice and len(segment):
            key = torch.rand(len(segment), generator=self.generator, device=self.device)
            by_key = torch.argsort(key)
            shuffled = by_key[torch.argsort(segment[by_key], stable=True)]  # each user's rows in random order
            keep = rank < self.max_examples_per_user  # rank of a row of `shuffled` within its (sorted) user
            examples, segment = examples[shuffled][keep], segment[keep]
        return UserBatch(self.x[examples], self.y[examples], segment)


# ---------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------
def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """Each row's clipping factor min(1, C / (‖g‖ + 1e-6)) for its norm ‖g‖ (Opacus's flat clipping, its
    1e-6 included): every clipped row of dpsweep's own steps (users, DP-FTRL, the fused step, the GAN's critic)."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


def per_example_gradients(
    model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, *, chunk_size: int | None = None
) -> dict[str, Tensor]:
    """Each example's gradient of ``loss_fn(model(x_i), y_i)`` with respect to the model's trainable
    parameters, ``{name: (n, *shape)}``, by ``vmap`` over ``grad`` with ``functional_call`` (buffers
    passed, not trained). ``chunk_size`` bounds how many examples ``vmap`` holds at once."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = {k: b.detach() for k, b in model.named_buffers()}

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out: Tensor = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    grads = vmap(grad(loss), in_dims=(None, 0, 0), randomness="different", chunk_size=chunk_size)(params, x, y)
    return dict(grads)


def _check_segments(x: Tensor, y: Tensor, segment: Tensor, num_segments: int, max_grad_norm: float) -> None:
    if not len(x) == len(y) == len(segment) or segment.ndim != 1:
        raise ValueError(f"need one label and one segment id per input, got {len(x)}, {len(y)} and {len(segment)}")
    if num_segments < 0 or (len(segment) and num_segments == 0):
        raise ValueError(f"num_segments={num_segments}: expected the number of users in the batch")
    if segment.dtype.is_floating_point or segment.dtype == torch.bool:
        raise ValueError(f"segment ids must be integers, got {segment.dtype}")
    if len(segment) and not 0 <= int(segment.min()) <= int(segment.max()) < num_segments:
        raise ValueError(f"segment ids must lie in 0..{num_segments - 1} (num_segments={num_segments})")
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm}: expected a positive, finite C")


def user_contributions(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    segment: Tensor,
    num_segments: int,
    max_grad_norm: float,
    *,
    chunk_size: int | None = None,
    extra: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Each user's clipped contribution ``{name: (num_segments, *shape)}``: the mean Δ_u of the
    per-example gradients of the examples with ``segment == u`` (ids 0..num_segments−1), scaled by
    min(1, C / (‖Δ_u‖ + 1e-6)), the norm flat over all trainable parameters. A segment id with no
    example contributes zeros. ``extra``: more units' contributions before clipping, ``{name: (k, *shape)}``
    (a white-box audit's canaries, ``dpsweep.mechanisms.private_step``), clipped as the users' are and
    returned after them (num_segments + k rows)."""
    _check_segments(x, y, segment, num_segments, max_grad_norm)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    if len(x) == 0 and extra is None:
        return {k: p.new_zeros((num_segments, *p.shape)) for k, p in params.items()}
    if len(x) == 0:
        means = {k: p.new_zeros((num_segments, *p.shape)) for k, p in params.items()}
    elif num_segments == len(x) and bool((segment == torch.arange(len(x), device=segment.device)).all()):
        # one example per segment (example-level DP-FTRL): each is its own mean
        means = per_example_gradients(model, loss_fn, x, y, chunk_size=chunk_size)
    else:
        means = _segment_means(per_example_gradients(model, loss_fn, x, y, chunk_size=chunk_size), segment,
                               num_segments)  # fmt: skip
    if extra is not None:
        means = {k: torch.cat([m, extra[k].to(m.device, m.dtype)]) for k, m in means.items()}
    norms = torch.stack([m.flatten(1).norm(2, dim=1) for m in means.values()], dim=1).norm(2, dim=1)
    factor = clip_factors(norms, max_grad_norm)
    return {k: m * factor.to(m.dtype).view(-1, *([1] * (m.ndim - 1))) for k, m in means.items()}


def _segment_means(per_example: dict[str, Tensor], segment: Tensor, num_segments: int) -> dict[str, Tensor]:
    """The mean per-example gradient of each segment ``{name: (num_segments, *shape)}`` (zeros for an empty one)."""
    first = next(iter(per_example.values()))
    # (num_segments, n): row u averages user u's examples. A matmul rather than index_add_, which is
    # slow on CPU and adds in a nondeterministic order on CUDA.
    members = segment.to(first.device).unsqueeze(0) == torch.arange(num_segments, device=first.device).unsqueeze(1)
    average = members.to(first.dtype)
    average /= average.sum(dim=1, keepdim=True).clamp(min=1)
    return {k: (average @ g.flatten(1)).view(num_segments, *g.shape[1:]) for k, g in per_example.items()}


def user_level_gradient(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    segment: Tensor,
    num_segments: int,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_users: float,
    generator: torch.Generator | None = None,
    *,
    chunk_size: int | None = None,
) -> dict[str, Tensor]:
    """The noisy user-level gradient of one step ``{name: shape}``: the users' clipped contributions
    (:func:`user_contributions`) summed, N(0, σ²C²) added per coordinate, divided by the expected
    number of users B (public). An empty batch (no user sampled) gets the noise alone. ``generator``, on the
    parameters' device, draws the noise (the default generator when ``None``)."""
    return user_level_release(
        model, loss_fn, x, y, segment, num_segments, max_grad_norm, noise_multiplier, expected_users, generator,
        chunk_size=chunk_size,
    )[1]  # fmt: skip


def user_level_release(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    segment: Tensor,
    num_segments: int,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_users: float,
    generator: torch.Generator | None = None,
    *,
    chunk_size: int | None = None,
    extra: dict[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """:func:`user_level_gradient` and the clipped sum it noised, both over B: ``(clipped, noisy)``.
    ``extra``: more units' contributions, clipped and summed with the users' before the noise
    (:func:`user_contributions`)."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier={noise_multiplier}: expected a finite σ >= 0")
    if not (math.isfinite(expected_users) and expected_users > 0):
        raise ValueError(f"expected_users={expected_users}: expected the positive, public B")
    contributions = user_contributions(
        model, loss_fn, x, y, segment, num_segments, max_grad_norm, chunk_size=chunk_size, extra=extra
    )
    std = noise_multiplier * max_grad_norm
    clipped, noisy = {}, {}
    for k, c in contributions.items():
        summed = c.sum(dim=0)
        noise = torch.randn(summed.shape, generator=generator, device=summed.device, dtype=summed.dtype)
        clipped[k] = summed / expected_users
        noisy[k] = (summed + std * noise) / expected_users
    return clipped, noisy
