"""The black-box audit's input canaries (dpsweep.audit.black_box): mislabelled training examples, half
of them left out, scored by a model's loss."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpsweep.audit import black_box
from dpsweep.data.resident import materialize
from dpsweep.tasks.classifier.private import minus_loss


def _train(n: int = 200) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 5, (n,), generator=g))


def test_the_training_set_keeps_the_others_and_the_included_canaries_with_a_wrong_label() -> None:
    train = _train()
    canaries = black_box.InputCanaries(train, num_classes=5, count=60, seed=1)
    x, y = materialize(canaries.training_set())
    included = int(canaries.included.sum())
    assert 0 < included < 60 and len(y) == 200 - 60 + included
    originals = train.tensors[1][canaries.indices]
    assert bool((canaries.labels != originals).all()) and bool(((canaries.labels >= 0) & (canaries.labels < 5)).all())
    # the last rows are the included canaries, with their wrong labels; no excluded canary is anywhere
    assert torch.equal(y[-included:], canaries.labels[canaries.included])
    excluded = train.tensors[0][canaries.indices[~canaries.included]]
    assert not any(bool((x == row).flatten(1).all(1).any()) for row in excluded)


def test_a_model_that_fits_the_included_canaries_is_guessed_right() -> None:
    train = _train()
    canaries = black_box.InputCanaries(train, num_classes=5, count=60, seed=2)

    class Memory(nn.Module):  # scores the included canaries' wrong labels high, everything else flat
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = torch.zeros(len(x), 5)
            for i, row in enumerate(x):
                hit = (canaries.x == row).flatten(1).all(1) & canaries.included
                if bool(hit.any()):
                    logits[i, canaries.labels[hit][0]] = 10.0
            return logits

    scores = canaries.scores(minus_loss(Memory()), torch.device("cpu"))
    assert canaries.right_guesses(scores, 20) == 20
    metrics = black_box.result(canaries, minus_loss(Memory()), torch.device("cpu"), 20, 0.0, 0.95)
    assert metrics["audit.tests"] == 2 and metrics["audit.correct_loss_20"] == 20 and metrics["audit.epsilon_lower"] > 1


def test_at_user_level_every_example_stays_and_each_included_canary_is_a_user_of_its_own() -> None:
    """added=True (dp.unit=user): the training set keeps every example with its user; the included
    canaries follow as wrongly labelled copies, one new user each (U, U + 1, ...)."""
    train = _train()
    canaries = black_box.InputCanaries(train, num_classes=5, count=60, seed=1, added=True)
    x, y = materialize(canaries.training_set())
    included = int(canaries.included.sum())
    assert (
        len(y) == 200 + included and torch.equal(y[:200], train.tensors[1]) and torch.equal(x[:200], train.tensors[0])
    )
    assert torch.equal(y[200:], canaries.labels[canaries.included])
    users = canaries.as_users(torch.arange(200) % 40)  # 40 users of the training examples
    assert torch.equal(users[:200], torch.arange(200) % 40) and torch.equal(
        users[200:], torch.arange(40, 40 + included)
    )
