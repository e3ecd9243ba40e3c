"""Memory at the four stages of the first training iteration, behind one small interface.

Stages, in order: ``model_load`` (model and DP wrapper on the device), ``batch_load`` (first batch on
the device), ``backward`` (after ``loss.backward()``), ``optimizer_step`` (after ``optimizer.step()``).

Two backends, chosen by the training device:

- ``cuda`` (CUDA only): the caching allocator's own counters, ``torch.cuda.memory_allocated``,
  ``max_memory_allocated`` (reset between stages) and ``memory_reserved``. These are GPU figures.
- ``cpu-tensors`` (the CPU twin): a census of the bytes of live tensors at the same stage boundaries,
  measured from a baseline taken when the monitor is created. It sees tensors reachable from Python
  (parameters, their ``.grad`` and Opacus's ``.grad_sample``, optimizer state, batches), not
  temporaries freed inside a stage, so its "peak" is the largest census at a boundary: a lower bound
  on the true peak. Runs tag ``memory.backend`` so nobody takes these for GPU figures.

  A census walks every object the garbage collector tracks (a million or so once torch, MLflow and
  Hydra are imported: about 0.3 s). The monitor therefore freezes what exists at its baseline
  (``gc.freeze``: the collector, and ``gc.get_objects``, no longer see those objects) and each
  later census walks only what was created since, skipping the baseline's storages (a new view of
  a dataset tensor is not new memory). ``close()`` collects the run's reference cycles and
  unfreezes the baseline; the runner closes its monitor when the run ends. Objects frozen before
  the monitor (by a test harness, or a caller's own ``gc.freeze``) are not its to thaw: they stay
  frozen, and out of every census (a new view of a tensor among them would count as new memory).

  The baseline itself is one full walk (about 0.1 s on the 2-core development VM), once per run.
  Runs that follow one another in one process (an inline sweep's jobs) can carry it instead, inside
  :func:`carried_baseline`: a run's ``close()`` leaves the baseline frozen, and the next run's
  baseline is the last one's tensors that are still alive (held by weak reference, their storages
  read again) plus the tensors among the objects created since, which are all a walk now sees.
  That is the same set of storages a full walk finds, for a walk of only what the last run left
  alive. The block's end unfreezes what its runs froze.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dpsweep.config import Config, step_kind
from dpsweep.memory.tables import logged_values
from dpsweep.registry import Registry

STAGES: tuple[str, ...] = ("model_load", "batch_load", "backward", "optimizer_step")
# Marks that split a stage's in-stage peak and record no level: "forward" ends the forward pass inside
# the backward stage. The forward activations' peak (on CUDA, e.g. a frozen backbone's transient maps) and
# the backward's (Opacus's per-sample gradients) then have a peak each: each grows linearly with the
# config, while their maximum does not, so memory models fit each and plan with the largest.
PEAK_SPLITS: dict[str, str] = {"forward": "backward"}  # split -> the stage it lies in


class MemoryMonitor(Protocol):
    backend: str

    def allocated_bytes(self) -> int:
        """Bytes allocated now (relative to the monitor's baseline for the CPU twin)."""

    def peak_bytes(self) -> int:
        """Highest allocated bytes since the last :meth:`reset_peak`."""

    def reserved_peak_bytes(self) -> int:
        """Highest reserved bytes since the last :meth:`reset_peak`."""

    def reset_peak(self) -> None: ...

    def close(self) -> None:
        """Release what the monitor holds (the CPU twin's frozen objects); call once, when the run ends."""


MONITORS: Registry[type] = Registry("memory backend")


@MONITORS.register("cuda")
class CudaMemoryMonitor:
    """CUDA only: reads the caching allocator of ``device``."""

    backend = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        gc.collect()  # free what earlier runs of this process left in reference cycles
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    def allocated_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved_peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def close(self) -> None:
        pass


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the distinct storages of all live tensors on ``device`` reachable from Python (and
    not frozen: see the module doc)."""
    return sum(live_storages(device).values())


def live_storages(device: torch.device) -> dict[int, int]:
    """{data pointer: bytes} of the distinct storages of the live tensors on ``device`` that the
    garbage collector tracks (frozen objects left out, see the module doc); empty storages left out."""
    return storages(tracked_tensors(), device)


def tracked_tensors() -> list[torch.Tensor]:
    """The tensors among the objects the garbage collector tracks (frozen ones left out)."""
    # The walk over every tracked object stays in C (map, set lookups, compress): only tensors reach
    # Python. type() rather than isinstance(), which reads __class__ and makes some lazy proxies warn.
    tensor_kinds = _subclasses(torch.Tensor)
    objects = gc.get_objects()
    return list(itertools.compress(objects, map(tensor_kinds.__contains__, map(type, objects))))


def storages(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, int]:
    """{data pointer: bytes} of the distinct storages of ``tensors`` (and of their parameters'
    ``.grad``) on ``device``; empty storages left out."""
    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if not isinstance(t, torch.Tensor):
            return
        # torch's ExpandedWeight (dp.grad_sample_mode=ew) wraps a parameter and refuses attribute
        # access: count the tensor it wraps
        tensor: torch.Tensor = t.__dict__.get("orig_weight", t)
        if tensor.device == device and tensor.layout == torch.strided:
            try:
                storage = tensor.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # the fake and batched tensors that torch.compile
                return  # and vmap keep (dp.engine=fused): they hold no memory of their own
            seen[pointer] = storage.nbytes()

    for tensor in tensors:
        add(tensor)
        if isinstance(tensor, torch.nn.Parameter):  # .grad is created in C++: no Python object until read
            add(tensor.grad)
    seen.pop(0, None)  # empty storages
    return seen


@dataclass
class _Carry:
    """What :func:`carried_baseline` hands from one run's monitor to the next."""

    active: bool = False
    tensors: list[weakref.ref[torch.Tensor]] | None = None  # the last baseline's tensors
    thaw: bool = False  # a monitor of the block froze first: the block's end unfreezes


_CARRY = _Carry()


@contextmanager
def carried_baseline() -> Iterator[None]:
    """Runs inside this block, one after another in this process, carry the CPU twin's baseline
    from one to the next instead of walking every object again (see the module doc).

    Where nothing is frozen yet, the block takes the first baseline as it starts (one walk) and
    freezes it, so that the garbage collector's full passes during the first run (the imports its
    optimizer and Opacus make) skip everything that existed before: about 0.3 s on the 2-core
    development VM. Where another froze objects first, the first run's monitor starts as usual."""
    if _CARRY.active:  # nested: the outer block carries
        yield
        return
    _CARRY.active = True
    if gc.get_freeze_count() == 0:  # (it walks the frozen objects: here there are none)
        _CARRY.tensors = [weakref.ref(t) for t in tracked_tensors()]
        _CARRY.thaw = True
        gc.freeze()
    try:
        yield
    finally:
        thaw = _CARRY.thaw
        _CARRY.active, _CARRY.tensors, _CARRY.thaw = False, None, False
        if thaw:
            gc.unfreeze()


def _subclasses(kind: type) -> set[type]:
    """``kind`` and every class derived from it, directly or not (those defined so far)."""
    found, todo = {kind}, [kind]
    while todo:
        subs: list[type] = type.__subclasses__(todo.pop())
        for sub in subs:
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


@MONITORS.register("cpu")
class CpuTensorMonitor:
    """CPU twin: live-tensor census at stage boundaries, relative to a baseline (see module doc)."""

    backend = "cpu-tensors"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if _CARRY.active and _CARRY.tensors is not None:  # the last run's baseline, still frozen
            # The last run's reference cycles (its model, once the runner let go of it) are among the
            # objects made since that baseline, which is all a collection now walks: free them, or the
            # freeze below would keep them for the rest of the block.
            gc.collect()
            tensors = tracked_tensors() + [t for ref in _CARRY.tensors if (t := ref()) is not None]
            self._thaw = False
        else:
            # gc.get_freeze_count() walks the frozen objects: asked only here, where usually none are
            self._thaw = gc.get_freeze_count() == 0  # what another froze is left frozen (module doc)
            # No collection first (a full one takes about 0.3 s): garbage an earlier run left in
            # reference cycles is frozen with the baseline, so it cannot be freed mid-run and
            # subtracted from this run's figures; close() collects this run's own cycles.
            tensors = tracked_tensors()
        self.baseline = storages(tensors, device)
        gc.freeze()  # later censuses walk only the objects created after the baseline (module doc)
        if _CARRY.active:  # the block, not this run, unfreezes
            _CARRY.tensors = [weakref.ref(t) for t in tensors]
            _CARRY.thaw, self._thaw = _CARRY.thaw or self._thaw, False
        self._peak = 0

    def allocated_bytes(self) -> int:
        now = sum(n for ptr, n in live_storages(self.device).items() if ptr not in self.baseline)
        self._peak = max(self._peak, now)
        return now

    def peak_bytes(self) -> int:
        return self._peak  # largest census since reset_peak: a lower bound on the true peak

    def reserved_peak_bytes(self) -> int:
        return self.peak_bytes()

    def reset_peak(self) -> None:
        self._peak = 0

    def close(self) -> None:
        gc.collect()  # this run's reference cycles (the frozen baseline is skipped: quick)
        if self._thaw:
            gc.unfreeze()  # the baseline's objects are the collector's again


def backend_for(device: torch.device) -> str:
    """The memory backend a training device's figures come from: ``cuda`` or ``cpu-tensors``."""
    backend: str = getattr(MONITORS.get(device.type), "backend")  # noqa: B009 (a class attribute)
    return backend


def monitor_for(device: torch.device) -> MemoryMonitor:
    """The memory monitor for a training device; create it before the model is built."""
    monitor: MemoryMonitor = MONITORS.get(device.type)(device)
    return monitor


@dataclass
class StageRecorder:
    """Records each stage of the first iteration once: its level, delta and in-stage peak."""

    monitor: MemoryMonitor
    active: bool = True  # False for a resumed run: its first iteration was recorded before
    levels: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    run_peak: int = 0
    reserved_peak: int = 0

    def __post_init__(self) -> None:
        self.monitor.reset_peak()

    def mark(self, stage: str) -> None:
        """Close ``stage`` (or, for a split of PEAK_SPLITS, record the peak so far inside its stage);
        later calls for a stage already recorded do nothing."""
        if stage in self.levels or stage in self.peaks or not self.active:
            return
        if stage in PEAK_SPLITS:
            if PEAK_SPLITS[stage] not in self.levels:  # inside its stage
                self.monitor.allocated_bytes()  # the CPU twin's census happens here
                self._close_peak(stage)
            return
        if stage not in STAGES:
            raise ValueError(f"unknown memory stage {stage!r}; valid: {', '.join([*STAGES, *PEAK_SPLITS])}")
        self.levels[stage] = self.monitor.allocated_bytes()
        self._close_peak(stage)

    def _close_peak(self, name: str) -> None:
        self.peaks[name] = self.monitor.peak_bytes()
        self.run_peak = max(self.run_peak, self.peaks[name])
        self.reserved_peak = max(self.reserved_peak, self.monitor.reserved_peak_bytes())
        self.monitor.reset_peak()

    @property
    def complete(self) -> bool:
        return len(self.levels) == len(STAGES) or not self.active

    def observe(self) -> int:
        """Fold the current level and peak into the run peak (call it e.g. once per epoch)."""
        self.monitor.allocated_bytes()  # the CPU twin's census happens here
        self.run_peak = max(self.run_peak, self.monitor.peak_bytes())
        self.reserved_peak = max(self.reserved_peak, self.monitor.reserved_peak_bytes())
        return self.run_peak

    def figures(self) -> dict[str, int]:
        """In bytes: ``<stage>_bytes`` levels, ``<stage>_delta_bytes``, ``<stage>_peak_bytes`` (the
        highest level inside the stage; ``forward_peak_bytes`` for the backward stage's part up to the
        end of the forward pass, see PEAK_SPLITS) and the first-iteration peaks."""
        out: dict[str, int] = {}
        previous = 0
        for stage in STAGES:
            if stage not in self.levels:
                continue
            out[f"{stage}_bytes"] = self.levels[stage]
            out[f"{stage}_delta_bytes"] = self.levels[stage] - previous
            previous = self.levels[stage]
        for stage, peak in self.peaks.items():  # the highest level inside each stage: on CUDA,
            out[f"{stage}_peak_bytes"] = peak  # activations and clipping buffers freed before its end
        if self.peaks:
            out["iteration_peak_bytes"] = max(self.peaks.values())
            out["reserved_peak_bytes"] = self.reserved_peak
        return out

    def metrics(self) -> dict[str, float]:
        """:meth:`figures` as a run logs them: in MiB, ``system/memory/backward_mib`` and the others
        (:func:`dpsweep.memory.tables.logged_values`; :func:`dpsweep.memory.tables.logged` reads them
        back in bytes)."""
        return logged_values(self.figures())


def model_key(cfg: Config) -> str:
    """The name memory models are fitted under: the model, with ``+cache`` when VGG16's frozen
    features come from the feature cache (then only the head is on the device: another model)."""
    return cfg.model.name + ("+cache" if getattr(cfg.model, "feature_cache", False) else "")


def config_features(cfg: Config, input_shape: tuple[int, int, int], trainable_params: int) -> dict[str, object]:
    """One config as a row of the probe table's config columns (what memory models are fitted on)."""
    channels, height, width = input_shape
    return {
        "model": model_key(cfg),
        "dataset": cfg.dataset.name,
        "hidden_units": cfg.model.hidden_units,
        "batch_size": cfg.train.batch_size,
        "channels": channels,
        "height": height,
        "width": width,
        "trainable_params": trainable_params,
        "dp": bool(cfg.dp.enabled),
        "grad_sample_mode": step_kind(cfg.dp),  # Opacus's mode, fused, or none without DP
    }
