"""Plots of ε against each DP-SGD knob around one configuration (matplotlib: PNG at 300 dpi, or PDF or SVG).

    dpsweep-epsilon -s 60000 -b 256 -n 1.1 -e 60 --plot plots/
    dpsweep-epsilon -s 60000 -b 256 -n 1.1 -e 60 --plot plots/ --plot-format pdf   # vector, fonts embedded

Each plot varies one knob (epochs, σ, batch size B, dataset size N, δ) and keeps the others at the
given configuration, which is marked. RDP accountant, improved conversion; steps follow Opacus's
Poisson loader (``dpsweep.privacy.schedule``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import NullFormatter

from dpsweep.analysis.report.figures import FigureStyle, save  # Agg, and fonts a publisher accepts
from dpsweep.privacy.schedule import PoissonSchedule, epsilon, epsilon_curve, poisson_schedule

PRINT_DPI = 300  # PNG at print resolution

# One plot: file name, x label, x values, ε at an x value, this configuration's x, log x axis.
Spec = tuple[str, str, np.ndarray, Callable[[float], float], float, bool]


def plot_all(
    out_dir: Path, *, n: int, batch_size: int, noise_multiplier: float, steps: int, delta: float, fmt: str = "png"
) -> list[Path]:
    """Write the five plots to ``out_dir`` as ``fmt`` (png, pdf or svg); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    schedule = poisson_schedule(n, batch_size)
    epochs = steps / schedule.steps_per_epoch  # may be fractional when --steps was given

    def eps(
        *, n_: int = n, b: int = batch_size, s: float = noise_multiplier, e: float = epochs, d: float = delta
    ) -> float:
        sched = poisson_schedule(n_, b)
        return epsilon(sched, noise_multiplier=s, delta=d, steps=max(1, round(e * sched.steps_per_epoch))).epsilon

    specs = _specs(
        schedule, eps, n=n, batch_size=batch_size, noise_multiplier=noise_multiplier, epochs=epochs, delta=delta
    )
    title = f"N={n}, B={batch_size}, σ={noise_multiplier:.3g}, {epochs:.3g} epochs, δ={delta:g}"
    style = FigureStyle(fmt, PRINT_DPI)
    return [_plot(out_dir, spec, eps, title, style) for spec in specs]


def _specs(
    schedule: PoissonSchedule,
    eps: Callable[..., float],
    *,
    n: int,
    batch_size: int,
    noise_multiplier: float,
    epochs: float,
    delta: float,
) -> list[Spec]:
    """The five plots around the configuration: ε against epochs, σ, B, N and δ, each over its range."""
    max_epochs = max(2, int(np.ceil(2 * epochs)))
    curve = epsilon_curve(schedule, noise_multiplier=noise_multiplier, delta=delta, epochs=max_epochs)
    sigmas = np.geomspace(noise_multiplier / 3, noise_multiplier * 3, 25)
    batches = np.unique(np.clip(np.geomspace(max(1, batch_size // 16), batch_size * 16, 25).astype(int), 1, n))
    sizes = np.unique(np.geomspace(max(batch_size, n // 10), n * 10, 25).astype(int))
    deltas = np.geomspace(min(delta, 1e-10) / 10, min(0.5, 0.99 / n), 25)
    return [
        (
            "epsilon_vs_epochs.png",
            "epochs",
            np.arange(1, max_epochs + 1),
            lambda e: curve[int(e) - 1],
            epochs,
            False,
        ),
        ("epsilon_vs_noise.png", "noise multiplier σ", sigmas, lambda s: eps(s=s), noise_multiplier, True),
        (
            "epsilon_vs_batch_size.png",
            "batch size B (examples)",
            batches,
            lambda b: eps(b=int(b)),
            batch_size,
            True,
        ),
        (
            "epsilon_vs_dataset_size.png",
            "dataset size N (examples)",
            sizes,
            lambda m: eps(n_=int(m)),
            n,
            True,
        ),
        ("epsilon_vs_delta.png", "δ", deltas, lambda d: eps(d=d), delta, True),
    ]


def _plot(out_dir: Path, spec: Spec, eps: Callable[[], float], title: str, style: FigureStyle) -> Path:
    """Write one plot of ``spec`` to ``out_dir``, the configuration (ε by ``eps()``) marked; returns its path."""
    name, xlabel, xs, fn, here, logx = spec
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    ax.plot(xs, [fn(float(x)) for x in xs], marker=".")
    ax.plot([here], [eps()], "o", color="crimson", label="this configuration")
    if logx:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ε (RDP, improved)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out_dir / name, style)
