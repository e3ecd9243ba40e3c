"""``task=recommender``: a factorized model of users' ratings trained by alternating least squares, one
round an epoch; with DP, DPALS at user level (joint DP).

    dpsweep task=recommender dp.target_epsilon=3        # DPALS on the planted ratings set, offline
    dpsweep task=recommender dp=off                     # non-private ALS, the reference row
    dpsweep experiment=dpals_planted                    # the preset: ε = 1, 3, 10 and non-private, 3 seeds

Each round is :func:`dpsweep.tasks.recommender.als.dpals_round`: every training user solves their own
embedding against the released item embeddings, the trusted aggregator bounds (``task.max_ratings_per_user``,
``task.max_user_norm``, ``task.max_abs_rating``) and noises the item side's sufficient statistics, and the
server solves the items from that release alone. Without DP the bounds and the noise are off.

What is released, logged and checkpointed is the item side only (:class:`ItemEmbeddings`): the users'
embeddings are a function of the released items and each user's own ratings, recomputed on their side
(at inference: fold-in), never stored. The runner's checkpoint holds the item embeddings, the rounds
taken and the noise generator's state, so a resumed run continues exactly (its ε is that of the rounds
taken). ``train.batch_size`` and ``dp.max_grad_norm`` are not used: every user is in every round, and
the bounds are the task's.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn

from dpsweep.config import RecommenderTaskConfig
from dpsweep.data.loaders import RatingsUsers
from dpsweep.errors import InputError
from dpsweep.mechanisms import dpals
from dpsweep.plan import mechanism_of, setting
from dpsweep.privacy import ledger
from dpsweep.tasks import TASKS, Checkpointed, Marks, RunInputs, Stages
from dpsweep.tasks.recommender import als, features
from dpsweep.tracking import Tracker

JOINT_DP = "joint DP: each user's embedding is solved and kept on the user's side, never released"


class ItemEmbeddings(nn.Module):
    """The released part of the factorized model: one embedding per item, and the rounds taken (a
    buffer, so that a checkpoint restores it). ``forward`` scores every item for user embeddings."""

    rounds: torch.Tensor

    def __init__(self, n_items: int, rank: int, seed: int) -> None:
        super().__init__()
        start = als.ItemModel.initial(n_items, rank, seed).item_embeddings  # public: seeded, no data
        self.item_embeddings = nn.Parameter(start)
        self.register_buffer("rounds", torch.zeros((), dtype=torch.int64))

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        return users @ self.item_embeddings.T

    @property
    def model(self) -> als.ItemModel:
        return als.ItemModel(self.item_embeddings.detach())


class RecommenderTask:
    def build(self, inputs: RunInputs) -> RecommenderRun:
        settings = inputs.cfg.task
        assert isinstance(settings, RecommenderTaskConfig)
        return RUNS[settings.method](inputs)


TASKS.register("recommender")(RecommenderTask())


class RecommenderRun:
    """One ALS or DPALS run (see :class:`dpsweep.tasks.TaskRun`)."""

    private_metrics: tuple[str, ...] = ()  # nothing computed from the training users is logged besides the release

    def __init__(self, inputs: RunInputs) -> None:
        self.inputs, self.cfg, self.device = inputs, inputs.cfg, inputs.device
        settings = self.cfg.task
        assert isinstance(settings, RecommenderTaskConfig)  # this task's own settings (task.*)
        self.settings = settings
        train, test = inputs.data.train, inputs.data.test
        assert isinstance(train, RatingsUsers) and isinstance(test, RatingsUsers) and test.held_out is not None
        self.implicit = settings.feedback == "implicit"
        self.train = als.Batch.of(train.ratings, self.implicit, self.device)
        self.history = als.Batch.of(test.held_out.history, self.implicit, self.device)
        self.target = als.Batch.of(test.held_out.target, self.implicit, self.device)
        self.n_items = train.ratings.n_items
        self.features: torch.Tensor | None = None
        if settings.item_features:
            if train.ratings.item_features is None:
                raise InputError(
                    "task.item_features", True,
                    f"false: {self.cfg.dataset.name} has no item features here (MovieLens: its movies file is missing)",
                )  # fmt: skip
            self.features = torch.as_tensor(train.ratings.item_features, device=self.device)
        self.module = ItemEmbeddings(self.n_items, settings.rank, self.cfg.train.seed)
        privacy = inputs.plan.privacy
        self.noise_multiplier = privacy.noise_multiplier if privacy is not None else 0.0
        value_bound = 1.0 if self.implicit else settings.max_abs_rating  # implicit feedback: values are 1
        self.bounds = (
            dpals.Bounds(settings.max_ratings_per_user, settings.max_user_norm, value_bound) if privacy else None
        )
        self.generator = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        self.aggregator: als.Aggregator
        if self.features is None:
            self.aggregator = als.Aggregator(self.bounds, self.noise_multiplier, self.implicit, self.generator)
        else:
            self.aggregator = features.FeatureAggregator(
                self.features, self.bounds, self.noise_multiplier, self.implicit, self.generator
            )
        noise = 0.0 if self.bounds is None else self.noise_multiplier * self.sensitivity()
        self.reg = als.ALSRegularization(
            user=settings.user_reg, item=settings.item_reg + settings.item_reg_per_noise * noise,
            unobserved=settings.unobserved_weight if self.implicit else 0.0,
        )  # fmt: skip
        self.server = als.Server(self.reg) if self.features is None else features.FeatureServer(self.reg, self.features)

    def sensitivity(self) -> float:
        """Δ of one round's release to one user: the aggregator's (item by item, or through the public
        features)."""
        return self.aggregator.sensitivity()

    def tags(self) -> dict[str, Any]:
        tags: dict[str, Any] = {
            "model.trainable_params": self.n_items * self.settings.rank,  # the released item embeddings only
            "recommender.released": "item embeddings (users' embeddings stay with the users)",
        }
        if self.bounds is not None:
            b = self.bounds
            tags |= {
                # the memory stages count the training users' ratings (the tensors' sizes): a statistic
                # of the private data that no accountant covers
                "dp.release": "not-for-release",
                "dp.outside_ledger": "memory/* (they follow the number of the training users' ratings)",
                "dp.semantics": JOINT_DP,
                "dp.contribution": (
                    f"per user per round: at most {b.max_ratings} ratings, embedding norm at most "
                    f"{b.max_user_norm:g}, |value| at most {b.max_abs_rating:g} "
                    f"(sensitivity {self.sensitivity():.4g})"
                ),
            }
        return tags

    def start(self, run: Tracker) -> Checkpointed:
        self.run = run
        self.module.to(self.device)
        # ALS solves each side exactly: no gradient step. The optimizer is only what a checkpoint holds
        # (it never steps, and holds no state).
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.0)
        return Checkpointed(self.module, self.optimizer, None, self.generator)

    @property
    def rounds(self) -> int:
        return int(self.module.rounds)

    def done(self) -> bool:
        return self.rounds >= self.inputs.plan.steps

    def _round(self, stages: Marks) -> als.ItemModel:
        stages.mark("batch_load")
        users = als.client_embeddings(self.module.model, self.train, self.reg)  # on each user's side
        stages.mark("forward")
        released = self.aggregator(users, self.train)  # the trusted aggregator's noisy statistics
        stages.mark("backward")
        return self.server.update(released)  # the server: from the release alone

    def train_epoch(self, epoch: int, stages: Stages) -> dict[str, float]:
        updated = self._round(stages)
        with torch.no_grad():
            self.module.item_embeddings.copy_(updated.item_embeddings)
            self.module.rounds.add_(1)
        stages.mark("optimizer_step")
        stages.stepped()
        return {"rounds": float(self.rounds)}

    def evaluate(self, epoch: int, final: bool) -> dict[str, float]:
        """Held-out users' scores, their embeddings folded in from their history."""
        model = self.module.model
        scores = {"recall_at_20": als.recall_at(model, self.history, self.target, self.reg)}
        if not self.implicit:
            scores["rmse"] = als.rmse(model, self.history, self.target, self.reg)
        return scores

    def probe(self, stages: Stages) -> dict[str, float]:
        """One round (every user), not applied."""
        self._round(stages)
        stages.stepped()
        return {}

    def memory_iteration(self, stages: Marks) -> None:
        """One round's stages, not applied, its noise drawn from a copy of the generator's state."""
        state = self.generator.get_state()
        self._round(stages)
        self.generator.set_state(state)

    def released_model(self) -> tuple[nn.Module, np.ndarray]:
        """The item embeddings, as a module scoring every item for a user embedding (folded in on the
        user's side); the input example is a zero embedding, no user's."""
        released = copy.deepcopy(self.module).cpu().eval()
        released.item_embeddings.requires_grad_(False)
        return released, np.zeros((1, self.settings.rank), dtype=np.float32)

    def trained_model(self) -> nn.Module:
        return self.module.eval()

    def privacy_ledger(self) -> ledger.Ledger:
        if self.bounds is None:
            return ledger.Ledger()
        s = setting(self.cfg, self.inputs.plan.facts.n_train)
        return mechanism_of(self.cfg).ledger_taken(s, self.noise_multiplier, self.rounds)

    def params(self) -> dict[str, Any]:
        return {}  # λ_v with DP (task.item_reg + task.item_reg_per_noise × σΔ) follows from the logged config


