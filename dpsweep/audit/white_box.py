"""White-box one-run audit of DP-SGD: Dirac gradient canaries inserted as per-example (per-unit)
gradients of the run's own step (:mod:`dpsweep.mechanisms.private_step`: Opacus's DP optimizer, the fused
step, user-level DP-SGD, a GAN's critic), scored on every step's released noisy gradient (Steinke, Nasr
& Jagielski 2023, §6, their white-box setting with Dirac canaries), in our own code.

    canaries = DiracCanaries(list(step.params.values()), count=1000, max_grad_norm=1.0, claimed=(q, sigma),
                             magnitude=100.0, seed=0)
    step.wrappers.append(PoissonCanaries(canaries, list(step.params), step.sample_rate))  # a PrivateStep
    canaries.active = True                      # while training: not during a memory probe
    ... train ...
    right = canaries.right_guesses(100, centred=False)  # the 50 highest scores guessed in, the 50 lowest out

**Canaries.** Canary k is one coordinate of the flattened trainable parameters (distinct coordinates,
drawn uniformly from the largest parameter tensor, or from all of them where it is smaller than m),
and is included with probability ½, both from the audit's own seeded generator. The largest tensor
is where the real examples' gradient is spread thinnest per coordinate, so it drowns the canaries
least (on digits' cnn, fc1's 16,384 weights: a correct run's mean bound at ε = 8 rose from 1.878 to
2.035 over 20 seeds, against coordinates drawn from every parameter; benchmarks/audit.py). An
included canary is a training example like the others: at each step it is in the batch independently
with the run's Poisson sample rate, and then its per-example gradient, ``magnitude`` at its
coordinate and 0 elsewhere, goes through the step's own clipping and noise with the real units'
(:meth:`PoissonCanaries.units`). Correct clipping brings it to norm C, the worst case an example can be;
broken clipping lets ``magnitude`` through.

**Scores.** The auditor sees every step's release: the clipped sum plus its noise, where an included
canary adds C at its coordinate each time it is sampled. A canary's score sums each step's
log-likelihood ratio of that coordinate (:class:`DiracCanaries`). The highest scores are guessed
included, the lowest excluded (:mod:`dpsweep.audit.bound` turns the count of right guesses into an ε
lower bound).

The canaries are extra training examples: the run's model and its accuracy are not those of a plain
run, so an audit run is not for release; its ledger is the run's ledger, unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dpsweep.audit.guesses import metrics, right_guesses, split_guesses
from dpsweep.data.resident import private_generator
from dpsweep.mechanisms.private_step import Release, StepWrapper
from dpsweep.privacy.ledger import Ledger

# The centred score reads the releases against the noise they show: σ̂ = 1.4826·median |x| of the
# centred releases (the median absolute deviation, scaled to a Gaussian's σ: Rousseeuw & Croux 1993,
# "Alternatives to the Median Absolute Deviation", JASA), floored where the releases show none.
MAD_TO_SIGMA = 1.4826
MIN_NOISE = 1e-6  # units of C
STATE_KEY = "dpsweep.audit"  # the audit's scores and generator in the optimizer's first param group (checkpoints)


class DiracCanaries:
    """m Dirac gradient canaries over ``params``, their inclusion bits and their scores.

    A canary's score sums, over the steps, the log-likelihood ratio of its coordinate's release x (in
    units of C) under "in this step's batch" against "not", for the mechanism the ledger claims: one
    Poisson-subsampled Gaussian step, log(1 − q + q·exp((2x − 1) / (2σ²))) (the privacy loss of
    the subsampled Gaussian, e.g. Zhu, Dong & Wang 2022, "Optimal Accounting of Differential Privacy via
    Characteristic Function", §5). It is the most powerful test of one step (Neyman–Pearson) where
    the other examples add nothing at the coordinate; q and σ are the claimed ones, so a run that
    noises or samples otherwise is tested against its claim. The score is taken twice
    (:func:`planned_tests`): on the releases as they are, and centred by each coordinate's median over the
    steps, which removes noise drawn once and reused (and the steady drift an included canary adds,
    so it is the weaker test of a correct run). The centred releases are read against the noise they
    show (σ̂, :data:`MAD_TO_SIGMA`), not the claimed σ: after reused noise is taken away, what is left
    is the other examples' gradient, far below σ, and a canary's step of C stands out of it (the
    test is still a function of the releases alone, so it stays valid whatever σ̂ comes to)."""

    def __init__(
        self,
        params: Sequence[Tensor],
        count: int,
        max_grad_norm: float,
        claimed: tuple[float, float],
        magnitude: float,
        seed: int,
    ) -> None:
        """``claimed``: (q, σ) of the ledger; ``magnitude``: a canary's gradient before clipping."""
        self.params, self.magnitude, self.max_grad_norm = params, magnitude, max_grad_norm
        self.sample_rate, self.noise_multiplier = claimed
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        if count > total:
            raise ValueError(f"{count} canaries need as many coordinates; the model has {total}")
        self.generator = private_generator("cpu", seed)  # every bit of the canary stream's seed
        largest = max(range(len(sizes)), key=lambda i: sizes[i])
        if sizes[largest] >= count:  # the largest tensor's coordinates: the data's gradient spread thinnest there
            start = sum(sizes[:largest])
            self.coordinates = start + torch.randperm(sizes[largest], generator=self.generator)[:count]
        else:
            self.coordinates = torch.randperm(total, generator=self.generator)[:count]
        self.included = torch.rand(count, generator=self.generator) < 0.5
        self.releases: list[Tensor] = []  # per step, each canary's coordinate of the release (units of C)
        # each canary's parameter and its coordinate in it, and each parameter's canaries (made once)
        starts = torch.tensor([0, *sizes]).cumsum(0)
        self.owner = torch.bucketize(self.coordinates, starts[1:], right=True)
        self.local = self.coordinates - starts[self.owner]
        self.members = [torch.nonzero(self.owner == i).flatten() for i in range(len(params))]
        self.active = False

    @property
    def count(self) -> int:
        return len(self.coordinates)

    def sample(self, rate: float) -> Tensor:
        """The canaries in this step's batch: each included one with probability ``rate``."""
        draws = torch.rand(self.count, generator=self.generator) < rate
        return torch.nonzero(draws & self.included).flatten()

    def rows(self, sampled: Tensor) -> list[Tensor]:
        """Per-example gradient rows of the ``sampled`` canaries, one tensor per parameter (len(sampled) × shape)."""
        rows = []
        owner, local = self.owner[sampled], self.local[sampled]
        for i, p in enumerate(self.params):
            row = torch.zeros(len(sampled), p.numel(), dtype=p.dtype, device=p.device)
            where = torch.nonzero(owner == i).flatten()
            row[where.to(p.device), local[where].to(p.device)] = self.magnitude
            rows.append(row.reshape(len(sampled), *p.shape))
        return rows

    def record(self, released: list[Tensor]) -> None:
        """Keep this step's release (one tensor per parameter) at each canary's coordinate, in units of C:
        read from the parameters that hold canaries only, not a copy of the whole gradient."""
        x = torch.empty(self.count, dtype=torch.float64)
        for members, g in zip(self.members, released, strict=True):
            if len(members):
                x[members] = g.detach().reshape(-1)[self.local[members].to(g.device)].to("cpu", torch.float64)
        self.releases.append(x / self.max_grad_norm)

    def scores(self, centred: bool) -> Tensor:
        """Each canary's score (see the class): the sum over the steps of each release's log-likelihood
        ratio, the releases first ``centred`` by their median over the steps or not."""
        if not self.releases:
            return torch.zeros(self.count, dtype=torch.float64)
        x = torch.stack(self.releases)
        q, sigma = self.sample_rate, self.noise_multiplier
        if centred:
            x = x - x.median(dim=0).values
            sigma = max(MAD_TO_SIGMA * float(x.abs().median()), MIN_NOISE)  # the noise the releases show
        return log_ratio(x, q, sigma).sum(dim=0)

    def right_guesses(self, guesses: int, centred: bool) -> int:
        """Of ``guesses`` guesses on the ``centred`` score or the raw one, the right ones: the highest half
        guessed included and the lowest half excluded, or, with a guess on every canary, each by the side
        of the scores' split it lies on (:func:`dpsweep.audit.guesses.split_guesses`)."""
        scores = self.scores(centred)
        if guesses >= self.count:
            return split_guesses(scores, self.included)
        return right_guesses(scores, self.included, guesses)

    def state(self) -> dict[str, Tensor]:
        """What a checkpoint keeps: the releases so far and the generator of the samples."""
        empty = torch.zeros(0, self.count, dtype=torch.float64)
        releases = torch.stack(self.releases) if self.releases else empty
        return {"releases": releases, "generator": self.generator.get_state()}

    def load(self, state: dict[str, Tensor]) -> None:
        self.releases = list(state["releases"].clone().unbind(0))
        self.generator.set_state(state["generator"])


def log_ratio(x: Tensor, sample_rate: float, noise_multiplier: float) -> Tensor:
    """Each release x's (units of C) log-likelihood ratio under "the canary is in this step's batch"
    against "not", for one Poisson-subsampled Gaussian step: log(1 − q + q·exp((2x − 1) / (2σ²)))
    (:class:`DiracCanaries`)."""
    q, sigma = sample_rate, noise_multiplier
    spike = math.log(q) + (2 * x - 1) / (2 * sigma**2)
    return torch.logaddexp(torch.full_like(x, math.log1p(-q)), spike)


def activate(canaries: DiracCanaries, optimizer: torch.optim.Optimizer) -> None:
    """Let ``canaries`` join the training steps (not a memory iteration's or a probe's), from the state
    ``optimizer``'s first param group holds (a resumed run's)."""
    group = optimizer.param_groups[0]
    if STATE_KEY in group:
        canaries.load(group[STATE_KEY])
    canaries.active = True


def deactivate(canaries: DiracCanaries, optimizer: torch.optim.Optimizer) -> None:
    """Stop ``canaries`` and keep their state in ``optimizer``'s first param group (saved with a checkpoint)."""
    canaries.active = False
    optimizer.param_groups[0][STATE_KEY] = canaries.state()


class PoissonCanaries(StepWrapper):
    """Dirac canaries in a Poisson-sampled private step (:class:`dpsweep.mechanisms.private_step.StepWrapper`):
    before each step, the sampled canaries' rows join the step's per-unit gradients, which the step clips,
    sums and noises as its own; after it, the noisy sum is recorded at the canaries' coordinates."""

    def __init__(self, canaries: DiracCanaries, names: Sequence[str], sample_rate: Callable[[], float]) -> None:
        """``names``: the trainable parameters' names, in the order of ``canaries.params``; ``sample_rate``:
        the step's real rate (a canary is in a step as often as a unit of the run is)."""
        self.canaries, self.names, self.sample_rate = canaries, list(names), sample_rate

    def units(self, step: int) -> dict[str, Tensor] | None:
        c = self.canaries
        if not c.active:
            return None
        return dict(zip(self.names, c.rows(c.sample(self.sample_rate())), strict=True))

    def released(self, release: Release) -> None:
        if self.canaries.active:
            self.canaries.record([release.noisy[name] * release.divisor for name in self.names])


def planned_tests(guesses: int, canaries: int) -> list[tuple[str, bool, int]]:
    """(score, centred, guesses) of each test: the raw score with ``guesses`` guesses, for a correct
    run's tightest bound, and both scores with a guess on every canary by the side of the scores' split
    it lies on, the most a bug that separates every canary can show (the centred one for reused noise). The centred
    score with few guesses is left out: it adds nothing either way (benchmarks/audit.py) and would cost
    every test confidence."""
    tests = [("raw", False, guesses), ("raw", False, canaries), ("centred", True, canaries)]
    return list(dict.fromkeys(tests))  # one test where guesses is every canary


def result(
    canaries: DiracCanaries, guesses: int, delta: float, confidence: float, claim: Ledger | None = None
) -> dict[str, float]:
    """The audit's metrics (:func:`dpsweep.audit.guesses.metrics`) for the tests of :func:`planned_tests`,
    read against the run's ledger ``claim`` too where it is given."""
    tests = {
        f"audit.correct_{name}_{r}": (r, canaries.right_guesses(r, centred))
        for name, centred, r in planned_tests(guesses, canaries.count)
    }
    return metrics(tests, canaries.count, guesses, delta, confidence, claim)
