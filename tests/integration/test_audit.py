"""A one-run privacy audit beside the accountant's ε (issue 36, dpsweep.audit): an audit run logs its
bound and leaves its ledger as it was, resumes exactly, catches bugs planted in DP-SGD, never flags
a correct run, and bad audit settings are refused before any run."""

from __future__ import annotations

from pathlib import Path

import planted
import pytest
import torch
from helpers import Composer, run_dpsweep, runs_of, straight_and_resumed
from mlflow.tracking import MlflowClient

from dpsweep.analysis.report import build_report, render
from dpsweep.config import ConfigError, flatten, identity, to_config, validate, validate_for_dataset
from dpsweep.mechanisms import engines, fused
from dpsweep.run.runner import train
from dpsweep.tasks.classifier import task

AUDIT = ["audit.mode=white_box", "dp.target_epsilon=1", "train.epochs=3"]
USER_LEVEL = ["dp.unit=user", "dataset.users=partition", "dataset.num_users=1000", "train.batch_size=50"]
OWN_STEPS = {  # the steps that noise their own gradients (dpsweep.mechanisms.functional)
    "dpftrl": [
        "dp.mechanism=dpftrl",
        "optimizer.momentum=0.9",
        "dp.ftrl_restart_every=2",
        "dp.ftrl_tree_completion=true",
    ],
    "fused": ["dp.grad_sample_mode=fused"],
    "user": USER_LEVEL,
}


def _audit(client: MlflowClient, run_id: str) -> dict[str, float]:
    return {k: v for k, v in client.get_run(run_id).data.metrics.items() if k.startswith("audit.") or k == "epsilon"}


def _flagged(m: dict[str, float]) -> bool:
    """Either bound above the claimed ε, or the f-DP test rejecting the run's own ledger: the run is
    less private than its ledger says (at 95%)."""
    return max(m["audit.epsilon_lower"], m["audit.epsilon_lower_fdp"]) > m["epsilon"] or m["audit.claim_rejected"] == 1


def test_an_audit_run_logs_its_bound_beside_an_unchanged_epsilon(make_cfg: Composer, client: MlflowClient) -> None:
    audited = train(make_cfg(*AUDIT))
    plain = train(make_cfg(*AUDIT[1:], "tracking.experiment_name=plain"))
    m = _audit(client, audited.run_id)
    assert m["epsilon"] == client.get_run(plain.run_id).data.metrics["epsilon"]  # the ledger is the run's
    assert audited.ledger == plain.ledger
    assert (
        m["audit.guesses"] == 100 and m["audit.tests"] == 6
    )  # raw with 100 guesses; raw and centred with 1,000; twice
    assert 0 <= m["audit.epsilon_lower_fdp"] <= m["epsilon"]  # read against the run's own ledger
    assert all(0 <= m[f"audit.correct_{s}_{r}"] <= r for s, r in (("raw", 100), ("raw", 1000), ("centred", 1000)))
    assert 0 <= m["audit.epsilon_lower"] <= m["epsilon"]
    tags = client.get_run(audited.run_id).data.tags
    assert tags["dp.release"] == "not-for-release" and "1000 canaries, about half trained on" in tags["audit.note"]
    params = client.get_run(audited.run_id).data.params
    assert params["audit.mode"] == "white_box" and params["audit.confidence"] == "0.95"


def test_the_report_shows_both_audit_bounds_beside_epsilon(
    make_cfg: Composer, client: MlflowClient, mlflow_uri: str, experiment_name: str
) -> None:
    audited = train(make_cfg(*AUDIT))
    m = _audit(client, audited.run_id)
    report = build_report(mlflow_uri, experiment_name)
    shown = render(report, "md")
    assert "| audit ε ≥ |" in shown and "| audit ε ≥ (f-DP) |" in shown, shown
    row = report.table.iloc[0]
    assert row["audit_epsilon_lower"] == m["audit.epsilon_lower"]
    assert row["audit_epsilon_lower_fdp"] == m["audit.epsilon_lower_fdp"]
    assert "read against each run's own ledger" in shown


@pytest.mark.parametrize("steps", ["opacus", "fused", "dpftrl", "user", "dpftrl_user"])
def test_a_black_box_audit_samples_as_planned_and_leaves_the_epsilon_unchanged(
    make_cfg: Composer, client: MlflowClient, steps: str
) -> None:
    """Its training set differs from the plan's (at example level the excluded canaries are left out;
    at user level the included ones join as users of their own), yet each step samples at the plan's
    rate and the ledger records it: the ε and the steps are a plain run's, through Opacus's loader, the
    fused step's own Poisson sampling, or DP-FTRL's fixed order in the plan's batches."""
    run = [*AUDIT[1:], *EVERY_OWN.get(steps, [])]
    audited = train(make_cfg("audit.mode=black_box", *run))
    plain = train(make_cfg(*run, "tracking.experiment_name=plain"))
    assert audited.ledger == plain.ledger and audited.steps == plain.steps
    m = _audit(client, audited.run_id)
    assert m["epsilon"] == client.get_run(plain.run_id).data.metrics["epsilon"]
    assert m["audit.tests"] == 4 and 0 <= m["audit.correct_loss_100"] <= 100
    assert 0 <= m["audit.epsilon_lower"] <= 1 and 0 <= m["audit.epsilon_lower_fdp"] <= 1


