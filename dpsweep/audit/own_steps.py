"""White-box one-run audit of DP-FTRL (``dpsweep.mechanisms.functional``, example or user level), with
Dirac canaries as in :mod:`dpsweep.audit.white_box` (Steinke, Nasr & Jagielski 2023, §6), in our own code.

    canaries = TreeCanaries(list(step.params.values()), 1000, C, sigma, 100 * C, seed=0,
                            names=list(step.params), order=step.fixed_order)
    step.wrappers.append(canaries)   # a PrivateStep: its units before each step, the model after it
    canaries.active = True           # while training
    ... train ...
    white_box.result(canaries, 100, delta, 0.95)

**A canary is one more unit** (an example at example level, a user at user level), included with
probability ½. Its row, ``magnitude`` at its coordinate and 0 elsewhere, joins the step's per-unit
gradients (:meth:`TreeCanaries.units`), so the step clips it with its own clipping, sums it with the
real units' and its tree noises the sum (the Poisson-sampled steps' canaries, user-level DP-SGD's and the
fused step's, are :class:`dpsweep.audit.white_box.PoissonCanaries`).

Nothing is sampled. Each canary has a seeded place in the fixed order: it is in the same batch of
every epoch, as a unit of the run is, and an excluded canary is the "zero" record of DP-FTRL's
neighbouring relation (replace-one-with-zero; Kairouz et al. 2021, Definition 1.1). The auditor sees
the model after every step. From θ_t it recovers the released noisy prefix sums P_t = G_t + N_t
(θ_t = θ_0 − lr·m_t, m_t = γ·m_{t−1} + P_t, the FTRL optimizer's update) and from them every node of the
tree: node [t − 2^h + 1, t] (h the trailing zero bits of t) is P_t − P_{t−2^h}, the sum of its steps'
gradients plus its own N(0, σ²C²) noise, independent of the other nodes'. A canary in c_I of node I's
steps shifts it by c_I (units of C), so its score is the claimed Gaussian nodes' log-likelihood ratio
Σ_I c_I (x_I − c_I/2) / σ². A tree after a restart starts from a baseline that is seen only where it
equals the last prefix sum (no tree completion, or a completed tree that needed no virtual step);
otherwise its nodes that start at its first step are left out. Any score of what the auditor sees is
sound; this one is the most powerful test of a canary where the real units add nothing at its
coordinate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpsweep.audit.white_box import DiracCanaries
from dpsweep.mechanisms.private_step import FixedOrder, StepWrapper


class TreeCanaries(DiracCanaries, StepWrapper):
    """Dirac canaries at seeded places in DP-FTRL's fixed order, scored on the tree's nodes recovered from
    the model after every step (module doc): a step's wrapper. ``order``: how DP-FTRL's steps go (b steps an
    epoch, its trees' first steps, their completion, its optimizer's lr and momentum, and B, the public
    constant the clipped sum is divided by)."""

    def __init__(
        self,
        params: Sequence[Tensor],
        count: int,
        max_grad_norm: float,
        noise_multiplier: float,
        magnitude: float,
        seed: int,
        *,
        names: Sequence[str],
        order: FixedOrder,
    ) -> None:
        super().__init__(params, count, max_grad_norm, (1.0, noise_multiplier), magnitude, seed)
        self.steps_per_epoch = order.steps_per_epoch
        self.position = torch.randint(self.steps_per_epoch, (count,), generator=self.generator)
        self.names = list(names)
        self.tree_starts, self.completion = list(order.tree_starts), order.completion
        self.lr, self.momentum, self.divisor = order.lr, order.momentum, order.divisor
        self.initial: Tensor | None = None  # θ_0 at the canaries' coordinates

    def units(self, step: int) -> dict[str, Tensor] | None:
        """The rows of the included canaries whose place is this step's batch (``step`` 0-based in the run)."""
        if not self.active:
            return None
        if self.initial is None:
            self.initial = self._read()
        here = torch.nonzero(self.included & (self.position == step % self.steps_per_epoch)).flatten()
        return dict(zip(self.names, self.rows(here), strict=True))

    def stepped(self, step: int) -> None:
        """Record θ after the step, at the canaries' coordinates."""
        if self.active:
            self.releases.append(self._read())

    def _read(self) -> Tensor:
        x = torch.empty(self.count, dtype=torch.float64)
        for members, p in zip(self.members, self.params, strict=True):
            if len(members):
                x[members] = p.detach().reshape(-1)[self.local[members].to(p.device)].to("cpu", torch.float64)
        return x

    def prefix_sums(self) -> Tensor:
        """P_t (steps × canaries, units of C) from θ_t: m_t = (θ_0 − θ_t)/lr, P_t = m_t − γ·m_{t−1}, times B/C."""
        if not self.releases or self.initial is None:
            return torch.zeros(0, self.count, dtype=torch.float64)
        m = (self.initial - torch.stack(self.releases)) / self.lr
        previous = torch.cat([torch.zeros_like(m[:1]), m[:-1]])
        return (m - self.momentum * previous) * self.divisor / self.max_grad_norm

    def nodes(self) -> tuple[Tensor, Tensor]:
        """Every node the releases so far show: its values (nodes × canaries, units of C) and, for each
        canary, how many of its steps hold the canary's place (nodes × canaries): its shift of the node
        if it is included."""
        p = self.prefix_sums()
        steps = len(p)
        starts = [s for s in self.tree_starts if s < steps]
        values, counts = [], []
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else steps
            length = start - starts[i - 1] if i else 0
            known = i == 0 or not self.completion or length & (length - 1) == 0
            base = torch.zeros(self.count, dtype=torch.float64) if i == 0 else p[start - 1]
            for t in range(1, end - start + 1):  # the tree's local steps 1..L
                span = t & -t  # 2^h, h the trailing zero bits of t
                if t == span and not known:
                    continue
                below = base if t == span else p[start + t - span - 1]
                values.append(p[start + t - 1] - below)
                counts.append(self._in_steps(t - span + 1, t))
        if not values:
            empty = torch.zeros(0, self.count, dtype=torch.float64)
            return empty, empty
        return torch.stack(values), torch.stack(counts)

    def _in_steps(self, first: int, last: int) -> Tensor:
        """For each canary, how many of the tree's local steps first..last (1-based) hold its place (a tree
        starts at an epoch's first step, so local step u is the epoch's step (u − 1) mod b)."""
        b, s = self.steps_per_epoch, self.position.to(torch.float64)

        def below(x: int) -> Tensor:  # local steps u <= x with (u - 1) mod b == s
            return torch.clamp(torch.floor((x - 1 - s) / b) + 1, min=0)

        return below(last) - below(first - 1)

    def scores(self, centred: bool) -> Tensor:
        """Each canary's log-likelihood ratio over the nodes (in its place against not), their values first
        ``centred`` by each coordinate's median over the nodes or not (noise drawn once and reused is the
        same in every node)."""
        values, c = self.nodes()
        if not len(values):
            return torch.zeros(self.count, dtype=torch.float64)
        if centred:
            values = values - values.median(dim=0).values
        return (c * (values - c / 2)).sum(dim=0) / self.noise_multiplier**2

    def state(self) -> dict[str, Tensor]:
        initial = self.initial if self.initial is not None else torch.zeros(0, dtype=torch.float64)
        return super().state() | {"initial": initial}

    def load(self, state: dict[str, Tensor]) -> None:
        super().load(state)
        self.initial = state["initial"].clone() if len(state["initial"]) else None
