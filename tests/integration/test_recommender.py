"""task=recommender through the runner (issue 35): DPALS runs log the ε of the rounds they took, release
only the item embeddings, state the unit, the joint-DP semantics and each user's bounds, resume
exactly, and refuse bad input before any run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dp_accounting import dp_event, pld
from fabricate import fabricate_movielens, movielens_ratings
from helpers import Composer, run_dpsweep, runs_of, straight_and_resumed
from mlflow.tracking import MlflowClient
from scipy.optimize import brentq
from scipy.stats import norm

from dpsweep.cli.lines import start_line, summary_line
from dpsweep.config import ConfigError, to_config, validate
from dpsweep.data import facts
from dpsweep.errors import InputError
from dpsweep.plan import prepare
from dpsweep.run.runner import train
from dpsweep.tasks.recommender import task

SMALL = [
    "task=recommender", "dataset.num_users=400", "dataset.held_out_users=60", "dataset.items=150",
    "dataset.mean_ratings=15", "train.batch_size=400",
]  # fmt: skip


def _exact_epsilon(sigma: float, rounds: int, delta: float) -> float:
    """T Gaussian rounds at σ, every user in each, are one Gaussian at σ/√T; its exact ε at δ (Balle &
    Wang 2018, Thm. 8)."""
    s = sigma / math.sqrt(rounds)

    def excess(eps: float) -> float:
        return norm.cdf(-eps * s + 0.5 / s) - math.exp(eps) * norm.cdf(-eps * s - 0.5 / s) - delta

    return float(brentq(excess, 0.0, 500.0))


@pytest.mark.slow  # about 10 s: a DPALS run, its model logged
def test_a_dpals_run_logs_the_epsilon_of_its_rounds_and_releases_only_the_items(
    make_cfg: Composer, client: MlflowClient
) -> None:
    result = train(make_cfg(*SMALL, "dp.target_epsilon=3", "train.epochs=4", "tracking.log_model=true"))
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and result.steps == 4
    sigma = float(run.data.tags["dp.noise_multiplier_calibrated"])
    exact = _exact_epsilon(sigma, 4, 1e-5)
    assert exact <= run.data.metrics["epsilon"] <= min(3.0, exact * 1.01)  # the rounds' ε, independently
    tags = run.data.tags
    assert tags["dp.unit"] == "user" and tags["dp.mechanism"] == "dpals" and tags["dp.sample_rate"] == "None"
    assert "joint DP" in tags["dp.semantics"] and "at most 50 ratings" in tags["dp.contribution"]
    # the memory stages would count the training users' ratings: a DP run logs none of them
    assert "dp.outside_ledger" not in tags and not any("memory" in k for k in run.data.metrics)
    assert 0.0 < run.data.metrics["recall_at_20"] <= 1.0
    # what is released: the item embeddings, no user's; no artifact holds the users' embeddings
    assert {a.path for a in client.list_artifacts(result.run_id)} == {"config.yaml", "privacy_ledger.json"}
    [logged] = client.search_logged_models([run.info.experiment_id])
    import mlflow.pytorch

    model = mlflow.pytorch.load_model(f"models:/{logged.model_id}")
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [("item_embeddings", (150, 8))]
    assert model(torch.zeros(1, 8)).shape == (1, 150)


@pytest.mark.slow  # about 8 s: a run straight through and one interrupted then resumed
def test_an_interrupted_dpals_run_resumes_exactly(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    args = [*SMALL, "dp.noise_multiplier=3", "train.epochs=4"]
    straight, resumed = straight_and_resumed(
        make_cfg, client, experiment_name, args, task.RecommenderRun, 3, tmp_path / "ckpt"
    )
    assert resumed.steps == straight.steps == 4 and resumed.epsilons == straight.epsilons
    assert resumed.epsilon == pytest.approx(_exact_epsilon(3.0, 4, 1e-5), rel=0.01)
    assert resumed.model is not None and straight.model is not None
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the same noise: the generator's state came back with the checkpoint


DPAM = [*SMALL, "task.method=dpam", "dp.mechanism=dpsgd", "train.batch_size=100", "dp.max_grad_norm=0.1",
        "optimizer=adam", "optimizer.lr=0.03"]  # fmt: skip


def _poisson_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """ε of ``steps`` Poisson-subsampled Gaussian steps, composed by dp-accounting's PLD accountant
    here, independently of the run's ledger."""
    event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return float(pld.PLDAccountant().compose(event).get_epsilon(delta))


