"""Fitting linear memory models to memory probes: how many bytes a config needs before it is run.

A probe measures the first training iteration of one config (see ``dpsweep.memory.stages``): the bytes
allocated after each stage (``model_load``, ``batch_load``, ``backward``, ``optimizer_step``), the
iteration's allocated peak and the CUDA allocator's reserved peak. Each of these six targets is
fitted, per model, as a linear function of features computed from the config (batch size B,
trainable parameters P, B·C·H·W input values, B·P, DP on/off, the grad-sample mode, …), twice:

- ``least_squares``: ordinary least squares, the best estimate of the typical figure;
- ``envelope``: the upper envelope, the linear function that lies on or above every probe with the
  least total over-prediction. It is the figure to plan with: it under-predicts no fitted probe.

Each fit is scored by k-fold held-out error (k = min(5, probes)). This package fits (pandas, scipy)
and plots (matplotlib); the fitted model, its features and its file are :mod:`dpsweep.memory.model`
(numpy only), which runs load and predict from. From Python::

    from dpsweep.analysis import memory_model
    models = memory_model.fit_all(probes)               # one dpsweep.memory.model.MemoryModel per model
    m = models["vgg16_frozen"]
    memory_model.cv_frame(m)                            # held-out error per target and fit
    print(memory_model.formula(m, "iteration_peak"))   # iteration_peak ≈ 1.92 MiB + 4 B × batch_params + …
    memory_model.save_models("memory_model.json", models, meta={"experiment": "probes"})
    memory_model.residual_plot(memory_model.cv_predictions_table(models), "residuals.png")
    loaded = core.load_models("memory_model.json")      # what a run does
    loaded["vgg16_frozen"].predict(configs)             # {target column: predicted bytes} (envelope fit)

Probe frames have one row per probe and these columns (others are ignored): ``model``, ``dataset``,
``hidden_units``, ``batch_size``, ``channels``, ``height``, ``width``, ``trainable_params``, ``dp``,
``grad_sample_mode`` (the step: Opacus's mode, ``fused`` for ``dp.engine=fused``, ``none`` without DP;
:func:`dpsweep.config.step_kind`), ``backend`` (``cuda`` or ``cpu-tensors``),
``device_name``, ``torch_version`` and the measured ``<target>_bytes`` of TARGETS. Only the columns
that the chosen features and targets need are required.

Allocated bytes are what is modelled; the reserved peak is fitted and reported on its own, since
the CUDA caching allocator rounds requests up to 512 B and packs them into 2 MiB (small) or 20 MiB
(large) segments, so reserved bytes are a step function of the allocated ones (PyTorch,
``c10/cuda/CUDACachingAllocator.cpp``: ``kMinBlockSize``, ``kSmallBuffer``, ``kLargeBuffer``).
Probes of different memory backends (CUDA counters against the CPU twin's tensor census) measure
different things and are never fitted together.

Its modules, each name re-exported here: ``probes`` (probe tables), ``design`` (default features,
design matrices, identifiability and the input checks), ``fits`` (least squares, the envelope),
``heldout`` (k-fold held-out error), ``fitting`` (fit, fit_all), ``output`` (the model file, formulas)
and ``plot`` (the residual plot).
"""

from __future__ import annotations

from dpsweep.analysis.memory_model.design import (
    DEFAULT_FEATURES,
    DEFAULT_FOLDS,
    NOT_IDENTIFIABLE,
    RANK_RTOL,
    Identifiable,
    identifiable,
    min_probes,
)
from dpsweep.analysis.memory_model.fits import FITS, Fit, envelope, least_squares
from dpsweep.analysis.memory_model.fitting import fit, fit_all
from dpsweep.analysis.memory_model.heldout import (
    CV_COLUMNS,
    CV_METRICS,
    PREDICTION_COLUMNS,
    UNDER_TOLERANCE,
    cross_validate,
    cv_frame,
    cv_predictions_table,
    cv_summary,
    cv_table,
)
from dpsweep.analysis.memory_model.output import NEGLIGIBLE_BYTES, formula, save_models
from dpsweep.analysis.memory_model.plot import residual_plot
from dpsweep.analysis.memory_model.probes import RANGE_COLUMNS, TEXT_COLUMNS, clean_probes, default_targets, read_probes

__all__ = [
    "CV_COLUMNS",
    "CV_METRICS",
    "DEFAULT_FEATURES",
    "DEFAULT_FOLDS",
    "FITS",
    "NEGLIGIBLE_BYTES",
    "NOT_IDENTIFIABLE",
    "PREDICTION_COLUMNS",
    "RANGE_COLUMNS",
    "RANK_RTOL",
    "TEXT_COLUMNS",
    "UNDER_TOLERANCE",
    "Fit",
    "Identifiable",
    "clean_probes",
    "cross_validate",
    "cv_frame",
    "cv_predictions_table",
    "cv_summary",
    "cv_table",
    "default_targets",
    "envelope",
    "fit",
    "fit_all",
    "formula",
    "identifiable",
    "least_squares",
    "min_probes",
    "read_probes",
    "residual_plot",
    "save_models",
]
