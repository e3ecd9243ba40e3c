"""Check: the largest batch ``dpsweep-memory predict`` allows on this GPU runs, and the real limit is near.

    .venv/bin/python benchmarks/oom_check.py --memory-model memory_model.json             # every case
    .venv/bin/python benchmarks/oom_check.py --memory-model m.json --case cnn --json oom.json

For each case (one config per model, chosen so that the card fills up before the 1,437 digits run out):

1. ``dpsweep-memory predict --json --gpu-memory <the card's total memory>`` gives the largest pass, B*
   (``largest_physical_batch_size``: the most examples one forward/backward may hold). A probe holds
   exactly its ``train.batch_size`` in one pass, so B* is what it can check. The largest *logical* batch
   (``largest_batch_size``) is smaller under DP: its Poisson batches must stay under B* too (exceeded
   with probability < 1e-6), and it is printed beside it.
2. ``dpsweep train.probe=true train.batch_size=B*`` (the first iteration, on exactly B* examples, a fresh
   process) must finish.
3. ``train.batch_size=B*+1``, the next size up, is run too; then larger batches (B* grown by 2%, 5%, 10%,
   20%, 40%, 80%) until one fails with CUDA out-of-memory, and the gap is bisected: the real largest batch
   B_real is printed beside B*. The prediction is safe when B* runs, and tight when B*/B_real is near 1.

Every size above B* that was tried is a size the plan rejects: the JSON lists those that ran out of memory
on the card (``plan_rejected_and_oom``) and those that ran all the same (``plan_rejected_but_ran``: the
allocator headroom's cost, ``memory_predict.ALLOCATOR_HEADROOM``).

It exits 1 when B* does not run, or when a run fails for another reason than out-of-memory.
Needs CUDA and a memory model of CUDA probes (``dpsweep-memory fit``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CASES: dict[str, list[str]] = {
    "cnn": ["model=cnn", "model.hidden_units=512", "dataset.image_size=224", "dp=dpsgd",
            "dp.noise_multiplier=1.0", "dp.grad_sample_mode=hooks"],
    "vgg16_frozen": ["model=vgg16_frozen", "model.pretrained=false", "model.feature_cache=false",
                     "model.hidden_units=1024", "dataset.image_size=224", "dp=dpsgd", "dp.noise_multiplier=1.0",
                     "dp.grad_sample_mode=hooks"],
}  # fmt: skip
GROWTH = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8)
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory")


def predicted_largest(overrides: list[str], memory_model: Path, gpu_memory: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "dpsweep.cli.memory", "predict", "--json", "--memory-model", str(memory_model),
               "--gpu-memory", gpu_memory, *overrides]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    prediction: dict[str, Any] = json.loads(done.stdout)[0]
    return prediction


def probe(overrides: list[str], batch_size: int, workdir: Path) -> str:
    """``ok``, ``oom``, or the tail of the output of a run that failed otherwise."""
    extra = [f"train.batch_size={batch_size}", "train.probe=true", "train.device=cuda",
             f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}", "tracking.experiment_name=oom_check",
             f"hydra.run.dir={workdir / 'hydra'}"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "dpsweep", *overrides, *extra], cwd=workdir,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode == 0:
        return "ok"
    text = done.stdout + done.stderr
    return "oom" if any(m in text for m in OOM_MARKERS) else text[-3000:]


def check_case(name: str, memory_model: Path, gpu_memory: str, workdir: Path) -> dict[str, Any]:
    overrides = CASES[name]
    prediction = predicted_largest(overrides, memory_model, gpu_memory)
    best = prediction["largest_physical_batch_size"]  # one pass of exactly B examples, as a probe makes
    tried: dict[int, str] = {}

    def run(b: int) -> str:
        tried[b] = probe(overrides, b, workdir)
        print(f"  {name}: train.batch_size={b}: {tried[b] if tried[b] in ('ok', 'oom') else 'FAILED'}", flush=True)
        return tried[b]

    result: dict[str, Any] = {
        "case": name, "overrides": overrides, "gpu_memory": gpu_memory,
        "predicted_largest_pass": best, "predicted_largest_batch_size": prediction["largest_batch_size"],
        "prediction": prediction, "tried": tried,
    }  # fmt: skip
    if not best:
        result["problems"] = ["predict found no pass size that fits"]
        return result
    problems = []
    if run(best) != "ok":
        problems.append(f"the predicted largest pass B*={best} did not run: {tried[best]}")
    ok, failed = best if tried[best] == "ok" else 0, None
    if not ok:  # the prediction was too large: find a batch that runs, shrinking it
        failed = best
        for shrink in GROWTH:
            b = max(1, int(best / (1 + shrink)))
            if run(b) == "ok":
                ok = b
                break
            failed = b
    elif run(best + 1) == "ok":
        ok = best + 1
        for growth in GROWTH:
            b = math.ceil(best * (1 + growth))
            if b <= ok:
                continue
            if run(b) == "ok":
                ok = b
            else:
                failed = b
                break
    else:
        failed = best + 1
    while failed is not None and ok and failed - ok > max(1, ok // 100):  # bisect to 1%
        mid = (ok + failed) // 2
        if run(mid) == "ok":
            ok = mid
        else:
            failed = mid
    others = [f"B={b}: {s}" for b, s in tried.items() if s not in ("ok", "oom")]
    problems += [f"a run failed for another reason than out-of-memory: {o}" for o in others]
    # The plan accepts exactly the sizes up to B*: each larger one tried either ran (the headroom's cost)
    # or ran out of memory on the card (a rejection borne out).
    rejected = {b: s for b, s in tried.items() if b > best}
    result |= {"real_largest_batch_size_at_least": ok, "first_oom_batch_size": failed, "problems": problems,
               "plan_rejected_and_oom": sorted(b for b, s in rejected.items() if s == "oom"),
               "plan_rejected_but_ran": sorted(b for b, s in rejected.items() if s == "ok")}  # fmt: skip
    return result


def card_memory() -> str:
    """What the caching allocator of a training process can get: the card's memory less what CUDA
    holds outside the allocator (the context, cuBLAS's and cuDNN's handles and workspaces), measured
    here after a small convolution and matrix product have loaded them. The README's advice for
    ``--gpu-memory`` (leave room for the context) is what this follows; the card's total would
    over-state the room by that much (a run on an H100 that took the total found the predicted pass
    about 1% too large: some 0.8 GB)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("oom_check needs CUDA")
    x = torch.randn(8, 3, 32, 32, device="cuda", requires_grad=True)
    conv = torch.nn.Conv2d(3, 8, 3).cuda()
    (conv(x).flatten(1) @ torch.randn(8 * 30 * 30, 4, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()  # held by CUDA, not by torch's allocator
    print(f"card: {total:,} B; outside the allocator after start-up: {outside:,} B; "
          f"planning with {total - outside:,} B", flush=True)  # fmt: skip
    return f"{total - outside}B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory-model", type=Path, required=True, help="from dpsweep-memory fit")
    parser.add_argument("--gpu-memory", help="default: the card's memory less what CUDA holds outside the allocator")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    gpu_memory = args.gpu_memory or card_memory()
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    results = []
    for name in args.case or list(CASES):
        with tempfile.TemporaryDirectory(prefix="oom_check_") as tmp:
            r = check_case(name, args.memory_model.resolve(), gpu_memory, Path(tmp))
        results.append(r)
        real, first = r.get("real_largest_batch_size_at_least"), r.get("first_oom_batch_size")
        ratio = f"{r['predicted_largest_pass'] / real:.1%} of it" if real else "-"
        print(f"{name}: --gpu-memory {gpu_memory}: predicted largest pass {r['predicted_largest_pass']} "
              f"(largest logical batch {r['predicted_largest_batch_size']}, whose Poisson batches stay under it); "
              f"real largest pass ≥ {real} (first OOM at {first}); the prediction is {ratio}")  # fmt: skip
        if "plan_rejected_and_oom" in r:
            print(f"  rejected by the plan: ran out of memory at {r['plan_rejected_and_oom']}; "
                  f"ran at {r['plan_rejected_but_ran'] or 'none'}")  # fmt: skip
        for p in r["problems"]:
            print(f"  PROBLEM: {p}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    sys.exit(1 if any(r["problems"] for r in results) else 0)


if __name__ == "__main__":
    main()