@pytest.mark.slow  # about 10 s: a DPAM run, its model logged
def test_a_dpam_run_logs_the_epsilon_of_its_sampled_steps_and_releases_only_the_items(
    make_cfg: Composer, client: MlflowClient
) -> None:
    result = train(make_cfg(*DPAM, "dp.noise_multiplier=1.5", "train.epochs=2", "tracking.log_model=true"))
    run = client.get_run(result.run_id)
    tags = run.data.tags
    assert run.info.status == "FINISHED" and result.steps == 8  # 2 rounds of ceil(400/100) steps
    assert tags["dp.mechanism"] == "dpsgd" and tags["dp.unit"] == "user" and float(tags["dp.sample_rate"]) == 0.25
    assert run.data.metrics["epsilon"] == pytest.approx(_poisson_epsilon(0.25, 1.5, 8, 1e-5), rel=1e-3)
    assert "joint DP" in tags["dp.semantics"] and "clipped to 0.1 as a whole" in tags["dp.contribution"]
    assert 0.0 < run.data.metrics["recall_at_20"] <= 1.0
    [logged] = client.search_logged_models([run.info.experiment_id])
    import mlflow.pytorch

    model = mlflow.pytorch.load_model(f"models:/{logged.model_id}")
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [("item_embeddings", (150, 8))]


@pytest.mark.slow  # about 12 s: two methods, each straight through and interrupted then resumed
@pytest.mark.parametrize("method", ["dpam", "sgd"])
def test_an_interrupted_user_level_dp_sgd_run_resumes_exactly(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str, method: str
) -> None:
    """The joint baseline's users' embeddings (its simulated devices' state) come back with the
    checkpoint, as the items, Adam's moments and the generator of the samples and the noise do."""
    args = [*DPAM, f"task.method={method}", "dp.noise_multiplier=2", "train.epochs=3"]
    run = task.JointSGDRun if method == "sgd" else task.DPAMRun
    straight, resumed = straight_and_resumed(make_cfg, client, experiment_name, args, run, 2, tmp_path / "ckpt")
    assert resumed.steps == straight.steps == 12 and resumed.epsilons == straight.epsilons
    assert resumed.epsilon == pytest.approx(_poisson_epsilon(0.25, 2.0, 12, 1e-5), rel=1e-3)
    assert resumed.model is not None and straight.model is not None
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert ("local_users" in straight.model.state_dict()) == (method == "sgd")


def test_a_dpam_run_through_public_features_trains_and_releases_their_map(
    make_cfg: Composer, client: MlflowClient
) -> None:
    result = train(make_cfg(*DPAM, "task.item_features=true", "dp.noise_multiplier=1", "train.epochs=2"))
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and 0.0 < run.data.metrics["recall_at_20"] <= 1.0
    assert "and of the public features map clipped to 0.1" in run.data.tags["dp.contribution"]
    assert result.model is not None
    weights = result.model.feature_weights.detach()
    assert float(weights.abs().sum()) > 0  # trained from zero
    assert run.data.tags["model.trainable_params"] == str(150 * 8 + weights.numel())


@pytest.mark.slow  # about 8 s: a run with its model logged
def test_the_joint_dp_sgd_baseline_keeps_the_users_embeddings_out_of_the_release(
    make_cfg: Composer, client: MlflowClient
) -> None:
    result = train(make_cfg(*DPAM, "task.method=sgd", "dp.noise_multiplier=1", "train.epochs=1",
                            "tracking.log_model=true"))  # fmt: skip
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and 0.0 < run.data.metrics["recall_at_20"] <= 1.0
    assert result.model is not None and tuple(result.model.local_users.shape) == (400, 8)  # on the users' side
    [logged] = client.search_logged_models([run.info.experiment_id])
    import mlflow.pytorch

    released = mlflow.pytorch.load_model(f"models:/{logged.model_id}")
    assert set(released.state_dict()) == {"item_embeddings", "rounds"}
    assert {a.path for a in client.list_artifacts(result.run_id)} == {"config.yaml", "privacy_ledger.json"}


