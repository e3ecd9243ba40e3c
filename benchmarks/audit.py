"""Benchmark: the one-run privacy audit (issue 36) on digits, at claimed ε = 1, 4 and 8.

    .venv/bin/python benchmarks/audit.py                  # 20 seeds (about 7 minutes on 2 cores)
    .venv/bin/python benchmarks/audit.py --seeds 5 --json /tmp/audit.json
    .venv/bin/python benchmarks/audit.py --mechanisms dpftrl,fused,user,gan   # the steps outside Opacus

Each run is the default digits/cnn DP-SGD run (B = 64, 10 epochs, C = 1, δ = 1e-5, PLD; σ calibrated
to the claim) with ``audit.mode=white_box``: 1,000 Dirac gradient canaries, 100 guesses, 95%
confidence (:mod:`dpsweep.audit`). For each claimed ε it records:

- correct runs, seeds 0 .. n − 1 (the audit's seed with them): both lower bounds, Steinke et al.'s
  (``audit.epsilon_lower``) and the f-DP one against the run's ledger (``audit.epsilon_lower_fdp``):
  their mean, largest, the share of the claim the mean reaches, and how many runs either flags
  (exceeds the claim: soundness wants none);
- one run with each bug of ``tests/planted.py``'s ``BUGS`` planted (seed 0), attached to the run as a
  test attaches it (``train(cfg, attach=[planted.bug(...)])``): both bounds, and
  whether either exceeds the claim (a detection);
- the cost: the median wall time of 3 audit runs against 3 plain runs of the same config (MLflow
  included, in this process);
- correct runs with ``audit.mode=black_box`` (1,000 mislabelled training examples as canaries, about
  half left out, scored by the final model's loss), the same seeds: their bounds.

``--mechanisms`` audits other mechanisms the same way, white box only: ``dpftrl`` (DP-FTRL, momentum
0.9, a tree restart every 2 epochs, completed; it samples nothing, so the sample rate reported at half
does not apply), ``fused`` (the fused step), ``user`` (user-level DP-SGD over 1,000 users of digits,
B = 50 users) and ``gan`` (the DP-WGAN-GP's critic, small networks). ``--black-box`` runs the black box
alone, for the mechanisms that have one (not ``user``):

    .venv/bin/python benchmarks/audit.py --black-box --mechanisms dpftrl,fused,gan --seeds 5

Writes ``--json`` (default ``analysis/data/audit_cpu.json`` for Opacus alone,
``analysis/data/audit_black_box_cpu.json`` with ``--black-box``, else
``analysis/data/audit_own_steps_cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the planted bugs live with the tests
import planted  # tests/planted.py

CLAIMS = (1.0, 4.0, 8.0)


def run(store: str, overrides: list[str], bug: str | None = None) -> tuple[dict[str, float], float]:
    """One run's metrics and its wall time."""
    from hydra import compose, initialize_config_module

    from dpsweep.run.runner import train

    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        cfg = compose("config", overrides=[
            f"tracking.uri={store}", "tracking.experiment_name=audit", "tracking.log_model=false",
            "train.progress=false", *overrides,
        ])  # fmt: skip
    with pytest.MonkeyPatch.context() as monkeypatch:  # what a bug patches is undone after its run
        attach = [] if bug is None else [planted.bug(bug, monkeypatch)]
        started = time.perf_counter()
        result = train(cfg, attach=attach)
        seconds = time.perf_counter() - started
    from mlflow.tracking import MlflowClient

    return dict(MlflowClient(store).get_run(result.run_id).data.metrics), seconds


MECHANISMS = {  # what each run adds to the default digits/cnn DP-SGD run through Opacus
    "opacus": [],
    "dpftrl": [
        "dp.mechanism=dpftrl",
        "optimizer.momentum=0.9",
        "dp.ftrl_restart_every=2",
        "dp.ftrl_tree_completion=true",
    ],
    "fused": ["dp.engine=fused"],
    "user": ["dp.unit=user", "dataset.users=partition", "dataset.num_users=1000", "train.batch_size=50"],
    "gan": ["task=gan", "task.tstr_epochs=1", "task.critic_width=8", "task.generator_width=16"],
}


BOUNDS = {"steinke": "audit.epsilon_lower", "fdp": "audit.epsilon_lower_fdp"}  # the two readings of the guesses


def correct_runs(runs: list[dict[str, float]], claim: float) -> dict[str, Any]:
    """Each bound's values over correct runs, their mean, largest and share of the claim, and how many
    runs either bound flags (soundness wants none)."""
    record: dict[str, Any] = {}
    for name, metric in BOUNDS.items():
        values = [m[metric] for m in runs]
        record[name] = {"bounds": values, "mean": statistics.fmean(values), "max": max(values),
                        "share_of_claim": statistics.fmean(values) / claim}  # fmt: skip
    record["flagged"] = sum(flagged(m, claim) for m in runs)
    return record


def flagged(m: dict[str, float], claim: float) -> bool:
    """Either bound above the claim, or the f-DP test rejecting the run's own ledger."""
    return max(m[metric] for metric in BOUNDS.values()) > claim or m.get("audit.claim_rejected", 0.0) == 1


