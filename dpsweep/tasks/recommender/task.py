"""``task=recommender``: a factorized model of users' ratings, one round an epoch, at user level (joint
DP), by the method ``task.method`` names (:data:`RUNS`).

    dpsweep task=recommender dp.target_epsilon=3        # DPALS on the planted ratings set, offline
    dpsweep task=recommender dp=off                     # non-private ALS, the reference row
    dpsweep experiment=dpals_planted                    # the preset: ε = 1, 3, 10 and non-private, 3 seeds
    dpsweep experiment=dpam_planted                     # DPAM (task.method=dpam, dp.mechanism=dpsgd), ε = 3

``als`` (:class:`RecommenderRun`): each round is :func:`dpsweep.tasks.recommender.als.dpals_round`: every
training user solves their own embedding against the released item embeddings, the trusted aggregator
bounds (``task.max_ratings_per_user``, ``task.max_user_norm``, ``task.max_abs_rating``) and noises the item
side's sufficient statistics, and the server solves the items from that release alone. Without DP the
bounds and the noise are off. ``dpam`` (:class:`DPAMRun`) and ``sgd`` (:class:`JointSGDRun`) train the
items by user-level DP-SGD instead (:mod:`dpsweep.tasks.recommender.sgd`); ``popularity``
(:class:`PopularityRun`) is the private popularity baseline.

What is released and logged is the item side only (:class:`ItemEmbeddings`): the users' embeddings are
a function of the released items and each user's own ratings, recomputed on their side (at inference:
fold-in), never stored; the joint baseline's, which are state, stay in its local resume checkpoint. The
runner's checkpoint holds the item embeddings, the rounds taken, the optimizer's state and the
generator the noise (and the samples) are drawn from, so a resumed run continues exactly (its ε is that
of the rounds taken).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn

from dpsweep.config import RecommenderTaskConfig
from dpsweep.data import resident
from dpsweep.data.loaders import RatingsUsers
from dpsweep.errors import InputError
from dpsweep.mechanisms import dpals
from dpsweep.models.optimizers import build_optimizer
from dpsweep.plan import mechanism_of, setting
from dpsweep.privacy import ledger
from dpsweep.privacy.schedule import poisson_schedule
from dpsweep.privacy.streams import Purpose
from dpsweep.tasks import TASKS, Checkpointed, Marks, RunInputs, Stages
from dpsweep.tasks.recommender import als, features, sgd
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


class ItemsWithFeatures(ItemEmbeddings):
    """Item embeddings V = E + F W (``task.method=dpam`` or ``sgd`` with ``task.item_features=true``): the
    per-item part E, and the map W of the items' public features F (a buffer: public, released with
    the model). W starts at zero: the model starts as :class:`ItemEmbeddings` does."""

    features: torch.Tensor

    def __init__(self, n_items: int, rank: int, seed: int, features: torch.Tensor) -> None:
        super().__init__(n_items, rank, seed)
        self.register_buffer("features", features.detach().clone())
        self.feature_weights = nn.Parameter(torch.zeros(features.shape[1], rank, dtype=features.dtype))

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        return users @ self.model.item_embeddings.T

    @property
    def model(self) -> als.ItemModel:
        return als.ItemModel((self.item_embeddings + self.features @ self.feature_weights).detach())


class RecommenderTask:
    def build(self, inputs: RunInputs) -> RecommenderRun:
        settings = inputs.cfg.task
        assert isinstance(settings, RecommenderTaskConfig)
        return RUNS[settings.method](inputs)


TASKS.register("recommender")(RecommenderTask())


class RecommenderRun:
    """One ALS or DPALS run (see :class:`dpsweep.tasks.TaskRun`)."""

    private_metrics: tuple[str, ...] = ()  # nothing computed from the training users is logged besides the release
    private_stages = True  # a round's tensors hold the training users' ratings: their sizes are private

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
                    f"false: {self.cfg.dataset.name} has no item features",
                )  # fmt: skip
            self.features = torch.as_tensor(train.ratings.item_features, device=self.device)
        self.module = ItemEmbeddings(self.n_items, settings.rank, self.cfg.train.seed)
        privacy = inputs.plan.privacy
        self.noise_multiplier = privacy.noise_multiplier if privacy is not None else 0.0
        value_bound = 1.0 if self.implicit else settings.max_abs_rating  # implicit feedback: values are 1
        self.bounds = (
            dpals.Bounds(settings.max_ratings_per_user, settings.max_user_norm, value_bound) if privacy else None
        )
        # the aggregator's noise and DPAM's users: private streams of their own, never the init's (train.seed)
        streams = inputs.streams
        self.generator = resident.Generators(
            sampling=resident.private_generator(self.device, streams.seed(Purpose.sampling)),
            noise=resident.private_generator(self.device, streams.seed(Purpose.noise)),
        )
        self.build_roles()

    def build_roles(self) -> None:
        """The aggregator, the regularisation and the server of DPALS (ALS without DP)."""
        settings = self.settings
        self.aggregator: als.Aggregator
        if self.features is None:
            self.aggregator = als.Aggregator(self.bounds, self.noise_multiplier, self.implicit, self.generator["noise"])
        else:
            self.aggregator = features.FeatureAggregator(
                self.features, self.bounds, self.noise_multiplier, self.implicit, self.generator["noise"]
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
            # the released item side only (per-item embeddings, and the features' map where trained)
            "model.trainable_params": sum(p.numel() for p in self.module.parameters()),
            "recommender.released": "item embeddings (users' embeddings stay with the users)",
        }
        if self.bounds is not None:
            b = self.bounds
            tags |= {"dp.semantics": JOINT_DP, "dp.contribution": self.contribution(b)}
            if self.cfg.train.probe:  # a probe logs its memory stages, which count the training users'
                tags |= {  # ratings (the tensors' sizes): a statistic of the private data no accountant covers
                    "dp.release": "not-for-release",
                    "dp.outside_ledger": "system/memory/* (they follow the number of the training users' ratings)",
                }
        return tags

    def contribution(self, b: dpals.Bounds) -> str:
        """What one user contributes, as the tag ``dp.contribution`` states it."""
        return (
            f"per user per round: at most {b.max_ratings} ratings, embedding norm at most {b.max_user_norm:g}, "
            f"|value| at most {b.max_abs_rating:g} (sensitivity {self.sensitivity():.4g})"
        )

    def start(self, run: Tracker) -> Checkpointed:
        self.run = run
        self.module.to(self.device)
        # ALS solves each side exactly: no gradient step. The optimizer is only what a checkpoint holds
        # (it never steps, and holds no state).
        self.optimizer: torch.optim.Optimizer = torch.optim.SGD(self.module.parameters(), lr=0.0)
        return Checkpointed(self.module, self.optimizer, None, self.generator)

    @property
    def rounds(self) -> int:
        return int(self.module.rounds)

    def steps_taken(self) -> int:
        """The mechanism's steps taken so far: one a round."""
        return self.rounds

    def done(self) -> bool:
        return self.steps_taken() >= self.inputs.plan.steps

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
        return mechanism_of(self.cfg).ledger_taken(s, self.noise_multiplier, self.steps_taken())

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
        return super().tags() | {"model.trainable_params": self.n_items, "recommender.released": "item counts"}

    def contribution(self, b: dpals.Bounds) -> str:
        return f"per user: at most {b.max_ratings} ratings counted (sensitivity {self.sensitivity():.4g})"

    def done(self) -> bool:
        return self.rounds >= 1

    def _round(self, stages: Marks) -> als.ItemModel:
        stages.mark("batch_load")
        b = self.bounds
        kept = self.train.items if b is None else self.train.first(b.max_ratings, b.max_abs_rating).items
        counts = torch.bincount(kept, minlength=self.n_items).to(self.module.item_embeddings.dtype)
        stages.mark("forward")
        if self.bounds is not None:  # the trusted aggregator's release
            g = self.generator["noise"]
            noise = torch.randn(counts.shape, generator=g, device=g.device)
            counts = counts + self.noise_multiplier * self.sensitivity() * noise.to(counts.device)
        stages.mark("backward")
        embeddings = torch.zeros_like(self.module.item_embeddings)
        embeddings[:, 0] = counts
        return als.ItemModel(embeddings)

    def evaluate(self, epoch: int, final: bool) -> dict[str, float]:
        counts = self.module.item_embeddings.detach()[:, 0]
        scores = counts.expand(self.history.n_users, -1)
        return {"recall_at_20": als.recall_of(scores, self.history, self.target)}


