"""The dp/ group: how a run is made differentially private, and the checks of ``dp.*``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from dpsweep.config.checks import require
from dpsweep.privacy import ranges

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


class Accountant(StrEnum):
    """Privacy accountants of the run's ledger (dpsweep.privacy.ledger)."""

    rdp = "rdp"  # Rényi DP, Mironov 2017; ε via the improved conversion of Balle et al. 2020
    prv = "prv"  # privacy random variables, Gopi et al. 2021 (Opacus's PRVAccountant)
    pld = "pld"  # privacy loss distributions (dp-accounting), Doroshenko et al. 2022


class PrivacyUnit(StrEnum):
    """Whom a run's ε protects (dp.unit): one example, or all of one user's examples together."""

    example = "example"
    user = "user"


@dataclass(frozen=True)
class UnitFacts:
    """What a privacy unit means where a run is planned and reported."""

    protects: str  # the report's line: whom each ε protects ({n}: the values of population_key)
    population_key: str | None  # the config key whose value is N of the guarantee; None: the training examples
    keys: tuple[str, ...] = ()  # config keys that only runs at this unit read


# Whom each dp.unit protects (the report's notes, dpsweep-plan's N): one entry per PrivacyUnit.
UNITS: dict[str, UnitFacts] = {
    PrivacyUnit.example.value: UnitFacts("ε per example (protects one training example; N = training examples)", None),
    PrivacyUnit.user.value: UnitFacts(
        "ε per user (protects all of one user's data together, their examples or ratings, whatever a step "
        "bounds them to; N = users, dataset.num_users = {n})",
        "dataset.num_users",
        ("dataset.users", "dataset.num_users", "dataset.user_label_skew", "dataset.users_seed"),
    ),
}


def population(cfg: Config, n_train: int) -> int:
    """N of the guarantee: the training examples, or the value of the unit's ``population_key`` (users
    with dp.unit=user: dataset.num_users)."""
    key = UNITS[cfg.dp.unit.value].population_key if cfg.dp.enabled else None
    if key is None:
        return n_train
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return int(value)


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
    # Deprecated: dpsweep's fused step is dp.engine=fused (an engine, not an Opacus mode); this spelling is
    # read as that, with one warning, until the next release (DPConfig.__post_init__)
    fused = "fused"


# Engines once spelt as a dp.grad_sample_mode value, before dp.engine existed: the old value -> the engine.
# A config is read as the engine (DPConfig.__post_init__); a run is hashed and logged as before
# (spelled_as_before), so that its config hash, its params and the memory model's probes keep their values.
RENAMED_MODES: dict[str, str] = {GradSampleMode.fused.value: "fused"}
_warned: set[str] = set()  # the old spellings warned of in this process (one line each)


