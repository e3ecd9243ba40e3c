"""What a run's MLflow run records about its config: its name, tags, params and ``config.yaml``; and,
at its end, how certain its ε is (:func:`certainty_figures`).

from dpsweep.run.records import run_name
run_name(cfg, 1.1)          # 'σ1.1-C1-B64-s0-e10-digits-cnn'

A trial of a private tuning (:func:`tuning_trial`) records neither its secret ``train.seed`` (Papernot &
Steinke 2022 need it secret; without ``dp.secure_mode`` it regenerates the trial's noise) nor the links
to its sweep's parent run, which holds K (issue 54, item 3): not in its name, params, tags or
``config.yaml``. Its ``sweep.id`` tag, which the sweep's driver needs until the release, is removed
from the released trial then (``dpsweep.tracking.sweeps.release_best``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from omegaconf import OmegaConf

from dpsweep.config import Config, flatten, identity, settings, shown_model, step_kind, structured
from dpsweep.data import loaders
from dpsweep.errors import redact, redacted
from dpsweep.mechanisms import engines
from dpsweep.plan import RunPlan
from dpsweep.privacy import certainty, streams
from dpsweep.privacy.ledger import Ledger
from dpsweep.tracking import Tracker
from dpsweep.tracking.environment import environment_tags

# What a trial of a private tuning keeps out of its config.yaml: its secret seed, and what names its sweep
# and the sweep's parent run (which holds K). Its params leave out the seed (WITHHELD_PARAMS); its tags, the
# parent run's id (sweep.id stays until the release: the driver finds the sweep's jobs by it).
WITHHELD_KEYS = ("train.seed", "sweep.id", "sweep.parent_run_id")
WITHHELD_PARAMS = ("train.seed",)
WITHHELD_NOTE = (
    "# a trial of a private tuning: train.seed, sweep.id and sweep.parent_run_id are withheld (its seed is secret,\n"
    "# and the sweep's parent run holds the number of trials K; Papernot & Steinke 2022)\n"
)


def tuning_trial(cfg: Config) -> bool:
    """Whether ``cfg`` is a trial of a private tuning (``sweep.private_tuning``, launched by a sweep)."""
    return bool(cfg.sweep.private_tuning and cfg.sweep.id is not None)


def log_config(config: Config, plan: RunPlan, data: loaders.DataSplits, run: Tracker) -> None:
    """A new run's params, setting tags, ``config.yaml`` and dataset splits."""
    run.log_params(run_params(plan))
    run.set_tags(setting_tags(plan))
    run.log_text(resolved_yaml(plan), "config.yaml")
    run.log_dataset_splits(
        flatten(config.dataset),
        {"train": data.n_train, "test": len(data.test)},  # type: ignore[arg-type]
    )


def run_name(cfg: Config, sigma: float | None) -> str:
    """A readable MLflow run name, e.g. ``σ1.1-C1-B64-s0-e10-digits-cnn`` (``nodp`` without DP; ``Cq0.5`` and
    ``Ca0.5``: C from the private 0.5 quantile, or adaptive towards it). What a sweep varies comes first
    (σ, C, B, the seed; an Optuna trial's number before them), where MLflow's runs table, which cuts a
    name at about 20 characters, still shows it; the dataset and model, which an experiment seldom
    varies, come last. A trial of a private tuning's has no seed: it is secret (:func:`tuning_trial`)."""
    dp = cfg.dp
    clip = f"C{dp.max_grad_norm:g}" if dp.clipping == "fixed" else f"C{dp.clipping.value[0]}{dp.clip_quantile:g}"
    privacy_part = f"σ{sigma:.3g}-{clip}" if sigma is not None else "nodp"
    t = cfg.train
    what = shown_model(cfg.task, cfg.model.name)  # the model, or the task where its model only evaluates
    seed = "" if tuning_trial(cfg) else f"-s{t.seed}"
    name = f"{privacy_part}-B{t.batch_size}{seed}-e{t.epochs}-{cfg.dataset.name}-{what}"
    return name if cfg.sweep.trial is None else f"trial{cfg.sweep.trial}-{name}"


