"""dpsweep-memory: probes in fresh processes through a real launcher and a real MLflow store, the fit,
and predictions, end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import REPO, Composer, run_main, run_script, runs_of
from memory_metrics import memory_bytes
from mlflow.tracking import MlflowClient

from dpsweep.cli import plan
from dpsweep.cli.memory import FORCED_VALUES, main, probe_overrides
from dpsweep.errors import InputError
from dpsweep.memory.model import load_models
from dpsweep.memory.probes import probe_table
from dpsweep.units import parse_bytes

PROBED = pytest.mark.xdist_group("probed")  # the tests of the 12 probes below: one worker trains them once


def memory_cli(*args: str, check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``dpsweep-memory`` in this process (``fresh``: as its own process, as users run it)."""
    done = run_script("dpsweep-memory", *args, cwd=Path.cwd()) if fresh else run_main(main, *args)
    if check and done.returncode != 0:
        raise AssertionError(f"dpsweep-memory {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@pytest.mark.slow
def test_probe_measures_each_config_in_its_own_process_and_writes_the_table(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Also the smoke test of the console script: a real process, its exit code and its output."""
    tracking = [f"tracking.uri={mlflow_uri}", f"tracking.experiment_name={experiment_name}", "train.progress=false"]
    done = memory_cli(
        "probe", "--csv", "out/probes.csv", "train.batch_size=16,64", "dataset.image_size=16", *tracking, fresh=True
    )
    assert "probing 2 configs" in done.stdout and "2 probes written to out/probes.csv" in done.stdout, done.stdout
    # issue 33, item 11: the hints point at the fit (a report of probes answered "0 FINISHED runs of 0")
    assert f"dpsweep: next: dpsweep-memory fit --experiment {experiment_name} --tracking-uri" in done.stdout
    assert "dpsweep-report" not in done.stdout, done.stdout
    assert (
        done.stdout.rstrip()
        .splitlines()[-1]
        .startswith("dpsweep-memory: next: dpsweep-memory fit --csv out/probes.csv --out memory_model.json")
    ), done.stdout
    table = pd.read_csv(tmp_path / "out" / "probes.csv")
    assert sorted(table.batch_size) == [16, 64]
    assert set(table.backend) == {"cpu-tensors"} and (table.height == 16).all() and table.dp.all()
    small, large = (table.set_index("batch_size").loc[b] for b in (16, 64))
    assert small.model_load_bytes == large.model_load_bytes > 0  # the same model
    for stage in ("batch_load", "backward"):  # more examples: more pixels, more per-sample gradients
        assert large[f"{stage}_delta_bytes"] > small[f"{stage}_delta_bytes"] > 0
    assert large.optimizer_step_delta_bytes == small.optimizer_step_delta_bytes  # P-sized state only
    assert (table.iteration_peak_bytes >= table.optimizer_step_bytes).all()
    runs = [r for r in runs_of(client, experiment_name) if r.data.tags.get("sweep.role") != "parent"]
    assert len(runs) == 2 and {r.data.tags["probe"] for r in runs} == {"true"}
    assert {r.info.status for r in runs} == {"FINISHED"}
    pids = {r.data.tags.get("job.pid") for r in runs}
    assert len(pids) == 2 and None not in pids  # a fresh process per config

    # Asked again: measured afresh (an earlier probe may be of another device), and only this
    # invocation's probes are in its table. In this process: the sweep's own output reaches the file
    # descriptors, so it is read from them (the probe itself is a fresh process all the same).
    capfd.readouterr()
    code = main(["probe", "--csv", "again.csv", "train.batch_size=16", "dataset.image_size=16", *tracking])
    again = capfd.readouterr()
    assert code == 0 and "1 finished, 0 skipped" in again.out, again.out + again.err
    [retaken] = pd.read_csv(tmp_path / "again.csv").itertuples()
    assert retaken.batch_size == 16 and retaken.run_id not in set(table.run_id)
    assert retaken.backward_bytes == small.backward_bytes  # the census is exact: the same figures
    assert len([r for r in runs_of(client, experiment_name) if r.data.tags.get("sweep.role") != "parent"]) == 3


def test_probes_logged_before_in_bytes_read_as_todays(
    make_cfg: Composer, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """Probes log MiB under ``system/memory/…_mib`` (issue 56, item 2); a store of probes logged before,
    in bytes under ``memory/…_bytes`` or, older still, ``memory.…_bytes``, gives the same probe table
    (in bytes), so that older probes still count in a fit."""
    from mlflow.entities import Metric, Param, RunTag

    from dpsweep.run.runner import train

    for batch in (8, 16):
        train(make_cfg("train.probe=true", f"train.batch_size={batch}", "dataset.image_size=16"))
    now = probe_table(mlflow_uri, experiment_name)
    before = client.create_experiment(experiment_name + "-before")
    for run, prefix in zip(runs_of(client, experiment_name), ("memory/", "memory."), strict=True):
        assert any(k.startswith("system/memory/") for k in run.data.metrics), run.data.metrics
        metrics = {  # the bytes, under the names of before; no system/memory/…
            prefix + k.removeprefix("system/memory/").removesuffix("_mib") + "_bytes": v * 2**20
            for k, v in run.data.metrics.items() if k.startswith("system/memory/")
        }  # fmt: skip
        old = client.create_run(before, tags=run.data.tags).info.run_id
        client.log_batch(
            old, [Metric(k, v, 0, 0) for k, v in metrics.items()], [Param(k, v) for k, v in run.data.params.items()],
            [RunTag(k, v) for k, v in run.data.tags.items()],
        )  # fmt: skip
        client.set_terminated(old, "FINISHED")
    then = probe_table(mlflow_uri, experiment_name + "-before")
    measured = [c for c in now.columns if c.endswith("_bytes")]
    assert len(measured) == 15 and len(now) == len(then) == 2
    key = ["batch_size"]
    assert (
        then.sort_values(key)[measured]
        .reset_index(drop=True)
        .equals(now.sort_values(key)[measured].reset_index(drop=True))
    )
    assert (now["backward_bytes"] > 0).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["probe", "launcher=inline"], "launcher='inline' is invalid: one of local, sge, slurm"),
        (["probe", "train.batch_size=0"], "train.batch_size=0 is invalid"),
        (["probe", "train.batch_size=5000"], "at most the training-set size N=1437"),
        (["probe", "train.physical_batch_size=8"], "train.physical_batch_size=8 is invalid"),
    ],
)
def test_probe_refuses_bad_input_before_any_work(
    args: list[str], message: str, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    done = memory_cli(*args, f"tracking.uri={mlflow_uri}", f"tracking.experiment_name={experiment_name}", check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert runs_of(client, experiment_name) == []


@pytest.fixture(scope="module")  # the tests that use it are marked PROBED, so that one worker trains them
def probed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """12 probes of the CNN on 16x16 digits (in-process: the fit does not care how they ran)."""
    from hydra import compose, initialize_config_module

    from dpsweep.run.runner import train

    root = tmp_path_factory.mktemp("probed")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        for hidden in (16, 64):
            for batch in (4, 8, 16, 32, 64, 128):
                train(compose("config", overrides=[
                    "train.probe=true", f"train.batch_size={batch}", f"model.hidden_units={hidden}",
                    "dataset.image_size=16", f"tracking.uri={uri}", "tracking.experiment_name=probes",
                    "sweep.max_epsilon=0.01",  # no probe meets it: a probe takes one step and has no budget
                ]))  # fmt: skip
    return uri, root


@pytest.fixture(scope="module")
def fitted(probed: tuple[str, Path]) -> Path:
    """The fit of the 12 probes, made once for the tests that predict with it (their tests are PROBED)."""
    uri, root = probed
    model = root / "fit" / "m.json"
    memory_cli("fit", "--experiment", "probes", "--tracking-uri", uri, "--out", str(model))
    return model


@pytest.mark.slow
@PROBED
def test_fit_prints_formulas_and_held_out_error_and_saves_the_model(probed: tuple[str, Path], tmp_path: Path) -> None:
    from dpsweep.analysis import memory_model

    uri, _ = probed
    done = memory_cli("fit", "--experiment", "probes", "--tracking-uri", uri, "--out", "models/m.json")
    assert "cnn: 12 probes, backend cpu-tensors" in done.stdout
    assert "iteration_peak ≈" in done.stdout and "least_squares" in done.stdout and "envelope" in done.stdout
    assert "k-fold held-out error" in done.stdout and "share_under_predicted" in done.stdout
    assert (tmp_path / "models" / "m_residuals.png").read_bytes().startswith(b"\x89PNG")
    [model] = load_models(tmp_path / "models" / "m.json").values()
    assert model.model == "cnn" and model.backend == "cpu-tensors" and model.n_probes == 12
    peak = memory_model.cv_frame(model).query("target == 'iteration_peak_bytes' and fit == 'envelope'").iloc[0]
    assert peak.mean_abs_rel_error < 0.05  # the census is close to linear in B and P


def test_probe_sweeps_are_probes_whatever_the_overrides_say() -> None:
    args = probe_overrides(["experiment=demo", "train.batch_size=8,16"])
    assert args[-len(FORCED_VALUES) :] == list(FORCED_VALUES)  # last: no preset can undo them
    assert "sweep.max_epsilon=null" in args and "launcher=local" in args
    assert "tracking.experiment_name=dpsweep-probes" in args  # probes in their own experiment (issue 33, item 11)
    named = probe_overrides(["tracking.experiment_name=mine", "train.batch_size=8"])
    assert [a for a in named if a.startswith("tracking.experiment_name=")] == ["tracking.experiment_name=mine"]
    for given in ("train.probe=false", "sweep.force=false", "sweep.max_epsilon=3"):
        key, _, value = given.partition("=")
        with pytest.raises(InputError, match=rf"{key}='{value}' is invalid: leave it out: dpsweep-memory probe sets"):
            probe_overrides(["train.batch_size=8", given])


def predict_json(*args: str) -> list[dict[str, object]]:
    out = memory_cli("predict", "--json", *args).stdout
    rows: list[dict[str, object]] = json.loads(out)  # stdout holds only the JSON
    return rows


@pytest.mark.slow
@PROBED
def test_predict_gives_the_verdict_and_the_largest_batch_that_really_fits(
    fitted: Path, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    from hydra import compose, initialize_config_module

    from dpsweep.run.runner import train

    budget = "3MiB"
    common = ["--memory-model", str(fitted), "--backend", "cpu-tensors", "--gpu-memory", budget]
    config = ["model.hidden_units=64", "dataset.image_size=16"]
    small = memory_cli("predict", *common, "train.batch_size=8", *config)
    assert ": fits: predicted peak" in small.stdout and "largest Poisson batch of B=8" in small.stdout
    large = memory_cli("predict", *common, "train.batch_size=1024", *config)
    assert "OUT OF MEMORY" in large.stdout and "train.physical_batch_size=" in large.stdout
    [row] = predict_json(*common, "train.batch_size=1024", *config)
    assert row["fits"] is False and float(row["peak_bytes"]) > parse_bytes(budget)  # type: ignore[arg-type]
    largest, physical = int(row["largest_batch_size"]), int(row["largest_physical_batch_size"])  # type: ignore[call-overload]
    assert 8 < largest < 1024 and physical >= largest  # a Poisson batch may exceed B; a pass never exceeds the cap

    # The largest B is predicted to fit and the next one up not ...
    assert predict_json(*common, f"train.batch_size={largest}", *config)[0]["fits"] is True
    assert predict_json(*common, f"train.batch_size={largest + 1}", *config)[0]["fits"] is False
    # ... and measured: a pass of the largest physical batch predicted to fit stays within the budget.
    tracking = [f"tracking.uri={mlflow_uri}", f"tracking.experiment_name={experiment_name}"]
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        train(compose("config", overrides=["train.probe=true", f"train.batch_size={physical}", *config, *tracking]))
    [run] = runs_of(client, experiment_name)
    assert memory_bytes(run.data.metrics, "iteration_peak") <= parse_bytes(budget)


@pytest.mark.slow
@PROBED
def test_device_resident_data_counts_against_the_gpu_memory(fitted: Path) -> None:
    config = ["--memory-model", str(fitted), "--backend", "cpu-tensors", "model.hidden_units=64",
              "dataset.image_size=16", "train.batch_size=128"]  # fmt: skip
    [loader] = predict_json("--gpu-memory", "1GiB", *config)
    [resident] = predict_json("--gpu-memory", "1GiB", *config, "train.device_resident=true")
    assert loader["resident_bytes"] == 0 and resident["peak_bytes"] == loader["peak_bytes"]
    assert resident["resident_bytes"] == 1437 * (1 * 16 * 16 * 4 + 8)  # N x (fp32 image + int64 label)
    # a GPU with room for the peak but not for the peak and the training split
    between = f"{int(loader['peak_bytes']) + int(resident['resident_bytes']) // 2}B"  # type: ignore[call-overload]
    assert predict_json("--gpu-memory", between, *config)[0]["fits"] is True
    [full] = predict_json("--gpu-memory", between, *config, "train.device_resident=true")
    assert full["fits"] is False and int(full["largest_batch_size"]) < 128  # type: ignore[call-overload]
    text = memory_cli("predict", "--gpu-memory", between, *config, "train.device_resident=true").stdout
    assert "OUT OF MEMORY" in text and "of device-resident data" in text


def test_plan_help_lists_every_option() -> None:
    done = run_main(plan.main, "--help")
    assert done.returncode == 0
    for option in ("--json", "--memory-model FILE", "--gpu-memory SIZE", "--backend B", "OVERRIDES"):
        assert option in done.stdout, option


@pytest.mark.slow
@PROBED
def test_plan_shows_the_predicted_peak_and_flags_what_will_not_fit(fitted: Path) -> None:
    done = run_main(
        plan.main, "--memory-model", str(fitted), "--backend", "cpu-tensors", "--gpu-memory", "3MiB",
        "train.batch_size=8,1024", "model.hidden_units=64", "dataset.image_size=16",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "peak" in lines[0]
    [small] = [line for line in lines if "digits" in line and "     8 " in line]
    [large] = [line for line in lines if "digits" in line and "  1024 " in line]
    assert "will not fit 3MiB" in large and "will not fit" not in small
    assert "1 of 2 jobs are predicted not to fit the GPU memory" in done.stdout


@pytest.mark.slow
@PROBED
def test_fit_and_predict_refuse_bad_input(probed: tuple[str, Path], tmp_path: Path) -> None:

    uri, _ = probed
    table = probe_table(uri, "probes")
    table.to_csv("probes.csv", index=False)
    table.iloc[:2].to_csv("few.csv", index=False)
    table.assign(backend=["cuda"] * 6 + ["cpu-tensors"] * 6).to_csv("mixed.csv", index=False)
    table.assign(device_name=["NVIDIA H100"] * 6 + ["NVIDIA A100"] * 6).to_csv("devices.csv", index=False)
    cases = [
        (["fit", "--csv", "few.csv"], "2 probes of model 'cnn' are too few to fit"),
        (["fit", "--csv", "probes.csv", "--features", "batch_size,colour"], "colour"),
        (["fit", "--csv", "mixed.csv"], "cpu-tensors"),
        (["fit", "--csv", "devices.csv"], "the probes of cnn ran on several devices"),
        (["fit", "--csv", "devices.csv", "--device", "TPU"], "--device='TPU' is invalid: a device the probes ran on"),
        (["fit", "--csv", "missing.csv"], "--csv='missing.csv'"),
        (["fit", "--experiment", "nope", "--tracking-uri", uri], "--experiment='nope'"),
    ]
    for args, message in cases:
        done = memory_cli(*args, check=False)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    assert not (tmp_path / "memory_model.json").exists()
    memory_cli("fit", "--csv", "probes.csv", "--out", "m.json")
    for figure, message in [("16", "units are required"), ("-1GiB", "a positive amount"), ("0B", "a positive amount")]:
        done = memory_cli("predict", "--memory-model", "m.json", f"--gpu-memory={figure}", check=False)
        assert done.returncode == 2 and f"--gpu-memory={figure!r} is invalid: {message}" in done.stderr, done.stderr
    done = memory_cli("predict", "--memory-model", "m.json", "--gpu-memory", "1GiB", "model=vgg16_frozen", check=False)
    assert done.returncode == 2 and "model.name='vgg16_frozen+cache'" in done.stderr and "fits of: cnn" in done.stderr
    done = memory_cli("predict", "--memory-model", "m.json", "--gpu-memory", "1GiB", "--backend", "cuda", check=False)
    assert done.returncode == 2 and "cpu-tensors probes" in done.stderr and "--backend cpu-tensors" in done.stderr
    # no --backend: cuda where a GPU is visible, else the fit's own backend (the CPU twin's, here)
    default = memory_cli("predict", "--memory-model", "m.json", "--gpu-memory", "1GiB", check=False)
    assert default.returncode == (2 if torch.cuda.is_available() else 0), default.stdout + default.stderr
    # --model: only that model's probes are checked (another model's two devices do not matter)
    other = table.assign(model="vgg16_frozen", device_name=["NVIDIA H100"] * 6 + ["NVIDIA A100"] * 6)
    pd.concat([table.assign(torch_version=""), other]).to_csv("two.csv", index=False)  # "" reads back as NaN
    fitted = memory_cli("fit", "--csv", "two.csv", "--model", "cnn", "--out", "cnn.json")
    assert "cnn: 12 probes" in fitted.stdout and "vgg16_frozen" not in fitted.stdout
    done = memory_cli("fit", "--csv", "two.csv", check=False)
    assert done.returncode == 2 and "the probes of vgg16_frozen ran on several devices" in done.stderr
    # a table without reserved peaks: named, and --targets leaves them out
    table.assign(reserved_peak_bytes=float("nan")).to_csv("unreserved.csv", index=False)
    done = memory_cli("fit", "--csv", "unreserved.csv", check=False)
    assert done.returncode == 2 and "'cnn'" in done.stderr
    assert "reserved_peak_bytes='nan' is invalid: 12 row(s)" in done.stderr
    memory_cli("fit", "--csv", "unreserved.csv", "--targets", "model_load", "--out", "u.json")
    [only] = load_models("u.json").values()
    assert sorted(only.targets) == ["iteration_peak_bytes", "model_load_bytes"]
    done = memory_cli("fit", "--csv", "two.csv", "--model", "nope", check=False)
    assert (
        done.returncode == 2
        and "--model='nope' is invalid: a model the probes are of: cnn, vgg16_frozen" in done.stderr
    )


GPU_DATA = REPO / "analysis" / "data"


@pytest.mark.parametrize("outcomes", ["gpu_oom_h100.json", "gpu_oom_h200.json"])
@pytest.mark.slow
def test_largest_pass_predicted_from_the_h100_probes_ran_and_is_tight(tmp_path: Path, outcomes: str) -> None:
    """``dpsweep-memory predict`` on a fit of the committed H100 probes, for the configs that
    benchmarks/oom_check.py ran on an H100 and on an H200 (analysis/data/gpu_oom_*.json: which exact
    passes ran and which ran out of CUDA memory). The largest pass predicted must not be one that ran
    out, and must be within 2% of the largest that ran. Planning with the reserved peak (VGG16: 18%
    short) or without the allocator's headroom (cnn: a pass that ran out) fails this."""
    measured = json.loads((GPU_DATA / outcomes).read_text())
    model = tmp_path / "gpu_model.json"
    memory_cli("fit", "--csv", str(GPU_DATA / "gpu_probes_h100.csv"), "--out", str(model))
    for case in measured["cases"]:
        tried = {int(b): outcome for b, outcome in case["tried"].items()}
        ran = max(b for b, outcome in tried.items() if outcome == "ok")
        first_oom = min(b for b, outcome in tried.items() if outcome == "oom")
        assert ran < first_oom, case
        [row] = predict_json("--memory-model", str(model), "--backend", "cuda",
                             "--gpu-memory", f"{measured['planning_bytes']}B", *case["overrides"])  # fmt: skip
        predicted = int(row["largest_physical_batch_size"])  # type: ignore[call-overload]
        assert row["headroom"] == pytest.approx(0.02)
        assert predicted < first_oom, (case["case"], predicted, tried)
        assert predicted >= 0.98 * ran, (case["case"], predicted, tried)
