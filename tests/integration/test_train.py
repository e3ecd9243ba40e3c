"""End-to-end training on digits against a real MLflow sqlite store."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, Composer, runs_of
from memory_metrics import MIB, memory_bytes, memory_metric
from mlflow.entities import LoggedModelStatus, Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from dpsweep.cli.lines import summary_line
from dpsweep.config import ConfigError, DigitsConfig, DPConfig, GradSampleMode, flatten, identity, to_config
from dpsweep.data import loaders
from dpsweep.data.loaders import DatasetNotFoundError
from dpsweep.errors import InputError
from dpsweep.mechanisms.fused import FusedStep
from dpsweep.mechanisms.opacus_engine import make_private
from dpsweep.memory.stages import STAGES, StageRecorder
from dpsweep.models import classifiers
from dpsweep.privacy import ledger
from dpsweep.privacy.schedule import epsilon, poisson_schedule
from dpsweep.run.runner import TrainResult, train
from dpsweep.tracking.monitors import GPU_MEMORY_TAG
from dpsweep.units import format_bytes

MEMORY_METRICS = {  # in MiB, under MLflow's system/ prefix (off a run's Model metrics tab): no memory/…_bytes
    *(memory_metric(s) for s in STAGES),
    *(memory_metric(f"{s}_delta") for s in STAGES),
    *(memory_metric(f"{s}_peak") for s in STAGES),
    memory_metric("forward_peak"),  # the backward stage up to the end of the forward pass
    memory_metric("iteration_peak"),
    memory_metric("reserved_peak"),
}
# no system/memory/peak_mib with DP: the peak over the Poisson batches would tell their (private) sizes
# no train_loss with DP: an un-noised statistic of the private examples (kept in TrainResult only)
DP_METRICS = {"test_accuracy", "epsilon", "epsilon_rdp", "epsilon_prv", "epsilon_pld", *MEMORY_METRICS}
DP_METRICS |= {"epsilon_lower", "mu_gdp", "gdp_delta_allowance", "tpr_at_1pct", "tpr_at_10pct", "mia_advantage"}
DP_METRICS |= {"sampling_statistic", "sampling_p_value"}  # the run-time sampling check (dpsweep.privacy.sampling)
OUR_TAGS = {
    "git.commit", "torch.version", "opacus.version", "device.name", "memory.backend", "memory.batch",
    "dataset.n_train", "dataset.n_test", "model.trainable_params", "dp.enabled", "dataset.input_shape",
}  # fmt: skip
DP_TAGS = {
    "dp.delta", "dp.accountant", "dp.secure_mode", "dp.steps", "dp.sample_rate", "dp.conversion", "dp.grad_sample_mode",
    "dp.release",
}  # fmt: skip


# The tests of each module fixture below go to one worker (pytest -n), which trains the fixture once.
DP_RUN = pytest.mark.xdist_group("dp_run")
SEED2 = pytest.mark.xdist_group("seed2_run")
VGG = pytest.mark.xdist_group("vgg_runs")


def _compose(root: Path, *overrides: str) -> DictConfig:
    """A config tracking into a sqlite store of its own under ``root``, for the module fixtures."""
    from hydra import compose, initialize_config_module

    tracking = [f"tracking.uri=sqlite:///{root / 'mlflow.db'}", "train.progress=false", "tracking.log_model=false"]
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        return compose("config", overrides=[*tracking, *overrides])


@pytest.fixture(scope="module")
def dp_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[TrainResult, MlflowClient, str, dict[str, object]]:
    """One short DP-SGD run on digits, shared by the assertions below."""
    root = tmp_path_factory.mktemp("dp_run")
    cfg = _compose(
        root, "train.epochs=3", "tracking.experiment_name=dp", "dp.noise_multiplier=1.1", "dp.max_grad_norm=1.5"
    )
    ledger.forget()  # nothing left by an earlier test in this process
    result = train(cfg)
    return result, MlflowClient(f"sqlite:///{root / 'mlflow.db'}"), "dp", flatten(cfg)


@pytest.fixture(scope="module")
def seed2_run(tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    """One epoch of the default DP-SGD run (hooks) with seed 2: the reference that several tests
    compare another run of the same batches and noise with (``STREAM``: configs that differ share them
    only when asked)."""
    return train(_compose(tmp_path_factory.mktemp("seed2"), "train.epochs=1", "train.seed=2", STREAM))


STREAM = "dp.stream_seed=2"  # the same batches and noise for the configs compared with seed2_run


@dataclass(frozen=True)
class VggRuns:
    uncached: TrainResult  # the frozen backbone runs every step
    cached: TrainResult  # its features built into the cache first, then the head trained on them
    again: TrainResult  # another run on the same data and weights: a cache hit
    runs: dict[str, Run]  # by run id
    store: str  # their tracking URI


@pytest.fixture(scope="module")
def vgg_runs(tmp_path_factory: pytest.TempPathFactory) -> VggRuns:
    """vgg16_frozen on digits at 32 px, trained once for the module (its backbone is the costly part)."""
    root = tmp_path_factory.mktemp("vgg")
    common = [
        "model=vgg16_frozen", "model.pretrained=false", "model.hidden_units=16", "dataset.image_size=32",
        "train.epochs=1", "train.batch_size=256", "optimizer.lr=0.05", f"model.feature_cache_dir={root / 'c'}",
        "tracking.experiment_name=vgg", STREAM,  # cached and not: the same batches and noise
    ]  # fmt: skip
    uncached = train(_compose(root, *common, "model.feature_cache=false", "tracking.log_model=true"))
    cached = train(_compose(root, *common))
    again = train(_compose(root, *common, "optimizer.lr=0.1"))  # same data and weights (a seed would change them)
    store = f"sqlite:///{root / 'mlflow.db'}"
    runs = {r.info.run_id: r for r in runs_of(MlflowClient(store), "vgg")}
    return VggRuns(uncached, cached, again, runs, store)


@DP_RUN
@pytest.mark.slow
def test_dp_run_logs_exactly_the_documented_params(dp_run: tuple) -> None:  # type: ignore[type-arg]
    result, client, exp, flat = dp_run
    [run] = runs_of(client, exp)
    assert run.info.status == "FINISHED" and run.info.run_id == result.run_id
    assert set(run.data.params) == set(identity(flat))  # the hyperparameters; settings are tags
    assert not any(k.startswith(("tracking.", "launcher.", "sweep.")) for k in run.data.params)
    assert run.data.tags["launcher.name"] == "inline" and run.data.tags["tracking.experiment_name"] == "dp"
    assert run.data.params["dp.noise_multiplier"] == "1.1"
    assert run.data.params["train.batch_size"] == "64"
    assert run.data.params["model.hidden_units"] == "32"
    assert run.data.params["dataset.name"] == "digits"


@DP_RUN
def test_dp_run_logs_exactly_the_documented_metrics(dp_run: tuple) -> None:  # type: ignore[type-arg]
    result, client, exp, _ = dp_run
    [run] = runs_of(client, exp)
    assert set(run.data.metrics) == DP_METRICS
    for name in ("test_accuracy", "epsilon"):
        history = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history] == [1, 2, 3], name  # step = epoch
    eps = [m.value for m in client.get_metric_history(run.info.run_id, "epsilon")]
    assert eps[0] < eps[1] < eps[2] == result.epsilon  # ε accumulates over epochs
    assert run.data.metrics["epsilon_pld"] == result.epsilons["pld"] == result.epsilon  # the default accountant
    assert 0 < run.data.metrics["epsilon_prv"] <= run.data.metrics["epsilon_rdp"]
    assert 0 < run.data.metrics["epsilon_pld"] <= run.data.metrics["epsilon_rdp"]
    # before the last epoch, PLD on its coarser grid (an upper bound), within 1e-3 of the run's own
    schedule, pld = poisson_schedule(1437, 64), ledger.Accounting("pld")
    fine = [epsilon(schedule, result.noise_multiplier, 1e-5, epochs=e, accounting=pld).epsilon for e in (1, 2)]
    assert all(f <= e <= f * 1.001 for f, e in zip(fine, eps[:2], strict=True)), (fine, eps)
    assert run.data.tags["dp.unit"] == "example" and run.data.tags["dp.events"] == "1"
    m = run.data.metrics
    assert memory_bytes(m, "model_load") > 0  # the CNN's weights
    assert memory_bytes(m, "backward") > memory_bytes(m, "batch_load")  # grads and per-sample grads
    assert memory_bytes(m, "iteration_peak") >= memory_bytes(m, "optimizer_step")
    assert run.data.tags["memory.batch"] == "exact-B"
    assert run.data.tags["dp.secure_mode"] == "False" and run.data.tags["dp.release"] == "not-for-release"
    assert 0.5 < result.test_accuracy <= 1.0
    assert sum(steps for _, _, steps in result.accountant_history) == result.steps == 3 * 23  # no extra step


def _logged_model(client: MlflowClient, run_id: str, name: str, dst: Path) -> tuple[torch.nn.Module, dict[str, object]]:
    """The run's model as a user loads it (``runs:/<run_id>/<name>`` with the store set as MLflow's tracking
    URI, which MLflow also reads the model's location from), and its MLmodel file."""
    import mlflow.artifacts
    import mlflow.pytorch

    mlflow.set_tracking_uri(client.tracking_uri)
    local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/{name}", dst_path=str(dst)))
    return mlflow.pytorch.load_model(str(local)), yaml.safe_load((local / "MLmodel").read_text())