def named(cfg: Config, plan: RunPlan) -> Any:
    """The tracking config with a run name (MLflow's random names repeat here: seeding resets Python's RNG)."""
    if cfg.tracking.run_name is not None:
        return cfg.tracking
    prefix = "probe-" if cfg.train.probe else ""
    return dataclasses.replace(cfg.tracking, run_name=prefix + run_name(cfg, plan.noise_multiplier))


def sweep_tags(cfg: Config) -> dict[str, Any]:
    """Tags that place a run in its sweep: the sweep id, the parent run (so MLflow shows a tree),
    and the Optuna study and trial. A private tuning's trials carry no index (it would reveal K), and no
    link to the parent run, which holds K: their sweep id alone, removed from the released trial at the
    release (:func:`tuning_trial`)."""
    s = cfg.sweep
    parent = None if tuning_trial(cfg) else s.parent_run_id
    tags = {"sweep.id": s.id, "mlflow.parentRunId": parent, "optuna.study": s.study, "optuna.trial": s.trial}
    return {k: v for k, v in tags.items() if v is not None}


def run_tags(plan: RunPlan, data: loaders.DataSplits, device: torch.device, backend: str) -> dict[str, Any]:
    cfg = plan.config
    tags: dict[str, Any] = {
        **environment_tags(device),
        "memory.backend": backend,
        # which batch the memory stages are of: with DP, exactly B examples in an iteration that is then
        # undone (a Poisson batch's size is private); without, the first training batch
        "memory.batch": "exact-B" if cfg.dp.enabled or cfg.train.probe else "first-batch",
        "dataset.n_train": data.n_train,
        "dataset.n_test": len(data.test),  # type: ignore[arg-type]
        "dataset.input_shape": "x".join(map(str, data.input_shape)),  # C x H x W of one example
        "dp.enabled": cfg.dp.enabled,
        "config.hash": plan.config_hash,
        "task.name": cfg.task.name,
    }
    if cfg.train.probe:
        tags["probe"] = "true"
    if plan.physical_batch_size is not None:
        tags["train.physical_batch_size_used"] = plan.physical_batch_size
    tags |= sweep_tags(cfg)
    if plan.privacy is not None:
        tags |= {
            "dp.delta": cfg.dp.delta, "dp.accountant": cfg.dp.accountant.value, "dp.secure_mode": cfg.dp.secure_mode,
            # without secure mode, train.seed and the config (logged) regenerate the noise and the sampling;
            # with it they come from the OS's entropy, never logged (dpsweep.privacy.streams)
            "dp.release": "ok" if cfg.dp.secure_mode else "not-for-release",
            "dp.streams": streams.described(cfg.dp.secure_mode, cfg.dp.stream_seed),
            "dp.grad_sample_mode": step_kind(cfg.dp),  # fused for the fused step, as logged before dp.engine
            "dp.engine": engines.engine_of(cfg).name,
        }  # fmt: skip
        if plan.privacy.calibrated:
            tags["dp.noise_multiplier_calibrated"] = plan.privacy.noise_multiplier
            tags["dp.noise_multiplier_calibrated_to"] = plan.privacy.calibrated_to  # "ε <= 3", or a TPR target
    return redacted(tags)


def run_params(plan: RunPlan) -> dict[str, Any]:
    """MLflow params: what determines the run's result (:func:`dpsweep.config.identity` of the
    flattened resolved config, σ as calibrated). Without DP only ``dp.enabled`` is kept, since σ, C,
    δ and the accountant have no effect on a non-private run. Settings that do not change the
    result (launcher, sweep, tracking, paths, progress bars) are :func:`setting_tags`. A trial of a private
    tuning's leave out its secret ``train.seed`` (:data:`WITHHELD_PARAMS`): MLflow cannot delete a param,
    and which trial is released is known only at the end (:func:`tuning_trial`)."""
    params = redacted(identity(flatten(plan.config)))
    if tuning_trial(plan.config):
        params = {k: v for k, v in params.items() if k not in WITHHELD_PARAMS}
    if plan.privacy is None:
        return params
    return params | {"dp.noise_multiplier": plan.privacy.noise_multiplier}