def test_a_dpals_run_trains_on_movielens_files(tmp_path: Path, make_cfg: Composer, client: MlflowClient) -> None:
    """ml-100k's layout, fabricated: 40 users (36 training, N of the guarantee), 30 items."""
    fabricate_movielens(tmp_path / "ml", "u.data", movielens_ratings(users=40, items=30), items=30)
    cfg = make_cfg(
        "task=recommender", "dataset=movielens", f"dataset.root={tmp_path / 'ml'}", "dataset.num_users=36",
        "dataset.held_out_users=4", "train.batch_size=36", "dp.noise_multiplier=2", "dp.delta=0.001",
    )  # fmt: skip
    result = train(cfg)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and result.steps == 2 and run.data.tags["dataset.n_train"] == "36"
    assert run.data.metrics["epsilon"] == pytest.approx(_exact_epsilon(2.0, 2, 1e-3), rel=0.01)


def test_a_dpals_run_through_public_features_states_their_larger_sensitivity(
    make_cfg: Composer, client: MlflowClient
) -> None:
    result = train(make_cfg(*SMALL, "task.item_features=true", "dp.noise_multiplier=2"))
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and 0.0 <= run.data.metrics["recall_at_20"] <= 1.0
    # k Γ² and k R Γ per user (k = 50, Γ = 0.3, R = 1), and Γ² for G: not √k as item by item
    assert "(sensitivity 15.66)" in run.data.tags["dp.contribution"]


def test_item_features_are_refused_where_the_data_has_none(tmp_path: Path, make_cfg: Composer) -> None:
    fabricate_movielens(tmp_path / "ml", "u.data", movielens_ratings(users=40, items=30), items=30, catalogue=False)
    cfg = make_cfg(
        "task=recommender", "dataset=movielens", f"dataset.root={tmp_path / 'ml'}", "dataset.num_users=36",
        "dataset.held_out_users=4", "train.batch_size=36", "dp.delta=0.001", "task.item_features=true",
    )  # fmt: skip
    with pytest.raises(InputError) as err:
        train(cfg)
    # MovieLens without its movies file is refused whatever the task asks (its item set would be the rated ids)
    assert err.value.key == "dataset.root" and "u.item" in str(err.value)


def test_the_private_popularity_baseline_is_one_release_of_the_counts(make_cfg: Composer, client: MlflowClient) -> None:
    result = train(make_cfg(*SMALL, "task.method=popularity", "train.epochs=1", "dp.target_epsilon=1"))
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and result.steps == 1 and 0.0 < run.data.metrics["recall_at_20"] <= 1.0
    sigma = float(run.data.tags["dp.noise_multiplier_calibrated"])
    assert _exact_epsilon(sigma, 1, 1e-5) <= run.data.metrics["epsilon"] <= 1.0
    assert "at most 50 ratings counted (sensitivity 7.071)" in run.data.tags["dp.contribution"]


