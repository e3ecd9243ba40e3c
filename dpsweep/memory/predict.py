"""Memory of configs before launch: predicted stages and peak, an OOM verdict, and what would fit.

A fitted :class:`~dpsweep.memory.model.MemoryModel` (``dpsweep-memory fit``) predicts bytes from a
config's features; this module turns a composed config into those features (one-row tables of numpy
columns) and applies it::

    from dpsweep.memory import model, predict
    fitted = predict.model_for(model.load_models("memory_model.json"), "cnn", backend="cpu-tensors")
    p = predict.predict_config(fitted, cfg, facts, budget_bytes=16 * 2**30)   # cfg: dpsweep.config.Config
    p.fits, p.peak_bytes, p.largest_batch_size, p.largest_hidden_units

The batch a pass holds is not always B. With DP, Poisson sampling makes every batch random, so the
plan is for the largest batch the run will see (:func:`dpsweep.privacy.schedule.max_poisson_batch`, exceeded
with probability <= 1e-6), unless ``train.physical_batch_size`` caps the pass (Opacus's
BatchMemoryManager). Largest sizes are found by predicting every candidate at once, so they need no
assumption that the fitted formula grows with B.

Importing this module loads neither pandas nor scipy: the Poisson quantile
(:mod:`dpsweep.privacy.schedule`, hence Opacus and scipy) is imported only when a DP run's batches are planned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpsweep import units
from dpsweep.config import Config, ConfigError, trials_per_device
from dpsweep.memory import packing
from dpsweep.memory.model import PEAK_TARGET, MemoryModel, MemoryModelError
from dpsweep.memory.stages import config_features
from dpsweep.models import classifiers

if TYPE_CHECKING:  # dpsweep.data.loaders imports scikit-learn (and with it pandas and scipy)
    from dpsweep.data.facts import DatasetFacts

PEAK = PEAK_TARGET
# The peak a config is planned with (MemoryModel.peak_targets): the largest of the in-stage allocated
# peaks (or the iteration peak, for probes without them). Not the reserved peak: when an allocation
# fails, PyTorch's caching allocator frees its cached, unused segments and retries before it raises
# out-of-memory (PyTorch docs, "CUDA semantics: memory management"), so reserved bytes above the
# allocated ones are not needed. Measured on an H100 (benchmarks/oom_check.py, 2026-11-25): a VGG16
# pass of 403 examples ran whose reserved peak was predicted at 103 GB, on a card with 84 GB to give.
#
# What the allocator cannot use of the memory it may take: blocks rounded up and split inside segments
# that are still in use (fragmentation). No probe sees it, so a share of the GPU memory is kept back per
# memory backend (none for the CPU twin, which counts tensors, not an allocator). On the H100, at the
# real largest pass, the predicted allocated peak was 98.3% (VGG16 head, 403 ran, 406 did not) and
# 98.4% (cnn, 221 ran, 222 did not) of the allocatable memory; the first pass that ran out, 98.8-99.0%.
ALLOCATOR_HEADROOM: dict[str, float] = {"cuda": 0.02}
POISSON_TAIL = 1e-6  # chance that some batch of a run exceeds the planned one
MAX_HIDDEN_UNITS = 65_536  # search range for the largest head


def model_for(models: Mapping[str, MemoryModel], name: str, backend: str | None = None) -> MemoryModel:
    """The fitted model of ``model.name``; errors name what the file holds."""
    if name not in models:
        held = ", ".join(sorted(models)) or "none"
        raise MemoryModelError("model.name", name, f"the memory model file holds fits of: {held}; probe {name} first")
    fitted = models[name]
    if backend is not None and fitted.backend != backend:
        raise MemoryModelError(
            "memory.backend",
            backend,
            f"the fit of {name} is of {fitted.backend} probes; a {backend} run needs probes of its own backend "
            f"(dpsweep-plan and dpsweep-memory predict: pass --backend {fitted.backend} to plan with these)",
        )
    return fitted


def trainable_parameters(cfg: Config, facts: DatasetFacts, hidden_units: int | None = None) -> int:
    """P of the config's model, built on the meta device (no memory, no pretrained weights)."""
    model_cfg = cfg.model
    if hidden_units is not None:
        model_cfg = dataclasses.replace(model_cfg, hidden_units=hidden_units)
    if hasattr(model_cfg, "pretrained"):
        model_cfg = dataclasses.replace(model_cfg, pretrained=False)  # same shapes, nothing to load
    with torch.device("meta"):
        return classifiers.trainable_parameters(classifiers.build(model_cfg, facts.input_shape, facts.num_classes))


