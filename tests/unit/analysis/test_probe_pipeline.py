"""``dpsweep.analysis.memory_model.pipeline``: the probe table from a CSV, the probes of one model and device,
and the fitted models saved with their residual plot, as ``dpsweep-memory fit`` does it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO

from dpsweep.analysis.memory_model import fit_all, pipeline
from dpsweep.errors import InputError
from dpsweep.memory.model import load_models

PROBES = REPO / "analysis" / "data" / "cpu_probes_digits.csv"  # real probes of the CPU twin


def test_probes_are_read_chosen_fitted_and_saved(tmp_path: Path) -> None:
    probes, source = pipeline.load_probes(PROBES, None, "sqlite:///unused.db")
    assert source == str(PROBES) and len(probes) > 100
    two = probes.assign(device_name=["gpu a" if i % 2 else "gpu b" for i in range(len(probes))])
    with pytest.raises(InputError, match="the probes of cnn ran on several devices"):
        pipeline.select_probes(two, None, None)
    with pytest.raises(InputError, match="--device='tpu' is invalid: a device the probes ran on: gpu a, gpu b"):
        pipeline.select_probes(two, None, "tpu")
    with pytest.raises(InputError, match="--model='vgg16' is invalid: a model the probes are of: cnn, vgg16_frozen"):
        pipeline.select_probes(probes, "vgg16", None)
    chosen = pipeline.select_probes(two, "cnn", "gpu a")
    expected = two[(two["model"] == "cnn") & (two["device_name"] == "gpu a")]
    assert 0 < len(chosen) == len(expected) and list(chosen.index) == list(expected.index)
    models = fit_all(pipeline.select_probes(probes, "cnn", None), "cnn", targets=["iteration_peak_bytes"])
    out, plot = pipeline.save_fit(models, source, tmp_path / "m.json")
    assert plot == tmp_path / "m_residuals.png" and plot.stat().st_size > 0
    assert set(load_models(out)) == {"cnn"} and json.loads(out.read_text())["meta"]["source"] == source
    with pytest.raises(InputError, match="--experiment=None is invalid"):
        pipeline.load_probes(None, None, "sqlite:///unused.db")
    with pytest.raises(InputError, match="--csv="):
        pipeline.load_probes(tmp_path / "missing.csv", None, "sqlite:///unused.db")