def test_the_trained_model_is_returned_and_logged_with_mlflows_pytorch_flavour(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    result = train(make_cfg("train.epochs=1", "tracking.log_model=true"))
    assert isinstance(result.model, classifiers.OpacusCNN)  # the plain module, not Opacus's wrapper
    [run] = runs_of(client, experiment_name)
    assert run.data.tags["model.logged"] == "true"
    assert int(run.data.tags["model.logged_bytes"]) == 4 * classifiers.trainable_parameters(result.model)
    name = run.data.tags["model.name"]  # what it is: digits-cnn-dpsgd-eps…
    assert name.startswith("digits-cnn-dpsgd-eps"), name
    loaded, mlmodel = _logged_model(client, run.info.run_id, name, tmp_path)
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(loaded(x), result.model.cpu()(x))  # the trained weights, exactly
    assert "pytorch" in mlmodel["flavors"] and "signature" in mlmodel  # type: ignore[operator]
    example = json.loads((tmp_path / name / "input_example.json").read_text())
    assert np.asarray(example).shape == (1, 1, 28, 28) and not np.any(example)  # zeros, never a training example
    # an MLflow 3 LoggedModel, the run's output (the UI's Models column and tab), in the run's experiment
    [output] = run.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert (logged.name, logged.source_run_id, logged.status) == (name, run.info.run_id, LoggedModelStatus.READY)
    assert logged.experiment_id == run.info.experiment_id and logged.tags["dp.release"] == "not-for-release"
    assert logged.params["train.batch_size"] == run.data.params["train.batch_size"]
    import mlflow.pytorch

    with torch.no_grad():
        assert torch.equal(mlflow.pytorch.load_model(f"models:/{output.model_id}")(x), result.model(x))
    # logged again for the same run (a job requeued after logging it): still one model
    from dpsweep.tracking import store

    store.log_model(client.tracking_uri, run.info.run_id, result.model, x[:1], result.model(x[:1]).detach(), name, "2")
    assert [m.model_id for m in client.search_logged_models([run.info.experiment_id])] == [output.model_id]


def test_a_size_limit_skips_logging_a_model(make_cfg: Composer, client: MlflowClient, experiment_name: str) -> None:
    small = train(make_cfg("train.epochs=1", "tracking.log_model=true", "tracking.log_model_max_mib=0.01"))
    [run] = runs_of(client, experiment_name)
    assert run.info.run_id == small.run_id and run.data.tags["model.logged"].startswith("skipped: ")
    assert "tracking.log_model_max_mib=0.01" in run.data.tags["model.logged"]
    assert not run.outputs.model_outputs and not client.search_logged_models([run.info.experiment_id])


@pytest.mark.slow
@VGG
def test_vgg16_logs_only_its_trained_head(vgg_runs: VggRuns, tmp_path: Path) -> None:
    result = vgg_runs.uncached  # the backbone ran every step; the run logged its model
    assert isinstance(result.model, classifiers.FrozenVGG16)  # the whole model is returned
    name = vgg_runs.runs[result.run_id].data.tags["model.name"]
    head, _ = _logged_model(MlflowClient(vgg_runs.store), result.run_id, name, tmp_path)
    assert isinstance(head, torch.nn.Sequential)  # the head alone: the backbone is public ImageNet weights
    assert int(vgg_runs.runs[result.run_id].data.tags["model.logged_bytes"]) == 4 * (25088 * 16 + 16 + 16 * 10 + 10)
    with torch.no_grad():
        x = torch.randn(3, 1, 32, 32)
        assert torch.equal(head(result.model.cpu().extract(x)), result.model(x))


def test_each_epoch_is_reported_as_a_line_where_no_bar_is_shown(
    make_cfg: Composer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="dpsweep"):
        result = train(make_cfg("train.epochs=2", "train.progress=false"))
    lines = [r.getMessage() for r in caplog.records if r.name == "dpsweep"]
    assert [line.split("  ")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    last = result.epochs[-1]
    assert f"epoch 2/2  test_accuracy={last['test_accuracy']:.4f}  ε={last['epsilon']:.3f}" in lines[1]
    assert "train_loss" not in "".join(lines)  # with DP, an un-noised statistic of private examples


def test_dp_memory_stages_are_of_exactly_b_not_of_a_poisson_batch(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    """A Poisson batch's size is private (add or remove one example and it may change by one), so DP
    runs record the stages on exactly B examples: two seeds draw different first batches and log the
    same levels."""
    for seed in (3, 4):
        train(make_cfg("train.epochs=1", f"train.seed={seed}"))
    runs = runs_of(client, experiment_name)
    levels = [[memory_bytes(r.data.metrics, s) for s in STAGES] for r in runs]
    assert len(runs) == 2 and levels[0] == levels[1]
    assert all(r.data.tags["memory.batch"] == "exact-B" and memory_metric("peak") not in r.data.metrics for r in runs)


def test_the_memory_iteration_changes_nothing_about_training(
    make_cfg: Composer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exact-B iteration is undone: parameters, optimizer state, accountant and RNG. A run without
    it (the method replaced by one that only marks) trains to the same loss, accuracy and ε."""
    from dpsweep.tasks.classifier.task import ClassifierRun

    with_it = train(make_cfg("train.epochs=1", "train.seed=5", "optimizer=adam"))  # Adam: state to undo
    monkeypatch.setattr(ClassifierRun, "memory_iteration", lambda self, stages: None)
    without = train(make_cfg("train.epochs=1", "train.seed=5", "optimizer=adam"))
    assert with_it.train_loss == without.train_loss and with_it.test_accuracy == without.test_accuracy
    assert with_it.accountant_history == without.accountant_history and with_it.epsilon == without.epsilon


@DP_RUN
def test_dp_run_logs_the_documented_tags_and_config(dp_run: tuple) -> None:  # type: ignore[type-arg]
    result, client, exp, _ = dp_run
    [run] = runs_of(client, exp)
    tags = run.data.tags
    assert set(tags) >= OUR_TAGS | DP_TAGS
    assert tags["memory.backend"] == "cpu-tensors"
    assert tags["dataset.n_train"] == "1437" and tags["dp.delta"] == "1e-05" and tags["dp.accountant"] == "pld"
    assert tags["dp.steps"] == str(3 * 23) == str(result.steps)
    assert tags["torch.version"] == torch.__version__
    artifact = client.download_artifacts(run.info.run_id, "config.yaml")
    with open(artifact) as f:
        logged = yaml.safe_load(f)
    assert logged["dp"]["noise_multiplier"] == 1.1 and logged["train"]["epochs"] == 3
    # MLflow's own run context, as mlflow.start_run would set it, with the command as the source
    assert tags["mlflow.source.name"] == "dpsweep" and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.user"]


@DP_RUN
def test_dp_run_logs_its_dataset_splits_as_mlflow_inputs(dp_run: tuple) -> None:  # type: ignore[type-arg]
    """The UI's Dataset column: both splits, named and context-tagged, with a digest of the dataset's
    public description (config and sizes), never of the private examples."""
    _, client, exp, flat = dp_run
    [run] = runs_of(client, exp)
    inputs = {i.dataset.name: i for i in client.get_run(run.info.run_id).inputs.dataset_inputs}
    assert sorted(inputs) == ["digits-test", "digits-train"]
    assert {i.tags[0].key: i.tags[0].value for i in [inputs["digits-train"]]} == {"mlflow.data.context": "train"}
    assert inputs["digits-test"].tags[0].value == "test"
    source = json.loads(inputs["digits-train"].dataset.source)["tags"]
    assert source["split"] == "train" and source["n_train"] == "1437" and source["n_test"] == "360"
    assert source["split_seed"] == str(flat["dataset.split_seed"])
    digest = inputs["digits-train"].dataset.digest
    assert digest == inputs["digits-test"].dataset.digest and len(digest) == 12
    # another split of the same data is another dataset: its digest differs
    from dpsweep.tracking import Tracker

    other = client.create_run(run.info.experiment_id)
    description = {k.removeprefix("dataset."): v for k, v in flat.items() if k.startswith("dataset.")}
    uri = client.tracking_uri
    same = Tracker(uri, other.info.run_id).log_dataset_splits(description, {"train": 1437, "test": 360})
    assert same == digest
    moved = Tracker(uri, other.info.run_id).log_dataset_splits(description | {"split_seed": 7}, {"train": 1437})
    assert moved != digest


@pytest.mark.parametrize("dp", ["off", "dpsgd"])
def test_system_metrics_are_logged_from_the_configured_delay(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, dp: str
) -> None:
    """MLflow's own system metrics, from tracking.system_metrics_after_s into training (0 here; the
    default 60 s keeps short runs free of them: the documented-metrics tests see none). A DP run is
    tagged as withholding GPU memory (tests/unit/tracking/test_tracking.py checks that it logs none)."""
    train(make_cfg(f"dp={dp}", "train.epochs=3", "tracking.system_metrics_after_s=0",
                   "tracking.system_metrics_interval_s=0.2"))  # fmt: skip
    [run] = runs_of(client, experiment_name)
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system, system
    assert run.info.status == "FINISHED"
    withheld = run.data.tags.get(GPU_MEMORY_TAG, "")
    assert withheld.startswith("withheld") if dp == "dpsgd" else withheld == "", run.data.tags


@DP_RUN
def test_planner_epsilon_equals_trainer_epsilon(dp_run: tuple) -> None:  # type: ignore[type-arg]
    result, *_ = dp_run
    for accountant in ("rdp", "prv", "pld"):
        planned = epsilon(poisson_schedule(1437, 64), 1.1, 1e-5, epochs=3, accounting=ledger.Accounting(accountant))
        assert planned.epsilon == result.epsilons[accountant]  # exactly: same convention, same maths
        assert planned.steps == result.steps
    assert result.accountant_history == [(1.1, planned.sample_rate, planned.steps)]


def test_dp_off_logs_no_epsilon(make_cfg: Composer, client: MlflowClient, experiment_name: str) -> None:
    result = train(make_cfg("dp=off", "train.epochs=1"))
    [run] = runs_of(client, experiment_name)
    assert run.info.status == "FINISHED"
    assert not any(k.startswith("epsilon") for k in run.data.metrics)
    assert "test_accuracy" in run.data.metrics and set(run.data.metrics) >= MEMORY_METRICS
    assert not {"dp.delta", "dp.accountant"} & set(run.data.tags) and run.data.tags["dp.enabled"] == "False"
    assert [k for k in run.data.params if k.startswith("dp.")] == ["dp.enabled"]
    assert result.epsilon is None and result.epsilons == {}


def test_target_epsilon_calibrates_and_logs_sigma(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    result = train(make_cfg("dp.target_epsilon=2.0", "train.epochs=2"))
    [run] = runs_of(client, experiment_name)
    sigma = float(run.data.params["dp.noise_multiplier"])
    assert sigma == result.noise_multiplier == float(run.data.tags["dp.noise_multiplier_calibrated"])
    assert sigma != 1.0  # not the configured default
    assert 2.0 - 0.01 <= result.epsilon <= 2.0  # type: ignore[operator]


@pytest.mark.slow
def test_eval_every_evaluates_its_epochs_and_the_last_and_changes_nothing_else(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    """train.eval_every=2 over 3 epochs: test accuracy after epochs 2 and 3 only, ε after every epoch,
    and the same final accuracy and ε as evaluating every epoch (evaluating does not touch training)."""
    sparse = train(make_cfg("train.epochs=3", "train.eval_every=2"))
    every = train(make_cfg("train.epochs=3"))
    assert [m.step for m in client.get_metric_history(sparse.run_id, "test_accuracy")] == [2, 3]
    assert [m.step for m in client.get_metric_history(every.run_id, "test_accuracy")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(sparse.run_id, "epsilon")] == [1, 2, 3]
    assert sparse.test_accuracy == every.test_accuracy and sparse.epsilon == every.epsilon
    run = client.get_run(sparse.run_id)
    assert run.data.tags["train.eval_every"] == "2" and "train.eval_every" not in run.data.params  # a setting
    assert run.data.tags["config.hash"] == client.get_run(every.run_id).data.tags["config.hash"]


@SEED2
def test_same_seed_same_result(make_cfg: Composer, seed2_run: TrainResult) -> None:
    a = seed2_run
    b = train(make_cfg("train.epochs=1", "train.seed=2", STREAM))
    assert a.test_accuracy == b.test_accuracy and a.train_loss == b.train_loss


def test_per_sample_clipping_bounds_each_gradient() -> None:
    """Each clipped per-sample gradient has norm <= C, and a batch's summed gradient is the sum of them."""
    torch.manual_seed(0)
    splits = loaders.build(DigitsConfig())
    model = classifiers.build(classifiers.CNNConfig(), splits.input_shape, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(splits.train, batch_size=64)
    c = 0.05  # small, so that clipping is active for most samples
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=c)
    _, model, opt, _, _ = make_private(dp, 1.0, dp.max_grad_norm, model, opt, loader, torch.nn.CrossEntropyLoss())
    x, y = splits.train.tensors[0][:16], splits.train.tensors[1][:16]  # type: ignore[attr-defined]
    loss_fn = torch.nn.CrossEntropyLoss()

    def clipped_sum(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        raw = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in model.parameters()]).norm(dim=0)
        opt.clip_and_accumulate()
        return torch.cat([p.summed_grad.flatten() for p in model.parameters()]), raw

    singles, raw_norms = [], []
    for i in range(len(y)):
        g, raw = clipped_sum(x[i : i + 1], y[i : i + 1])
        singles.append(g)
        raw_norms.append(float(raw))
    norms = [float(g.norm()) for g in singles]
    assert all(n <= c * (1 + 1e-5) for n in norms)
    assert sum(r > c for r in raw_norms) >= 8  # clipping really happened
    for n, r in zip(norms, raw_norms, strict=True):
        assert n == pytest.approx(min(r, c), rel=1e-3)  # clipped to C, never inflated
    batch, _ = clipped_sum(x, y)
    assert torch.allclose(batch, torch.stack(singles).sum(0), atol=1e-6)


@pytest.mark.parametrize("mode", list(GradSampleMode))
def test_every_grad_sample_mode_clips_per_sample_gradients_to_c(mode: GradSampleMode) -> None:
    """With σ=0 the DP gradient is exactly sum_i min(1, C/|g_i|) g_i / E[B], g_i each sample's own
    gradient by plain autograd (Abadi et al. 2016, Algorithm 1), whichever way Opacus gets |g_i|."""
    torch.manual_seed(0)
    splits = loaders.build(DigitsConfig(image_size=16))
    reference = classifiers.build(classifiers.CNNConfig(hidden_units=16), splits.input_shape, 10)
    model = classifiers.build(classifiers.CNNConfig(hidden_units=16), splits.input_shape, 10)
    model.load_state_dict(reference.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = torch.utils.data.DataLoader(splits.train, batch_size=64)
    c = 0.05  # small, so that clipping binds for most samples
    x, y = splits.train.tensors[0][:12], splits.train.tensors[1][:12]  # type: ignore[attr-defined]
    if mode == GradSampleMode.fused:  # dpsweep's own step (dpsweep.mechanisms.fused), not Opacus's
        divisor = 64  # the config's B, as every engine divides (issue 58, item 5)
        step = FusedStep(model, torch.nn.CrossEntropyLoss(), max_grad_norm=c, pad_to=16, mode=None)
        grads = step.gradient(x, y, noise_multiplier=0.0, divisor=divisor, generator=torch.Generator())
        got = torch.cat([grads[k].flatten() for k, _ in model.named_parameters()])
        opt.expected_batch_size = divisor  # type: ignore[attr-defined]
    else:
        dp = DPConfig(noise_multiplier=0.0, max_grad_norm=c, grad_sample_mode=mode)
        _, model, opt, criterion, _ = make_private(
            dp, 0.0, dp.max_grad_norm, model, opt, loader, torch.nn.CrossEntropyLoss()
        )
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()
        got = torch.cat([p.grad.flatten() for p in model.parameters()])

    expected = torch.zeros_like(got)
    clipped = 0
    for i in range(len(y)):
        reference.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]).backward()
        g = torch.cat([p.grad.flatten() for p in reference.parameters()])
        clipped += int(g.norm() > c)
        expected += g * min(1.0, c / (float(g.norm()) + 1e-6))
    expected /= opt.expected_batch_size
    assert clipped >= 6  # clipping really happened
    assert torch.allclose(got, expected, rtol=1e-3, atol=1e-7), mode


@SEED2
@pytest.mark.slow
def test_physical_batches_change_memory_not_results(make_cfg: Composer, seed2_run: TrainResult) -> None:
    """BatchMemoryManager (DP) and split passes (non-DP): same steps, loss, accuracy and ε."""
    for dp in ("dpsgd", "off"):
        whole = seed2_run if dp == "dpsgd" else train(make_cfg(f"dp={dp}", "train.epochs=1", "train.seed=2"))
        shared = [STREAM] if dp == "dpsgd" else []
        split = train(make_cfg(f"dp={dp}", "train.epochs=1", "train.seed=2", "train.physical_batch_size=16", *shared))
        assert split.steps == whole.steps == 23
        assert split.epsilon == whole.epsilon and split.accountant_history == whole.accountant_history
        assert split.test_accuracy == pytest.approx(whole.test_accuracy, abs=0.01)
        assert split.train_loss == pytest.approx(whole.train_loss, rel=1e-3)


def test_probe_runs_one_iteration_and_records_the_stages(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    result = train(make_cfg("train.probe=true", "train.batch_size=100"))
    [run] = runs_of(client, experiment_name)
    assert run.info.status == "FINISHED" and run.data.tags["probe"] == "true"
    assert run.data.tags["dataset.input_shape"] == "1x28x28" and run.info.run_name.startswith("probe-")
    assert result.steps == 1 and "epsilon" not in run.data.metrics and "test_accuracy" not in run.data.metrics
    m = run.data.metrics
    levels = [memory_bytes(m, s) for s in STAGES]
    assert 0 < levels[0] < levels[1] < levels[2]
    assert memory_bytes(m, "batch_load_delta") >= 100 * 28 * 28 * 4  # exactly B images of float32 on the device
    params = int(run.data.tags["model.trainable_params"])
    assert memory_bytes(m, "backward_delta") >= 100 * params * 4  # per-sample gradients: B x P floats


def test_a_run_logs_its_memory_in_mib_under_the_system_prefix_and_no_bytes(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory goes to a run's System metrics tab in MLflow's UI (names under ``system/``), in MiB a person
    can read (issue 56, item 2): each figure the recorder measured in bytes, divided by 2**20, nothing
    rounded; and no ``memory/…_bytes`` of before."""
    measured: list[dict[str, int]] = []
    figures = StageRecorder.figures

    def kept(self: StageRecorder) -> dict[str, int]:
        measured.append(figures(self))
        return measured[-1]

    monkeypatch.setattr(StageRecorder, "figures", kept)
    cfg = make_cfg("dp=off", "train.probe=true", "train.batch_size=50")
    result = train(cfg)
    [run] = runs_of(client, experiment_name)
    m, stages = run.data.metrics, measured[0]
    assert len(stages) == 15 and all(isinstance(v, int) and v > 0 for k, v in stages.items() if "delta" not in k)
    assert {k: m[memory_metric(k.removesuffix("_bytes"))] for k in stages} == {k: v / MIB for k, v in stages.items()}
    assert {k for k in m if "memory" in k} == {memory_metric(k.removesuffix("_bytes")) for k in stages} | {
        memory_metric("peak")
    }
    assert (m[memory_metric("peak")] * MIB).is_integer() and memory_bytes(m, "peak") >= stages["iteration_peak_bytes"]
    line = summary_line(to_config(cfg), result)  # the probe's line reads them back in bytes
    assert f"backward={format_bytes(stages['backward_bytes'])}" in line, line


@pytest.mark.slow
@VGG
def test_vgg16_frozen_run_trains_only_the_head(vgg_runs: VggRuns) -> None:
    for result in (vgg_runs.cached, vgg_runs.uncached):  # on cached features, and with the backbone on the device
        run = vgg_runs.runs[result.run_id]
        assert run.info.status == "FINISHED"
        assert run.data.tags["model.trainable_params"] == str(25088 * 16 + 16 + 16 * 10 + 10)
        assert result.epsilon is not None and math.isfinite(result.test_accuracy)


BAD_INPUT = [
    (["dp.noise_multiplier=0"], ConfigError, "dp.noise_multiplier=0.0"),
    (["dp.max_grad_norm=-1"], ConfigError, "dp.max_grad_norm=-1.0"),
    (["dp.delta=1.0"], ConfigError, "dp.delta=1.0"),
    (["dp.delta=0.01"], ConfigError, "1/N"),
    (["train.batch_size=0"], ConfigError, "train.batch_size=0"),
    (["train.batch_size=5000"], ConfigError, "N=1437"),
    (["train.epochs=0"], ConfigError, "train.epochs=0"),
    (["train.eval_every=0"], ConfigError, "train.eval_every=0 is invalid: a number of epochs, 1 or more"),
    (["model.hidden_units=-2"], ConfigError, "model.hidden_units=-2"),
    # out of RDP's reach (under PLD, σ ≈ 1e5 spends ε = 0 at δ = 1e-5, rightly: Φ's step is under δ)
    (["dp.target_epsilon=1e-9", "dp.accountant=rdp"], ConfigError, "dp.target_epsilon"),
    (
        ["dataset=mnist", "dataset.root=/nonexistent/data"],
        DatasetNotFoundError,
        "/nonexistent/data/MNIST/raw",
    ),
    (["train.device=cuda"], ConfigError, "no CUDA device") if not torch.cuda.is_available() else None,
    (
        ["model=vgg16_frozen", "model.pretrained=false", "dataset.image_size=32", "model.feature_cache_dir=/proc/x"],
        ConfigError,
        "model.feature_cache_dir='/proc/x'",
    ),
    (["train.memory_model=missing.json"], ConfigError, "train.memory_model='missing.json'"),
]


@pytest.mark.parametrize(("overrides", "error", "text"), [b for b in BAD_INPUT if b], ids=lambda v: str(v))
def test_bad_input_fails_before_any_run(
    make_cfg: Composer,
    client: MlflowClient,
    experiment_name: str,
    overrides: list[str],
    error: type,
    text: str,
) -> None:
    with pytest.raises(error) as info:
        train(make_cfg(*overrides))
    assert text in str(info.value)
    assert runs_of(client, experiment_name) == []  # nothing started, nothing left RUNNING


def test_train_accepts_the_typed_config(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("train.epochs=1", "dp=off"))
    assert train(cfg).n_train == 1437


@pytest.mark.slow
def test_memory_model_and_gpu_memory_choose_the_physical_batch(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    """The largest pass predicted to fit the budget; the privacy batch stays B (same steps, same ε)."""
    import pandas as pd

    from dpsweep.analysis import memory_model

    reference = REPO / "analysis" / "data" / "cpu_probes_digits.csv"
    memory_model.save_models(tmp_path / "m.json", memory_model.fit_all(pd.read_csv(reference), "cnn"), meta={})
    chosen = ["train.memory_model=m.json", "launcher.gpu_memory=3MiB", "train.batch_size=256", "train.epochs=1"]
    result = train(make_cfg(*chosen))
    plain = train(make_cfg("train.batch_size=256", "train.epochs=1"))
    runs = {r.info.run_id: r for r in runs_of(client, experiment_name)}
    physical = int(runs[result.run_id].data.tags["train.physical_batch_size_used"])
    assert 1 <= physical < 256 and "train.physical_batch_size_used" not in runs[plain.run_id].data.tags
    # DP runs measure one pass of exactly the planned size (not their private Poisson batches)
    assert memory_bytes(runs[result.run_id].data.metrics, "iteration_peak") <= 3 * 2**20  # and it did fit
    assert memory_bytes(runs[plain.run_id].data.metrics, "iteration_peak") > 3 * 2**20  # B in one pass does not
    assert result.steps == plain.steps and result.epsilon == plain.epsilon
    with pytest.raises(ConfigError, match=r"launcher.gpu_memory='1KiB' is invalid: room for at least one example"):
        train(make_cfg("train.memory_model=m.json", "launcher.gpu_memory=1KiB"))
    with pytest.raises(ConfigError, match=r"train.memory_model='nope.json' is invalid: an existing"):
        train(make_cfg("train.memory_model=nope.json", "launcher.gpu_memory=1GiB"))


@pytest.mark.slow
@VGG
def test_feature_cache_trains_the_same_run_without_the_backbone_on_the_device(vgg_runs: VggRuns) -> None:
    uncached, cached, again, runs = vgg_runs.uncached, vgg_runs.cached, vgg_runs.again, vgg_runs.runs
    assert cached.steps == uncached.steps and cached.epsilon == uncached.epsilon  # the same Poisson process
    assert cached.accountant_history == uncached.accountant_history
    assert cached.test_accuracy == pytest.approx(uncached.test_accuracy, abs=1.5 / 360)  # float order only
    assert cached.train_loss == pytest.approx(uncached.train_loss, rel=1e-4)
    tags = runs[cached.run_id].data.tags
    assert tags["feature_cache.train"] == tags["feature_cache.test"] == "built"
    assert tags["feature_cache.map_shape"] == "512x1x1"
    assert runs[again.run_id].data.tags["feature_cache.train"] == "hit"
    assert "feature_cache.train" not in runs[uncached.run_id].data.tags
    load = {k: memory_bytes(runs[r.run_id].data.metrics, "model_load") for k, r in (("c", cached), ("u", uncached))}
    # The 14.7 M frozen weights are gone; on CPU the census sees the cached rows instead (512 fp32
    # values and an int64 label per image of both splits), to the byte
    assert load["c"] == load["u"] - 4 * 14_714_688 + (4 * 512 + 8) * (1437 + 360)


@pytest.mark.slow
def test_device_resident_data_keeps_the_sample_rate_steps_and_epsilon(make_cfg: Composer) -> None:
    loader = train(make_cfg("train.epochs=2"))
    resident = train(make_cfg("train.epochs=2", "train.device_resident=true", STREAM))
    assert resident.accountant_history == loader.accountant_history == [(1.0, 1 / 23, 46)]
    assert resident.epsilon == loader.epsilon and resident.steps == loader.steps
    assert resident.test_accuracy > 0.5  # it learns
    split = train(make_cfg("train.epochs=2", "train.device_resident=true", "train.physical_batch_size=16", STREAM))
    assert split.accountant_history == resident.accountant_history
    assert split.train_loss == pytest.approx(resident.train_loss, rel=1e-3)  # same batches, in passes
    baseline = train(make_cfg("dp=off", "train.epochs=2", "train.device_resident=true"))
    assert baseline.steps == 2 * 23 and baseline.test_accuracy > 0.6


@SEED2
@pytest.mark.parametrize("mode", list(GradSampleMode))
def test_every_grad_sample_mode_trains_and_probes_through_train(
    mode: GradSampleMode, make_cfg: Composer, client: MlflowClient, experiment_name: str, seed2_run: TrainResult
) -> None:
    """The same run in every Opacus mode (the same clipped sums, up to float order), the same ε and steps
    with the fused step, and a probe of each."""
    hooks = seed2_run
    other = train(make_cfg("train.epochs=1", "train.seed=2", STREAM, f"dp.grad_sample_mode={mode.value}"))
    assert other.epsilon == hooks.epsilon and other.steps == hooks.steps
    if mode != GradSampleMode.fused:  # fused draws its Poisson batches on the device: other batches, same law
        assert other.test_accuracy == pytest.approx(hooks.test_accuracy, abs=2 / 360)
    train(make_cfg("train.probe=true", "train.batch_size=32", f"dp.grad_sample_mode={mode.value}"))
    probes = [r for r in runs_of(client, experiment_name) if r.data.tags.get("probe") == "true"]
    assert [r.info.status for r in probes] == ["FINISHED"]
    assert probes[0].data.tags["dp.grad_sample_mode"] == mode.value
    if mode == GradSampleMode.ghost:  # no per-sample gradients held: far less memory than B x P floats
        params = int(probes[0].data.tags["model.trainable_params"])
        assert memory_bytes(probes[0].data.metrics, "backward_delta") < 32 * params * 4 / 4


@pytest.mark.slow
def test_ew_mode_survives_empty_poisson_batches(make_cfg: Composer) -> None:
    """torch's ExpandedWeights refuse an empty batch; the step still adds noise and is accounted."""
    result = train(make_cfg("dp.grad_sample_mode=ew", "train.batch_size=2", "train.epochs=1", "dataset.image_size=16"))
    assert result.steps == 719 and result.accountant_history == [(1.0, 1 / 719, 719)]  # ~13% of them empty


def test_a_run_with_a_tiny_sigma_reports_rdp_and_says_why_pld_and_prv_are_not_computed(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    """σ = 0.05: PLD and PRV would discretise the privacy loss for minutes at the end of the run. Under
    the default accountant (PLD) such a run is refused before it starts, saying to use RDP."""
    with pytest.raises(InputError, match=r"dp.accountant='pld' is invalid: rdp for this run: its RDP ε is \d+"):
        train(make_cfg("dp.noise_multiplier=0.05", "train.epochs=1", "tracking.log_model=false"))
    assert runs_of(client, experiment_name) == []
    result = train(
        make_cfg("dp.noise_multiplier=0.05", "train.epochs=1", "tracking.log_model=false", "dp.accountant=rdp")
    )
    assert set(result.epsilons) == {"rdp"} and result.epsilon == result.epsilons["rdp"] > ledger.DISCRETISED_MAX_EPSILON
    [run] = runs_of(client, experiment_name)
    assert "epsilon_rdp" in run.data.metrics and not {"epsilon_pld", "epsilon_prv"} & set(run.data.metrics)
    path = Path(client.download_artifacts(run.info.run_id, "privacy_ledger.json", str(tmp_path)))
    bill = json.loads(path.read_text())
    assert set(bill["not_computed"]) == {"pld", "prv"} and bill["epsilon"] == {"rdp": result.epsilon}


@pytest.mark.slow
def test_a_run_that_diverges_is_tagged_with_why_and_one_that_learns_is_not(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    """Issue 33, item 2: a learning rate of 10^4 blows the weights up; at lr 10^-6 a non-private run
    stays at chance; a DP run at σ = 1000 stays at chance too, but is a point of the trade-off."""
    blown = train(make_cfg("dp=off", "optimizer.lr=1e4", "train.epochs=1"))
    stuck = train(make_cfg("dp=off", "optimizer.lr=1e-6", "optimizer.momentum=0", "train.epochs=1"))
    noisy = train(make_cfg("dp.noise_multiplier=1000", "train.epochs=1"))
    fine = train(make_cfg("dp=off", "train.epochs=1"))
    assert blown.diverged == "the trained model's weights are not finite"
    assert stuck.diverged is not None and stuck.diverged.startswith("test_accuracy stayed at chance"), stuck
    assert noisy.diverged is None and noisy.test_accuracy < 0.2
    assert fine.diverged is None and fine.test_accuracy > 0.3
    tags = {r.info.run_id: r.data.tags for r in runs_of(client, experiment_name)}
    assert tags[blown.run_id]["run.diverged"] == "true" and "not finite" in tags[blown.run_id]["run.diverged.reason"]
    assert "stayed at chance" in tags[stuck.run_id]["run.diverged.reason"]
    assert "run.diverged" not in tags[fine.run_id] and "run.diverged" not in tags[noisy.run_id]
