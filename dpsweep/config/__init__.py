"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, and input validation.

The YAML files under ``conf/`` hold the values; the dataclasses here hold the keys and their types,
so a misspelt key or a value of the wrong type fails at composition with Hydra's own message::

    dpsweep train.bach_size=64      # Key 'bach_size' not in 'TrainConfig'
    dpsweep train.device=gpu        # Invalid value 'gpu', expected one of [auto, cpu, cuda]

Range checks that types cannot express (``noise_multiplier > 0``, ``delta < 1/N``, ...) are done by
:func:`validate` and :func:`validate_for_dataset` before any training starts. Each failure raises
:class:`ConfigError`, whose message names the key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from dpsweep import units
from dpsweep.errors import InputError
from dpsweep.privacy import ranges

# A configuration value out of its allowed range: ``<key>=<value> is invalid: <allowed>``. The one
# bad-input error of every command (dpsweep.errors), under the name the config module has always used.
ConfigError = InputError


class Accountant(StrEnum):
    """Privacy accountants of the run's ledger (dpsweep.privacy.ledger)."""

    rdp = "rdp"  # Rényi DP, Mironov 2017; ε via the improved conversion of Balle et al. 2020
    prv = "prv"  # privacy random variables, Gopi et al. 2021 (Opacus's PRVAccountant)
    pld = "pld"  # privacy loss distributions (dp-accounting), Doroshenko et al. 2022


class Mechanism(StrEnum):
    """How a DP run noises its gradients (dp.mechanism)."""

    dpsgd = "dpsgd"  # DP-SGD with Poisson sampling (Abadi et al. 2016): amplified by sampling
    dpftrl = "dpftrl"  # DP-FTRL tree aggregation (Kairouz et al. 2021): a fixed order, no sampling


class PrivacyUnit(StrEnum):
    """Whom a run's ε protects (dp.unit): one example, or all of one user's examples together."""

    example = "example"
    user = "user"


# Which user each training example belongs to (dataset.users): none (no users: example-level DP
# only), natural (the data carries a user id), partition (dataset.num_users users, a seeded
# Dirichlet(dataset.user_label_skew) label skew). A string, not an enum: str.partition is a method.
USER_ASSIGNMENTS = ("none", "natural", "partition")


class RdpOrders(StrEnum):
    """The RDP orders ε is minimised over (dpsweep.privacy.rdp.ORDER_GRIDS)."""

    default = "default"  # Opacus's grid plus a dense fractional grid and orders up to 1024
    opacus = "opacus"  # Opacus's and TF Privacy's grid (to 63): reproduces their published ε


class Clipping(StrEnum):
    """How the clipping norm C is chosen."""

    fixed = "fixed"  # C = dp.max_grad_norm
    quantile = "quantile"  # C = a private quantile of per-example gradient norms at initialisation
    adaptive = "adaptive"  # C moves towards a quantile at every step (Andrew et al. 2021)


class QuantileMethod(StrEnum):
    """The ε-DP quantile mechanism of dp.clipping=quantile (dpsweep.privacy.stats)."""

    histogram = "histogram"  # AboveThreshold over dp.clip_steps bins of [clip_low, clip_high]
    exponential = "exponential"  # the exponential mechanism (Smith 2011)


class GradSampleMode(StrEnum):
    """How Opacus computes per-sample gradients (``grad_sample_mode`` of ``PrivacyEngine.make_private``)."""

    hooks = "hooks"  # module hooks materialise every per-sample gradient (memory ~ B x P)
    ghost = "ghost"  # ghost clipping: per-sample norms without per-sample gradients, two backward passes
    functorch = "functorch"  # torch.func vmap per-sample gradients
    ew = "ew"  # torch's ExpandedWeights


