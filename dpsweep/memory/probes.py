"""Probe runs in MLflow: a probe sweep run in fresh processes, and the probe table read back from the store.

    from dpsweep.memory import probes
    table = probes.probe_table("sqlite:///mlflow.db", "dpsweep-probes")     # one row per config and device
    swept = probes.run_probe_sweep(overrides, uri, experiment, hashes, Path("probes.csv"))

A probe (``train.probe=true``, see :mod:`dpsweep.memory.stages`) is an MLflow run tagged ``probe=true``
that logs the bytes allocated after each stage of the first training iteration, in MiB
(:func:`dpsweep.memory.tables.metric`). The probe table holds one row per probe: the config columns
(see :func:`dpsweep.memory.stages.config_features`) and :data:`MEASURED` in bytes, the schema
``dpsweep.analysis.memory_model`` fits. ``dpsweep-memory probe`` and ``fit`` call these; MLflow and
pandas are imported where used.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpsweep.errors import InputError
from dpsweep.memory.model import STAGE_PEAK_TARGETS
from dpsweep.memory.tables import logged, metric

if TYPE_CHECKING:
    import pandas as pd

# The probe table: config columns (see dpsweep.memory.stages.config_features), then the measurements.
MEASURED = (
    "model_load_bytes", "batch_load_bytes", "backward_bytes", "optimizer_step_bytes",
    "model_load_delta_bytes", "batch_load_delta_bytes", "backward_delta_bytes", "optimizer_step_delta_bytes",
    "iteration_peak_bytes", "reserved_peak_bytes",
)  # fmt: skip

# Told of each run left out of a probe table: the sentence that says which and why
Note = Callable[[str], None]


@dataclass(frozen=True)
class ProbeSweep:
    """What a probe sweep did: the sweep's exit code, this sweep's probe table and how many of its
    configs have no FINISHED probe in it."""

    returncode: int
    table: pd.DataFrame
    missing: int


def run_probe_sweep(
    overrides: Sequence[str], uri: str, experiment: str, hashes: Sequence[str], csv: Path, note: Note | None = None
) -> ProbeSweep:
    """Run the sweep ``dpsweep -m overrides`` (probe overrides, each config a fresh process through its
    launcher), then read back the probes it finished of the configs ``hashes`` from ``experiment`` of
    ``uri`` and write them to ``csv``. Only probes started since this call count: a config probed
    before is measured afresh (that probe may be of another device)."""
    command = [sys.executable, "-m", "dpsweep", "-m", *overrides]
    started_ms = int(time.time() * 1000)
    done = subprocess.run(command, check=False)
    table = probe_table(uri, experiment, hashes, since_ms=started_ms, note=note)
    csv.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(csv, index=False)
    return ProbeSweep(done.returncode, table, len(set(hashes)) - len(table))


def probe_table(
    uri: str,
    experiment: str,
    hashes: Sequence[str] | None = None,
    since_ms: int | None = None,
    note: Note | None = None,
) -> pd.DataFrame:
    """The FINISHED probes of an experiment (only those of ``hashes``, and started at or after
    ``since_ms``, when given), one row each, newest per config and device: the config columns and
    the measurements in bytes. Runs that lack a probe's tags or metrics are left out, each told to
    ``note``."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise InputError("--experiment", experiment, f"an experiment of {uri} that holds probes")
    rows: dict[str, dict[str, Any]] = {}
    token = None
    while True:
        page = client.search_runs(
            [exp.experiment_id], filter_string="tags.probe = 'true' and attributes.status = 'FINISHED'",
            max_results=10000, order_by=["attributes.start_time ASC"], page_token=token,
        )  # fmt: skip
        for run in page:
            tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
            h = tags.get("config.hash")
            if (hashes is not None and h not in hashes) or (since_ms is not None and run.info.start_time < since_ms):
                continue
            try:
                row = _probe_row(run, tags, params, metrics)
            except (KeyError, ValueError) as err:
                if note is not None:
                    note(f"run {run.info.run_id} is not a complete probe ({err}); left out")
                continue
            rows[f"{h}/{row['device_name']}"] = row
        token = page.token
        if not token:
            break
    return pd.DataFrame(list(rows.values()))


def _measured(metrics: dict[str, float], name: str, missing: float | None = None) -> float:
    """Memory figure ``name`` (``backward_bytes``) of a probe run, in bytes (logged in MiB, or in bytes
    under an older dpsweep's name: :func:`dpsweep.memory.tables.logged`); ``missing`` if it was not
    logged, or KeyError without one."""
    value = logged(metrics, name)
    if value is not None:
        return value
    if missing is None:
        raise KeyError(metric(name))
    return missing


def _probe_row(run: Any, tags: dict[str, str], params: dict[str, str], metrics: dict[str, float]) -> dict[str, Any]:
    """One probe run as a row of the probe table (KeyError or ValueError when something is missing)."""
    h = tags.get("config.hash")
    channels, height, width = (int(v) for v in tags["dataset.input_shape"].split("x"))
    dp = params.get("dp.enabled") == "True"
    row: dict[str, Any] = {
        "run_id": run.info.run_id,
        "config_hash": h,
        "model": params["model.name"] + ("+cache" if params.get("model.feature_cache") == "True" else ""),
        "dataset": params["dataset.name"],
        "hidden_units": int(params["model.hidden_units"]),
        "batch_size": int(params["train.batch_size"]),
        "channels": channels,
        "height": height,
        "width": width,
        "trainable_params": int(tags["model.trainable_params"]),
        "dp": dp,
        "grad_sample_mode": params.get("dp.grad_sample_mode", "hooks") if dp else "none",
        "backend": tags["memory.backend"],
        "device_name": tags.get("device.name", ""),
        "torch_version": tags.get("torch.version", ""),
    }
    row |= {name: int(_measured(metrics, name)) for name in MEASURED}
    # the in-stage peaks, logged since dpsweep 0.2: an older probe's row has them empty (its fit leaves them out)
    row |= {name: _measured(metrics, name, float("nan")) for name in STAGE_PEAK_TARGETS}
    return row