def test_non_private_als_trains_without_bounds_or_noise(make_cfg: Composer, client: MlflowClient) -> None:
    result = train(make_cfg(*SMALL, "dp=off", "train.epochs=3"))
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and "dp.semantics" not in run.data.tags and "epsilon" not in run.data.metrics
    assert run.data.metrics["recall_at_20"] > 0.1


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["task.rank=0"], "task.rank", "a rank of 1 or more"),
        (["task.max_ratings_per_user=0"], "task.max_ratings_per_user", "1 or more ratings per user"),
        (["dataset.min_ratings=1"], "dataset.min_ratings", "a held-out user needs a history and a target"),
        (["dp.unit=example"], "dp.unit", "user with task=recommender"),
        (["dp.delta=0.01"], "dp.delta", ""),
        (["dp.mechanism=dpsgd"], "dp.mechanism", "dpals with task.method=als"),
        (["task.method=dpam"], "dp.mechanism", "dpsgd with task.method=dpam"),
        (["task.method=sgd", "dp.mechanism=dpftrl"], "dp.mechanism", "dpsgd with task.method=sgd"),
        (["task.method=sgd", "dp.mechanism=dpsgd", "task.user_lr=0"], "task.user_lr", "a positive value"),
        (["task.method=popularity"], "train.epochs", "1 with task.method=popularity"),
        (["task.method=svd"], "task.method", "one of als, popularity, dpam, sgd"),
    ],
)
def test_bad_recommender_input_is_refused_before_training(
    make_cfg: Composer, overrides: list[str], key: str, allowed: str
) -> None:
    cfg = to_config(make_cfg(*SMALL, *overrides))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
        found = facts.described(cfg.dataset)
        assert found is not None
        prepare(cfg, found)
    assert err.value.key == key and allowed in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("overrides", "allowed"),
    [
        (["dataset=planted_ratings"], "an image dataset (digits, mnist, ...) with image classification"),
        (["task=recommender", "dataset=digits"], "a ratings dataset (planted_ratings) with task=recommender"),
    ],
)
def test_a_task_refuses_the_other_kind_of_data(make_cfg: Composer, overrides: list[str], allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(to_config(make_cfg(*overrides)))
    assert err.value.key == "dataset.name" and allowed in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["task=recommender", "task.rank=0"], ["task.rank", "a rank of 1 or more"]),
        (["task.rank=4"], ["task.rank", "not in 'ClassifierTaskConfig'"]),  # a recommender setting on the classifier
        (["task=gan", "task.max_user_norm=1"], ["task.max_user_norm", "not in 'GanTaskConfig'"]),
    ],
)
def test_a_bad_recommender_setting_exits_2_naming_it_and_leaves_no_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], needles: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    done = run_dpsweep(*args, "tracking.experiment_name=bad")
    assert done.returncode == 2, done.stderr
    assert all(needle in done.stderr for needle in needles), done.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "mlflow.db").exists() or not runs_of(client, "bad")


@pytest.mark.parametrize(
    ("broken", "needle"),
    [
        ("missing", "dataset.root='{root}' is invalid: a folder holding MovieLens ratings (ratings.csv, ratings.dat"),
        ("malformed", "u.data:7: expected a rating of 0.5 to 5 stars"),
    ],
)
def test_movielens_files_missing_or_malformed_exit_2_naming_them_and_leave_no_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str, needle: str
) -> None:
    root = tmp_path / "ml"
    if broken == "missing":
        root.mkdir()
    else:
        path = fabricate_movielens(root, "u.data", movielens_ratings(users=40, items=30), items=30)
        lines = path.read_text(encoding="latin-1").splitlines(keepends=True)
        lines.insert(6, "3\t7\t9\t1\n")  # the file's seventh line: 9 stars
        path.write_text("".join(lines), encoding="latin-1")
    monkeypatch.chdir(tmp_path)
    done = run_dpsweep(
        "task=recommender", "dataset=movielens", f"dataset.root={root}", "dataset.num_users=36",
        "dataset.held_out_users=4", "train.batch_size=36", "dp.delta=0.001", "tracking.experiment_name=bad",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert needle.format(root=root) in done.stderr, done.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "mlflow.db").exists() or not runs_of(client, "bad")


@pytest.mark.parametrize(
    ("args", "shown", "hidden"),
    [
        (["dp.noise_multiplier=2"], ["recommender epochs=1", "dpals per user (σ=2)"], ["B=", "C="]),
        ([*DPAM[1:], "dp.noise_multiplier=2"], ["recommender B=100 epochs=1", "σ=2, C=0.1"], []),
    ],
)
def test_a_runs_lines_show_the_batch_and_clipping_only_where_its_method_reads_them(
    make_cfg: Composer, client: MlflowClient, args: list[str], shown: list[str], hidden: list[str]
) -> None:
    """DPALS puts every user in every round and bounds them by task.*: B and C would be noise on its lines."""
    cfg = make_cfg(*SMALL, *args, "train.epochs=1")
    start, summary = start_line(cfg, "out"), summary_line(to_config(cfg), train(cfg))
    assert shown[0] in start and shown[0] in summary and shown[1] in start, (start, summary)
    assert not any(h in start or h in summary for h in hidden), (start, summary)