class Device(StrEnum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


# ---------------------------------------------------------------------------------------------
# dataset/
# ---------------------------------------------------------------------------------------------
@dataclass
class DatasetConfig:
    name: str = MISSING
    # Side length in pixels the images are served at (square); null keeps the dataset's own size.
    image_size: int | None = None
    # Users, for dp.unit=user (dpsweep.data.users): partition splits the training set into num_users
    # non-iid users, each class's examples shared out by proportions ~ Dirichlet(user_label_skew)
    # (Hsu et al. 2019; small: each user holds few classes), seeded by users_seed.
    users: str = "none"  # none | natural | partition (USER_ASSIGNMENTS)
    num_users: int = 100
    user_label_skew: float = 1.0
    users_seed: int = 0


@dataclass
class DigitsConfig(DatasetConfig):
    """scikit-learn's 8x8 handwritten digits (1,797 images, ships offline)."""

    name: str = "digits"
    image_size: int | None = 28  # upsampled from 8x8 so the MNIST CNN applies unchanged
    test_fraction: float = 0.2  # share of the data held out, stratified by class: 1,437 train / 360 test images
    split_seed: int = 0  # fixed split: the same train/test partition in every run (not train.seed)


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    """A dataset read by a torchvision loader from ``root``."""

    root: str = "data"
    download: bool = False  # true fetches the files into root (needs internet)


@dataclass
class Flowers102Config(TorchvisionDatasetConfig):
    name: str = "flowers102"
    downscale: int = 1  # F: images are served at 224/F pixels unless image_size is set (2 -> 112, 4 -> 56)
    # Official splits to train on; the official train split holds only 1,020 images, so
    # [train, val] (2,040 images) is common. The N used is logged as the tag dataset.n_train.
    train_splits: list[str] = field(default_factory=lambda: ["train"])


# ---------------------------------------------------------------------------------------------
# model/
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    name: str = MISSING
    hidden_units: int = 32  # width of the trained dense layer


@dataclass
class CNNConfig(ModelConfig):
    """The Opacus MNIST example network, trained from scratch."""

    name: str = "cnn"
    hidden_units: int = 32  # width of the dense layer (the Opacus example's 512 -> 32 on 28x28 inputs)


@dataclass
class MLPConfig(ModelConfig):
    """Flattened pixels -> dense(hidden_units) -> ReLU -> dense(classes), trained from scratch."""

    name: str = "mlp"
    hidden_units: int = 16


@dataclass
class VGG16FrozenConfig(ModelConfig):
    """torchvision VGG16 with frozen convolutional features and a trained MLP head."""

    name: str = "vgg16_frozen"
    hidden_units: int = 512  # head width: the head dominates DP memory (B x trainable params)
    pretrained: bool = True  # ImageNet weights (torchvision's IMAGENET1K_V1); false initialises randomly
    dropout: float = 0.0  # dropout probability between the head's two layers; 0 disables it
    # Compute the frozen convolutional features once per (dataset, split, image size, weights) and
    # train the head on them (dpsweep.models.feature_cache); false recomputes them every step.
    feature_cache: bool = True
    feature_cache_dir: str = "cache/features"  # content-keyed feature files, relative to where dpsweep runs


# ---------------------------------------------------------------------------------------------
# task/
# ---------------------------------------------------------------------------------------------
@dataclass
class TaskConfig:
    """What a run trains and how it is scored: a name in ``dpsweep.tasks.TASKS``."""

    name: str = MISSING
    # The metric a run is scored by (what sweeps, searches and private tuning maximise). A class
    # constant, not a key: each task states it once here, where drivers read it without torch.
    objective: ClassVar[str] = ""


@dataclass
class ClassifierTaskConfig(TaskConfig):
    """Image classification: cross-entropy, scored by top-1 test accuracy (``dpsweep.tasks.classifier``)."""

    name: str = "classifier"
    objective: ClassVar[str] = "test_accuracy"


@dataclass
class GanTaskConfig(TaskConfig):
    """Private synthetic data: a conditional DP-WGAN-GP (``dpsweep.tasks.gan.task``); its settings are ``gan.*``."""

    name: str = "gan"
    objective: ClassVar[str] = "tstr_accuracy"  # train on synthetic, test on real (dpsweep.tasks.gan.synthetic)


# ---------------------------------------------------------------------------------------------
# gan/ (task=gan only: absent from every other task's config)
# ---------------------------------------------------------------------------------------------
@dataclass
class GanConfig:
    """dp-GAN (Zhang, Ji & Wang 2018, Alg. 1) on WGAN-GP (Gulrajani et al. 2017): the critic trains with
    DP-SGD (per-example clipping of its whole loss, gradient penalty included; Poisson batches of
    expected size train.batch_size), the generator with plain Adam (post-processing). An epoch is
    ceil(N/B) critic steps, so ε per epoch is DP-SGD's at the same σ, B and N; the generator steps
    once every n_critic critic steps. The TSTR classifier is the model group (cnn)."""

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
    # nothing. With DP it is a statistic of the training data that no accountant covers: the run
    # is then tagged dp.release=not-for-release.
    memorisation_check: bool = True
    memorisation_samples: int = 2000  # synthetic samples compared (drawn at random), each against every real image


# ---------------------------------------------------------------------------------------------
# dp/, optimizer/, train/, tracking/
# ---------------------------------------------------------------------------------------------
@dataclass
class DPConfig:
    enabled: bool = True
    noise_multiplier: float = 1.0  # σ: noise std relative to max_grad_norm; calibrated when target_epsilon is set
    max_grad_norm: float = 1.0  # C: per-sample gradient clipping norm (L2)
    delta: float = 1e-5  # δ of the (ε, δ) guarantee; must be < 1/N unless allow_large_delta
    accountant: Accountant = Accountant.rdp  # rdp | prv | pld: the accountant of the ε logged as `epsilon`
    rdp_orders: RdpOrders = RdpOrders.default  # default (to 1024) | opacus (Opacus's grid, to 63)
    target_epsilon: float | None = None  # when set, σ is calibrated so that ε <= target_epsilon
    allow_large_delta: bool = False  # permit δ >= 1/N, which makes the guarantee void
    grad_sample_mode: GradSampleMode = GradSampleMode.hooks  # how Opacus computes per-sample gradients
    # Opacus's secure mode: noise and Poisson sampling from a cryptographically secure RNG (torchcsprng)
    # instead of torch's generator, which train.seed (logged) regenerates. Off: runs are tagged
    # dp.release=not-for-release.
    secure_mode: bool = False
    # The clipping norm: fixed (dp.max_grad_norm); quantile: before training, the dp.clip_quantile of
    # the per-example gradient norms at initialisation on one Poisson sample, released with
    # dp.clip_epsilon-DP by dp.clip_quantile_method over the public range [clip_low, clip_high], and
    # charged in the run's privacy ledger (dp.max_grad_norm is then unused); adaptive: C starts at
    # dp.max_grad_norm and moves geometrically towards the dp.clip_quantile of the norms at every step
    # (Andrew et al. 2021), within [clip_low, clip_high], from a count of unclipped examples noised
    # with std dp.clip_count_noise; the gradient noise grows so that each step costs what DP-SGD at σ does.
    clipping: Clipping = Clipping.fixed
    clip_quantile: float = 0.5  # the target quantile γ of per-example gradient norms, in (0, 1)
    clip_quantile_method: QuantileMethod = QuantileMethod.histogram
    # ε of the quantile release (pure DP), before amplification by its Poisson sample: on digits (q = 1/23)
    # ε = 1 costs 0.072; a smaller ε on a sample of ~60 norms is mostly noise (Laplace(4/ε) per count)
    clip_epsilon: float = 1.0
    clip_low: float = 0.0  # the public range the quantile is searched in
    clip_high: float = 10.0
    clip_steps: int = 100  # bins of [clip_low, clip_high] for the histogram method
    clip_lr: float = 0.2  # adaptive: η of the geometric update C <- C·exp(-η(unclipped share - γ))
    # adaptive: σ_b, the std of the noise on the count of unclipped examples; null: B/20 (Andrew et al.)
    clip_count_noise: float | None = None
    # quantile and adaptive: divide the noisy clipped gradient by C, so that optimizer.lr is per unit of C
    # and the rate tuned at C = 1 carries over to a C chosen privately (DP-SGD's step grows with C
    # otherwise: normalised DP-SGD, De et al. 2022; Bu et al. 2022). Post-processing: no privacy cost.
    clip_normalize: bool = True
    # dpsgd (Poisson sampling, amplified) | dpftrl: tree aggregation over batches in a fixed, seeded
    # order, each example (or user) once per epoch, no sampling and no amplification (Kairouz et al.
    # 2021); the tree restarts every ftrl_restart_every epochs (null: never), completed with virtual
    # steps before a restart when ftrl_tree_completion; momentum is optimizer.momentum (sgd only).
    mechanism: Mechanism = Mechanism.dpsgd
    ftrl_restart_every: int | None = None
    ftrl_tree_completion: bool = False
    # example | user: ε per example, or per user (dataset.users; N = users, train.batch_size = expected
    # users per step): each sampled user's contribution is the mean gradient of at most
    # max_examples_per_user of their examples, clipped to max_grad_norm as a whole (McMahan et al. 2018).
    unit: PrivacyUnit = PrivacyUnit.example
    max_examples_per_user: int = 16


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = 0.05  # learning rate
    weight_decay: float = 0.0  # L2 penalty (not clipped per sample: it does not depend on the data)


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    momentum: float = 0.9  # heavy-ball momentum


@dataclass
class AdamConfig(OptimizerConfig):
    name: str = "adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's moment decay rates


@dataclass
class TrainConfig:
    batch_size: int = 64  # logical (expected) batch size B; with DP the sample rate is 1/ceil(N/B) (Opacus)
    epochs: int = 10  # passes over the data; steps = epochs x ceil(N/B)
    seed: int = 0  # seeds torch, numpy and Python; sweep it as an ordinary axis
    device: Device = Device.auto
    eval_batch_size: int = 1024  # examples per evaluation batch (no effect on privacy)
    # Evaluate (the classifier's test accuracy, the GAN's sample grids) every this many epochs; the
    # last epoch always is. ε and the memory peak are still logged every epoch.
    eval_every: int = 1
    progress: bool = True  # tqdm bars for epochs and steps (off by themselves when not on a terminal)
    # Per-epoch checkpoints (model, optimizer, accountant, RNG, MLflow run id); a run started again
    # with the same directory and config resumes from the last completed epoch. The dpsweep command
    # uses the Hydra job's output directory when this is null.
    checkpoint_dir: str | None = None
    # Examples per forward/backward pass (Opacus's BatchMemoryManager): a logical batch is split into
    # physical batches of at most this size, with one optimizer step (and one privacy step) per
    # logical batch, so the privacy accounting is unchanged. null: chosen from train.memory_model and
    # launcher.gpu_memory when both are set, else the whole logical batch in one pass.
    physical_batch_size: int | None = None
    memory_model: str | None = None  # a dpsweep-memory fit JSON file (used to choose physical_batch_size)
    # Memory probe: run only the first iteration on a batch of exactly batch_size examples, record the
    # four memory stages (tag probe=true), and stop; no evaluation, no ε. See dpsweep-memory probe.
    probe: bool = False
    # Hold the training split on the device and draw Poisson batches there (dpsweep.data.device):
    # same sample rate and steps as Opacus's loader, without per-example loader overhead. For
    # datasets that fit in device memory (digits, MNIST, CIFAR-10, cached VGG16 features).
    device_resident: bool = False


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///mlflow.db"  # relative to where dpsweep runs; any MLflow URI, e.g. http://host:5000
    experiment_name: str = "dpsweep"  # the MLflow experiment the runs go to
    run_name: str | None = None  # null: a readable name from the config (digits-cnn-σ1-C1-B64-e10-s0)
    # Log the trained model (MLflow's PyTorch flavour, artifact "model"): only its trained parameters
    # (vgg16_frozen: the head, not the public backbone), when they take at most log_model_max_mib.
    log_model: bool = True
    log_model_max_mib: float = 256.0
    # MLflow's system metrics (CPU, memory, disk, network; GPU where pynvml finds one), sampled every
    # system_metrics_interval_s from this many seconds into training on: short runs log none. null: never.
    system_metrics_after_s: float | None = 60.0
    system_metrics_interval_s: float = 10.0


@dataclass
class SweepConfig:
    # Drop configs whose planned ε (dp.accountant, over all their steps) exceeds this budget:
    # dpsweep-plan marks them and dpsweep -m skips them. null keeps every config.
    max_epsilon: float | None = None
    force: bool = False  # re-run configs that already FINISHED in the experiment (default: skip them)
    # Stop a sweep or study that is mostly failing: checked once at least min_jobs_for_failure_rate
    # jobs have ended. Below the rate, failures are reported at the end.
    max_failure_rate: float = 0.5
    min_jobs_for_failure_rate: int = 4
    # Set by dpsweep's sweepers on every job; each becomes a tag of the job's MLflow run.
    id: str | None = None
    parent_run_id: str | None = None  # the sweep's parent MLflow run (mlflow.parentRunId)
    study: str | None = None  # Optuna study name
    trial: int | None = None  # Optuna trial number
    storage: str | None = None  # Optuna storage URL, for reporting per-epoch accuracy (pruning)
    pruner: str | None = None  # Optuna pruner the job consults each epoch (median), or null
    pruner_startup_trials: int = 2  # the median pruner prunes nothing until this many trials completed
    pruner_warmup_epochs: int = 1  # ... nor before this many epochs of a trial
    # Private tuning (dpsweep.privacy.tuning, Papernot & Steinke 2022): instead of every grid config, run K
    # trials, K drawn from tuning_distribution (poisson | geometric | tnb) with mean tuning_mean_trials
    # from secret randomness, each a config drawn uniformly from the grid with a secret train.seed;
    # only the best trial is released, and the parent run logs epsilon_tuning, the whole procedure's ε.
    private_tuning: bool = False
    tuning_distribution: str = "poisson"
    tuning_mean_trials: float = 10.0
    tuning_eta: float = 0.5  # shape η > 0 of the truncated negative binomial (tnb)
    tuning_trial: int | None = None  # set by the sweeper on each trial of a private tuning

    @property
    def prunes(self) -> bool:
        """This job reports per-epoch accuracy to an Optuna trial whose pruner may stop it."""
        return bool(self.pruner and self.study and self.storage and self.trial is not None)


@dataclass
class LauncherConfig:
    """Resources, said once; each launcher maps them to its scheduler (conf/launcher/*.yaml)."""

    name: str = "inline"  # inline (in-process, one after another) | local | slurm | sge
    gpus_per_job: int = 0
    cpus_per_job: int = 1
    mem_gb: int = 4  # memory per job, GiB
    timeout_min: int = 60  # wall-clock limit per job, minutes
    partition: str | None = None  # Slurm partition or SGE queue; null: the scheduler's default
    max_parallel: int = 1  # jobs running at once (local: processes; clusters: array throttle)
    setup: list[str] = field(default_factory=list)  # shell lines run before each job (module load, venv)
    gpu_resource: str = "gpu={gpus}"  # SGE only: the -l resource string sites use for GPUs
    # Memory of each job's GPU with units, e.g. 16GiB or 80GB: dpsweep-plan flags configs predicted
    # not to fit (with train.memory_model), and training picks the physical batch from it.
    gpu_memory: str | None = None


@dataclass
class Config:
    task: Any = MISSING  # a TaskConfig subclass, chosen by the task/ group
    gan: GanConfig | None = None  # task=gan's settings (conf/gan/), absent for every other task
    dataset: Any = MISSING  # a DatasetConfig subclass, chosen by the dataset/ group
    model: Any = MISSING  # a ModelConfig subclass
    dp: DPConfig = MISSING
    optimizer: Any = MISSING  # an OptimizerConfig subclass
    train: TrainConfig = MISSING
    tracking: TrackingConfig = MISSING
    sweep: SweepConfig = field(default_factory=SweepConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent).

    Each YAML option under ``conf/<group>/`` names its schema first in its defaults list.
    """
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="task", name="base_classifier", node=ClassifierTaskConfig)
    cs.store(group="task", name="base_gan", node=GanTaskConfig)
    cs.store(group="gan", name="base_gan", node=GanConfig)
    cs.store(group="dataset", name="base_digits", node=DigitsConfig)
    cs.store(group="dataset", name="base_torchvision", node=TorchvisionDatasetConfig)
    cs.store(group="dataset", name="base_flowers102", node=Flowers102Config)
    cs.store(group="model", name="base_cnn", node=CNNConfig)
    cs.store(group="model", name="base_mlp", node=MLPConfig)
    cs.store(group="model", name="base_vgg16_frozen", node=VGG16FrozenConfig)
    cs.store(group="dp", name="base_dp", node=DPConfig)
    cs.store(group="optimizer", name="base_sgd", node=SGDConfig)
    cs.store(group="optimizer", name="base_adam", node=AdamConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="tracking", name="base_tracking", node=TrackingConfig)


def to_config(cfg: DictConfig | Config) -> Config:
    """Return the typed :class:`Config` object for a composed DictConfig (or pass one through)."""
    if isinstance(cfg, Config):
        return cfg
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):
        raise TypeError(
            "train() needs a config composed against the dpsweep schema "
            "(hydra.compose(config_name='config') or the dpsweep CLI), got a plain mapping"
        )
    _refuse_unknown_keys(cfg, obj)
    return obj


def _refuse_unknown_keys(given: DictConfig, typed: Config) -> None:
    """Keys the schema lacks (``+train.bach_size=32``: Hydra adds them, and the typed config would drop
    them silently) are refused, with the closest valid keys. Only the keys are compared (the given
    config's node names against the schema's fields), so no value is resolved unless one is refused."""
    import difflib

    for key in _unknown_keys(given, typed):
        value = OmegaConf.select(given, key)
        if isinstance(value, DictConfig):  # name the first value under the unknown node, as a dotted key
            leaf, value = next(iter(_flatten(value).items()), ("", {}))
            key = f"{key}.{leaf}" if leaf else key
        close = difflib.get_close_matches(key, list(flatten(typed)), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(key, value, f"a key of the dpsweep config (this one is not in its schema){hint}")


def _unknown_keys(given: DictConfig, typed: object, prefix: str = "") -> Iterator[str]:
    """The dotted key of each node of ``given`` whose name is no field of the dataclass ``typed`` at the
    same place; below a field that is not a dataclass (a dict of any keys), every key is known."""
    if not dataclasses.is_dataclass(typed):
        return
    names = {f.name for f in dataclasses.fields(typed)}
    for name in map(str, given):
        if name not in names:
            yield prefix + name
        elif isinstance(node := given._get_node(name), DictConfig):  # the node: nothing resolved
            yield from _unknown_keys(node, getattr(typed, name), f"{prefix}{name}.")


def flatten(cfg: DictConfig | Config) -> dict[str, Any]:
    """Flatten a config to dotted keys: ``{"dp.noise_multiplier": 1.0, ...}`` (enums as strings)."""
    if isinstance(cfg, DictConfig):
        return _flatten(cfg)
    return dict(_structured(cfg)[1])


def structured(cfg: Config) -> DictConfig:
    """``OmegaConf.structured(cfg)``, read-only (a run asks for it again for its ``config.yaml``)."""
    return _structured(cfg)[0]


def _structured(cfg: Config) -> tuple[DictConfig, dict[str, Any]]:
    """A typed config as a read-only DictConfig and flattened, made once per config: a run flattens
    its config several times, and ``OmegaConf.structured`` takes about 15 ms each time."""
    key = repr(cfg)  # a dataclass's repr holds every field
    if key not in _STRUCTURED:
        if len(_STRUCTURED) >= 64:
            _STRUCTURED.clear()
        node = OmegaConf.structured(cfg)
        OmegaConf.set_readonly(node, True)
        _STRUCTURED[key] = node, _flatten(node)
    return _STRUCTURED[key]


_STRUCTURED: dict[str, tuple[DictConfig, dict[str, Any]]] = {}


def _flatten(node: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", container)
    return out


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


SECURE_RNG_MODULE = "torchcsprng"  # what Opacus's PrivacyEngine(secure_mode=True) imports


def validate(cfg: Config) -> None:
    """Check the ranges that need no data. Raises :class:`ConfigError` on the first bad value."""
    t, dp, m, opt = cfg.train, cfg.dp, cfg.model, cfg.optimizer
    ranges.check("batch_size", "train.batch_size", t.batch_size)
    ranges.check("epochs", "train.epochs", t.epochs)
    _require(t.eval_batch_size > 0, "train.eval_batch_size", t.eval_batch_size, "a positive integer")
    _require(t.eval_every >= 1, "train.eval_every", t.eval_every, "a number of epochs, 1 or more")
    pb = t.physical_batch_size
    _require(pb is None or pb > 0, "train.physical_batch_size", pb, "a positive number of examples or null")
    _require(
        not (t.probe and pb is not None),
        "train.physical_batch_size",
        pb,
        "null with train.probe=true: a probe measures one pass over exactly train.batch_size examples",
    )
    if t.memory_model is not None and not Path(t.memory_model).is_file():
        raise ConfigError("train.memory_model", t.memory_model, "an existing dpsweep-memory fit JSON file or null")
    _require(
        t.memory_model is None or cfg.launcher.gpu_memory is not None,
        "launcher.gpu_memory",
        cfg.launcher.gpu_memory,
        f"the GPU memory with units (e.g. 16GiB) for train.memory_model={t.memory_model!r} to pick the physical batch",
    )
    _require(m.hidden_units > 0, "model.hidden_units", m.hidden_units, "a positive integer")
    if isinstance(m, VGG16FrozenConfig):
        _require(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "a probability in [0, 1)")
    for key, value in flatten(cfg).items():  # every number of every input is finite (nan, inf hang or lie)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, value, "a finite number")
    _require(opt.lr > 0, "optimizer.lr", opt.lr, "a positive learning rate")
    _require(opt.weight_decay >= 0, "optimizer.weight_decay", opt.weight_decay, "0 or a positive L2 penalty")
    if isinstance(opt, SGDConfig):
        _require(0 <= opt.momentum < 1, "optimizer.momentum", opt.momentum, "a momentum in [0, 1)")
    if isinstance(opt, AdamConfig):
        betas = list(opt.betas)
        _require(
            len(betas) == 2 and all(0 <= b < 1 for b in betas), "optimizer.betas", betas, "two decay rates in [0, 1)"
        )
    if isinstance(cfg.dataset, DigitsConfig):
        frac = cfg.dataset.test_fraction
        _require(0 < frac < 1, "dataset.test_fraction", frac, "a share of the data in (0, 1)")
    s = cfg.sweep
    _require(
        s.max_epsilon is None or s.max_epsilon > 0, "sweep.max_epsilon", s.max_epsilon, "a positive ε budget or null"
    )
    _require(
        0 < s.max_failure_rate <= 1, "sweep.max_failure_rate", s.max_failure_rate, "a share of failed jobs in (0, 1]"
    )
    _require(
        s.min_jobs_for_failure_rate >= 1,
        "sweep.min_jobs_for_failure_rate",
        s.min_jobs_for_failure_rate,
        "1 or more jobs",
    )
    _require(
        cfg.tracking.log_model_max_mib > 0,
        "tracking.log_model_max_mib",
        cfg.tracking.log_model_max_mib,
        "a positive size in MiB (or tracking.log_model=false)",
    )
    after = cfg.tracking.system_metrics_after_s
    _require(
        after is None or after >= 0, "tracking.system_metrics_after_s", after, "0 or more seconds, or null (never)"
    )
    interval = cfg.tracking.system_metrics_interval_s
    _require(interval > 0, "tracking.system_metrics_interval_s", interval, "a positive number of seconds")
    img = cfg.dataset.image_size
    _require(img is None or img > 0, "dataset.image_size", img, "a positive number of pixels or null")
    if isinstance(cfg.dataset, Flowers102Config):
        _require(cfg.dataset.downscale > 0, "dataset.downscale", cfg.dataset.downscale, "a positive integer")
        allowed_splits = {"train", "val"}
        bad = [s for s in cfg.dataset.train_splits if s not in allowed_splits]
        splits = list(cfg.dataset.train_splits)
        _require(
            bool(splits) and not bad and len(set(splits)) == len(splits),
            "dataset.train_splits",
            list(cfg.dataset.train_splits),
            "a non-empty subset of [train, val] without repeats (test is held out; a repeat would count images twice)",
        )
    _validate_gan(cfg)
    _validate_users(cfg)
    if not dp.enabled:
        return
    _validate_mechanism(cfg)
    ranges.check("delta", "dp.delta", dp.delta)
    ranges.check("max_grad_norm", "dp.max_grad_norm", dp.max_grad_norm)
    if dp.clipping != Clipping.fixed:
        _require(0 < dp.clip_quantile < 1, "dp.clip_quantile", dp.clip_quantile, "a quantile in (0, 1)")
        _require(dp.clip_low >= 0, "dp.clip_low", dp.clip_low, "a gradient norm >= 0")
        _require(dp.clip_low < dp.clip_high, "dp.clip_high", dp.clip_high, f"a norm above dp.clip_low={dp.clip_low:g}")
    if dp.clipping == Clipping.quantile:
        _require(dp.clip_epsilon > 0, "dp.clip_epsilon", dp.clip_epsilon, "a positive ε for the quantile release")
        _require(dp.clip_steps >= 2, "dp.clip_steps", dp.clip_steps, "2 or more histogram bins")
    if dp.clipping == Clipping.adaptive:
        _require(dp.clip_lr > 0, "dp.clip_lr", dp.clip_lr, "a positive learning rate η of the clipping norm")
        sigma_b = dp.clip_count_noise
        _require(sigma_b is None or sigma_b > 0, "dp.clip_count_noise", sigma_b, "a positive noise std σ_b, or null")
        _require(
            dp.grad_sample_mode != GradSampleMode.ghost, "dp.grad_sample_mode", dp.grad_sample_mode.value,
            "hooks, functorch or ew with dp.clipping=adaptive: Opacus's ghost clipping has a fixed norm",
        )  # fmt: skip
    if dp.target_epsilon is None:
        ranges.check("noise_multiplier", "dp.noise_multiplier", dp.noise_multiplier)
    else:
        ranges.check("target_epsilon", "dp.target_epsilon", dp.target_epsilon)
    _require(
        not dp.secure_mode or importlib.util.find_spec(SECURE_RNG_MODULE) is not None,
        "dp.secure_mode",
        dp.secure_mode,
        f"false here: Opacus's secure mode needs the {SECURE_RNG_MODULE} package, which is not installed "
        "(pytorch/csprng; it has no build for recent torch versions)",
    )
    _require(
        not (dp.secure_mode and t.device_resident),
        "train.device_resident",
        t.device_resident,
        "false with dp.secure_mode=true: device-resident Poisson sampling draws from torch's generator",
    )


NATURAL_USER_DATASETS: tuple[str, ...] = ()  # datasets whose examples carry a user id (none of today's)


def _validate_users(cfg: Config) -> None:
    """dataset.users and dp.unit: users where the unit is the user, and sane partitions."""
    d, dp = cfg.dataset, cfg.dp
    _require(d.users in USER_ASSIGNMENTS, "dataset.users", d.users, f"one of {', '.join(USER_ASSIGNMENTS)}")
    _require(
        d.users != "natural" or d.name in NATURAL_USER_DATASETS, "dataset.users", d.users,
        f"none or partition: {d.name} carries no user ids (partition splits it into dataset.num_users users)",
    )  # fmt: skip
    if d.users == "partition":
        _require(d.num_users >= 2, "dataset.num_users", d.num_users, "2 or more users (at most N)")
        _require(
            d.user_label_skew > 0, "dataset.user_label_skew", d.user_label_skew,
            "a positive Dirichlet concentration α (small: users hold few classes; large: iid)",
        )  # fmt: skip
    if not dp.enabled or dp.unit != PrivacyUnit.user:
        return
    _require(
        d.users != "none", "dp.unit", dp.unit.value,
        "example, or user on data with users (dataset.users=partition): this dataset has none",
    )  # fmt: skip
    _require(
        dp.max_examples_per_user >= 1, "dp.max_examples_per_user", dp.max_examples_per_user,
        "1 or more examples of a user per step",
    )  # fmt: skip
    _require(cfg.gan is None, "dp.unit", dp.unit.value, "example with task=gan")


def _validate_mechanism(cfg: Config) -> None:
    """What dp.mechanism=dpftrl and dp.unit=user run with (they noise their own gradients, without Opacus)."""
    dp, t = cfg.dp, cfg.train
    own = dp.mechanism == Mechanism.dpftrl or dp.unit == PrivacyUnit.user
    if dp.mechanism == Mechanism.dpftrl:
        _require(
            cfg.optimizer.name == "sgd", "optimizer.name", cfg.optimizer.name,
            "sgd with dp.mechanism=dpftrl: its tree adds noise to the prefix sums of the gradients, a fixed "
            "linear workload; an adaptive optimizer (adam) is not that workload (Kairouz et al. 2021)",
        )  # fmt: skip
        restart = dp.ftrl_restart_every
        _require(
            restart is None or 1 <= restart <= t.epochs, "dp.ftrl_restart_every", restart,
            f"a whole number of epochs from 1 to train.epochs={t.epochs} (a longer period never restarts), or null",
        )  # fmt: skip
        _require(dp.accountant != Accountant.prv, "dp.accountant", dp.accountant.value, "rdp or pld with dpftrl")
        _require(cfg.gan is None, "dp.mechanism", dp.mechanism.value, "dpsgd with task=gan")
    if not own:
        return
    what = "dp.mechanism=dpftrl" if dp.mechanism == Mechanism.dpftrl else "dp.unit=user"
    _require(dp.clipping == Clipping.fixed, "dp.clipping", dp.clipping.value, f"fixed with {what}")
    _require(not dp.secure_mode, "dp.secure_mode", dp.secure_mode, f"false with {what}: its noise is torch's")
    pb = t.physical_batch_size
    _require(pb is None, "train.physical_batch_size", pb, f"null with {what}: a step is one pass")


GAN_GRAD_SAMPLE_MODES = (GradSampleMode.functorch,)  # those that can take a gradient of a gradient


def _validate_gan(cfg: Config) -> None:
    """task=gan's settings (and that gan.* is set exactly when task=gan)."""
    g = cfg.gan
    if g is None:
        _require(cfg.task.name != "gan", "gan", None, "the gan settings: compose with task=gan (conf/task/gan.yaml)")
        return
    _require(cfg.task.name == "gan", "task.name", cfg.task.name, "gan: the gan.* settings belong to task=gan")
    _require(g.gp_weight >= 0, "gan.gp_weight", g.gp_weight, "a gradient-penalty weight λ >= 0")
    _require(g.n_critic >= 1, "gan.n_critic", g.n_critic, "1 or more critic steps per generator step")
    for key in (
        "latent_dim", "generator_width", "critic_width", "grid_every", "tstr_epochs", "tstr_batch_size", "snapshots",
        "snapshot_every",
    ):  # fmt: skip
        value = getattr(g, key)
        _require(value >= 1, f"gan.{key}", value, "a positive integer")
    for key in ("critic_lr", "generator_lr", "tstr_lr"):
        value = getattr(g, key)
        _require(value > 0, f"gan.{key}", value, "a positive learning rate")
    _require(0 <= g.generator_ema < 1, "gan.generator_ema", g.generator_ema, "a decay in [0, 1) (0: no average)")
    betas = list(g.betas)
    _require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "gan.betas", betas, "two decay rates in [0, 1)")
    _require(
        0 < g.tstr_val_fraction < 1,
        "gan.tstr_val_fraction",
        g.tstr_val_fraction,
        "a share of the synthetic set in (0, 1)",
    )
    _require(g.memorisation_samples >= 1, "gan.memorisation_samples", g.memorisation_samples, "a positive integer")
    _require(
        cfg.model.name == "cnn", "model.name", cfg.model.name,
        "cnn with task=gan: the model group is the TSTR classifier, trained on 28x28 synthetic images",
    )  # fmt: skip
    dp = cfg.dp
    if not dp.enabled:
        return
    _require(
        dp.grad_sample_mode in GAN_GRAD_SAMPLE_MODES, "dp.grad_sample_mode", dp.grad_sample_mode.value,
        "functorch with task=gan: the gradient penalty needs a gradient of a gradient inside each example's "
        f"clipped gradient, which Opacus's {dp.grad_sample_mode.value} mode cannot take (Opacus #31, #548); "
        "dpsweep computes it with torch.func",
    )  # fmt: skip
    _require(dp.clipping == Clipping.fixed, "dp.clipping", dp.clipping.value, "fixed with task=gan (dp.max_grad_norm)")
    _require(
        not dp.secure_mode, "dp.secure_mode", dp.secure_mode,
        "false with task=gan: its critic's noise and Poisson sampling draw from torch's generator",
    )  # fmt: skip
    pb = cfg.train.physical_batch_size
    _require(pb is None, "train.physical_batch_size", pb, "null with task=gan: a critic step is one pass")
    _require(
        not g.stop_at_budget or dp.target_epsilon is not None, "gan.stop_at_budget", g.stop_at_budget,
        "false, or true with dp.target_epsilon set (the budget training stops at)",
    )  # fmt: skip


