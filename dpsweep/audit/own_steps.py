"""White-box one-run audit of the DP steps that noise their own gradients (``dpsweep.mechanisms.functional``:
user-level DP-SGD, the fused step, and DP-FTRL at example or user level), with Dirac canaries as in
:mod:`dpsweep.audit.white_box` (Steinke, Nasr & Jagielski 2023, §6), in our own code.

    canaries = PoissonCanaries(DiracCanaries(params, 1000, C, (q, sigma), 100 * C, seed=0), names,
                               clip=C, sample_rate=lambda: batches.sample_rate)
    own.hooks.append(canaries)       # OwnSteps calls gradient(...) before each step, stepped() after it
    canaries.canaries.active = True  # while training
    ... train ...
    white_box.result(canaries.canaries, 100, delta, 0.95)

**A canary is one more unit** (an example at example level, a user at user level), included with
probability ½. Its contribution, ``magnitude`` at its coordinate and 0 elsewhere, is clipped by the
run's own clipping factor (:func:`dpsweep.data.users.clip_factors`, at the C the steps clip with) and
added to the step's clipped sum; the step's noise is independent of it, so adding the contribution
to the noisy sum (over the step's divisor) is the same release as adding it before the noise.

- **Poisson-sampled steps** (:class:`PoissonCanaries`: user-level DP-SGD, the fused step): an
  included canary is in a step's batch independently with the batches' real sample rate. The auditor
  sees each step's noisy gradient; a canary is scored as in :class:`~dpsweep.audit.white_box.DiracCanaries`
  (the claimed subsampled Gaussian's log-likelihood ratio, summed over the steps).
- **DP-FTRL** (:class:`TreeCanaries`): nothing is sampled. Each canary has a seeded place in the
  fixed order: it is in the same batch of every epoch, as a unit of the run is, and an excluded canary
  is the "zero" record of DP-FTRL's neighbouring relation (replace-one-with-zero; Kairouz et al. 2021,
  Definition 1.1). The auditor sees the model after every step. From θ_t it recovers the released
  noisy prefix sums P_t = G_t + N_t (θ_t = θ_0 − lr·m_t, m_t = γ·m_{t−1} + P_t, the FTRL optimizer's
  update) and from them every node of the tree: node [t − 2^h + 1, t] (h the trailing zero bits of t)
  is P_t − P_{t−2^h}, the sum of its steps' gradients plus its own N(0, σ²C²) noise, independent of
  the other nodes'. A canary in c_I of node I's steps shifts it by c_I (units of C), so its score is the
  claimed Gaussian nodes' log-likelihood ratio Σ_I c_I (x_I − c_I/2) / σ². A tree after a restart
  starts from a baseline that is seen only where it equals the last prefix sum (no tree completion,
  or a completed tree that needed no virtual step); otherwise its nodes that start at its first step
  are left out. Any score of what the auditor sees is sound; this one is the most powerful test of a
  canary where the real units add nothing at its coordinate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dpsweep.audit.white_box import DiracCanaries
from dpsweep.data import users


class PoissonCanaries:
    """Dirac canaries inserted in Poisson-sampled steps of their own (user-level DP-SGD, the fused step)
    and recorded from each step's noisy gradient: an ``OwnSteps`` hook."""

    def __init__(
        self, canaries: DiracCanaries, names: Sequence[str], clip: float, sample_rate: Callable[[], float]
    ) -> None:
        """``names``: the trainable parameters' names, in the order of ``canaries.params``; ``clip``: the C
        the steps clip with; ``sample_rate``: the batches' real rate."""
        self.canaries, self.names, self.clip, self.sample_rate = canaries, list(names), clip, sample_rate

    def gradient(self, grads: dict[str, Tensor], divisor: float, step: int) -> None:
        """Add the sampled canaries' clipped contributions to this step's noisy gradient (over
        ``divisor``, as the step divides its sum), then record the release in units of C."""
        c = self.canaries
        if not c.active:
            return
        add_contributions(c, grads, self.names, c.sample(self.sample_rate()), self.clip, divisor)
        c.record([grads[name] * divisor for name in self.names])

    def stepped(self, step: int) -> None:
        return None


def add_contributions(
    canaries: DiracCanaries,
    grads: dict[str, Tensor],
    names: Sequence[str],
    sampled: Tensor,
    clip: float,
    divisor: float,
) -> None:
    """Add each ``sampled`` canary's contribution, its row clipped to ``clip`` by the run's clipping factor,
    over ``divisor``, to ``grads`` in place."""
    if not len(sampled):
        return
    norm = torch.tensor(canaries.magnitude, dtype=torch.float64)
    value = float(canaries.magnitude * users.clip_factors(norm, clip)) / divisor
    owner, local = canaries.owner[sampled], canaries.local[sampled]
    for i, name in enumerate(names):
        where = torch.nonzero(owner == i).flatten()
        if len(where):
            g = grads[name]
            flat = g.reshape(-1).clone()
            flat[local[where].to(g.device)] += value
            grads[name] = flat.reshape(g.shape)


class TreeCanaries(DiracCanaries):
    """Dirac canaries at seeded places in DP-FTRL's fixed order, scored on the tree's nodes recovered from
    the model after every step (module doc): an ``OwnSteps`` hook.

    ``steps_per_epoch``: b; ``tree_starts``: the first step (0-based) of each tree, 0 first;
    ``completion``: trees are completed before a restart; ``lr``, ``momentum``: the FTRL optimizer's;
    ``divisor``: B, the public constant the clipped sum is divided by."""

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
        clip: float,
        steps_per_epoch: int,
        tree_starts: Sequence[int],
        completion: bool,
        lr: float,
        momentum: float,
        divisor: float,
    ) -> None:
        super().__init__(params, count, max_grad_norm, (1.0, noise_multiplier), magnitude, seed)
        self.position = torch.randint(steps_per_epoch, (count,), generator=self.generator)
        self.names, self.clip, self.steps_per_epoch = list(names), clip, steps_per_epoch
        self.tree_starts, self.completion = list(tree_starts), completion
        self.lr, self.momentum, self.divisor = lr, momentum, divisor
        self.initial: Tensor | None = None  # θ_0 at the canaries' coordinates

    def gradient(self, grads: dict[str, Tensor], divisor: float, step: int) -> None:
        """Add the included canaries whose place is this step's batch (``step`` 0-based in the run)."""
        if not self.active:
            return
        if self.initial is None:
            self.initial = self._read()
        here = torch.nonzero(self.included & (self.position == step % self.steps_per_epoch)).flatten()
        add_contributions(self, grads, self.names, here, self.clip, divisor)

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