class DPAMRun(RecommenderRun):
    """``task.method=dpam``: DP alternating minimisation with a DP-SGD item step
    (:mod:`dpsweep.tasks.recommender.sgd`; ``dp.mechanism=dpsgd`` at ``dp.unit=user``). A round (an epoch)
    solves every training user's embedding against the released items on the user's side, then takes
    ceil(U/B) steps on the item embeddings: users Poisson-sampled (B = ``train.batch_size`` in
    expectation), each one's gradient, over their first ``task.max_ratings_per_user`` ratings, clipped as
    a whole to ``dp.max_grad_norm`` by the aggregator, noised, and stepped by the server with
    ``optimizer.*``. The checkpoint holds the items, the optimizer's state and the generator the samples
    and the noise are drawn from. Each training step's number of sampled users is kept
    (:meth:`sampled_units`), so the runner checks them against the ledger's Binomial(U, q)."""

    def __init__(self, inputs: RunInputs) -> None:
        super().__init__(inputs)
        self.sampled_sizes: list[tuple[int, int]] = []  # (step, users) of each training step this process took

    def build_roles(self) -> None:
        s, n_users = self.settings, self.train.n_users
        self.reg = als.ALSRegularization(
            user=s.user_reg, item=s.item_reg, unobserved=s.unobserved_weight if self.implicit else 0.0
        )
        self.schedule = poisson_schedule(n_users, self.cfg.train.batch_size)  # q = 1/ceil(U/B), as DP-SGD's ledger
        if self.bounds is not None and n_users != self.cfg.dataset.num_users:  # the ledger's U
            raise InputError(
                "dataset.num_users", self.cfg.dataset.num_users, f"{n_users}: the training users this data holds"
            )
        b = self.bounds
        self.contributions = self.train if b is None else self.train.first(b.max_ratings, b.max_abs_rating)
        clip = self.cfg.dp.max_grad_norm if b is not None else None
        # over the config's B, a public constant (issue 58, item 5; cf. arXiv 2605.15648), not q·U, a function
        # of U: post-processing, q and the ledger unchanged
        expected = float(self.cfg.train.batch_size)
        mapped = None if self.features is None else features.unit_rows(self.features.float())
        if mapped is not None:  # V = E + F W
            self.module = ItemsWithFeatures(self.n_items, s.rank, self.cfg.train.seed, mapped)
        self.gradients = sgd.GradientAggregator(clip, self.noise_multiplier, expected, self.reg.unobserved,
                                                self.generator["noise"], mapped)  # fmt: skip

    def sensitivity(self) -> float:
        """Δ of one step's released sum to one user: their clipped gradient, C."""
        return float(self.cfg.dp.max_grad_norm)

    def contribution(self, b: dpals.Bounds) -> str:
        mapped = " and of the public features map" if self.features is not None else ""
        return (
            f"per user per step: at most {b.max_ratings} ratings, their gradient of the item embeddings{mapped} "
            f"clipped to {self.cfg.dp.max_grad_norm:g} as a whole (sensitivity {self.sensitivity():.4g})"
        )

    def start(self, run: Tracker) -> Checkpointed:
        self.run = run
        self.module.to(self.device)
        self.optimizer = build_optimizer(self.cfg.optimizer, self.module)  # the item side: E (and W with features)
        weights = self.module.feature_weights if isinstance(self.module, ItemsWithFeatures) else None
        self.item_server = sgd.GradientServer(
            self.module.item_embeddings, self.optimizer, self.reg.item, self.train.n_users, weights
        )
        return Checkpointed(self.module, self.optimizer, None, self.generator)

    def steps_taken(self) -> int:
        return self.rounds * self.schedule.steps_per_epoch

    def sampled_units(self) -> list[tuple[int, int]]:
        """(step, users) of each training step since this process started or resumed: the step's 0-based
        index in the run (a resumed run's continue from the checkpoint's :meth:`steps_taken`) and how many
        users its Poisson sample held (:class:`dpsweep.mechanisms.private_step.SampledUnits`). A probe's
        or a memory iteration's fixed batch of B users is no training step: not among them."""
        return list(self.sampled_sizes)

    def local_users(self) -> torch.Tensor:
        """The round's user embeddings, on each user's side: their exact solve against the released items."""
        return als.client_embeddings(self.module.model, self.train, self.reg)

    def local_step(self, users: torch.Tensor, sampled: torch.Tensor, items: torch.Tensor) -> None:
        """What the sampled users do with their own embeddings at a step: nothing (DPAM fixes them for the round)."""

    def _step(self, users: torch.Tensor, sampled: torch.Tensor, stages: Marks, apply: bool) -> None:
        stages.mark("batch_load")
        items = self.module.model.item_embeddings  # V, the whole item embeddings
        part = sgd.users_of(self.contributions, sampled)  # the sampled users' bounded ratings
        stages.mark("forward")
        released = self.gradients(items, users[sampled], part)  # the trusted aggregator's noisy mean
        stages.mark("backward")
        if apply:
            self.local_step(users, sampled, items)
            self.item_server.update(released)  # the server: from the release alone
        stages.mark("optimizer_step")

    def train_epoch(self, epoch: int, stages: Stages) -> dict[str, float]:
        users = self.local_users()
        rate, first = self.schedule.inclusion_probability, self.steps_taken()
        for i in range(self.schedule.steps_per_epoch):
            sampled = sgd.sample_users(self.train.n_users, rate, self.generator["sampling"])
            self.sampled_sizes.append((first + i, len(sampled)))
            self._step(users, sampled, stages, apply=True)
            stages.stepped()
        with torch.no_grad():
            self.module.rounds.add_(1)
        return {"rounds": float(self.rounds)}

    def _fixed_step(self, stages: Marks) -> None:
        """One step on exactly B users (the first B: a public count), not applied, the generator as before."""
        state = self.generator.get_state()
        sampled = torch.arange(min(self.cfg.train.batch_size, self.train.n_users), device=self.device)
        self._step(self.local_users(), sampled, stages, apply=False)
        self.generator.set_state(state)

    def probe(self, stages: Stages) -> dict[str, float]:
        self._fixed_step(stages)
        stages.stepped()
        return {}

    def memory_iteration(self, stages: Marks) -> None:
        self._fixed_step(stages)