GAN_IMAGE_SHAPE = (1, 28, 28)  # what task=gan's networks are sized for


def validate_input_shape(cfg: Config, input_shape: tuple[int, int, int]) -> None:
    """task=gan: one example must be a 28x28 single-channel image (digits at image_size=28, MNIST)."""
    if cfg.gan is None or tuple(input_shape) == GAN_IMAGE_SHAPE:
        return
    shape = "x".join(map(str, input_shape))
    if input_shape[0] != 1:
        raise ConfigError(
            "dataset.name", cfg.dataset.name, f"a single-channel dataset (digits, mnist) with task=gan; it has {shape}"
        )
    raise ConfigError(
        "dataset.image_size", cfg.dataset.image_size, f"28 with task=gan (its images are served at {shape})"
    )


def validate_launcher(launcher: LauncherConfig) -> None:
    """Resources must be satisfiable: positive counts, memory in GiB, time in minutes."""
    _require(launcher.gpus_per_job >= 0, "launcher.gpus_per_job", launcher.gpus_per_job, "0 or more GPUs")
    _require(launcher.cpus_per_job >= 1, "launcher.cpus_per_job", launcher.cpus_per_job, "1 or more CPUs")
    _require(launcher.mem_gb > 0, "launcher.mem_gb", launcher.mem_gb, "a positive amount of memory in GiB, e.g. 16")
    _require(
        launcher.timeout_min > 0, "launcher.timeout_min", launcher.timeout_min, "a positive time in minutes, e.g. 120"
    )
    _require(launcher.max_parallel >= 1, "launcher.max_parallel", launcher.max_parallel, "1 or more jobs at once")
    if launcher.gpu_memory is not None:
        units.parse_bytes(launcher.gpu_memory, key="launcher.gpu_memory")
    _require(
        "{gpus}" in launcher.gpu_resource,
        "launcher.gpu_resource",
        launcher.gpu_resource,
        "an SGE resource string with a {gpus} placeholder, e.g. gpu={gpus} or h_gpu={gpus}",
    )