@dataclass
class DPConfig:
    enabled: bool = True
    noise_multiplier: float = 1.0  # σ: noise std relative to max_grad_norm; calibrated when target_epsilon is set
    max_grad_norm: float = 1.0  # C: per-sample gradient clipping norm (L2)
    delta: float = 1e-5  # δ of the (ε, δ) guarantee; must be < 1/N unless allow_large_delta
    # pld | prv | rdp: the accountant of the ε logged as `epsilon` and of calibration; PLD, the tightest
    # sound one (dp-accounting's pessimistic, connect-the-dots estimate); rdp to reproduce papers
    accountant: Accountant = Accountant.pld
    rdp_orders: RdpOrders = RdpOrders.default  # default (to 1024) | opacus (Opacus's grid, to 63)
    target_epsilon: float | None = None  # when set, σ is calibrated so that ε <= target_epsilon
    # when set (instead of target_epsilon), σ is calibrated so that no membership-inference attack reaches a
    # true-positive rate above it at 1 % false positives (dpsweep.privacy.certainty.noise_for_risk), in (0.01, 1)
    target_tpr_at_1pct: float | None = None
    allow_large_delta: bool = False  # permit δ >= 1/N, which makes the guarantee void
    grad_sample_mode: GradSampleMode = GradSampleMode.hooks  # how Opacus computes per-sample gradients
    # What takes the private steps (dpsweep.mechanisms.engines): opacus | own_steps | fused | critic |
    # sufficient_statistics; null: the mechanism's own at dp.unit that the task takes (dpsgd: opacus per
    # example, own_steps per user, critic with task=gan; dpftrl: own_steps; dpals: sufficient_statistics).
    # fused: DP-SGD's steps in compiled passes of one fixed shape (dpsweep.mechanisms.fused), per example or
    # per user (dp.grad_sample_mode=fused before).
    engine: str | None = None
    # fused: the rows (users, at user level) of every pass (>= train.batch_size; null: fused.default_pad_to(B)).
    # A Poisson batch larger than that takes more passes: nothing is truncated, the accounting is DP-SGD's.
    pad_to: int | None = None
    # fused: torch.compile the pass (CUDA graphs on a GPU); null: on a GPU only (on 2 CPU cores compiling
    # took 44 s and the compiled cnn pass was no faster than eager: benchmarks/throughput.py)
    compile: bool | None = None
    # Secure mode: every private stream (Poisson sampling, noise, canaries, a private clipping norm) is
    # seeded from 128 bits of the OS's entropy (63-bit seeds), never logged (dpsweep.privacy.streams); such
    # a run is tagged dp.release=ok and does not reproduce bit for bit. Off: the streams derive from train.seed and the
    # config, which are logged, so the run reproduces and is tagged dp.release=not-for-release.
    secure_mode: bool = False
    # The seed of the private streams, shared by every run that sets the same value (common random
    # numbers, e.g. to compare σ on the same batches and noise); null: derived from train.seed and the
    # run's config, so two configs of a sweep never share their batches or noise.
    stream_seed: int | None = None
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
    # How the run noises its gradients: a name in the mechanism registry (dpsweep.mechanisms), checked
    # where the run is planned. dpsgd (Poisson sampling, amplified) | dpftrl: tree aggregation over
    # batches in a fixed, seeded order, each example (or user) once per epoch, no sampling and no
    # amplification (Kairouz et al. 2021); the tree restarts every ftrl_restart_every epochs (null:
    # never), completed with virtual steps before a restart when ftrl_tree_completion; momentum is
    # optimizer.momentum (sgd only).
    mechanism: str = "dpsgd"
    ftrl_restart_every: int | None = None
    ftrl_tree_completion: bool = False
    # example | user: ε per example, or per user (dataset.users; N = users, train.batch_size = expected
    # users per step): each sampled user's contribution is the mean gradient of at most
    # max_examples_per_user of their examples, clipped to max_grad_norm as a whole (McMahan et al. 2018).
    unit: PrivacyUnit = PrivacyUnit.example
    max_examples_per_user: int = 16

    def __post_init__(self) -> None:
        """The old spelling of an engine (:data:`RENAMED_MODES`) read as the engine, with one line on stderr
        a process: every reader then sees ``dp.engine`` and Opacus's default ``dp.grad_sample_mode``."""
        old = str(self.grad_sample_mode)  # a GradSampleMode (a StrEnum), or its value given by hand
        engine = RENAMED_MODES.get(old)
        if engine is None or self.engine not in (None, engine):
            return  # dp.engine=opacus with the old spelling: refused by the engine, which reads no such mode
        self.engine, self.grad_sample_mode = engine, GradSampleMode.hooks
        if old not in _warned:
            _warned.add(old)
            said = f"dp.grad_sample_mode={old} is now dp.engine={engine}; the old spelling goes in the next release"
            print(f"dpsweep: {said}", file=sys.stderr)


def step_kind(dp: DPConfig) -> str:
    """A run's step as the memory model names it (its feature ``grad_sample_mode``, and the tag
    ``dp.grad_sample_mode``): Opacus's ``dp.grad_sample_mode``, or an engine that was once spelt as one
    (:data:`RENAMED_MODES`: ``fused``), so that the fits made before ``dp.engine`` still load; ``none``
    without DP."""
    if not dp.enabled:
        return "none"
    old = {engine: mode for mode, engine in RENAMED_MODES.items()}
    return old.get(dp.engine or "", str(dp.grad_sample_mode))


RISK_TARGET = "dp.target_tpr_at_1pct"  # left out of a run's identity where null (spelled_as_before)