def pass_batch_sizes(cfg: Config, n_train: int, batch_sizes: np.ndarray) -> np.ndarray:
    """Examples in the largest pass a run of each logical batch size makes (see the module doc)."""
    b = np.asarray(batch_sizes, dtype=np.int64)
    if cfg.dp.enabled:
        from dpsweep.privacy import schedule  # Opacus and scipy: only for DP runs

        b = schedule.max_poisson_batch(n_train, b, cfg.train.epochs, POISSON_TAIL)
    physical = cfg.train.physical_batch_size
    if physical is not None:
        b = np.minimum(b, physical)
    return b


def gpu_budget(cfg: Config, override: str | None = None) -> tuple[str | None, int | None]:
    """The GPU memory a config is planned against: ``override`` (the ``--gpu-memory`` flag), else
    ``launcher.gpu_memory``; as written and in bytes (None, None when neither is given). With K trials
    per device (``launcher.trials_per_device``), the bytes are one trial's share
    (:func:`dpsweep.memory.packing.trial_share_bytes`) and the figure says so; ``auto`` before the sweep
    has resolved it plans as one trial alone."""
    figure = override or cfg.launcher.gpu_memory
    if figure is None:
        return None, None
    total = units.parse_bytes(figure, key="--gpu-memory" if override else "launcher.gpu_memory")
    k = trials_per_device(cfg.launcher) or 1
    if k == 1:
        return figure, total
    return f"{figure} shared by {k} trials", packing.trial_share_bytes(total, k)


def resident_bytes(cfg: Config, facts: DatasetFacts) -> int:
    """Bytes that stay on the GPU beside every pass and that no probe holds: with
    ``train.device_resident``, the training split (fp32 inputs, int64 labels); else 0."""
    if not cfg.train.device_resident:
        return 0
    return facts.n_train * (math.prod(facts.input_shape) * 4 + 8)


def headroom(fitted: MemoryModel) -> float:
    """The share of the GPU memory kept back for the allocator of ``fitted``'s backend."""
    return ALLOCATOR_HEADROOM.get(fitted.backend, 0.0)


def usable_bytes(fitted: MemoryModel, budget_bytes: float) -> float:
    """What the peaks of ``fitted``'s backend may reach of ``budget_bytes``: less :func:`headroom`."""
    return budget_bytes * (1 - headroom(fitted))


def pass_budget_bytes(fitted: MemoryModel, cfg: Config, facts: DatasetFacts, budget_bytes: int | None = None) -> float:
    """The GPU memory (``budget_bytes``, else ``launcher.gpu_memory``), less the allocator's headroom
    for ``fitted``'s backend (:func:`usable_bytes`) and :func:`resident_bytes`: what one pass may use.
    ConfigError when the resident data alone fills it."""
    if budget_bytes is None:
        budget_bytes = gpu_budget(cfg)[1]
        assert budget_bytes is not None
    usable = usable_bytes(fitted, budget_bytes)
    resident = resident_bytes(cfg, facts)
    if resident and resident >= usable:
        raise ConfigError(
            "train.device_resident", True,
            f"false: the training split needs {units.format_bytes(resident)} of the GPU's "
            f"{units.format_bytes(budget_bytes)}",
        )  # fmt: skip
    return usable - resident


def chosen_physical_batch(
    fitted: MemoryModel, cfg: Config, facts: DatasetFacts, budget_bytes: int | None = None
) -> int | None:
    """The physical batch training picks from ``train.memory_model`` and the GPU memory
    (``budget_bytes``, else ``launcher.gpu_memory``): the largest pass predicted to fit (None: not
    even one example)."""
    return largest_pass(fitted, cfg, facts, pass_budget_bytes(fitted, cfg, facts, budget_bytes))


