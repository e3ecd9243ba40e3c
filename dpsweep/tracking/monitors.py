"""MLflow's system metrics of a run (CPU, memory, disk, network, GPU), started after a delay and
stopped with the run; under DP without the GPU's memory, which follows the private batch sizes.

    start_system_metrics(run_id, uri, 60.0, 10.0, True)  # what dpsweep.tracking.system_metrics does
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Any

from dpsweep.tracking.store import set_tags

_MONITORS: dict[str, Any] = {}  # run id -> its system metrics monitor, or the timer that starts it
_MONITORS_LOCK = threading.Lock()

# The card's memory in use, as MLflow's GPU monitors (NVIDIA and ROCm) name it. It follows the largest
# batch a run has held: on an H200, 4.8, 5.1 and 11.4 GB for DP runs of B = 16, 64 and 128
# (benchmarks/system_metrics_gpu.py, analysis/data/system_metrics_gpu_h200.json), so under DP it
# would tell the sizes of the private Poisson batches, as the memory peak that DP runs withhold does.
GPU_MEMORY_METRIC = re.compile(r"gpu_\d+_memory_usage_")
GPU_MEMORY_TAG = "system_metrics.gpu_memory"


def without_gpu_memory(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` (MLflow's system metric names, before their ``system/`` prefix) less GPU memory."""
    return {k: v for k, v in metrics.items() if not GPU_MEMORY_METRIC.match(k)}


def system_metrics_monitor(run_id: str, uri: str, interval_s: float, withhold_gpu_memory: bool) -> Any:
    """MLflow's ``SystemMetricsMonitor`` for ``run_id`` (not started), one sample per logged step; with
    ``withhold_gpu_memory`` (DP runs) it logs everything but the GPU memory metrics."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class PrivateRunMonitor(SystemMetricsMonitor):
        def publish_metrics(self, metrics: dict[str, float]) -> None:
            super().publish_metrics(without_gpu_memory(metrics))

    kind = PrivateRunMonitor if withhold_gpu_memory else SystemMetricsMonitor
    return kind(run_id, sampling_interval=interval_s, samples_before_logging=1, tracking_uri=uri)


def start_system_metrics(
    run_id: str, uri: str, after_s: float, interval_s: float, withhold_gpu_memory: bool = False
) -> None:
    """MLflow's system metrics (CPU, memory, disk, network, and GPU where pynvml finds one: the
    machine's) logged to ``run_id`` every
    ``interval_s``, from ``after_s`` seconds on, until :func:`stop_system_metrics`. With
    ``withhold_gpu_memory`` (DP runs) the GPU memory metrics are left out, and the run is tagged so."""
    if withhold_gpu_memory:
        set_tags(uri, run_id, {GPU_MEMORY_TAG: "withheld: under DP it follows the private batch sizes"})

    def start() -> None:  # psutil and pynvml are imported only by runs that reach after_s
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no "Started monitoring" lines
        with _MONITORS_LOCK:
            if _MONITORS.get(run_id) is not timer:  # stopped meanwhile
                return
            monitor = system_metrics_monitor(run_id, uri, interval_s, withhold_gpu_memory)
            monitor.start()
            _MONITORS[run_id] = monitor

    timer = threading.Timer(after_s, start)
    timer.daemon = True
    with _MONITORS_LOCK:
        _MONITORS[run_id] = timer
    timer.start()


def stop_system_metrics(run_id: str) -> None:
    """Stop the run's system metrics (their last sample flushed), or the timer that would start them."""
    with _MONITORS_LOCK:
        found = _MONITORS.pop(run_id, None)
    if isinstance(found, threading.Timer):
        found.cancel()
        found.join()  # a start under way ends first (and finds itself stopped)
    elif found is not None:
        found.finish()
