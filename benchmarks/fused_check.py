"""Check: the fused DP step on a device, compiled (CUDA graphs on a GPU) against eager, and a run end to end.

    .venv/bin/python benchmarks/fused_check.py                       # cuda if available, else cpu
    .venv/bin/python benchmarks/fused_check.py --json fused.json

1. The clipped sum of the compiled pass equals the eager one's (the cnn: vmap; the mlp: the linear way),
   for a batch that fits one pass and one that takes two (the CUDA graph's output buffer is reused at
   its next replay: the first pass must be kept).
   Then once more after the parameters moved in place, as the optimizer moves them: a replayed CUDA graph
   must read their new values.
2. The same at user level (``FusedUserStep``: users of at most ``M`` examples, by ``vmap`` over users), for
   a batch of users that fits one pass and one that takes two.
3. ``dpsweep dp.engine=fused`` trains 2 epochs on the device, beside a hooks run of the same
   settings, for the cnn and the mlp: the same ε and steps, and an accuracy well above chance; and, with
   ``dp.unit=user`` (50 users, 3 epochs), beside user-level DP-SGD's own steps.

Exit status 1 if a check fails. The unit tests check the same on the CPU (tests/unit/mechanisms/test_fused.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpsweep.config import CNNConfig, MLPConfig
from dpsweep.mechanisms import fused
from dpsweep.models import classifiers
from dpsweep.tracking.environment import device_name

C, PAD_TO, SEED = 0.5, 40, 0
M, USERS_PER_PASS = 4, 8  # user level: examples per user, users per pass
USERS = ["dp.unit=user", "dataset.users=partition", "dataset.num_users=50", "train.batch_size=10",
         "dp.max_examples_per_user=8", "dp.noise_multiplier=0.8", "train.epochs=3"]  # fmt: skip


def _models(device: torch.device) -> Iterator[tuple[str, nn.Module]]:
    """The cnn (the vmap way) and the mlp (the linear way), each from the same seed, on ``device``."""
    for name, config in (("cnn", CNNConfig()), ("mlp", MLPConfig())):
        torch.manual_seed(SEED)
        yield name, classifiers.build(config, (1, 28, 28), 10).to(device)


def compiled_equals_eager(device: torch.device) -> list[dict[str, Any]]:
    """Max |compiled − eager| of the clipped sum, for each model and batch size (one pass, two passes)."""
    out = []
    for name, model in _models(device):
        eager = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=PAD_TO, mode=None)
        mode = fused.compile_mode(device, compiled=True)
        compiled = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=PAD_TO, mode=mode)
        # one pass of 40 (padded), two passes (the second padded), then one pass after the parameters moved in
        # place as an optimizer's step moves them (a replayed graph must read the new values)
        for rows, moved in ((33, False), (61, False), (33, True)):
            if moved:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p), alpha=0.1)
            x = torch.randn(rows, 1, 28, 28, device=device)
            y = torch.randint(0, 10, (rows,), device=device)
            what = f"{rows} rows{', parameters moved' if moved else ''}"
            row = _compare(name, what, compiled, eager, (x, y))
            out.append(row | {"rows": rows, "passes": -(-rows // PAD_TO), "parameters_moved": moved})
    return out


def _compare(name: str, what: str, compiled: Any, eager: Any, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Max |compiled − eager| of one batch's clipped sum, the compiled pass replayed three times."""
    expected = eager.clipped_sum(*batch).clone()
    for _ in range(3):  # replays of the graph, not only its first run
        got = compiled.clipped_sum(*batch).clone()
    diff, scale = float((got - expected).abs().max()), float(expected.abs().max())
    ok = diff <= 1e-4 * max(scale, 1.0)
    print(f"{name} ({compiled.way}) {what}: compiled vs eager max |diff| {diff:.3g} (scale {scale:.3g}) "
          f"{'PASS' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return {"model": name, "way": compiled.way, "batch": what, "max_abs_diff": diff, "scale": scale, "passed": ok}


def user_level_compiled_equals_eager(device: torch.device) -> list[dict[str, Any]]:
    """FusedUserStep compiled against eager: 5 users (one pass of 8) and 13 (two passes), each of 1 to M rows."""
    out = []
    for name, model in _models(device):
        modes = (None, fused.compile_mode(device, compiled=True))
        steps = [
            fused.FusedUserStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=USERS_PER_PASS, max_examples=M,
                                mode=mode)
            for mode in modes
        ]  # fmt: skip
        for users in (5, 13):
            counts = torch.randint(1, M + 1, (users,))
            segment = torch.repeat_interleave(torch.arange(users), counts).to(device)
            x = torch.randn(len(segment), 1, 28, 28, device=device)
            y = torch.randint(0, 10, (len(segment),), device=device)
            out.append(_compare(name, f"{users} users", steps[1], steps[0], (x, y, segment)))
    return out


def runs_end_to_end(device: torch.device, model: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """A fused run and a hooks run (with ``extra``: dp.unit=user, user-level DP-SGD's own steps) of the same
    settings on the device: ε, steps and accuracy."""
    from hydra import compose, initialize_config_module

    from dpsweep.run.runner import train

    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, Any] = {"model": model, "overrides": list(extra)}
        # the mechanism's own engine (opacus per example, own_steps per user), and the fused step
        for mode, engine in {"hooks": [], "fused": ["dp.engine=fused"]}.items():
            overrides = [
                f"model={model}", *engine, "train.progress=false", "tracking.log_model=false",
                f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"train.device={device.type}",
                *(extra or ["train.epochs=2"]),
            ]  # fmt: skip
            with initialize_config_module("dpsweep.conf", version_base="1.3"):
                cfg = compose("config", overrides=overrides)
            ran = train(cfg)
            results[mode] = {"epsilon": ran.epsilon, "steps": ran.steps, "test_accuracy": ran.test_accuracy}
            print(
                f"{model} {mode} {' '.join(extra)}: ε={ran.epsilon:.4f} steps={ran.steps} "
                f"test_accuracy={ran.test_accuracy:.4f}",
                flush=True,
            )
    same = (
        results["fused"]["epsilon"] == results["hooks"]["epsilon"]
        and results["fused"]["steps"] == results["hooks"]["steps"]
    )
    learns = results["fused"]["test_accuracy"] > (0.2 if extra else 0.3)  # chance is 0.1; 50 users learn less
    print(f"same ε and steps: {'PASS' if same else 'FAIL'}; learns: {'PASS' if learns else 'FAIL'}", flush=True)
    return {**results, "passed": same and learns}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    print(f"device {device}: {device_name(device)}; torch {torch.__version__}", flush=True)
    equal = compiled_equals_eager(device)
    users = user_level_compiled_equals_eager(device)
    runs = [runs_end_to_end(device, model) for model in ("cnn", "mlp")]  # the vmap way and the linear way
    runs += [runs_end_to_end(device, model, tuple(USERS)) for model in ("cnn", "mlp")]
    passed = all(e["passed"] for e in [*equal, *users]) and all(r["passed"] for r in runs)
    if args.json:
        report = {"device": str(device), "device_name": device_name(device), "torch": torch.__version__,
                  "compiled_equals_eager": equal, "user_level_compiled_equals_eager": users, "runs": runs,
                  "passed": passed}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
