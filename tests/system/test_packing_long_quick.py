"""benchmarks/packing_long.py --quick (issue 59 item 1): the benchmark of packed training-dominated trials
runs on the CPU, end to end (fabricated data, real sweeps, MLflow stores, ratios), and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_packing_long_quick_writes_ratios_and_equal_epsilons(tmp_path: Path) -> None:
    out = tmp_path / "packing_long.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "benchmarks/packing_long.py", "--quick", "--json", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["environment"]["torch"] and result["environment"]["cpu_model"]
    case = result["cases"]["cnn32"]
    rows = case["rows"]["default"]
    assert [r["k"] for r in rows] == [1, 2]
    assert case["prediction"]["peak_bytes"] > 0, case["prediction"]
    for row in rows:
        assert row["finished"] == row["trials"] == 2, row.get("output_tail")
        assert row["trials_per_hour"] > 0 and row["vs_k1"] > 0
        assert row["epsilon_all_equal"] is True
        for run in row["runs"]:
            assert run["sigma"] in result["sigmas"]
            assert run["epsilon"] == pytest.approx(run["epsilon_alone"], rel=1e-9) and run["epsilon"] > 0
            assert run["slowdown"] > 0
            assert run["peak_mib"] > 0 and run["peak_over_predicted"] > 0
    assert rows[0]["vs_k1"] == 1.0
    assert {r["device_sharing"] for r in rows[1]["runs"]} == {"time-slicing, 2 trials"}
