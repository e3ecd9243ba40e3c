"""DP-FTRL, the mechanism: tree-aggregation noise (:class:`TreeAggregator`) and the FTRL optimizer with
heavy-ball momentum (:class:`FTRLOptimizer`). Its privacy is planned by :mod:`dpsweep.mechanisms.dpftrl_accounting`
(no torch there).

    import torch
    from dpsweep.mechanisms.ftrl import FTRLOptimizer, TreeAggregator
    from dpsweep.mechanisms.dpftrl_accounting import restart_after_epoch

    tree = TreeAggregator.for_params(model.parameters(), std=noise_multiplier * clip,
                                     generator=torch.Generator(device).manual_seed(seed), tree_completion=True)
    opt = FTRLOptimizer(model.parameters(), lr=0.5, momentum=0.9, noise=tree)
    for epoch in range(1, epochs + 1):
        for batch in batches:  # the same order in every epoch of a tree
            opt.zero_grad()
            ...  # p.grad = the SUM of the step's per-example gradients, each clipped to `clip`
            opt.step()
        if restart_after_epoch(epoch, epochs, restart_every):
            opt.restart()

Kairouz, McMahan, Song, Thakkar, Thakurta & Xu, ICML 2021, "Practical and Private (Deep) Learning
without Sampling or Shuffling" (arXiv:2103.00039); reference implementation google-research/DP-FTRL
(PyTorch): ``ftrl_noise.py`` (``CummuNoiseTorch``) and ``optimizers.py`` (``FTRLOptimizer``), driven by
``main.py``.

Tree aggregation (the paper's Algorithm 1 and its tree subroutines; Dwork, Naor, Pitassi & Rothblum
2010, Chan, Shi & Song 2011): a binary tree over the steps 1, 2, ... of the current tree; node
[t − 2^h + 1, t] (h the number of trailing zero bits of t) gets noise N(0, std²) drawn once, at step
t, and kept while it is part of a prefix; the noise of the prefix sum 1..t is the sum of the nodes of
the dyadic decomposition of [1, t], one per 1 bit of t, so its variance is popcount(t)·std². Only the
O(log t) nodes of the current prefix are kept, with their running sum (as ``CummuNoiseTorch`` does).
Tree completion (``proceed_until`` in the reference): before a restart, virtual steps (noise only)
complete the tree up to the next power of two, so that the noise folded into the next tree is that of
the root alone (variance std²) rather than of popcount(t) nodes. The Honaker (2015) estimator of the
reference's ``CummuNoiseEffTorch`` is not implemented.

FTRL, exactly as the reference's ``FTRLOptimizer.step`` (the paper's Algorithm 1, θ_t the minimiser of
⟨m_t, θ⟩ + (λ/2)‖θ − θ_0‖², with its momentum variant DP-FTRLM; lr = 1/λ): with G_t the sum of the
(clipped, summed) gradients of steps 1..t and N_t the tree's prefix noise,

    momentum γ = 0:  θ_t = θ_0 − lr·(G_t + N_t)
    momentum γ > 0:  m_t = γ·m_{t−1} + (G_t + N_t);  θ_t = θ_0 − lr·m_t

At a restart (the reference's ``FTRLOptimizer.restart``), the noise of the tree's last prefix (of the
completed tree's root with tree completion) is added to G, so the model carries on from the released
noisy sum, and the next tree starts from zero noise; m and θ_0 are kept.

The optimizer's state (G, the raw sum of the clipped gradients, and the tree's noise) is *not* private:
only the parameters are released. Keep checkpoints as private as the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import ParamsT


class TreeAggregator:
    """The noise of tree aggregation for tensors of ``shapes``: :meth:`advance` takes one step and returns
    the noise of the prefix sum of the current tree's steps 1..t (see the module docstring).

    Node noise is N(0, ``std``²) per coordinate (std = σ·C for sums of gradients clipped to C), drawn
    from ``generator`` on its own device, in ``dtype``, then moved to ``device`` (the generator's by
    default): the same seed gives the same noise wherever it is moved. ``tree_completion`` completes the
    tree before each :meth:`restart`."""

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        std: float,
        generator: torch.Generator,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        tree_completion: bool = False,
    ) -> None:
        if not (0 <= std < math.inf):
            raise ValueError(f"the noise std of a tree node must be finite and >= 0, got {std}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.std = float(std)
        self.generator = generator
        self.device = torch.device(device) if device is not None else generator.device
        self.dtype = dtype
        self.tree_completion = bool(tree_completion)
        self.step = 0  # steps of the current tree, virtual ones included
        self.restarts = 0  # trees done
        self._nodes: dict[int, list[torch.Tensor]] = {}  # level h -> noise of the prefix's node at h
        self._sum = self._zeros()

    @classmethod
    def for_params(
        cls,
        params: Iterable[torch.Tensor],
        std: float,
        generator: torch.Generator,
        *,
        tree_completion: bool = False,
    ) -> TreeAggregator:
        """An aggregator for these parameters, in their order, on the first one's device and dtype."""
        tensors = list(params)
        if not tensors:
            raise ValueError("no parameters")
        return cls(
            [p.shape for p in tensors], std, generator,
            device=tensors[0].device, dtype=tensors[0].dtype, tree_completion=tree_completion,
        )  # fmt: skip

    # -----------------------------------------------------------------------------------------
    def _zeros(self) -> list[torch.Tensor]:
        return [torch.zeros(s, device=self.device, dtype=self.dtype) for s in self.shapes]

    def _draw(self) -> list[torch.Tensor]:
        if self.std == 0:
            return self._zeros()
        g = self.generator
        return [
            torch.randn(s, generator=g, device=g.device, dtype=self.dtype).mul_(self.std).to(self.device)
            for s in self.shapes
        ]

    @property
    def noise(self) -> list[torch.Tensor]:
        """The noise of the current prefix sum (zeros before the first step of a tree). Read-only: the
        aggregator updates these tensors in place."""
        return self._sum

    @torch.no_grad()
    def advance(self) -> list[torch.Tensor]:
        """One step: the noise of the prefix sum 1..t after it (see :attr:`noise`)."""
        self.step += 1
        level = (self.step & -self.step).bit_length() - 1  # trailing zero bits of t
        for h in range(level):  # the nodes that the new one covers leave the prefix
            for total, node in zip(self._sum, self._nodes.pop(h), strict=True):
                total.sub_(node)
        new = self._draw()
        if self._nodes:
            for total, node in zip(self._sum, new, strict=True):
                total.add_(node)
        else:  # the new node is the whole prefix (t a power of two): no rounding carried over
            for total, node in zip(self._sum, new, strict=True):
                total.copy_(node)
        self._nodes[level] = new
        return self._sum

    __call__ = advance

    @torch.no_grad()
    def complete(self) -> list[torch.Tensor]:
        """Virtual steps up to the next power of two (none if the step count is one, or 0): the noise of
        the completed tree's root."""
        if self.step > 0:
            target = 1 << (self.step - 1).bit_length()
            while self.step < target:
                self.advance()
        return self._sum

    @torch.no_grad()
    def restart(self) -> list[torch.Tensor]:
        """End the tree (completing it first with ``tree_completion``) and start a new one; returns the
        noise of the ended tree's last prefix sum, which the optimizer folds into its sum of gradients."""
        last = [t.clone() for t in (self.complete() if self.tree_completion else self._sum)]
        self.step = 0
        self.restarts += 1
        self._nodes = {}
        self._sum = self._zeros()
        return last

    # -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the step count, the nodes of the current prefix, their sum and the
        generator's state. Like torch's ``state_dict``, it holds references: save it before stepping on."""
        return {
            "step": self.step,
            "restarts": self.restarts,
            "std": self.std,
            "tree_completion": self.tree_completion,
            "shapes": [list(s) for s in self.shapes],
            "nodes": {h: list(node) for h, node in self._nodes.items()},
            "noise_sum": list(self._sum),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` (:meth:`state_dict`) stopped; ValueError if it was saved by an
        aggregator of other shapes, noise or completion (its privacy would not be the one planned)."""
        shapes = [torch.Size(s) for s in state["shapes"]]
        if shapes != self.shapes:
            raise ValueError(f"tree state for shapes {shapes}, not {self.shapes}")
        if float(state["std"]) != self.std or bool(state["tree_completion"]) != self.tree_completion:
            raise ValueError(
                f"tree state with std={state['std']}, tree_completion={state['tree_completion']}; "
                f"this aggregator has std={self.std}, tree_completion={self.tree_completion}"
            )
        step = int(state["step"])
        nodes = {int(h): [t.to(self.device, self.dtype).clone() for t in node] for h, node in state["nodes"].items()}
        if set(nodes) != {h for h in range(step.bit_length()) if step >> h & 1}:
            raise ValueError(f"tree state at step {step} with nodes at levels {sorted(nodes)}")
        self.step = step
        self.restarts = int(state["restarts"])
        self._nodes = nodes
        self._sum = [t.to(self.device, self.dtype).clone() for t in state["noise_sum"]]
        self.generator.set_state(state["generator"])


