"""Did a run diverge? A run whose weights or loss became non-finite, or a non-private run whose
accuracy never left chance, is no baseline and no point of a privacy–utility curve: it is tagged so
as it ends, and reports leave it out of means and baselines (``dpsweep.analysis.report``).

    why = why_diverged(result.epochs, "test_accuracy", chance=0.1, n_test=360, weights_finite=True, private=False)

"At chance" is judged with a margin of three binomial standard errors on the test set, so that
a run is not called diverged for noise alone: on digits (10 classes, 360 test images) an accuracy
of at most 0.1 + 3·sqrt(0.1·0.9/360) = 0.147 at every evaluation. A private run at chance is not
called diverged: at strong privacy that is the trade-off's honest answer, and leaving it out would
lift the curve (reports flag a row whose spread exceeds its mean instead). Under DP only released
figures are judged (the model's weights, the logged accuracy): the training loss, a statistic of
the private examples that no mechanism noised, is not, or the tag would release it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # reports read the tags below without importing torch
    import torch

DIVERGED_TAG = "run.diverged"  # "true" on a diverged run
REASON_TAG = "run.diverged.reason"
CHANCE_MARGIN_SE = 3.0  # standard errors above chance that still count as chance


def chance_threshold(chance: float, n_test: int) -> float:
    """The highest accuracy still called chance: ``chance`` plus CHANCE_MARGIN_SE binomial standard
    errors over ``n_test`` examples."""
    return chance + CHANCE_MARGIN_SE * math.sqrt(chance * (1 - chance) / max(n_test, 1))


def weights_finite(parameters: Iterable[torch.Tensor]) -> bool:
    return all(bool(p.isfinite().all()) for p in parameters)


def why_diverged(
    epochs: Sequence[Mapping[str, float]],
    objective: str,
    chance: float | None,
    n_test: int,
    weights_finite: bool,
    private: bool,
) -> str | None:
    """Why the run diverged, or None. ``epochs``: each epoch's metrics (``TrainResult.epochs``);
    ``chance``: the objective's value for guessing (1 / classes), None where the objective is no
    accuracy; ``private``: DP was on (the training loss and chance are then not judged)."""
    if not weights_finite:
        return "the trained model's weights are not finite"
    if not private:
        for m in epochs:
            loss = m.get("train_loss")
            if loss is not None and not math.isfinite(loss):
                return f"train_loss became {loss} at epoch {int(m.get('epoch', 0))}"
    scores = [m[objective] for m in epochs if objective in m]
    if any(not math.isfinite(s) for s in scores):
        return f"{objective} is not finite"
    if chance is not None and scores and not private:
        threshold = chance_threshold(chance, n_test)
        best = max(scores)
        if best <= threshold:
            return (
                f"{objective} stayed at chance (best {best:.4f} <= {threshold:.4f}: {chance:.4g} for guessing, "
                f"plus {CHANCE_MARGIN_SE:g} standard errors on {n_test} test examples)"
            )
    return None
