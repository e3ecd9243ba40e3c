"""benchmarks/job_startup.py --quick: it runs, writes its JSON, and its phases add up to the measured time to
the first step (issue 59, item 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

SCRIPT = REPO / "benchmarks" / "job_startup.py"
PHASES = ("interpreter", "imports", "config", "store", "tracking", "data", "model", "first_step")


@pytest.mark.slow  # about 40-90 s: a plain run and a one-job sweep, each twice at once (instrumented, as shipped)
def test_job_startup_quick_phases_sum_to_the_end_to_end_time(tmp_path: Path) -> None:
    out = tmp_path / "job_startup.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    record = json.loads(out.read_text())
    assert record["repeat"] == 1
    assert record["machine"]["cores"] >= 1 and record["machine"]["torch"]
    for kind in ("plain", "sweep_job"):
        figures = record[kind]
        phases = figures["phases_s"]
        assert set(phases) == set(PHASES), kind
        assert all(phases[p] > 0 for p in PHASES), (kind, phases)
        end_to_end = figures["end_to_end_median_s"]
        assert end_to_end > 0, kind
        # the phases cut one instrumented run's timeline; the end to end is another, unmodified run beside it.
        # On CI's loaded workers the two drift apart (1.27x seen with 3 workers on 2 cores; 1.02-1.05x idle, in
        # analysis/data/job_startup.json): the benchmark, not this test, measures. Within 2x catches a phase
        # counted twice or left out (imports, 80 % of the total).
        ratio = sum(phases.values()) / end_to_end
        assert 0.5 <= ratio <= 2.0, (kind, ratio, phases, end_to_end, done.stdout)
        assert figures["imports_by_package_s"]["torch"] > 0, kind
