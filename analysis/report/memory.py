"""Memory per config: the bytes at each stage of the first training iteration, and configs pooled where they agree."""

from __future__ import annotations

import pandas as pd

from dpsweep.analysis.report.cells import key_text, sort_key
from dpsweep.analysis.report.columns import MEMORY_STAGES, SHORT_NAMES, column, memory_column
from dpsweep.analysis.report.table import swept_params


def memory_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Memory per config over its FINISHED runs: the mean bytes at each stage of the first training
    iteration (model_load, batch_load, backward, optimizer_step), the first iteration's peak and the
    run's peak, with the measuring backend (``cuda`` or ``cpu-tensors``). One row per config_id."""
    done = runs[runs["outcome"] == "finished"]
    frame = pd.DataFrame({name: memory_column(done, logged) for name, logged in MEMORY_STAGES.items()})
    frame = frame.astype(float)
    frame["config_id"] = done["config_id"]
    frame["backend"] = column(done, "tags.memory.backend").fillna("unknown")
    grouped = frame.groupby("config_id", sort=False)
    out = grouped[list(MEMORY_STAGES)].mean()
    out["backend"] = grouped["backend"].agg(lambda b: ", ".join(sorted(set(b))))
    out["runs"] = grouped.size()
    return out.reset_index()


def memory_groups(memory: pd.DataFrame, table: pd.DataFrame, resolution_bytes: float = 2.0**14) -> pd.DataFrame:
    """memory_table's configs pooled where their figures agree to ``resolution_bytes`` (memory
    depends on few hyperparameters: σ, C or lr change nothing), each group labelled with the swept
    hyperparameters its configs share, e.g. ``B=512 (40 configs)``. Largest run peak first."""
    kinds = table[["config_id", "dataset", "model", "private"]]
    swept = swept_params(table)
    merged = memory.merge(table[["config_id", "dataset", "model", "private", *[f"params.{k}" for k in swept]]],
                          on="config_id", how="left")  # fmt: skip
    levels = merged[list(MEMORY_STAGES)].div(resolution_bytes).round().fillna(-1).astype(int).astype(str)
    key = levels.agg("/".join, axis=1) + merged["backend"] + merged["dataset"].astype(str) + merged["model"].astype(str)
    several = kinds[["dataset", "model"]].drop_duplicates().shape[0] > 1
    rows = []
    for _, group in merged.groupby(key + merged["private"].astype(str), sort=False):
        first = group.iloc[0]
        label = _group_label(group, swept, several)
        figures = group[list(MEMORY_STAGES)].mean()
        rows.append({"label": label, **figures, "backend": first["backend"], "configs": len(group),
                     "config_ids": tuple(group["config_id"])})  # fmt: skip
    out = pd.DataFrame(rows, columns=["label", *MEMORY_STAGES, "backend", "configs", "config_ids"])
    # largest first; DP runs log no run peak (it would tell their Poisson batch sizes): their first-iteration peak
    largest = out["run_peak_bytes"].fillna(out["iteration_peak_bytes"])
    return out.iloc[largest.argsort(kind="mergesort")[::-1]].reset_index(drop=True)


def _group_label(group: pd.DataFrame, swept: list[str], several: bool) -> str:
    """A memory group's label: the dataset and model when there are ``several``, non-private, the swept
    hyperparameters its configs share (else those taking at most 3 values), and how many configs."""
    first = group.iloc[0]
    parts = [f"{first['dataset']}/{first['model']}"] if several else []
    parts += [] if first["private"] else ["non-private"]
    varying = []
    for k in swept:
        values = sorted(group[f"params.{k}"].dropna().unique(), key=sort_key)
        if not first["private"] and k.startswith("dp."):
            continue
        if len(values) == 1:
            parts.append(f"{SHORT_NAMES.get(k, k)}={key_text(k, values[0])}")
        elif len(values) <= 3:
            varying.append(f"{SHORT_NAMES.get(k, k)}∈{{{', '.join(key_text(k, v) for v in values)}}}")
    label = " ".join(parts or varying) or ("private" if first["private"] else "non-private")
    if len(group) > 1:
        label += f" ({len(group)} configs)"
    return label