def spelled_as_before(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened config with ``dp.engine`` as a run was hashed and logged before the key existed: left
    out where null (every run then; so is ``dp.target_tpr_at_1pct``), and an engine that was a
    ``dp.grad_sample_mode`` value (:data:`RENAMED_MODES`) spelt as that value. The two spellings of a run,
    and runs made before, share one config hash (resume, skipping FINISHED runs) and one set of params."""
    if flat.get(RISK_TARGET) is None:  # a key added later: left out where null, as runs before had it
        flat = {k: v for k, v in flat.items() if k != RISK_TARGET}
    if "dp.engine" not in flat:
        return flat
    out = {k: v for k, v in flat.items() if k != "dp.engine"}
    engine, old = flat["dp.engine"], {engine: mode for mode, engine in RENAMED_MODES.items()}
    if engine in old and flat.get("dp.grad_sample_mode") == GradSampleMode.hooks.name:
        out["dp.grad_sample_mode"] = old[engine]
    elif engine is not None:
        out["dp.engine"] = engine
    return out


def check(cfg: Config) -> None:
    """With DP on: the privacy unit, the ranges of σ, C, δ and ε, clipping and secure mode. What the
    mechanism and its engine need (fixed clipping, one pass a step, ...) is theirs to say, asked where the
    run is planned (:func:`dpsweep.mechanisms.engines.check`)."""
    dp = cfg.dp
    if not dp.enabled:
        return
    _check_unit(cfg)
    ranges.check("delta", "dp.delta", dp.delta)
    ranges.check("max_grad_norm", "dp.max_grad_norm", dp.max_grad_norm)
    _check_clipping(cfg)
    if dp.target_epsilon is not None:
        ranges.check("target_epsilon", "dp.target_epsilon", dp.target_epsilon)
    if dp.target_tpr_at_1pct is not None:
        _check_risk_target(dp)
    elif dp.target_epsilon is None:
        ranges.check("noise_multiplier", "dp.noise_multiplier", dp.noise_multiplier)
    _check_secure_mode(cfg)


def _check_risk_target(dp: DPConfig) -> None:
    """dp.target_tpr_at_1pct: a true-positive rate in (0.01, 1) (above the 1 % an attack that guesses
    reaches), and not beside dp.target_epsilon (σ is calibrated to one target)."""
    tpr = dp.target_tpr_at_1pct
    require(
        dp.target_epsilon is None, "dp.target_tpr_at_1pct", tpr,
        f"null with dp.target_epsilon={dp.target_epsilon}: σ is calibrated to one target, ε or attack risk",
    )  # fmt: skip
    require(
        isinstance(tpr, int | float) and not isinstance(tpr, bool) and 0.01 < tpr < 1, "dp.target_tpr_at_1pct", tpr,
        "a true-positive rate in (0.01, 1): above the 1 % FPR itself, below 1",
    )  # fmt: skip


def _check_unit(cfg: Config) -> None:
    """A unit the task protects; dp.unit=user: data with users (dataset.users, dpsweep.config.dataset)."""
    d, dp = cfg.dataset, cfg.dp
    units = type(cfg.task).units
    require(dp.unit.value in units, "dp.unit", dp.unit.value, f"{' or '.join(units)} with {type(cfg.task).label}")
    if dp.unit != PrivacyUnit.user:
        return
    require(
        d.users != "none", "dp.unit", dp.unit.value,
        "example, or user on data with users (dataset.users=partition): this dataset has none",
    )  # fmt: skip
    require(
        dp.max_examples_per_user >= 1, "dp.max_examples_per_user", dp.max_examples_per_user,
        "1 or more examples of a user per step",
    )  # fmt: skip


def _check_clipping(cfg: Config) -> None:
    """dp.clipping=quantile and adaptive: the quantile, its public range, and each method's own settings."""
    dp = cfg.dp
    if dp.clipping != Clipping.fixed:
        require(0 < dp.clip_quantile < 1, "dp.clip_quantile", dp.clip_quantile, "a quantile in (0, 1)")
        require(dp.clip_low >= 0, "dp.clip_low", dp.clip_low, "a gradient norm >= 0")
        require(dp.clip_low < dp.clip_high, "dp.clip_high", dp.clip_high, f"a norm above dp.clip_low={dp.clip_low:g}")
    if dp.clipping == Clipping.quantile:
        require(dp.clip_epsilon > 0, "dp.clip_epsilon", dp.clip_epsilon, "a positive ε for the quantile release")
        require(dp.clip_steps >= 2, "dp.clip_steps", dp.clip_steps, "2 or more histogram bins")
    if dp.clipping == Clipping.adaptive:
        require(dp.clip_lr > 0, "dp.clip_lr", dp.clip_lr, "a positive learning rate η of the clipping norm")
        sigma_b = dp.clip_count_noise
        require(sigma_b is None or sigma_b > 0, "dp.clip_count_noise", sigma_b, "a positive noise std σ_b, or null")


def _check_secure_mode(cfg: Config) -> None:
    """dp.secure_mode=true draws every private stream from the OS's entropy (``dpsweep.privacy.streams``),
    which shared streams would contradict."""
    dp = cfg.dp
    require(
        not (dp.secure_mode and dp.stream_seed is not None), "dp.stream_seed", dp.stream_seed,
        "null with dp.secure_mode=true: a secure run's sampling and noise come from the OS's entropy, not a seed",
    )  # fmt: skip
