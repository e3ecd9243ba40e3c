"""Memory stages: the CPU twin counts live tensor bytes; the recorder keeps levels, deltas, peaks."""

from __future__ import annotations

import pytest
import torch

from dpsweep.memory import STAGES, CpuTensorMonitor, StageRecorder, live_tensor_bytes, monitor_for

CPU = torch.device("cpu")


def test_census_sees_a_new_tensor_once_per_storage() -> None:
    before = live_tensor_bytes(CPU)
    x = torch.zeros(1000, 250)  # 1,000,000 bytes of float32
    view = x[:10]  # shares the storage: counted once
    assert live_tensor_bytes(CPU) - before == 1_000_000
    del x, view
    assert live_tensor_bytes(CPU) - before == 0


def test_census_sees_parameter_grads_created_in_cpp() -> None:
    layer = torch.nn.Linear(100, 100, bias=False)  # 40,000 bytes of weights
    before = live_tensor_bytes(CPU)
    layer(torch.ones(1, 100)).sum().backward()  # .grad is allocated by autograd in C++
    assert live_tensor_bytes(CPU) - before >= 40_000


def test_cpu_twin_is_labelled_and_relative_to_its_baseline() -> None:
    keep = torch.ones(10_000)  # existed before the monitor: part of the baseline
    monitor = monitor_for(CPU)
    assert isinstance(monitor, CpuTensorMonitor) and monitor.backend == "cpu-tensors"
    assert monitor.allocated_bytes() == 0
    new = torch.ones(2_500)  # 10,000 bytes
    assert monitor.allocated_bytes() == 10_000
    del new
    assert monitor.allocated_bytes() == 0
    assert monitor.peak_bytes() == 10_000  # the largest census since reset
    monitor.reset_peak()
    assert monitor.peak_bytes() == 0
    del keep


def test_recorder_levels_deltas_and_peaks() -> None:
    rec = StageRecorder(monitor_for(CPU))
    held = []
    for i, stage in enumerate(STAGES, start=1):
        held.append(torch.ones(250 * i))  # stage i adds 1,000 * i bytes
        rec.mark(stage)
    m = rec.metrics()
    assert [m[f"memory.{s}_bytes"] for s in STAGES] == [1000, 3000, 6000, 10000]
    assert [m[f"memory.{s}_delta_bytes"] for s in STAGES] == [1000, 2000, 3000, 4000]
    assert m["memory.iteration_peak_bytes"] == 10000
    assert rec.complete
    rec.mark("backward")  # later iterations do not overwrite the first one
    assert rec.levels["backward"] == 6000
    held.append(torch.ones(25_000))
    assert rec.observe() == 110_000  # the run peak follows later growth


def test_unknown_stage_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: model_load, batch_load, backward, optimizer_step"):
        StageRecorder(monitor_for(CPU)).mark("forward")


def test_cuda_backend_is_registered_behind_the_same_interface() -> None:
    from dpsweep.memory import MONITORS, CudaMemoryMonitor

    assert MONITORS.get("cuda") is CudaMemoryMonitor and CudaMemoryMonitor.backend == "cuda"
    with pytest.raises(KeyError, match="valid: cpu, cuda"):
        MONITORS.get("mps")