def setting_tags(plan: RunPlan) -> dict[str, Any]:
    """The config's settings that do not change the result (:func:`dpsweep.config.settings`), as tags
    (same dotted keys): so that the MLflow UI's params are the hyperparameters alone. ``config.yaml``
    holds both. A trial of a private tuning's leave out ``sweep.parent_run_id`` (:func:`tuning_trial`)."""
    tags = redacted(settings(flatten(plan.config)))  # a URL's password is never logged
    if tuning_trial(plan.config):
        tags.pop("sweep.parent_run_id", None)
    return tags


def resolved_yaml(plan: RunPlan) -> str:
    """The config as it ran (σ as calibrated), for the run's ``config.yaml`` artifact; a trial of a private
    tuning's without :data:`WITHHELD_KEYS`, which a comment at its top says."""
    config = plan.config
    if plan.privacy is not None:
        config = dataclasses.replace(
            config, dp=dataclasses.replace(config.dp, noise_multiplier=plan.privacy.noise_multiplier)
        )
    node = structured(config)
    if not tuning_trial(config):
        return redact(OmegaConf.to_yaml(node))  # a URL's password is never logged
    tree = OmegaConf.to_container(node, enum_to_str=True)
    assert isinstance(tree, dict)
    for key in WITHHELD_KEYS:
        group, _, name = key.partition(".")
        tree[group].pop(name, None)
    return WITHHELD_NOTE + redact(OmegaConf.to_yaml(OmegaConf.create(tree)))


INTERVAL_ACCOUNTANT = "pld"  # the interval is the PLD's, whatever dp.accountant is (tag epsilon_interval.accountant)


def certainty_figures(bill: Ledger, delta: float) -> dict[str, float]:
    """The figures beside a DP run's final ε (metrics at its last epoch, fields of its TrainResult, and the
    ``certainty`` of its privacy_ledger.json), by metric name (:func:`dpsweep.privacy.certainty.figures`:
    the interval's sound lower end, Gopi, Lee & Wutschitz 2021; μ-GDP, Dong, Roth & Su 2022, Cor. 2.13; a
    membership-inference attacker's TPRs and advantage, Kairouz, Oh & Viswanath 2015, Kulynych et al.
    2024). Computed once, at the run's end, from the whole ledger (a resumed run's included): a few seconds
    for a long run. Empty for an empty ledger, or where the PLD is not computed (its RDP ε beyond
    :data:`dpsweep.privacy.ledger.DISCRETISED_MAX_EPSILON`: ``epsilon_pld`` is not either)."""
    found = certainty.profile(bill)
    if found is None or found.tail >= 1:
        return {}
    return certainty.figures(bill, delta, found)


def certainty_record(figures: dict[str, float], upper: float) -> dict[str, Any]:
    """The ``certainty`` of a run's ``privacy_ledger.json``: the interval (the PLD's: ``upper`` is the
    run's ``epsilon_pld``), μ with its δ allowance, and the attack risk (:func:`certainty_figures`)."""
    return {
        "epsilon_interval": {"lower": figures["epsilon_lower"], "upper": upper, "accountant": INTERVAL_ACCOUNTANT},
        "mu_gdp": figures["mu_gdp"],
        "gdp_delta_allowance": figures["gdp_delta_allowance"],
        "attack_risk": attack_risk_of(figures),
    }


def attack_risk_of(figures: dict[str, float]) -> dict[str, float]:
    """The attack risk of :func:`certainty_figures` under :func:`dpsweep.privacy.certainty.attack_risk`'s keys."""
    return {"tpr_at_1pct": figures["tpr_at_1pct"], "tpr_at_10pct": figures["tpr_at_10pct"],
            "advantage": figures["mia_advantage"]}  # fmt: skip
