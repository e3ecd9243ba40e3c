"""The task/ group: what a run trains and how it is scored, each task's own settings (``task.*``), and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from omegaconf import MISSING

from dpsweep.config import audit
from dpsweep.config.checks import ConfigError, require
from dpsweep.config.dataset import RatingsConfig

if TYPE_CHECKING:
    from dpsweep.config.schema import Config

GAN_IMAGE_SHAPE = (1, 28, 28)  # what task=gan's networks are sized for


@dataclass
class TaskConfig:
    """What a run trains and how it is scored: a name in ``dpsweep.tasks.TASKS``, and the task's own
    settings (``task.*``). Class constants, read by drivers and reports without torch, state what a
    task needs of the rest of the config."""

    name: str = MISSING
    # The metric a run is scored by (what sweeps, searches and private tuning maximise).
    objective: ClassVar[str] = ""
    # Whether a row of this task shows model.name as its model (a task whose model group is only an
    # evaluation model shows the task's name instead: :func:`shown_model`).
    shows_model: ClassVar[bool] = True
    # What it can run, asked by the checks (this module's, dpsweep.config.dp and .train, dpsweep.mechanisms.engines):
    units: ClassVar[tuple[str, ...]] = ("example", "user")  # the dp.unit values it can protect
    engines: ClassVar[tuple[str, ...]] = ("opacus", "own_steps")  # the dp.engine values its private steps take
    # its runs build each private step by the engine's own builder (dpsweep.mechanisms.engines.Engine.steps), so
    # an engine it takes must say one; False: it trains its engines' steps itself
    builds_steps: ClassVar[bool] = False
    audits: ClassVar[tuple[str, ...]] = ()  # the audit.mode values (besides off) it can be audited by
    unaudited_why: ClassVar[str] = ""  # a task with no audits: why, for the refusal (see unaudited)
    distributed: ClassVar[bool] = False  # a run can span train.devices x train.nodes ranks
    label: ClassVar[str] = ""  # the task's name in words, for messages
    # What a report says of the task's rows (dpsweep.analysis.report reads these; it names no task):
    objective_label: ClassVar[str] = ""  # the objective as a table header and an axis call it
    objective_note: ClassVar[str] = ""  # what the objective measures, under the table
    # the objective is an accuracy the task trains for directly, so that a non-private run at chance
    # (1/K classes) failed to learn (dpsweep.run.divergence); not a downstream score such as TSTR
    at_chance_is_failure: ClassVar[bool] = False
    logs_samples: ClassVar[bool] = False  # runs log sample grids (samples/epoch_NNN.png): <name>_samples.png
    reference_metric: ClassVar[str] = ""  # a non-private run's reference score, noted per block of rows
    reference_note: ClassVar[str] = ""  # "{classifier}", "{score}", "{runs}" filled in
    reference_recipe: ClassVar[tuple[str, ...]] = ()  # the params behind the reference: differing ones are named
    row_share: ClassVar[tuple[str, str]] = ("", "")  # (a per-run share, its baseline): averaged per row
    row_share_note: ClassVar[str] = ""  # "{baseline}" and "{rows}" filled in

    learning_rate_param: ClassVar[str] = "optimizer.lr"  # the param a report's lr column shows (learning_rate)
    ratings: ClassVar[bool] = False  # trains on users' ratings (a dataset.RatingsConfig), not on images

    def learning_rate(self, optimizer_lr: float) -> float:
        """The learning rate a plan shows for this task (optimizer.lr unless the task has its own)."""
        return optimizer_lr

    def stops_at_budget(self) -> bool:
        """Whether a run keeps σ and stops where its ε would pass dp.target_epsilon (instead of calibrating σ)."""
        return False

    def reads_batches(self) -> bool:
        """Whether a run reads ``train.batch_size`` and ``dp.max_grad_norm`` (a run's lines show them)."""
        return True

    def unaudited(self) -> str:
        """Why a run of this task cannot be audited (a task with no audits); "": no reason given."""
        return self.unaudited_why

    def method_name(self) -> str | None:
        """The ``task.method`` a run trains by, which a mechanism declares it trains (``Mechanism.methods``,
        asked by :func:`dpsweep.mechanisms.engines.check`); None: a task with one way of training."""
        return None

    def check(self, cfg: Config) -> None:
        """The task's own settings, and what it needs of the other groups (ConfigError names the key)."""
        return None


@dataclass
class ClassifierTaskConfig(TaskConfig):
    """Image classification: cross-entropy, scored by top-1 test accuracy (``dpsweep.tasks.classifier``)."""

    name: str = "classifier"
    objective: ClassVar[str] = "test_accuracy"
    engines: ClassVar[tuple[str, ...]] = ("opacus", "own_steps", "fused")
    builds_steps: ClassVar[bool] = True  # dpsweep.tasks.classifier.task: each engine's step by its builder
    audits: ClassVar[tuple[str, ...]] = ("white_box", "black_box")
    distributed: ClassVar[bool] = True  # through Opacus's distributed optimizers (dpsweep.distributed)
    at_chance_is_failure: ClassVar[bool] = True
    label: ClassVar[str] = "image classification"
    objective_label: ClassVar[str] = "test accuracy"


@dataclass
class GanTaskConfig(TaskConfig):
    """Private synthetic data: dp-GAN (Zhang, Ji & Wang 2018, Alg. 1) on WGAN-GP (Gulrajani et al. 2017),
    conditional (``dpsweep.tasks.gan.task``). The critic trains with DP-SGD (per-example clipping of its
    whole loss, gradient penalty included; Poisson batches of expected size train.batch_size), the
    generator with plain Adam (post-processing). An epoch is ceil(N/B) critic steps, so ε per epoch is
    DP-SGD's at the same σ, B and N; the generator steps once every n_critic critic steps. The TSTR
    classifier is the model group (cnn)."""

    name: str = "gan"
    objective: ClassVar[str] = "tstr_accuracy"  # train on synthetic, test on real (dpsweep.tasks.gan.synthetic)
    shows_model: ClassVar[bool] = False  # model.name is the TSTR classifier
    units: ClassVar[tuple[str, ...]] = ("example",)
    # its critic's own step (dpsweep.tasks.gan.critic): the gradient penalty's gradient of a gradient inside
    # each example's clipped gradient, by torch.func, which Opacus's modes cannot take (Opacus #31, #548)
    engines: ClassVar[tuple[str, ...]] = ("critic",)
    audits: ClassVar[tuple[str, ...]] = ("white_box", "black_box")  # its critic's steps
    label: ClassVar[str] = "task=gan"
    objective_label: ClassVar[str] = "TSTR accuracy"
    objective_note: ClassVar[str] = (
        "TSTR (train on synthetic, test on real) accuracy: the model group's classifier (model.name) trained on "
        "each run's synthetic data, tested on the real test split"
    )
    logs_samples: ClassVar[bool] = True
    reference_metric: ClassVar[str] = "real_accuracy"  # the TSTR classifier trained on the real training split
    reference_note: ClassVar[str] = (
        "the same classifier ({classifier}) trained on real data instead: {score} test accuracy"
    )
    reference_recipe: ClassVar[tuple[str, ...]] = ("model.", "dataset.", "task.tstr_")
    row_share: ClassVar[tuple[str, str]] = ("memorisation_share", "memorisation_baseline")
    row_share_note: ClassVar[str] = (
        "memorisation share (synthetic samples nearer a training image than any test image; {baseline} if "
        "independent of the training set), mean per row: {rows}"
    )

    latent_dim: int = 64  # z dimension
    generator_width: int = 64  # channels of the generator's last hidden layer (doubled before it)
    critic_width: int = 32  # channels of the critic's first convolution (doubled in the second)
    gp_weight: float = 10.0  # λ of the gradient penalty λ(‖∇x̂ D(x̂)‖ − 1)²
    n_critic: int = 5  # critic steps per generator step
    critic_lr: float = 1e-3  # Adam's α for the critic (its noisy, clipped gradient)
    generator_lr: float = 1e-3  # Adam's α for the generator
    betas: list[float] = field(default_factory=lambda: [0.5, 0.9])  # Adam's (β1, β2) for both
    # Decay of an exponential moving average of the generator's weights, updated after each generator
    # step (0: off). With it, the grids, the synthetic set, TSTR and the released model use the
    # average (Yazıcı et al. 2019, "The Unusual Effectiveness of Averaging in GAN Training"); it is a
    # function of the generator's iterates only, so post-processing.
    generator_ema: float = 0.0
    # The synthetic set, TSTR, generator.pt and the released model: a uniform mixture of the generator
    # (or its average) as it was at the end of the last `snapshots` epochs that are multiples of
    # snapshot_every, and of the last epoch (1: the final generator alone). The generator's iterates
    # are post-processing of the private critic's steps, so the mixture costs no privacy; a noisy
    # critic lets the generator's modes drift during training, and the mixture keeps several of them
    # (cf. Neunhoeffer et al. 2021, "Private Post-GAN Boosting", which weights the iterates instead).
    snapshots: int = 1
    snapshot_every: int = 5
    # With dp.target_epsilon set: true keeps dp.noise_multiplier and stops training at the critic step
    # after which the ledger would exceed target_epsilon (dp-GAN's stopping rule); false calibrates σ.
    stop_at_budget: bool = False
    grid_every: int = 5  # log a 10 x 10 sample grid (PNG) every this many epochs, and at the end
    # Evaluation, train on synthetic / test on real (TSTR): a labelled synthetic set of N examples
    # (balanced classes), the model group's classifier trained on it with SGD (momentum 0.9) for
    # tstr_epochs, the epoch kept by accuracy on a held-out synthetic split (never real data), and
    # its accuracy on the real test split logged as tstr_accuracy.
    tstr_epochs: int = 15
    tstr_lr: float = 0.05
    tstr_batch_size: int = 64
    tstr_val_fraction: float = 0.2
    # The share of synthetic samples closer (L2) to a training image than to any test image, logged
    # beside memorisation_baseline = n_train/(n_train+n_test), its mean for samples that memorised
    # nothing. With DP it is a statistic of the training data that no accountant covers: it is then
    # computed only when asked for (true), and the run is tagged dp.release=not-for-release.
    # null: on without DP, off with DP.
    memorisation_check: bool | None = None
    memorisation_samples: int = 2000  # synthetic samples compared (drawn at random), each against every real image

    learning_rate_param: ClassVar[str] = "task.critic_lr"  # the critic's: it reads the data (issue 33, item 8)

    def learning_rate(self, optimizer_lr: float) -> float:
        return self.critic_lr

    def checks_memorisation(self, private: bool) -> bool:
        """Whether a run computes the memorisation share: asked for, or by default without DP only."""
        return self.memorisation_check if self.memorisation_check is not None else not private

    def stops_at_budget(self) -> bool:
        return self.stop_at_budget

    def check(self, cfg: Config) -> None:
        _check_gan_settings(self)
        require(
            cfg.model.name == "cnn", "model.name", cfg.model.name,
            "cnn with task=gan: the model group is the TSTR classifier, trained on 28x28 synthetic images",
        )  # fmt: skip
        if cfg.dp.enabled:
            _check_gan_privacy(cfg, self)


@dataclass
class RecommenderTaskConfig(TaskConfig):
    """A factorized model of users' ratings (``dpsweep.tasks.recommender``): item embeddings, released,
    and user embeddings, each solved on its user's side from the released items and never released
    (joint DP, Jain et al. 2021). One round per epoch, by ``task.method``: alternating least squares
    (with DP, ``dp.mechanism=dpals``, Chien et al. 2021), DPAM or user-level DP-SGD on the same model
    (``dp.mechanism=dpsgd``), always at ``dp.unit=user``. Scored by Recall@20 of held-out users, their
    embeddings folded in from their history."""

    name: str = "recommender"
    objective: ClassVar[str] = "recall_at_20"
    shows_model: ClassVar[bool] = False  # the model group is unused: the model is task.rank's factors
    units: ClassVar[tuple[str, ...]] = ("user",)
    # DPALS (sufficient statistics); DPAM and the joint baseline: user-level DP-SGD's own steps
    engines: ClassVar[tuple[str, ...]] = ("sufficient_statistics", "own_steps")
    label: ClassVar[str] = "task=recommender"
    objective_label: ClassVar[str] = "Recall@20"
    objective_note: ClassVar[str] = (
        "Recall@20 of held-out users: their target items among the 20 best-scored items they had not rated, "
        "their embedding folded in from the rest of their ratings"
    )
    ratings: ClassVar[bool] = True

    rank: int = 8  # of the user and item embeddings
    feedback: str = "implicit"  # implicit (rated or not; Recall@20) | explicit (the stars; RMSE too)
    # Each user's contribution to a round, with DP (dpsweep.mechanisms.dpals.Bounds): the first
    # max_ratings_per_user ratings of the user's row, the embedding clipped to max_user_norm, a centred
    # rating clipped to [-max_abs_rating, max_abs_rating] (implicit feedback: values are 1).
    max_ratings_per_user: int = 50
    max_user_norm: float = 0.3
    max_abs_rating: float = 2.0
    user_reg: float = 1.0  # λ_u of each user's solve
    item_reg: float = 1.0  # λ_v of each item's solve, plus item_reg_per_noise × σΔ with DP
    item_reg_per_noise: float = 10.0
    unobserved_weight: float = 0.2  # w₀: every unrated item as a 0 of this weight (implicit feedback)
    # true: the items' public features F are used (dpsweep.tasks.recommender.features). als: the item
    # embeddings are F W, the release W's statistics, fewer numbers, each user's bound k times larger;
    # dpam, sgd: they are E + F W, per-item embeddings plus the features' map, trained together
    item_features: bool = False
    # als: the factorized model by alternating least squares (DPALS with DP); dpam: alternating, the
    # items by user-level DP-SGD (dp.mechanism=dpsgd, train.batch_size users a step, dp.max_grad_norm,
    # optimizer.*); sgd: user-level DP-SGD on the same model, each user's embedding by their own gradient
    # steps (task.user_lr); popularity: the private popularity baseline, every item scored by its count
    # over each user's first max_ratings_per_user ratings, released once with Gaussian noise (train.epochs=1)
    method: str = "als"
    user_lr: float = 0.05  # task.method=sgd: the step size of each user's own steps on their embedding

    def reads_batches(self) -> bool:
        """DPAM and the joint baseline sample users in batches and clip; DPALS and popularity neither."""
        return self.method in BATCHED_METHODS

    def unaudited(self) -> str:
        return UNAUDITED.get(self.method, "")

    def method_name(self) -> str | None:
        return self.method

    def check(self, cfg: Config) -> None:
        require(self.rank >= 1, "task.rank", self.rank, "a rank of 1 or more")
        require(self.feedback in FEEDBACK, "task.feedback", self.feedback, f"one of {', '.join(FEEDBACK)}")
        require(
            self.max_ratings_per_user >= 1, "task.max_ratings_per_user", self.max_ratings_per_user,
            "1 or more ratings per user",
        )  # fmt: skip
        for key in ("max_user_norm", "max_abs_rating"):
            require(getattr(self, key) > 0, f"task.{key}", getattr(self, key), "a positive bound")
        for key in ("user_reg", "item_reg", "user_lr"):
            require(getattr(self, key) > 0, f"task.{key}", getattr(self, key), "a positive value")
        for key in ("item_reg_per_noise", "unobserved_weight"):
            require(getattr(self, key) >= 0, f"task.{key}", getattr(self, key), "a weight >= 0")
        require(self.method in METHODS, "task.method", self.method, f"one of {', '.join(METHODS)}")
        if self.method == "popularity":
            require(
                cfg.train.epochs == 1, "train.epochs", cfg.train.epochs, "1 with task.method=popularity (one release)"
            )


FEEDBACK = ("implicit", "explicit")
# task=recommender's models (dpsweep.tasks.recommender.task.RUNS); the mechanism each trains with declares it
# (Mechanism.methods), asked where the engine is (dpsweep.mechanisms.engines.check)
METHODS = ("als", "popularity", "dpam", "sgd")
BATCHED_METHODS = ("dpam", "sgd")  # those that sample users in batches and clip (user-level DP-SGD's steps)
_NO_SCORE = "and a user's embedding, which a black-box score needs, is never released (docs: guides/audit.md)"
# why each task.method's runs are not audited (audit.mode's refusal)
UNAUDITED = {
    "als": "DP-ALS releases noised item-side sufficient statistics, not clipped per-unit gradients a canary could "
    f"join, {_NO_SCORE}",
    "popularity": "the popularity baseline releases noised item counts once, no gradient a canary could join, "
    f"{_NO_SCORE}",
    "dpam": "DPAM's item steps are user-level DP-SGD, but the recommender exposes no private step "
    f"(dpsweep.mechanisms.private_step) a white-box canary could join, {_NO_SCORE}",
    "sgd": "the joint baseline's steps are user-level DP-SGD, but the recommender exposes no private step "
    f"(dpsweep.mechanisms.private_step) a white-box canary could join, {_NO_SCORE}",
}


def check(cfg: Config) -> None:
    """The task's own settings (``task.*``), its kind of data, and what it needs of the other groups."""
    task = cfg.task
    if isinstance(cfg.dataset, RatingsConfig) != task.ratings:
        wanted = "a ratings dataset (planted_ratings)" if task.ratings else "an image dataset (digits, mnist, ...)"
        raise ConfigError("dataset.name", cfg.dataset.name, f"{wanted} with {task.label or 'task=' + task.name}")
    if cfg.dp.enabled:
        _check_steps(cfg, task)
    task.check(cfg)


def _check_steps(cfg: Config, task: TaskConfig) -> None:
    """What the task's private steps take, asked of its declarations: ``dp.engine`` (where given; null is
    the mechanism's own, asked with the engine's own needs: ``dpsweep.mechanisms.engines.check``) and the audit."""
    dp, label, mode, why_not = cfg.dp, task.label or f"task={task.name}", cfg.audit.mode, task.unaudited()
    if mode in audit.MODES and cfg.audit.enabled and mode not in task.audits:
        audited = " or ".join(f"task={name}" for name, t in sorted(task_schemas().items()) if mode in t.audits)
        why = f"{label} is not audited: {why_not}" if why_not else f"{mode} runs with {audited}"
        raise ConfigError("audit.mode", mode, f"off with {label}: {why}")
    engine = dp.engine
    require(engine is None or engine in task.engines, "dp.engine", engine, f"{_either(task.engines)} with {label}")


def _either(names: tuple[str, ...] | list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def shown_model(task: TaskConfig | type[TaskConfig], model_name: str) -> str:
    """The model a run's row shows: model.name, or the task's name for a task whose model group is
    only an evaluation model (``TaskConfig.shows_model``)."""
    return model_name if task.shows_model else str(task.name)


def _check_gan_settings(g: GanTaskConfig) -> None:
    """The ranges of task=gan's settings: weights, counts, learning rates, Adam's decay rates and shares."""
    require(g.gp_weight >= 0, "task.gp_weight", g.gp_weight, "a gradient-penalty weight λ >= 0")
    require(g.n_critic >= 1, "task.n_critic", g.n_critic, "1 or more critic steps per generator step")
    for key in (
        "latent_dim", "generator_width", "critic_width", "grid_every", "tstr_epochs", "tstr_batch_size", "snapshots",
        "snapshot_every",
    ):  # fmt: skip
        value = getattr(g, key)
        require(value >= 1, f"task.{key}", value, "a positive integer")
    for key in ("critic_lr", "generator_lr", "tstr_lr"):
        value = getattr(g, key)
        require(value > 0, f"task.{key}", value, "a positive learning rate")
    require(0 <= g.generator_ema < 1, "task.generator_ema", g.generator_ema, "a decay in [0, 1) (0: no average)")
    betas = list(g.betas)
    require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "task.betas", betas, "two decay rates in [0, 1)")
    require(
        0 < g.tstr_val_fraction < 1,
        "task.tstr_val_fraction",
        g.tstr_val_fraction,
        "a share of the synthetic set in (0, 1)",
    )
    require(g.memorisation_samples >= 1, "task.memorisation_samples", g.memorisation_samples, "a positive integer")


def _check_gan_privacy(cfg: Config, g: GanTaskConfig) -> None:
    """task=gan with DP: its stopping rule (what its critic's steps run with is their engine's to say:
    ``critic``, :mod:`dpsweep.mechanisms.engines`)."""
    dp = cfg.dp
    require(
        not g.stop_at_budget or dp.target_epsilon is not None, "task.stop_at_budget", g.stop_at_budget,
        "false, or true with dp.target_epsilon set (the budget training stops at)",
    )  # fmt: skip


def validate_input_shape(cfg: Config, input_shape: tuple[int, int, int]) -> None:
    """task=gan: one example must be a 28x28 single-channel image (digits at image_size=28, MNIST)."""
    if not isinstance(cfg.task, GanTaskConfig) or tuple(input_shape) == GAN_IMAGE_SHAPE:
        return
    shape = "x".join(map(str, input_shape))
    if input_shape[0] != 1:
        raise ConfigError(
            "dataset.name", cfg.dataset.name, f"a single-channel dataset (digits, mnist) with task=gan; it has {shape}"
        )
    raise ConfigError(
        "dataset.image_size", cfg.dataset.image_size, f"28 with task=gan (its images are served at {shape})"
    )


def task_schemas() -> dict[str, type[TaskConfig]]:
    """Task name -> its schema: each TaskConfig subclass by its ``name`` default (read now, so that a
    task defined after this import is included)."""
    out: dict[str, type[TaskConfig]] = {}
    stack = list(TaskConfig.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if isinstance(getattr(cls, "name", None), str) and cls.objective:
            out[cls.name] = cls
    return out


def task_objectives() -> dict[str, str]:
    """Task name -> the metric its runs are scored by (its schema's ``objective``)."""
    return {name: cls.objective for name, cls in task_schemas().items()}