# Keys that do not change what a run computes: where it is tracked, launched or checkpointed.
NON_IDENTITY_PREFIXES = (
    "tracking.", "launcher.", "sweep.", "train.checkpoint_dir", "train.progress", "train.eval_batch_size",
    "train.eval_every", "train.memory_model", "model.feature_cache_dir", "gan.grid_every", "gan.memorisation_",
)  # fmt: skip


# Config sections only some tasks have (null for the others): absent ones are left out of the
# identity, so adding a task's section leaves every other task's config hashes as they were.
TASK_SECTIONS = ("gan",)


def identity(flat: dict[str, Any]) -> dict[str, Any]:
    """The part of a flattened config that determines the run's result (for hashes and resume).

    Without DP, σ, C, δ and the accountant have no effect, so only ``dp.enabled`` is kept.
    """
    dp_off = flat.get("dp.enabled") is False
    return {
        k: v
        for k, v in flat.items()
        if not k.startswith(NON_IDENTITY_PREFIXES)
        and not (dp_off and k.startswith("dp.") and k != "dp.enabled")
        and not (k in TASK_SECTIONS and v is None)
    }


def identity_hash(flat_identity: dict[str, Any]) -> str:
    """Stable hash of a flattened config's identity (keys sorted; values as JSON): resume and skipping."""
    blob = json.dumps(flat_identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


SWEEPER_KEYS = ("sweep.id", "sweep.parent_run_id")  # what dpsweep's grid sweeper adds to every job


def given_overrides(overrides: Sequence[str]) -> list[str]:
    """A job's overrides as the user gave them, without those the sweeper added (SWEEPER_KEYS)."""
    return [o for o in overrides if o.partition("=")[0] not in SWEEPER_KEYS]


def settings(flat: dict[str, Any]) -> dict[str, Any]:
    """The rest of a flattened config: where a run is tracked, launched or checkpointed
    (NON_IDENTITY_PREFIXES), which does not change what it computes; unset ones left out."""
    return {k: v for k, v in flat.items() if k.startswith(NON_IDENTITY_PREFIXES) and v is not None}


def validate_for_dataset(cfg: Config, n_train: int) -> None:
    """Check the ranges that depend on the training-set size N (and, with dp.unit=user, the users)."""
    d = cfg.dataset
    if d.users == "partition":
        _require(d.num_users <= n_train, "dataset.num_users", d.num_users, f"2 to N={n_train} users (one example each)")
    if cfg.dp.enabled and cfg.dp.unit == PrivacyUnit.user:
        n_train = d.num_users  # the population of the guarantee: B users per step, δ < 1/users
    ranges.check_batch_size("train.batch_size", cfg.train.batch_size, n_train)
    if cfg.dp.enabled:
        ranges.check_delta("dp.delta", cfg.dp.delta, n_train, cfg.dp.allow_large_delta, "dp.allow_large_delta=true")
