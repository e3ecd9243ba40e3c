"""Benchmark: ``dpsweep-report`` over a 1,000-run sweep; the target is at most 10 s on 2 cores.

    .venv/bin/python benchmarks/report_speed.py              # prints the figures, exits 1 if over target
    .venv/bin/python benchmarks/report_speed.py --keep DIR   # keep the sqlite store and the report in DIR

It logs synthetic runs straight into a fresh sqlite store with ``MlflowClient.log_batch`` (no
training; this setup is not timed): one sweep of 1,000 runs, with the params, tags and metrics a
real run logs (the flattened config, per-epoch accuracy, loss, ε and peak memory, the four memory
stages, ε under both accountants). 800 are FINISHED DP runs (5 σ × 4 B × 2 C × 4 lr × 5 seeds), 80
FINISHED non-private runs (4 B × 4 lr × 5 seeds), 80 FAILED and 40 pruned; plus the sweep's parent
run and 20 memory probes, which the report leaves out.

Then it times the report as a user runs it, in a fresh process, imports included:
``dpsweep-report --experiment bench --sweep ID --out DIR`` (read, table, markdown, every plot, and
the files logged on the parent run); and, in this process, each stage on its own.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from dpsweep.memory.tables import logged_values, metric, to_logged

TARGET_S = 10.0
EXPERIMENT = "bench"
SWEEP_ID = "bench0000001"
N_TRAIN = 1437  # digits
EPOCHS = 5
SIGMAS = [0.5, 0.8, 1.1, 1.5, 2.0]
BATCH_SIZES = [64, 128, 256, 512]
CLIPS = [0.5, 1.0]
LRS = [0.01, 0.05, 0.1, 0.5]
SEEDS = range(5)
N_FAILED, N_PRUNED, N_PROBES = 80, 40, 20

BASE_PARAMS = {  # what dpsweep logs besides the swept keys (a flattened config)
    "dataset.name": "digits", "dataset.image_size": "28", "dataset.split_seed": "0", "dataset.test_fraction": "0.2",
    "model.name": "cnn", "model.hidden_units": "32", "optimizer.name": "sgd", "optimizer.momentum": "0.9",
    "optimizer.weight_decay": "0.0", "train.device": "auto", "train.eval_batch_size": "1024",
    "train.progress": "False", "tracking.experiment_name": EXPERIMENT, "tracking.run_name": "None",
    "launcher.name": "inline", "launcher.cpus_per_job": "1", "launcher.gpus_per_job": "0", "launcher.mem_gb": "4",
    "launcher.timeout_min": "60", "launcher.max_parallel": "1", "launcher.partition": "None", "launcher.setup": "[]",
    "launcher.gpu_resource": "gpu={gpus}", "sweep.id": SWEEP_ID, "sweep.max_epsilon": "None",
    "train.epochs": str(EPOCHS),
}  # fmt: skip
DP_PARAMS = {"dp.enabled": "True", "dp.delta": "1e-05", "dp.accountant": "rdp", "dp.target_epsilon": "None",
             "dp.allow_large_delta": "False"}  # fmt: skip
TAGS = {
    "sweep.id": SWEEP_ID, "memory.backend": "cpu-tensors", "dataset.n_train": str(N_TRAIN), "dataset.n_test": "360",
    "torch.version": "2.x", "opacus.version": "1.x", "device.name": "cpu", "git.commit": "bench",
    "model.trainable_params": "26010",
}  # fmt: skip


def _metrics(rng: np.random.Generator, private: bool, sigma: float, batch_size: int, lr: float) -> list[Metric]:
    now = int(time.time() * 1000)
    quality = 0.97 - (0.35 / sigma**0.5 if private else 0.0) * 0.5 - abs(np.log10(lr / 0.05)) * 0.05
    eps_final = 6.0 * (batch_size / N_TRAIN) ** 0.5 * EPOCHS**0.5 / sigma
    out = []
    for epoch in range(1, EPOCHS + 1):
        acc = float(np.clip(quality * (1 - 0.5 ** (epoch + 1)) + rng.normal(0, 0.01), 0, 1))
        values = {"test_accuracy": acc, "train_loss": 2.3 * (1 - acc)}
        values[metric("peak_bytes")] = to_logged(8e6 * batch_size / 64)  # in MiB, as runs log it
        if private:
            values["epsilon"] = eps_final * (epoch / EPOCHS) ** 0.5
        out += [Metric(k, v, now, epoch) for k, v in values.items()]
    scale = batch_size / 64
    stages = {"model_load": 1e5, "batch_load": 3e5 * scale, "backward": (8e6 if private else 4e5) * scale}
    stages["optimizer_step"] = peak = stages["backward"] + 2e5
    figures = {f"{k}_bytes": v for k, v in stages.items()} | {f"{k}_delta_bytes": v / 2 for k, v in stages.items()}
    first = logged_values(figures | {"iteration_peak_bytes": peak, "reserved_peak_bytes": peak})  # in MiB
    out += [Metric(k, float(v), now, 0) for k, v in first.items()]
    if private:
        out += [Metric("epsilon_rdp", eps_final, now, EPOCHS), Metric("epsilon_prv", eps_final * 0.85, now, EPOCHS)]
    return out


def log_runs(uri: str, artifacts: Path) -> int:
    """Log the synthetic sweep; returns the number of runs the report will count."""
    client = MlflowClient(uri)
    exp = client.create_experiment(EXPERIMENT, artifact_location=artifacts.as_uri())
    rng = np.random.default_rng(0)
    parent = client.create_run(exp, run_name=f"sweep-{SWEEP_ID}", tags={"sweep.id": SWEEP_ID, "sweep.role": "parent"})
    jobs: list[tuple[bool, float, int, float, float, int, str]] = [
        (True, s, b, c, lr, seed, "FINISHED")
        for s, b, c, lr, seed in itertools.product(SIGMAS, BATCH_SIZES, CLIPS, LRS, SEEDS)
    ]
    jobs += [(False, 1.0, b, 1.0, lr, seed, "FINISHED") for b, lr, seed in itertools.product(BATCH_SIZES, LRS, SEEDS)]
    jobs += [(True, SIGMAS[i % 5], 64, 1.0, 0.05, 100 + i, "FAILED") for i in range(N_FAILED)]
    jobs += [(True, SIGMAS[i % 5], 64, 1.0, 0.05, 200 + i, "KILLED") for i in range(N_PRUNED + N_PROBES)]
    for i, (private, sigma, batch_size, clip, lr, seed, status) in enumerate(jobs):
        params = BASE_PARAMS | {"train.batch_size": str(batch_size), "optimizer.lr": str(lr), "train.seed": str(seed)}
        params |= {"tracking.uri": uri, "train.checkpoint_dir": f"/tmp/bench/{i}/checkpoint"}
        tags = TAGS | {"mlflow.parentRunId": parent.info.run_id, "dp.enabled": str(private)}
        if private:
            params |= DP_PARAMS | {"dp.noise_multiplier": str(sigma), "dp.max_grad_norm": str(clip)}
            tags |= {"dp.delta": "1e-05", "dp.accountant": "rdp"}
        else:
            params["dp.enabled"] = "False"
        probe = i >= len(jobs) - N_PROBES
        if status == "KILLED":
            tags |= {"probe": "true"} if probe else {"optuna.pruned": "true"}
            status = "FINISHED" if probe else status
        run_id = client.create_run(exp, tags=tags).info.run_id
        metrics = _metrics(rng, private, sigma, batch_size, lr) if status == "FINISHED" else []
        client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()],
                         tags=[RunTag("mlflow.runName", f"bench-{i}")])  # fmt: skip
        client.set_terminated(run_id, status)
    client.set_terminated(parent.info.run_id, "FINISHED")
    return len(jobs) - N_PROBES


def time_stages(uri: str, out: Path) -> dict[str, float]:
    """Each stage of the report in this process, in seconds (imports excluded)."""
    from dpsweep.analysis import report
    from dpsweep.analysis.report import plots

    stages: dict[str, float] = {}
    start = time.perf_counter()
    r = report.build_report(uri, EXPERIMENT, SWEEP_ID)
    stages["read + table + checks"] = time.perf_counter() - start
    start = time.perf_counter()
    for fmt in report.FORMATS:
        report.render(r, fmt)
    stages["render md, csv, tex, html"] = time.perf_counter() - start
    start = time.perf_counter()
    histories = report.metric_histories(uri, report.best_runs(r.runs))
    paths = plots.plot_report(r, out, histories)
    stages[f"{len(paths)} plots (+ 3 metric histories)"] = time.perf_counter() - start
    assert r.counts["total"] == 1000 and r.counts["pruned"] == N_PRUNED, r.counts
    return stages


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep the store and the report here")
    a = p.parse_args()
    if a.keep is not None:
        a.keep.mkdir(parents=True, exist_ok=True)
        return bench(a.keep)
    with tempfile.TemporaryDirectory(prefix="dpsweep-report-bench-") as work:
        return bench(Path(work))


def bench(work: Path) -> int:
    """Log the synthetic sweep into ``work``, then time the report; 0 if within the target."""
    db = work / "mlflow.db"
    if db.exists():
        db.unlink()
        shutil.rmtree(work / "mlruns", ignore_errors=True)
    uri = f"sqlite:///{db}"
    start = time.perf_counter()
    n = log_runs(uri, work / "mlruns")
    print(f"setup: {n} runs (+ parent, {N_PROBES} probes) logged in {time.perf_counter() - start:.1f} s (not timed)")

    command = [str(Path(sys.executable).with_name("dpsweep-report")), "--experiment", EXPERIMENT, "--sweep", SWEEP_ID,
               "--out", str(work / "cli"), "--tracking-uri", uri]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    cli_s = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr)
        return 1
    rows = sum(1 for line in proc.stdout.splitlines() if line.startswith("| ")) - 2
    files = sum(1 for line in proc.stderr.splitlines() if line.startswith("dpsweep-report: wrote "))

    stages = time_stages(uri, work / "lib")
    print(f"machine: {os.cpu_count()} cores")
    print(f"dpsweep-report --sweep --out, fresh process: {cli_s:.2f} s for {n} runs -> {rows} rows, {files} files "
          f"(logged on the parent run); target <= {TARGET_S:.0f} s")  # fmt: skip
    for name, seconds in stages.items():
        print(f"  in-process {name}: {seconds:.2f} s")
    ok = cli_s <= TARGET_S
    print("PASS" if ok else "FAIL: over target")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