@pytest.mark.slow  # about 12 s: three runs
@pytest.mark.parametrize("bug", ["noise_tenth", "no_clipping", "reused_noise"])
def test_a_bug_planted_in_dp_sgd_is_caught_by_one_audit_run(
    make_cfg: Composer, client: MlflowClient, monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    """The accountant claims ε = 1 (its ledger does not know the bug); the audit's bound exceeds it."""
    result = train(make_cfg(*AUDIT), attach=[planted.bug(bug, monkeypatch)])
    m = _audit(client, result.run_id)
    assert m["epsilon"] == pytest.approx(1.0, abs=1e-3)
    assert _flagged(m), m


@pytest.mark.slow  # about 10 s: one audit run
@pytest.mark.parametrize("bug", ["noise_tenth", "no_clipping", "reused_noise"])
def test_a_bug_is_caught_at_a_claimed_epsilon_of_8_by_the_f_dp_bound(
    make_cfg: Composer, client: MlflowClient, monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    """At ε = 8, 1,000 canaries can show Steinke et al.'s bound no more than about 5.4; read against the
    run's own ledger, the same guesses show the bug (reused noise: on the centred score, read against
    the noise the releases show)."""
    cfg = make_cfg("audit.mode=white_box", "dp.target_epsilon=8", "train.epochs=10")
    m = _audit(client, train(cfg, attach=[planted.bug(bug, monkeypatch)]).run_id)
    assert m["audit.epsilon_lower"] < m["epsilon"] < m["audit.epsilon_lower_fdp"], m


@pytest.mark.slow  # about 30 s: 20 audit runs a mode
@pytest.mark.parametrize(
    "mode", ["white_box", "black_box", "black_box+fused", "black_box+dpftrl", "black_box+user", "black_box+gan"]
)
def test_correct_runs_are_never_flagged_over_20_seeds(make_cfg: Composer, client: MlflowClient, mode: str) -> None:
    """Soundness: a correct run's bound stays below its claimed ε (at 95% each; 20 of 20 here), through
    Opacus, or (+) the fused step or DP-FTRL."""
    bounds = []
    audit, *own = mode.split("+")
    for seed in range(20):
        args = [*AUDIT, f"audit.mode={audit}", f"train.seed={seed}", f"audit.seed={seed}", "train.epochs=2"]
        args += (OWN_STEPS | {"gan": GAN})[own[0]] if own else []
        result = train(make_cfg(*args))
        m = _audit(client, result.run_id)
        bounds.append(max(m["audit.epsilon_lower"], m["audit.epsilon_lower_fdp"]))
        assert not _flagged(m), (seed, m)
    # their black box shows 0 on digits (DP-FTRL's: noise ÷ 10 too); the GAN critic's showed 0 over these 20 runs
    # once the runs drew from their own streams (it had shown a bound above 0 in some before): its white box is
    # shown not blind by the bugs it catches (test_a_bug_planted_in_the_gans_critic_is_caught_by_one_audit_run)
    if own not in (["dpftrl"], ["user"], ["gan"]):
        assert max(bounds) > 0  # the audit found something in some run: it is not blind


EVERY_OWN = OWN_STEPS | {"dpftrl_user": [*OWN_STEPS["dpftrl"], *USER_LEVEL]}


@pytest.mark.parametrize("own", EVERY_OWN)
def test_an_audit_of_steps_outside_opacus_logs_its_bound_beside_an_unchanged_epsilon(
    make_cfg: Composer, client: MlflowClient, own: str
) -> None:
    """DP-FTRL (example and user level), the fused step and user-level DP-SGD: one more unit per canary,
    the ledger a plain run's."""
    audited = train(make_cfg(*AUDIT, *EVERY_OWN[own]))
    plain = train(make_cfg(*AUDIT[1:], *EVERY_OWN[own], "tracking.experiment_name=plain"))
    assert audited.ledger == plain.ledger and audited.steps == plain.steps
    m = _audit(client, audited.run_id)
    assert m["epsilon"] == client.get_run(plain.run_id).data.metrics["epsilon"]
    assert m["audit.tests"] == 6 and 0 <= m["audit.correct_raw_100"] <= 100
    assert not _flagged(m), m
    assert client.get_run(audited.run_id).data.tags["dp.release"] == "not-for-release"


@pytest.mark.slow  # about 25 s: nine runs
@pytest.mark.parametrize("own", OWN_STEPS)
@pytest.mark.parametrize("bug", ["noise_tenth", "no_clipping", "reused_noise"])
def test_a_bug_planted_in_steps_outside_opacus_is_caught_by_one_audit_run(
    make_cfg: Composer, client: MlflowClient, monkeypatch: pytest.MonkeyPatch, bug: str, own: str
) -> None:
    m = _audit(client, train(make_cfg(*AUDIT, *OWN_STEPS[own]), attach=[planted.bug(bug, monkeypatch)]).run_id)
    assert m["epsilon"] == pytest.approx(1.0, abs=1e-3)
    assert _flagged(m), m


@pytest.mark.parametrize("own", ["fused", "fused_user"])
def test_a_bug_in_the_fused_steps_own_clipping_is_caught_by_one_audit_run(
    make_cfg: Composer, client: MlflowClient, monkeypatch: pytest.MonkeyPatch, own: str
) -> None:
    """The fused step clips nothing (its own clipping factor 1 for every row), its noise and the ledger's σC
    unchanged: the canaries go through that clipping too, so their releases show it. (When the canaries
    were clipped apart from the step and added after its noise, this run was not flagged.)"""
    monkeypatch.setattr(fused, "clip_factors", planted.clips_nothing)
    args = OWN_STEPS["fused"] + (USER_LEVEL if own == "fused_user" else [])
    m = _audit(client, train(make_cfg(*AUDIT, *args)).run_id)
    assert m["epsilon"] == pytest.approx(1.0, abs=1e-3)
    assert _flagged(m), m


@pytest.mark.slow  # about 60 s: 20 audit runs each
@pytest.mark.parametrize("own", OWN_STEPS)
def test_correct_runs_outside_opacus_are_never_flagged_over_20_seeds(
    make_cfg: Composer, client: MlflowClient, own: str
) -> None:
    bounds = []
    for seed in range(20):
        args = [*AUDIT, *OWN_STEPS[own], "dp.target_epsilon=4", f"train.seed={seed}", f"audit.seed={seed}"]
        m = _audit(client, train(make_cfg(*args)).run_id)
        bounds.append(max(m["audit.epsilon_lower"], m["audit.epsilon_lower_fdp"]))
        assert not _flagged(m), (seed, m)
    assert max(bounds) > 0


GAN = ["task=gan", "task.tstr_epochs=1", "task.critic_width=8", "task.generator_width=16", "train.epochs=3"]


def test_a_white_box_audit_of_the_gans_critic_logs_its_bound(make_cfg: Composer, client: MlflowClient) -> None:
    """The canaries join the critic's private steps; the ledger is a plain GAN run's."""
    audited = train(make_cfg(*AUDIT, *GAN))
    plain = train(make_cfg(*AUDIT[1:], *GAN, "tracking.experiment_name=plain"))
    assert audited.ledger == plain.ledger and audited.steps == plain.steps
    m = _audit(client, audited.run_id)
    assert m["audit.tests"] == 6 and not _flagged(m), m
    tags = client.get_run(audited.run_id).data.tags
    assert tags["dp.release"] == "not-for-release" and "white_box one-run audit" in tags["audit.note"]


def test_a_black_box_audit_of_the_gans_critic_samples_as_planned(make_cfg: Composer, client: MlflowClient) -> None:
    """Mislabelled real examples join the critic's training set, half of them, and the final critic's
    D(x, y) scores them; the critic samples at the plan's rate: the ledger is a plain GAN run's."""
    audited = train(make_cfg("audit.mode=black_box", *AUDIT[1:], *GAN))
    plain = train(make_cfg(*AUDIT[1:], *GAN, "tracking.experiment_name=plain"))
    assert audited.ledger == plain.ledger and audited.steps == plain.steps
    m = _audit(client, audited.run_id)
    assert m["audit.tests"] == 4 and 0 <= m["audit.correct_loss_100"] <= 100 and not _flagged(m), m
    tags = client.get_run(audited.run_id).data.tags
    assert tags["dp.release"] == "not-for-release" and "black_box one-run audit" in tags["audit.note"]


@pytest.mark.slow  # about 20 s: three GAN runs
@pytest.mark.parametrize("bug", ["noise_tenth", "no_clipping", "reused_noise"])
def test_a_bug_planted_in_the_gans_critic_is_caught_by_one_audit_run(
    make_cfg: Composer, client: MlflowClient, monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    m = _audit(client, train(make_cfg(*AUDIT, *GAN, "train.epochs=10"), attach=[planted.bug(bug, monkeypatch)]).run_id)
    assert _flagged(m) and m["epsilon"] == pytest.approx(1.0, abs=1e-3), m


@pytest.mark.slow  # about 10 s: a run straight through and one interrupted then resumed
@pytest.mark.parametrize("own", [[], OWN_STEPS["dpftrl"], OWN_STEPS["fused"]])
def test_an_interrupted_audit_run_resumes_to_the_same_bound(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str, own: list[str]
) -> None:
    args = [*AUDIT, *own, "dp.target_epsilon=8"]
    straight, resumed = straight_and_resumed(
        make_cfg, client, experiment_name, args, task.ClassifierRun, 2, tmp_path / "ckpt"
    )
    a, b = _audit(client, straight.run_id), _audit(client, resumed.run_id)
    assert a == b and a["audit.epsilon_lower"] > 0, (a, b)
    assert straight.model is not None and resumed.model is not None
    for (name, x), y in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["audit.confidence=1.0"], "audit.confidence", "a confidence in (0, 1)"),
        (["audit.confidence=0"], "audit.confidence", "a confidence in (0, 1)"),
        (["audit.guesses=7"], "audit.guesses", "an even number of guesses"),
        (["audit.mode=grey_box"], "audit.mode", "one of off, white_box, black_box"),
        (["dp=off"], "audit.mode", "off for a non-private run"),
        (
            ["dp.grad_sample_mode=ghost"],
            "audit.mode",
            "white_box runs with dp.engine=opacus with dp.grad_sample_mode=hooks, functorch or ew, "
            "dp.engine=own_steps or dp.engine=fused",
        ),
        (
            ["task=recommender", "dp.unit=user", "dataset=movielens"],
            "audit.mode",
            "off with task=recommender: task=recommender is not audited: DP-ALS releases noised item-side",
        ),
        (["dp.clipping=adaptive"], "dp.clipping", "fixed or quantile with audit.mode=white_box"),
        (["train.physical_batch_size=16"], "train.physical_batch_size", "null with audit.mode=white_box"),
    ],
)
def test_bad_audit_settings_are_refused(make_cfg: Composer, overrides: list[str], key: str, allowed: str) -> None:
    """Refused by the audit's checks, or by what the task and engine declare (both before any line)."""
    with pytest.raises(ConfigError) as err:
        cfg = to_config(make_cfg("audit.mode=white_box", *overrides))
        validate(cfg)
        engines.check(cfg)
    assert err.value.key == key and allowed in str(err.value), str(err.value)


