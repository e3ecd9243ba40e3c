"""What a fit is written as: the model file runs load, and each target's formula with units."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpsweep.memory.model import CONST, FORMAT, PLAN_FIT, TARGETS, MemoryModel, target_column
from dpsweep.units import format_bytes

NEGLIGIBLE_BYTES = 1e-6  # per unit of a feature: formulas leave out smaller coefficients


def save_models(path: str | Path, models: Mapping[str, MemoryModel], meta: Mapping[str, Any]) -> Path:
    """Write ``{"format": FORMAT, "meta": meta, "models": {name: model.to_json()}}`` to ``path``."""
    path = Path(path)
    data = {"format": FORMAT, "meta": dict(meta), "models": {name: m.to_json() for name, m in models.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


def formula(model: MemoryModel, target: str, fit: str = PLAN_FIT) -> str:
    """``target``'s ``fit`` as a formula with units, each coefficient in bytes per unit of its column:
    ``iteration_peak ≈ 1.92 MiB + 4 B × batch_params + 2.1 KiB × batch_size``."""
    coefs = model.coefficients(target, fit)
    const = round(coefs.get(CONST, 0.0))  # whole bytes: what is left is solver round-off
    text = f"{TARGETS[target_column(target)]} ≈ {format_bytes(const)}"
    for column, value in coefs.items():
        if column == CONST or abs(value) < NEGLIGIBLE_BYTES:  # solver round-off, not a term
            continue
        sign = "-" if value < 0 else "+"
        text += f" {sign} {format_bytes(abs(value))} × {column}"
    return text
