"""dpsweep.run.divergence: which runs are called diverged, and why (issue 33, item 2)."""

from __future__ import annotations

import math

import pytest
import torch

from dpsweep.run.divergence import chance_threshold, weights_finite, why_diverged

DIGITS = {"chance": 0.1, "n_test": 360}


def epochs(*accuracies: float, loss: float = 0.5) -> list[dict[str, float]]:
    return [{"epoch": float(i), "test_accuracy": a, "train_loss": loss} for i, a in enumerate(accuracies, 1)]


def test_the_chance_threshold_is_three_standard_errors_above_guessing() -> None:
    assert chance_threshold(0.1, 360) == pytest.approx(0.1 + 3 * math.sqrt(0.09 / 360))  # 0.1474
    assert chance_threshold(0.5, 100) == pytest.approx(0.65)


@pytest.mark.parametrize(
    ("history", "private", "finite", "needle"),
    [
        (epochs(0.097, 0.097, 0.097), False, True, "stayed at chance (best 0.0970 <= 0.1474"),
        (epochs(0.12, 0.14), False, True, "stayed at chance"),
        (epochs(0.9, 0.2), True, False, "weights are not finite"),
        (epochs(0.3, 0.3, loss=math.nan), False, True, "train_loss became nan at epoch 1"),
        (epochs(0.3, math.nan), True, True, "test_accuracy is not finite"),
    ],
)
def test_diverged_runs_are_named_with_their_reason(
    history: list[dict[str, float]], private: bool, finite: bool, needle: str
) -> None:
    why = why_diverged(history, "test_accuracy", weights_finite=finite, private=private, **DIGITS)
    assert why is not None and needle in why


@pytest.mark.parametrize(
    ("history", "private", "chance"),
    [
        (epochs(0.1, 0.15), False, 0.1),  # once above chance: a weak run, not a diverged one
        (epochs(0.6, 0.6, loss=math.nan), True, 0.1),  # under DP the loss is private, and not judged
        (epochs(0.097, 0.1), True, 0.1),  # a private run at chance: a point of the trade-off, not a failure
        (epochs(0.05), False, None),  # an objective that is no accuracy has no chance level
        ([], True, 0.1),
    ],
)
def test_runs_that_learned_or_cannot_be_judged_are_not_called_diverged(
    history: list[dict[str, float]], private: bool, chance: float | None
) -> None:
    assert why_diverged(history, "test_accuracy", chance, 360, weights_finite=True, private=private) is None


def test_weights_finite_looks_at_every_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    assert weights_finite(model.parameters())
    with torch.no_grad():
        model[1].bias[0] = math.inf
    assert not weights_finite(model.parameters())