class FTRLOptimizer(torch.optim.Optimizer):
    """DP-FTRL (with momentum: DP-FTRLM), as the reference's ``FTRLOptimizer`` (see the module docstring).

    Each :meth:`step` reads in ``p.grad`` the already clipped *sum* of the step's per-example (or
    per-user) gradients, adds it to the running sum G, takes one step of the tree (``noise``, whose
    shapes are the parameters', in order) and sets θ = θ_0 − lr·(momentum-filtered G + noise). A
    parameter without a gradient counts as a zero gradient: it still moves with the noise (the
    reference skips it). ``lr`` is FTRL's 1/λ over the whole sum: changing it during a run rescales the
    past too. ``noise=None`` is FTRL without privacy (with γ = 0, plain gradient descent)."""

    def __init__(self, params: ParamsT, lr: float, momentum: float = 0.0, noise: TreeAggregator | None = None) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.noise = noise
        # shown each step's prefix sum of gradients and its noisy release, in the parameters' order, before
        # θ moves (``dpsweep.mechanisms.private_step``: what wraps the step reads or changes the release there)
        self.on_release: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None
        if noise is not None:
            shapes = [p.shape for group in self.param_groups for p in group["params"]]
            if shapes != noise.shapes:
                raise ValueError(f"the tree's shapes {noise.shapes} are not the parameters' {shapes}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        noise = self.noise.advance() if self.noise is not None else None
        params = [p for group in self.param_groups for p in group["params"]]
        prefix, released = [], []
        for i, p in enumerate(params):
            state = self.state[p]
            if not state:
                state["initial"] = p.detach().clone(memory_format=torch.preserve_format)
                state["grad_sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError("FTRLOptimizer does not support sparse gradients")
                state["grad_sum"].add_(p.grad)
            prefix.append(state["grad_sum"])
            released.append(state["grad_sum"] if noise is None else state["grad_sum"] + noise[i])
        if self.on_release is not None and noise is not None:
            self.on_release(prefix, released)  # which may change the noisy prefix sums in place
        i = 0
        for group in self.param_groups:
            lr, gamma = group["lr"], group["momentum"]
            for p in group["params"]:
                state, noisy = self.state[p], released[i]
                if gamma != 0:
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    noisy = state["momentum_buffer"].mul_(gamma).add_(noisy)
                p.copy_(state["initial"].add(noisy, alpha=-lr))
                i += 1
        return loss

    @torch.no_grad()
    def restart(self) -> None:
        """Restart the tree: fold the noise of its last prefix sum (of the completed tree, with tree
        completion) into the sum of gradients, so θ carries on, and start a new tree."""
        if self.noise is None:
            return
        last = self.noise.restart()
        params = [p for group in self.param_groups for p in group["params"]]
        for p, noise in zip(params, last, strict=True):
            state = self.state[p]
            if state:
                state["grad_sum"].add_(noise)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (θ_0, G and m per parameter) and the tree's (``"tree"``)."""
        state = super().state_dict()
        state["tree"] = self.noise.state_dict() if self.noise is not None else None
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        tree = state.pop("tree", None)
        if (tree is None) != (self.noise is None):
            raise ValueError("the state and this optimizer disagree on having tree-aggregation noise")
        super().load_state_dict(state)
        if self.noise is not None and tree is not None:
            self.noise.load_state_dict(tree)