def with_chosen_physical_batch(
    fitted: MemoryModel, cfg: Config, facts: DatasetFacts, budget_bytes: int | None = None
) -> Config:
    """``cfg`` with the physical batch training would choose (see :func:`chosen_physical_batch`)
    when ``train.memory_model`` and the GPU memory are set and no size is given."""
    t = cfg.train
    if t.physical_batch_size is not None or t.memory_model is None:
        return cfg
    if budget_bytes is None and cfg.launcher.gpu_memory is None:
        return cfg
    chosen = chosen_physical_batch(fitted, cfg, facts, budget_bytes)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, physical_batch_size=chosen))


@dataclass(frozen=True)
class MemoryPrediction:
    row: dict[str, Any]  # the config's features (probe-table columns), batch_size = largest pass
    batch_size: int  # the logical batch size B
    pass_reason: str  # why the pass holds row["batch_size"]: poisson | physical | batch
    stages: dict[str, float]  # predicted bytes per target (envelope fit)
    typical: dict[str, float]  # the same by least squares: the expected figure, not a bound
    peak_bytes: float  # envelope prediction of the planned peak (MemoryModel.peak_targets): the figure to plan with
    budget_bytes: float | None
    largest_batch_size: int | None  # logical B whose largest pass fits the budget (None: not even 1)
    largest_hidden_units: int | None  # at this B; None when no head size fits or hidden units were not probed
    largest_physical_batch_size: int | None  # the most examples one pass may hold (BatchMemoryManager)
    resident_bytes: int = 0  # the device-resident training split, beside the peak (no probe holds it)
    notes: tuple[str, ...] = ()  # what the prediction could not do, or where it extrapolates
    headroom: float = 0.0  # share of budget_bytes kept back for the allocator (ALLOCATOR_HEADROOM)

    @property
    def usable_bytes(self) -> float | None:
        """What the peak and the resident data may take of the budget: less the allocator's headroom."""
        return None if self.budget_bytes is None else self.budget_bytes * (1 - self.headroom)

    @property
    def fits(self) -> bool | None:
        if self.usable_bytes is None:
            return None
        return self.peak_bytes + self.resident_bytes <= self.usable_bytes


def config_row(cfg: Config, facts: DatasetFacts) -> dict[str, Any]:
    return config_features(cfg, facts.input_shape, trainable_parameters(cfg, facts))


def planned_peak(fitted: MemoryModel, predicted: dict[str, float]) -> float:
    """The peak to plan with from one row's envelope predictions (MemoryModel.peak_targets)."""
    return max(predicted[t] for t in fitted.peak_targets())


def _table(row: Mapping[str, Any], **columns: np.ndarray | int) -> dict[str, np.ndarray]:
    """``row`` repeated as a table of numpy columns, with ``columns`` replaced (arrays: one row per
    candidate; scalars: the same in every row). One row when no array is given."""
    n = max((len(v) for v in columns.values() if isinstance(v, np.ndarray)), default=1)
    return {name: np.broadcast_to(np.asarray(value), (n,)) for name, value in (dict(row) | columns).items()}


def _peaks(fitted: MemoryModel, row: dict[str, Any], **columns: np.ndarray | int) -> np.ndarray:
    """Planned peaks of ``row`` with ``columns`` replaced (arrays: one candidate each)."""
    return fitted.predict_peak(_table(row, **columns))


