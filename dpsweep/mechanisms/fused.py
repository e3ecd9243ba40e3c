"""The fused DP-SGD step (``dp.engine=fused``): DP-SGD with every pass of one fixed shape,
per-example (or per-user) gradients from ``torch.func``, and the pass compiled (``torch.compile``; CUDA
graphs on a GPU). No Opacus hooks. At user level (``dp.unit=user``) see :class:`FusedUserStep`; what
follows describes the example level.

    dpsweep dp.engine=fused                   # the cnn on digits, DP-SGD at σ=1.0, C=1.0
    dpsweep dp.engine=fused dp.pad_to=96      # every pass 96 rows
    dpsweep dp.engine=fused dp.compile=false  # the same step, not compiled (eager)

After masked DP-SGD (Beltran et al. 2024, "Towards Efficient and Scalable Training of Differentially
Private Deep Learning", arXiv:2406.17298; jax_privacy's padded batches): Poisson sampling is kept
exactly, and the shape that varies with it is hidden by padding.

1. **Sampling**: each of the N examples is in the step with probability q, drawn on the device
   (:class:`dpsweep.data.resident.PoissonBatches`: the distribution of Opacus's ``DPDataLoader``, the same
   q = 1/⌈N/B⌉ and ``int(1/q)`` steps per epoch as ``dp.grad_sample_mode=hooks``).
2. **Passes of P rows**, P = ``dp.pad_to`` (≥ B; by default, of the multiples of 8 that a batch exceeds
   in at most 5% of the steps, the one with the fewest rows per step on average,
   :func:`default_pad_to`: 80 for B = 64, 288 for B = 256): the b sampled rows
   are cut into ⌈b/P⌉ passes, the last one padded with zero rows of weight 0 where the pass is compiled
   (an eager pass needs no fixed shape and takes the rows as they are: on a CPU, where each row costs
   its compute, padding 64 rows to 80 made the step 10% slower).
   **Nothing is truncated**: a step's sum is over exactly the sampled examples, so the accountant is
   DP-SGD's, unchanged (a step with b > P takes more passes, not fewer examples).
3. **One pass**: each row's gradient norm over all trainable parameters, the factor
   min(1, C/(‖g‖ + 1e-6)) (Opacus's clipping, 1e-6 included) times the row's weight (1, or 0 for
   padding: a padded row adds exactly nothing, whatever its gradient), and the weighted sum of the
   rows' gradients. Two ways, chosen by the model:

   - **linear** (every trainable parameter is an ``nn.Linear``'s, on 2-D inputs: the mlp, the cached
     VGG16 head): book-keeping (Bu et al. 2023, "Differentially Private Optimization on Large Model at
     Small Cost", ICML; the norm identity ‖g_i a_iᵀ‖ = ‖g_i‖·‖a_i‖ of Goodfellow 2015, "Efficient
     Per-Example Gradient Computations"): one forward pass keeps each layer's inputs A, one backward
     pass to the layers' outputs gives G (no parameter gradients), the norms come from ‖a_i‖ and ‖g_i‖,
     and the clipped sum of a weight is (c ⊙ G)ᵀA: no per-example gradient is ever held. Compiled on a
     GPU, the whole pass (forward, backward, norms, sums) is captured once as a CUDA graph and replayed
     (:class:`_CapturedPass`; ``torch.compile`` cannot trace the backward to the layers' outputs); on a
     CPU the forward and backward passes run eagerly and what follows them is compiled.
   - **vmap** (any other model: the cnn): each row's gradient by ``vmap(grad(loss))`` over
     ``functional_call``, compiled once (the shapes never change).
4. **Noise**: one flat draw N(0, σ²C²) over all trainable coordinates added to the sum, divided by
   the config's B (``train.batch_size``, public; not int(N·q), a function of the private N: issue 58,
   item 5), unflattened into each parameter's ``.grad``; the configured optimizer steps.

The clipped sum equals Opacus hooks' on the same batch (tests/unit/mechanisms/test_fused.py: the cnn,
the mlp and the VGG16 head). Models must treat examples independently: a layer that mixes the rows of a
batch (BatchNorm) is refused by name where the run is planned, before a sweep launches any job
(:func:`check_planned_model`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dpsweep.data.users import clip_factors, segment_count
from dpsweep.errors import InputError

if TYPE_CHECKING:
    from dpsweep.config import ModelConfig

MAX_SECOND_PASS = 0.05  # the default bound: at most this share of steps take a second pass
ROW_MULTIPLE = 8  # the default bound is rounded up to a multiple of 8 rows (tensor-core friendly)
# layers whose output mixes a batch's rows: torch's batch norms, every subclass of its private _BatchNorm
MIXING_LAYERS = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
)  # fmt: skip
CompileMode = str | None  # torch.compile's mode; None: not compiled
CUDA_GRAPHS = "reduce-overhead"  # torch.compile's mode that replays CUDA graphs (compile_mode's choice on a GPU)


def default_pad_to(batch_size: int) -> int:
    """Of the multiples of 8 rows P ≥ B whose Poisson batches (mean B: the limit of DP-SGD's Binomial(N, q))
    take a second pass at most 5% of the steps, the one that makes the fewest rows per step on average,
    P·E⌈b/P⌉; the smallest P on a tie. B = 64 gives 80 (a second pass 2% of the steps), B = 256 gives 288."""
    b = float(batch_size)
    low = int(math.ceil(b / ROW_MULTIPLE) * ROW_MULTIPLE)
    candidates = range(low, int(b + 6 * math.sqrt(b)) + 2 * ROW_MULTIPLE, ROW_MULTIPLE)
    rare = [p for p in candidates if _poisson_tail(b, p) <= MAX_SECOND_PASS] or [candidates[-1]]
    return min(rare, key=lambda p: (p * _expected_passes(b, p), p))


def _expected_passes(mean: float, rows: int) -> float:
    """E⌈b/rows⌉ for b ~ Poisson(mean) (b = 0 takes one pass): 1 + Σ_{k≥1} P(b > k·rows)."""
    passes, k = 1.0, 1
    while k * rows < mean + 12 * math.sqrt(mean) + 12:
        passes += _poisson_tail(mean, k * rows)
        k += 1
    return passes


def _poisson_tail(mean: float, n: int) -> float:
    """P(b > n) for b ~ Poisson(mean), summed in log space (no overflow for large means)."""
    log_terms = [i * math.log(mean) - mean - math.lgamma(i + 1) for i in range(n + 1)]
    top = max(log_terms)
    return max(0.0, 1.0 - math.exp(top) * sum(math.exp(t - top) for t in log_terms))


def pad_bound(pad_to: int | None, batch_size: int) -> int:
    """P, the rows of every pass: ``dp.pad_to``, or :func:`default_pad_to`. InputError below B."""
    if pad_to is None:
        return default_pad_to(batch_size)
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < batch_size:
        raise InputError(
            "dp.pad_to", pad_to, f"an integer at least train.batch_size={batch_size} (the rows of every pass), or null"
        )
    return pad_to


def check_model(model: nn.Module) -> None:
    """Refuse a model with a layer that mixes the rows of a batch (InputError names the layer)."""
    for name, module in model.named_modules():
        if isinstance(module, MIXING_LAYERS):
            raise InputError(
                "dp.engine",
                "fused",
                f"opacus or own_steps for this model: its layer {name!r} ({type(module).__name__}) "
                "mixes the examples of a batch, so per-example gradients are not defined",
            )


_PLANNED: set[tuple[str, tuple[int, ...], int]] = set()  # the model configs check_planned_model passed


def check_planned_model(model: ModelConfig, input_shape: tuple[int, int, int], num_classes: int) -> None:
    """:func:`check_model` where the run is planned (``dpsweep.plan.prepare``: before a sweep launches
    any job): the model built on the meta device, which allocates no memory, once per model config.
    Built without pretrained weights (``pretrained`` false where the config has it): weights do not
    change a model's layers, and planning downloads nothing."""
    from dpsweep.models.classifiers import build

    key = (repr(model), tuple(input_shape), num_classes)
    if key in _PLANNED:
        return
    layers_only = replace(model, pretrained=False) if hasattr(model, "pretrained") else model  # type: ignore[call-arg]
    with torch.device("meta"):
        check_model(build(layers_only, input_shape, num_classes))
    _PLANNED.add(key)


def compile_mode(device: torch.device, compiled: bool) -> CompileMode:
    """``reduce-overhead`` (CUDA graphs) on a GPU, torch.compile's default elsewhere; None: eager."""
    if not compiled:
        return None
    return CUDA_GRAPHS if device.type == "cuda" else "default"


class FusedStep:
    """The clipped, noised gradient of one Poisson batch, in passes of ``pad_to`` rows (module doc)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        *,
        max_grad_norm: float,
        pad_to: int,
        mode: CompileMode,
    ) -> None:
        check_model(model)
        self.model, self.loss_fn, self.pad_to = model, loss_fn, pad_to
        # detached views of the model's tensors (the optimizer updates them in place): build it on its device
        self.params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
        self.names = list(self.params)  # the flat vectors' order
        self.sizes = [p.numel() for p in self.params.values()]  # each parameter's share of a flat vector
        self.buffers = {k: b.detach() for k, b in model.named_buffers()}
        self.max_grad_norm = float(max_grad_norm)
        self.passes = 0  # passes run (a step whose batch exceeds pad_to takes more than one)
        self.linear = _LinearRows.of(model, loss_fn, self.names, max_grad_norm, pad_to, mode)
        self.way = "linear" if self.linear is not None else "vmap"
        # what is compiled needs one shape (a captured pass pads into its own buffers); eager passes take the rows
        self.padded = mode is not None and not (self.linear is not None and self.linear.captured)
        one = self._clipped_sum
        self._pass: Callable[..., Tensor] = one if mode is None else torch.compile(one, mode=mode, dynamic=False)

    def _clipped_sum(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor, y: Tensor,
                     weight: Tensor, *extra: Tensor) -> Tensor:  # fmt: skip
        """Σᵢ wᵢ·min(1, C/(‖gᵢ‖+1e-6))·gᵢ over the P rows and the pass's ``extra`` units, flat (the parameters'
        order)."""

        def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            out: Tensor = functional_call(self.model, (p, buffers), (xi.unsqueeze(0),))
            return self.loss_fn(out, yi.unsqueeze(0))

        per_row = vmap(grad(loss), in_dims=(None, 0, 0), randomness="different")(params, x, y)
        return self._clipped(per_row, weight, *extra)

    def _clipped(self, per_unit: dict[str, Tensor], weight: Tensor, *extra: Tensor) -> Tensor:
        """Σ_u w_u·min(1, C/(‖g_u‖+1e-6))·g_u of per-unit gradients ``{name: (P, *shape)}``, the norm flat over
        all trainable parameters; flat, in the parameters' order. ``extra``: more units, ``(rows, weight)`` with
        ``rows`` (k, D) flat in the parameters' order (:meth:`clipped_sum`), clipped with them: the same norms,
        the same factors."""
        flat = [per_unit[k].flatten(1) for k in self.names]
        if extra:
            rows, extra_weight = extra
            flat = [torch.cat([f, r]) for f, r in zip(flat, rows.split(self.sizes, dim=1), strict=True)]
            weight = torch.cat([weight, extra_weight])
        norms = torch.sqrt(cast(Tensor, sum(f.pow(2).sum(1) for f in flat)))  # (a sum of tensors, never 0)
        factor = clip_factors(norms, self.max_grad_norm) * weight
        return torch.cat([factor @ f for f in flat])

    def passes_of(self, x: Tensor, y: Tensor, pad: bool = True) -> Iterator[tuple[Tensor, ...]]:
        """The batch's rows in passes of at most ``pad_to`` rows, each with its weights; ``pad``: exactly
        ``pad_to`` rows, the padding of weight 0."""
        return self._cut((x, y), pad, x.dtype if x.is_floating_point() else torch.float32)

    def _cut(self, rows: tuple[Tensor, ...], pad: bool, dtype: torch.dtype) -> Iterator[tuple[Tensor, ...]]:
        """Row-aligned tensors in passes of at most ``pad_to`` rows, each pass's tensors followed by its weights
        (1 a row); ``pad``: exactly ``pad_to`` rows, zero rows of weight 0 added. No rows: one pass of padding
        where ``pad``, else none (an unpadded pass of no rows has nothing to take a gradient of)."""
        n, p = len(rows[0]), self.pad_to
        for start in range(0, max(n, 1) if pad else n, p):
            part = [t[start : start + p] for t in rows]
            short = p - len(part[0]) if pad else 0
            weight = torch.ones(len(part[0]) + short, device=rows[0].device, dtype=dtype)
            if short:
                weight[len(part[0]) :] = 0
                part = [torch.cat([t, t.new_zeros((short, *t.shape[1:]))]) for t in part]
            yield (*part, weight)

    def _passes(self, x: Tensor, y: Tensor, segment: Tensor | None, pad: bool) -> Iterator[tuple[Tensor, ...]]:
        """Each pass's inputs to :meth:`_run`: here the rows themselves, each its own unit (``segment`` unused)."""
        return self.passes_of(x, y, pad=pad)

    def _run(self, *inputs: Tensor) -> Tensor:
        """One pass's clipped sum, flat (``inputs``: the pass's, then any extra units' rows and weights)."""
        if self.linear is not None:
            return self.linear.clipped_sum(*inputs)
        return self._pass(self.params, self.buffers, *inputs)

    def _with_extra(self, passes: list[tuple[Tensor, ...]], extra: dict[str, Tensor]) -> list[tuple[Tensor, ...]]:
        """The passes with the ``extra`` units as more rows: flat (k, D) in the parameters' order, in parts of at
        most ``pad_to`` units with their weights (:meth:`_cut`), after a pass's inputs. More parts than passes: the
        first pass's inputs at weight 0 carry the rest (they add exactly nothing)."""
        flat = torch.cat([extra[k].to(self.params[k].device, self.params[k].dtype).flatten(1) for k in self.names], 1)
        parts = list(self._cut((flat,), self.padded, flat.dtype))
        blank = tuple(t.new_zeros(t.shape) for t in passes[0])  # its weight 0: the rows count for nothing
        passes += [blank] * (len(parts) - len(passes))
        return [(*inputs, *part) for inputs, part in zip(passes, parts, strict=False)] + passes[len(parts) :]

    def clipped_sum(
        self, x: Tensor, y: Tensor, segment: Tensor | None = None, extra: dict[str, Tensor] | None = None
    ) -> Tensor:
        """The sum of the batch's clipped per-unit gradients, flat; valid until the next call (a compiled pass's
        output buffer is reused). ``segment``: each row's user (``UserBatch``), at user level
        (:class:`FusedUserStep`). An empty batch (Poisson sampling draws none with probability (1 − q)^N) sums to
        zeros: a padded pass of weight-0 rows where passes have a fixed shape, else no pass at all (``vmap``
        over no rows fails), so that its step releases the noise alone, N(0, σ²C²) over the divisor
        (Abadi et al. 2016, "Deep Learning with Differential Privacy", Algorithm 1: the noised sum of the
        lot's clipped gradients, of which there are none). ``extra``: more units' gradients
        ``{name: (k, *shape)}`` (a white-box audit's canaries, ``dpsweep.mechanisms.private_step``), rows of the
        step's own passes (:meth:`_with_extra`): clipped by the pass's own norms, compiled or captured with it
        (as jax_privacy's ``CanaryGradientForwardFnWrapper`` puts canaries among the gradients its step clips)."""
        extra = extra if extra is not None and len(next(iter(extra.values()))) else None  # no rows: none
        # an empty batch with extra units: one pass of padding (its rows of weight 0) carries them
        passes = list(self._passes(x, y, segment, pad=self.padded or (extra is not None and len(y) == 0)))
        if extra is not None:
            passes = self._with_extra(passes, extra)
        total: Tensor | None = None
        for i, inputs in enumerate(passes):
            part = self._run(*inputs)
            # a CUDA graph's next replay overwrites its output: keep a copy when another pass follows
            last = i == len(passes) - 1
            total = (part if last else part.clone()) if total is None else total + part
            self.passes += 1
        if total is None:
            first = next(iter(self.params.values()))
            return torch.zeros(sum(p.numel() for p in self.params.values()), device=first.device, dtype=first.dtype)
        return total

    def gradient(
        self, x: Tensor, y: Tensor, *, noise_multiplier: float, divisor: float, generator: torch.Generator,
        segment: Tensor | None = None,
    ) -> dict[str, Tensor]:  # fmt: skip
        """(clipped sum + N(0, σ²C²)) / divisor, by parameter name."""
        summed = self.clipped_sum(x, y, segment)
        std = noise_multiplier * self.max_grad_norm / divisor  # N(0, σ²C²)/d = N(0, (σC/d)²): two passes, not three
        noisy = torch.normal(0.0, std, summed.shape, generator=generator, device=summed.device, dtype=summed.dtype)
        return self.unflatten(noisy.add_(summed, alpha=1.0 / divisor))

    def release(
        self, x: Tensor, y: Tensor, *, noise_multiplier: float, divisor: float, generator: torch.Generator,
        segment: Tensor | None = None, extra: dict[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:  # fmt: skip
        """:meth:`gradient` with ``extra`` units (:meth:`clipped_sum`), and the clipped sum it noised, both over
        the divisor: ``(clipped, noisy)`` by parameter name (the same noise drawn, from the same generator)."""
        summed = self.clipped_sum(x, y, segment, extra)
        std = noise_multiplier * self.max_grad_norm / divisor
        noisy = torch.normal(0.0, std, summed.shape, generator=generator, device=summed.device, dtype=summed.dtype)
        clipped = summed / divisor
        return self.unflatten(clipped), self.unflatten(noisy.add_(summed, alpha=1.0 / divisor))

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """A flat vector in the parameters' order, as ``{name: tensor of the parameter's shape}``."""
        out: dict[str, Tensor] = {}
        start = 0
        for k, p in self.params.items():
            out[k] = flat[start : start + p.numel()].view_as(p)
            start += p.numel()
        return out


class FusedUserStep(FusedStep):
    """User-level DP-SGD's clipped sum (McMahan et al. 2018, "Learning Differentially Private Recurrent
    Language Models", ICLR) in fixed-shape passes: P users (``pad_to``) of m examples each
    (``max_examples``, ``dp.max_examples_per_user``), padded with zero examples of weight 0 and, where the
    pass is compiled, zero users of weight 0. A user's contribution is the gradient of their mean loss,
    which is the mean of their per-example gradients (``dpsweep.data.users.user_contributions``), by
    ``vmap(grad(·))`` over the users: no per-example gradient is held. It is clipped as a whole to C and
    the contributions summed. Users beyond P take more passes: nothing is truncated, and the accountant is
    user-level DP-SGD's."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], *, max_grad_norm: float,
                 pad_to: int, max_examples: int, mode: CompileMode) -> None:  # fmt: skip
        super().__init__(model, loss_fn, max_grad_norm=max_grad_norm, pad_to=pad_to, mode=mode)
        self.max_examples = int(max_examples)
        self.linear, self.way, self.padded = None, "users", mode is not None
        users = self._users_sum
        self._pass = users if mode is None else torch.compile(users, mode=mode, dynamic=False)

    def _users_sum(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor, y: Tensor, rows: Tensor,
                   weight: Tensor, *extra: Tensor) -> Tensor:  # fmt: skip
        """Σ_u w_u·min(1, C/(‖Δ_u‖+1e-6))·Δ_u over the pass's users, Δ_u the gradient of user u's mean loss
        over their rows (``rows``: 1 for an example, 0 for padding), and the pass's ``extra`` units (:meth:`_clipped`),
        flat (the parameters' order)."""

        def one(out: Tensor, label: Tensor) -> Tensor:
            return self.loss_fn(out.unsqueeze(0), label.unsqueeze(0))

        def user_loss(p: dict[str, Tensor], xu: Tensor, yu: Tensor, ru: Tensor) -> Tensor:
            losses = vmap(one)(functional_call(self.model, (p, buffers), (xu,)), yu)
            return (losses * ru).sum() / ru.sum().clamp(min=1.0)

        per_user = vmap(grad(user_loss), in_dims=(None, 0, 0, 0), randomness="different")(params, x, y, rows)
        return self._clipped(per_user, weight, *extra)

    def _passes(self, x: Tensor, y: Tensor, segment: Tensor | None, pad: bool) -> Iterator[tuple[Tensor, ...]]:
        """The batch as users × m examples (``segment``: each row's user 0..b−1, non-decreasing, at most m rows
        each, as ``UserBatches`` draws them), in passes of at most P users: (x, y, rows, weight)."""
        if segment is None:
            raise ValueError("a user-level step needs each row's user (segment)")
        b, m, device = segment_count(segment), self.max_examples, y.device
        counts = torch.bincount(segment, minlength=b)
        rank = torch.arange(len(segment), device=device) - (torch.cumsum(counts, 0) - counts)[segment]
        xs, ys = x.new_zeros((b, m, *x.shape[1:])), y.new_zeros((b, m))
        rows = torch.zeros((b, m), device=device, dtype=x.dtype if x.is_floating_point() else torch.float32)
        xs[segment, rank], ys[segment, rank], rows[segment, rank] = x, y, 1.0  # a rank >= m: IndexError
        return self._cut((xs, ys, rows), pad, rows.dtype)


class _LinearRows:
    """Book-keeping clipping for a model whose trainable parameters are all ``nn.Linear``'s (module doc)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor],
                 layers: list[tuple[str, nn.Linear]], names: list[str], max_grad_norm: float, pad_to: int,
                 mode: CompileMode) -> None:  # fmt: skip
        self.model, self.loss_fn, self.layers, self.names = model, loss_fn, layers, names
        self.sizes = [p.numel() for k, p in model.named_parameters() if k in names]  # (names: in this order)
        self.max_grad_norm = float(max_grad_norm)
        self.trained = [(m.weight.requires_grad, m.bias is not None and m.bias.requires_grad) for _, m in layers]
        tail = self._tail
        compiled_tail = mode is not None and mode != CUDA_GRAPHS  # under CUDA graphs the whole pass is captured
        self.tail: Callable[..., Tensor] = torch.compile(tail, mode=mode, dynamic=False) if compiled_tail else tail
        self.captured = mode == CUDA_GRAPHS
        # captured: one graph for the passes of the batch's rows alone, one for those that also hold extra units
        self.plain: Callable[..., Tensor] = _CapturedPass(self._pass, pad_to) if self.captured else self._pass
        self.with_extra: Callable[..., Tensor] = _CapturedPass(self._pass, pad_to) if self.captured else self._pass
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.capturing = False
        self.handles: list[torch.utils.hooks.RemovableHandle] | None = None

    def _keep(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            if not self.capturing:
                return
            if args[0].dim() != 2:
                raise ValueError(f"layer {name!r} has {args[0].dim()}-D inputs: the fused step's norms need 2-D")
            self.inputs[name], self.outputs[name] = args[0].detach(), out

        return hook

    @classmethod
    def of(cls, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], names: list[str],
           max_grad_norm: float, pad_to: int, mode: CompileMode) -> _LinearRows | None:  # fmt: skip
        """The model's trainable Linear layers, or None when some trainable parameter is not a Linear's."""
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        covered = {f"{n}.{k}" for n, m in layers for k, p in m.named_parameters(recurse=False) if p.requires_grad}
        if not names or covered != set(names):
            return None
        return cls(model, loss_fn, layers, names, max_grad_norm, pad_to, mode)

    def clipped_sum(self, x: Tensor, y: Tensor, weight: Tensor, *extra: Tensor) -> Tensor:
        """One pass's clipped sum (:meth:`_pass`), captured where the pass is."""
        return (self.with_extra if extra else self.plain)(x, y, weight, *extra)

    def _pass(self, x: Tensor, y: Tensor, weight: Tensor, *extra: Tensor) -> Tensor:
        """One pass: Σᵢ wᵢ·min(1, C/(‖gᵢ‖+1e-6))·gᵢ over its rows and its ``extra`` units (:meth:`_tail`), flat
        (the parameters' order)."""
        if self.handles is None:  # once: hooks that keep the layers' inputs and outputs while capturing
            self.handles = [m.register_forward_hook(self._keep(n)) for n, m in self.layers]
        inputs, outputs = self.inputs, self.outputs
        inputs.clear()
        outputs.clear()
        self.capturing = True
        try:
            loss = self.loss_fn(self.model(x), y) * len(y)  # the rows' losses summed (a mean over the P rows, times P)
        finally:
            self.capturing = False
        missing = [n for n, _ in self.layers if n not in outputs]
        if missing:
            raise ValueError(f"layers {missing} took no part in the forward pass: the fused step needs them all")
        grads = torch.autograd.grad(loss, [outputs[n] for n, _ in self.layers])
        return self.tail([inputs[n] for n, _ in self.layers], list(grads), weight, self.max_grad_norm, *extra)

    def _tail(self, inputs: list[Tensor], grads: list[Tensor], weight: Tensor, max_grad_norm: float,
              *extra: Tensor) -> Tensor:  # fmt: skip
        """From each layer's inputs A and output gradients G: the norms, the factors, the clipped sums.
        ``extra``: more units, ``(rows, weight)`` with ``rows`` (k, D) flat in the parameters' order (a white-box
        audit's canaries, :meth:`FusedStep.clipped_sum`): rows of the pass, their norms summed by the rows' own
        :meth:`_squared_norms` and clipped by the rows' own factors."""
        terms = []  # each layer's squared norms of each row's weight and bias gradients
        for a, g in zip(inputs, grads, strict=True):
            g2 = torch.linalg.vector_norm(g, dim=1).square()  # one reduction, no P x d temporary of squares
            terms.append((torch.linalg.vector_norm(a, dim=1).square() * g2, g2))  # ‖g_i a_iᵀ‖² = ‖g_i‖²‖a_i‖²
        if extra:
            rows, extra_weight = extra
            terms = [(torch.cat([w, wx]), torch.cat([b, bx])) for (w, b), (wx, bx) in zip(terms, self._terms(rows),
                                                                                          strict=True)]  # fmt: skip
            weight = torch.cat([weight, extra_weight])
        factor = clip_factors(self._squared_norms(terms, weight).sqrt(), max_grad_norm) * weight
        sums: dict[str, Tensor] = {}
        for (n, _), a, g in zip(self.layers, inputs, grads, strict=True):
            scaled = g * factor[: len(g), None]
            sums[f"{n}.weight"] = scaled.T @ a
            sums[f"{n}.bias"] = scaled.sum(0)
        flat = torch.cat([sums[k].flatten() for k in self.names])
        return flat + factor[len(grads[0]) :] @ extra[0] if extra else flat

    def _squared_norms(self, terms: list[tuple[Tensor, Tensor]], weight: Tensor) -> Tensor:
        """Each row's squared gradient norm: the sum of its layers' weight and bias ``terms``, the trained ones."""
        squared = torch.zeros_like(weight)
        for (weight_term, bias_term), (w, b) in zip(terms, self.trained, strict=True):
            if w:
                squared = squared + weight_term
            if b:
                squared = squared + bias_term
        return squared

    def _terms(self, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's squared norms of the flat rows' (k, D) weight and bias parts (0: a part not trained)."""
        parts = dict(zip(self.names, rows.split(self.sizes, dim=1), strict=True))
        zero = rows.new_zeros(len(rows))
        norm = {k: v.square().sum(1) for k, v in parts.items()}
        return [(norm.get(f"{n}.weight", zero), norm.get(f"{n}.bias", zero)) for n, _ in self.layers]


class _CapturedPass:
    """CUDA only: a pass over ``rows`` rows, captured once as a CUDA graph and then replayed (PyTorch's
    whole-network capture with ``torch.cuda.graph``: warm-up on a side stream, then capture;
    https://pytorch.org/docs/stable/notes/cuda.html#whole-network-capture). Each call's n ≤ rows rows are
    copied into the captured inputs and the rest of them zeroed: the padding of :meth:`FusedStep.passes_of`
    (zero rows of weight 0), written in place. The model's parameters are read where they live, so the
    optimizer's in-place updates are seen by every replay. The output is the captured buffer, overwritten by
    the next replay. Its CPU twin is the function itself (the eager pass: compile_mode never chooses CUDA
    graphs off a GPU)."""

    WARMUP = 3  # runs on a side stream before the capture (the cuDNN/cuBLAS choices and workspaces settle)

    def __init__(self, fn: Callable[..., Tensor], rows: int) -> None:
        self.fn, self.rows = fn, rows
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: list[Tensor] = []
        self.static_out: Tensor | None = None

    def __call__(self, *args: Tensor) -> Tensor:
        if self.graph is None:
            self.static_in = [a.new_zeros((self.rows, *a.shape[1:])) for a in args]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.WARMUP):
                    self.fn(*self.static_in)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = self.fn(*self.static_in)
        for static, a in zip(self.static_in, args, strict=True):
            static[: len(a)].copy_(a)
            static[len(a) :].zero_()
        self.graph.replay()
        assert self.static_out is not None
        return self.static_out
