"""Black-box one-run audit of DP-SGD: input canaries, scored by the trained model's loss on them
(Steinke, Nasr & Jagielski 2023, §6, their black-box setting), in our own code.

    canaries = InputCanaries(data.train, num_classes=10, count=1000, seed=0)
    train_set = canaries.training_set()          # the other examples, and the included canaries
    ... train on train_set, at the plan's sample rate and steps (PrivateRun.wrap_training_set) ...
    right = canaries.right_guesses(canaries.scores(run.example_score(), device), 100)

**Canaries.** m training examples, drawn with the audit's own seeded generator, each given a wrong
label (its class shifted by a seeded offset of 1 to K − 1) and then kept in training with probability
½: an excluded canary is left out of the training set altogether, so the two worlds of each canary
differ by adding or removing one example, the neighbouring relation of the run's ε. At user level
(``added``), every training example stays with its user and each included canary is a wrongly
labelled copy held by a user of its own: the worlds differ by one user. Only the final model is
looked at: the auditor sees no step's release.

**The same sampling as planned.** Leaving canaries out makes the training set smaller than the N the
plan priced, and a loader would sample at 1/ceil(N'/B), a rate the ledger would then record. A private
run whose training set is wrapped (:meth:`dpsweep.mechanisms.private_step.PrivateRun.wrap_training_set`)
samples at the plan's rate and steps and records those, so each example is sampled exactly as a plain
run's would be and the ledger is the plain run's.

**Scores.** A canary's score is the run's own per-example score of its final model
(:meth:`~dpsweep.mechanisms.private_step.PrivateRun.example_score`) on its (image, wrong label): for a
classifier, minus its cross-entropy (a model that trained on it fits the wrong label better); for a
conditional GAN, its critic's D(x, y). The highest scores are guessed included, the lowest excluded.

The canaries are mislabelled training examples: the run's model is not a plain run's, so an audit run
is not for release.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from dpsweep.audit.guesses import metrics, right_guesses
from dpsweep.data.resident import materialize, private_generator
from dpsweep.mechanisms.private_step import Score
from dpsweep.privacy.ledger import Ledger


class InputCanaries:
    """m mislabelled training examples, their inclusion bits, and their scores under a trained model."""

    def __init__(self, train: Dataset[Any], num_classes: int, count: int, seed: int, added: bool = False) -> None:
        generator = private_generator("cpu", seed)  # every bit of the canary stream's seed
        n = len(train)  # type: ignore[arg-type]
        if count > n:
            raise ValueError(f"{count} canaries need as many training examples; there are {n}")
        self.train, self.added = train, added
        self.indices = torch.randperm(n, generator=generator)[:count]
        self.included = torch.rand(count, generator=generator) < 0.5
        offsets = torch.randint(1, num_classes, (count,), generator=generator)
        self.x, labels = materialize(Subset(train, self.indices.tolist()))
        self.labels = (labels + offsets) % num_classes  # never its own class

    @property
    def count(self) -> int:
        return len(self.indices)

    def training_set(self) -> Dataset[Any]:
        """The training examples that are not canaries, and the included canaries with their wrong labels;
        ``added``: every training example, then the included canaries (copies, wrongly labelled)."""
        kept = TensorDataset(self.x[self.included], self.labels[self.included])
        if self.added:
            return ConcatDataset([self.train, kept])
        others = torch.ones(len(self.train), dtype=torch.bool)  # type: ignore[arg-type]
        others[self.indices] = False
        return ConcatDataset([Subset(self.train, torch.nonzero(others).flatten().tolist()), kept])

    @torch.no_grad()
    def scores(self, score: Score, device: torch.device) -> Tensor:
        """Each canary's ``score`` (the run's ``example_score``: minus a classifier's loss, a GAN critic's
        D(x, y)) on its (image, wrong label): higher, more likely trained on."""
        parts = [
            score(x.to(device), y.to(device)).cpu()
            for x, y in zip(self.x.split(256), self.labels.split(256), strict=True)
        ]
        return torch.cat(parts).to(torch.float64)

    def sampled_population(self, planned: int) -> int:
        """The units of :meth:`training_set`, from the ``planned`` N of the original set: the m canaries
        taken out and the included ones put back (N − m + included), or, at user level (``added``), each
        included canary a user of its own (N + included). Sampled at the plan's rate q, a step's batch
        is then Binomial(that, q) (the sampling check, :mod:`dpsweep.privacy.sampling`)."""
        included = int(self.included.sum())
        return planned + included if self.added else planned - self.count + included

    def as_users(self, units: Tensor) -> Tensor:
        """At user level (``added``): the training examples' users ``units`` (0..U−1), then each included
        canary a user of its own (U, U + 1, ...): adding or removing one user, the unit of the run's ε."""
        added = torch.arange(int(self.included.sum()), dtype=units.dtype) + int(units.max()) + 1
        return torch.cat([units, added])

    def right_guesses(self, scores: Tensor, guesses: int) -> int:
        """Of ``guesses`` guesses on ``scores`` (:meth:`scores`), the right ones."""
        return right_guesses(scores, self.included, guesses)


def result(
    canaries: InputCanaries,
    score: Score,
    device: torch.device,
    guesses: int,
    delta: float,
    confidence: float,
    claim: Ledger | None = None,
) -> dict[str, float]:
    """The audit's metrics (:func:`dpsweep.audit.guesses.metrics`) for its two tests, fixed before training:
    ``guesses`` guesses, and a guess on every canary; read against the run's ledger ``claim`` too where it
    is given."""
    scores = canaries.scores(score, device)
    every = canaries.count - canaries.count % 2
    tests = {f"audit.correct_loss_{r}": (r, canaries.right_guesses(scores, r)) for r in dict.fromkeys((guesses, every))}
    return metrics(tests, canaries.count, guesses, delta, confidence, claim)