class PopularityRun(RecommenderRun):
    """``task.method=popularity``: the private popularity baseline. Every item is scored by its count over
    each user's first ``task.max_ratings_per_user`` ratings, released once with Gaussian noise of σ√k
    (a user adds 1 to at most k counts: :func:`dpsweep.mechanisms.dpals.count_sensitivity`); every
    held-out user gets the same ranking. Without DP, the exact counts of every rating."""

    def sensitivity(self) -> float:
        assert self.bounds is not None
        return dpals.count_sensitivity(self.bounds)

    def tags(self) -> dict[str, Any]:
        tags = super().tags() | {"model.trainable_params": self.n_items, "recommender.released": "item counts"}
        if self.bounds is not None:
            k = self.bounds.max_ratings
            tags["dp.contribution"] = f"per user: at most {k} ratings counted (sensitivity {self.sensitivity():.4g})"
        return tags

    def done(self) -> bool:
        return self.rounds >= 1

    def _round(self, stages: Marks) -> als.ItemModel:
        stages.mark("batch_load")
        b = self.bounds
        kept = self.train.items if b is None else self.train.first(b.max_ratings, b.max_abs_rating).items
        counts = torch.bincount(kept, minlength=self.n_items).to(self.module.item_embeddings.dtype)
        stages.mark("forward")
        if self.bounds is not None:  # the trusted aggregator's release
            noise = torch.randn(counts.shape, generator=self.generator, device=self.generator.device)
            counts = counts + self.noise_multiplier * self.sensitivity() * noise.to(counts.device)
        stages.mark("backward")
        embeddings = torch.zeros_like(self.module.item_embeddings)
        embeddings[:, 0] = counts
        return als.ItemModel(embeddings)

    def evaluate(self, epoch: int, final: bool) -> dict[str, float]:
        counts = self.module.item_embeddings.detach()[:, 0]
        scores = counts.expand(self.history.n_users, -1)
        return {"recall_at_20": als.recall_of(scores, self.history, self.target)}


RUNS: dict[str, type[RecommenderRun]] = {"als": RecommenderRun, "popularity": PopularityRun}  # by task.method