def predict_config(
    fitted: MemoryModel, cfg: Config, facts: DatasetFacts, budget_bytes: int | None = None
) -> MemoryPrediction:
    """Predicted stages and peak of one config, and the largest B and head that fit ``budget_bytes``
    (the GPU memory; with ``train.device_resident`` the training split is set against it too)."""
    cfg = with_chosen_physical_batch(fitted, cfg, facts, budget_bytes)
    base = config_row(cfg, facts)
    row = base | {"batch_size": int(pass_batch_sizes(cfg, facts.n_train, np.array([cfg.train.batch_size]))[0])}
    table = _table(row)
    stages = {t: float(v[0]) for t, v in fitted.predict(table).items()}
    typical = {t: float(v[0]) for t, v in fitted.predict(table, fit="least_squares").items()}
    resident = resident_bytes(cfg, facts)
    notes = [f"extrapolated: {note}" for note in fitted.outside_probed(table)]
    largest: dict[str, int | None] = {}
    usable = usable_bytes(fitted, budget_bytes) if budget_bytes is not None else None
    if usable is not None and usable > resident:
        for key, (search, column) in LARGEST.items():
            try:
                found = largest[key] = search(fitted, cfg, facts, usable - resident, base)
            except MemoryModelError as err:  # e.g. every probe had the same batch size
                notes.append(f"largest {key} not predicted: {err}")
                continue
            probed = fitted.ranges.get(column)
            if found is not None and probed is not None and found > probed[1]:
                notes.append(f"the largest {key} ({found}) is extrapolated beyond the probed {probed[1]:g}")
    b = cfg.train.batch_size
    reason = "physical" if cfg.train.physical_batch_size is not None and row["batch_size"] < b else "batch"
    if cfg.dp.enabled and reason == "batch":
        reason = "poisson"
    return MemoryPrediction(
        row, b, reason, stages, typical, planned_peak(fitted, stages), budget_bytes,
        largest.get("train.batch_size"), largest.get("model.hidden_units"), largest.get("train.physical_batch_size"),
        resident, tuple(notes), headroom(fitted),
    )  # fmt: skip


def _largest(fits: np.ndarray, values: np.ndarray) -> int | None:
    return int(values[fits].max()) if fits.any() else None


def largest_batch_size(
    fitted: MemoryModel, cfg: Config, facts: DatasetFacts, budget_bytes: float, row: dict[str, Any] | None = None
) -> int | None:
    """The largest logical batch size (<= N) whose largest pass is predicted to fit."""
    b = np.arange(1, facts.n_train + 1)
    passes = pass_batch_sizes(cfg, facts.n_train, b)
    return _largest(_peaks(fitted, row or config_row(cfg, facts), batch_size=passes) <= budget_bytes, b)


def largest_pass(
    fitted: MemoryModel, cfg: Config, facts: DatasetFacts, budget_bytes: float, row: dict[str, Any] | None = None
) -> int | None:
    """The largest number of examples one forward/backward pass may hold (a physical batch size)."""
    b = np.arange(1, facts.n_train + 1)
    return _largest(_peaks(fitted, row or config_row(cfg, facts), batch_size=b) <= budget_bytes, b)


def largest_hidden_units(
    fitted: MemoryModel, cfg: Config, facts: DatasetFacts, budget_bytes: float, row: dict[str, Any] | None = None
) -> int | None:
    """The widest head (hidden units) predicted to fit at the config's batch size. P is affine in
    the hidden units for both models (two Linear layers around it): P(h) = P(1) + (h - 1)·ΔP."""
    p1, p2, p3 = (trainable_parameters(cfg, facts, h) for h in (1, 2, 3))
    if p3 - p2 != p2 - p1:
        raise MemoryModelError("model.name", cfg.model.name, "a model whose parameters grow linearly in hidden_units")
    h = np.arange(1, MAX_HIDDEN_UNITS + 1)
    passes = int(pass_batch_sizes(cfg, facts.n_train, np.array([cfg.train.batch_size]))[0])
    peaks = _peaks(
        fitted, row or config_row(cfg, facts), hidden_units=h, trainable_params=p1 + (h - 1) * (p2 - p1),
        batch_size=passes,
    )  # fmt: skip
    return _largest(peaks <= budget_bytes, h)


# The largest sizes predict_config searches for: config key -> (search, the probe column it varies).
LARGEST = {
    "train.batch_size": (largest_batch_size, "batch_size"),
    "model.hidden_units": (largest_hidden_units, "hidden_units"),
    "train.physical_batch_size": (largest_pass, "batch_size"),
}