class JointSGDRun(DPAMRun):
    """``task.method=sgd``: user-level DP-SGD on the same factorized model, the baseline DPAM is measured
    against. No exact solve: each user's embedding starts from a public seeded draw and moves only by
    the user's own gradient steps (``task.user_lr``), one at each step they are sampled in, while the item
    embeddings take :class:`DPAMRun`'s DP-SGD step. The users' embeddings are the simulated devices'
    state: a buffer the run's own resume checkpoint (``train.checkpoint_dir``) holds, never logged to
    MLflow or put in the released model; held-out users are scored by fold-in, as for every method."""

    def __init__(self, inputs: RunInputs) -> None:
        super().__init__(inputs)
        start = torch.Generator().manual_seed(self.cfg.train.seed + USERS_SEED_OFFSET)  # public: no data
        users = torch.randn(self.train.n_users, self.settings.rank, generator=start) * USERS_INITIAL_SCALE
        self.module.register_buffer("local_users", (users / self.settings.rank**0.5).to(self.module.item_embeddings))

    def local_users(self) -> torch.Tensor:
        users = self.module.local_users
        assert isinstance(users, torch.Tensor)
        return users

    def local_step(self, users: torch.Tensor, sampled: torch.Tensor, items: torch.Tensor) -> None:
        own = sgd.users_of(self.train, sampled)  # every rating of theirs: on their own side, nothing bounded
        step = sgd.user_gradients(items, users[sampled], own, self.reg.unobserved, self.reg.user)
        users[sampled] = users[sampled] - self.settings.user_lr * step

    def released_model(self) -> tuple[nn.Module, np.ndarray]:
        released, example = super().released_model()
        del released.local_users  # the users' own: never released
        return released, example


USERS_SEED_OFFSET = 7_919  # the joint baseline's public start of the users' embeddings: its own stream
USERS_INITIAL_SCALE = 0.1  # × N(0, 1/rank)


RUNS: dict[str, type[RecommenderRun]] = {  # by task.method
    "als": RecommenderRun, "popularity": PopularityRun, "dpam": DPAMRun, "sgd": JointSGDRun,
}  # fmt: skip