def planted_run(m: dict[str, float], claim: float) -> dict[str, Any]:
    """A broken run's two bounds, whether the f-DP test rejected its ledger, and whether it was caught."""
    bounds = {name: m[metric] for name, metric in BOUNDS.items()}
    rejected = m.get("audit.claim_rejected", 0.0) == 1
    return bounds | {"claim_rejected": rejected, "detected": flagged(m, claim)}


def shown(planted: dict[str, dict[str, Any]]) -> str:
    return ", ".join(
        f"{bug} {p['steinke']:.3f}/{p['fdp']:.3f}{' DETECTED' if p['detected'] else ''}" for bug, p in planted.items()
    )


def claim_record(store: str, claim: float, mechanism: str, seeds: int) -> dict[str, Any]:
    """One claimed ε of one mechanism: correct runs over ``seeds``, each planted bug it can take, the
    cost, and (Opacus only) the black box."""
    base = [f"dp.target_epsilon={claim:g}", *MECHANISMS[mechanism]]
    audit = [*base, "audit.mode=white_box"]
    correct = correct_runs([run(store, [*audit, f"train.seed={s}", f"audit.seed={s}"])[0] for s in range(seeds)], claim)
    takes = [bug for bug in planted.BUGS if not (mechanism == "dpftrl" and bug == "half_sample_rate")]
    bugs = {bug: planted_run(run(store, audit, bug)[0], claim) for bug in takes}
    audit_s = [run(store, [*audit, "train.seed=100"])[1] for _ in range(3)]
    plain_s = [run(store, [*base, "train.seed=100"])[1] for _ in range(3)]
    cost = statistics.median(audit_s) / statistics.median(plain_s)
    record: dict[str, Any] = {
        "correct": correct,
        "planted": bugs,
        "seconds": {"audit": audit_s, "plain": plain_s, "ratio": cost},
    }
    st, fd = correct["steinke"], correct["fdp"]
    line = (f"{mechanism}, claimed ε={claim:g}: correct runs' bounds (Steinke / f-DP) mean {st['mean']:.3f} / "
            f"{fd['mean']:.3f} (max {st['max']:.3f} / {fd['max']:.3f}; {fd['mean'] / claim:.0%} of the claim), "
            f"{correct['flagged']} of {seeds} flagged; planted: {shown(bugs)}; "
            f"audit run / plain run: {cost:.2f}x")  # fmt: skip
    if mechanism == "opacus":
        record["black_box"], black = black_box_record(store, claim, mechanism, seeds)
        line += f"; {black}"
    print(line, flush=True)
    return record


def black_box_record(store: str, claim: float, mechanism: str, seeds: int) -> tuple[dict[str, Any], str]:
    """The black box at one claimed ε: correct runs over ``seeds``, and each planted bug the mechanism
    takes; the record and its line."""
    base = [f"dp.target_epsilon={claim:g}", *MECHANISMS[mechanism], "audit.mode=black_box"]
    blind = correct_runs([run(store, [*base, f"train.seed={s}", f"audit.seed={s}"])[0] for s in range(seeds)], claim)
    takes = [bug for bug in planted.BUGS if not (mechanism == "dpftrl" and bug == "half_sample_rate")]
    bugs = {bug: planted_run(run(store, base, bug)[0], claim) for bug in takes}
    line = (f"black box: mean {blind['steinke']['mean']:.3f} / {blind['fdp']['mean']:.3f} (max "
            f"{blind['steinke']['max']:.3f} / {blind['fdp']['max']:.3f}), {blind['flagged']} of {seeds} flagged, "
            f"planted: {shown(bugs)}")  # fmt: skip
    return blind | {"planted": bugs}, line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--mechanisms", default="opacus", help=f"comma-separated, of {', '.join(MECHANISMS)}")
    parser.add_argument("--black-box", action="store_true", help="the black box alone, of --mechanisms "
                        "(default analysis/data/audit_black_box_cpu.json)")  # fmt: skip
    parser.add_argument("--json", default=None, help="default analysis/data/audit_cpu.json (opacus) or "
                        "analysis/data/audit_own_steps_cpu.json")  # fmt: skip
    args = parser.parse_args()
    mechanisms = args.mechanisms.split(",")
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown:
        parser.error(f"--mechanisms: {', '.join(unknown)} unknown; one of {', '.join(MECHANISMS)}")
    name = "black_box_cpu" if args.black_box else "cpu" if mechanisms == ["opacus"] else "own_steps_cpu"
    json_path = args.json or f"analysis/data/audit_{name}.json"
    started = time.monotonic()
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dpsweep-audit-") as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        for mechanism in mechanisms:
            if args.black_box:
                black = {f"{c:g}": black_box_record(store, c, mechanism, args.seeds) for c in CLAIMS}
                for c, (_, line) in black.items():
                    print(f"{mechanism}, claimed ε={c}: {line}", flush=True)
                record.setdefault("mechanisms", {})[mechanism] = {c: r for c, (r, _) in black.items()}
                continue
            claims = {f"{claim:g}": claim_record(store, claim, mechanism, args.seeds) for claim in CLAIMS}
            if mechanisms == ["opacus"]:  # the layout of the first benchmark's file
                record["claims"] = claims
            else:
                record.setdefault("mechanisms", {})[mechanism] = {"overrides": MECHANISMS[mechanism], "claims": claims}
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    )
    record |= {"machine": machine, "seconds": time.monotonic() - started, "seeds": args.seeds}
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{machine}; {record['seconds']:.0f} s; wrote {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