def test_more_canaries_than_training_examples_exit_2_naming_the_key_and_leave_no_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    done = run_dpsweep("audit.mode=white_box", "audit.canaries=5000", "tracking.experiment_name=bad")
    assert done.returncode == 2, done.stderr
    assert "audit.canaries=5000 is invalid: at most the 1437 training examples" in done.stderr, done.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "mlflow.db").exists() or not runs_of(client, "bad")


def test_the_canary_check_counts_the_training_examples(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("audit.mode=white_box", "audit.canaries=200"))
    validate_for_dataset(cfg, 200)
    with pytest.raises(ConfigError) as err:
        validate_for_dataset(cfg, 199)
    assert err.value.key == "audit.canaries"


def test_a_plain_runs_identity_and_params_hold_no_audit_key(make_cfg: Composer) -> None:
    """Configs hashed before audits existed keep their hash (resume, skipping FINISHED configs)."""
    plain = identity(flatten(to_config(make_cfg())))
    audited = identity(flatten(to_config(make_cfg("audit.mode=white_box"))))
    assert not any(k.startswith("audit.") for k in plain)
    assert audited["audit.mode"] == "white_box" and audited["audit.canaries"] == 1000


def test_a_white_box_audit_refuses_a_plan_that_splits_steps_into_passes(
    make_cfg: Composer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memory model and a small GPU budget make the plan choose passes of fewer than B examples: a
    canary drawn at each pass would enter one release several times."""
    import pandas as pd

    from dpsweep.analysis import memory_model

    monkeypatch.chdir(tmp_path)
    reference = Path(__file__).resolve().parents[2] / "analysis" / "data" / "cpu_probes_digits.csv"
    memory_model.save_models(tmp_path / "m.json", memory_model.fit_all(pd.read_csv(reference), "cnn"), meta={})
    chosen = ["train.memory_model=m.json", "launcher.gpu_memory=3MiB", "train.batch_size=256"]
    with pytest.raises(ConfigError) as err:
        train(make_cfg(*chosen, "audit.mode=white_box"))
    assert err.value.key == "train.memory_model" and "null with audit.mode=white_box" in str(err.value)
