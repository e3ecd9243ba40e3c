"""Regressions of the red team's input and privacy-hygiene findings (issue 13): non-finite numbers,
negative ε, keys the schema lacks, a DP probe's loss, corrupt checkpoints, and ids that Hydra would
read as numbers (issue 14)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import Composer, run_dpsweep, runs_of
from hydra.core.override_parser.overrides_parser import OverridesParser
from mlflow.tracking import MlflowClient
from opacus.accountants.analysis import rdp as opacus_rdp

from dpsweep.config import ConfigError, to_config, validate
from dpsweep.data.facts import DatasetFacts
from dpsweep.launchers.overrides import new_sweep_id, string_override
from dpsweep.plan import prepare
from dpsweep.privacy import ledger, rdp
from dpsweep.privacy.schedule import epsilon, poisson_schedule
from dpsweep.run.runner import train

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optimizer.lr=inf", "optimizer.lr"),
        ("dp.max_grad_norm=inf", "dp.max_grad_norm"),
        ("dp.noise_multiplier=inf", "dp.noise_multiplier"),
        ("dp.noise_multiplier=nan", "dp.noise_multiplier"),
        ("dp.target_epsilon=inf", "dp.target_epsilon"),
        ("dp.target_epsilon=nan", "dp.target_epsilon"),
        ("dp.delta=nan", "dp.delta"),
        ("sweep.max_epsilon=inf", "sweep.max_epsilon"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay"),
    ],
)
def test_non_finite_numbers_are_refused_before_any_work(make_cfg: Composer, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(to_config(make_cfg(override)))
    assert info.value.key == key and "finite" in str(info.value)


def test_momentum_is_below_one(make_cfg: Composer) -> None:
    with pytest.raises(ConfigError, match=r"optimizer.momentum=1.0 is invalid: a momentum in \[0, 1\)"):
        validate(to_config(make_cfg("optimizer.momentum=1.0")))


def test_a_key_the_schema_lacks_is_refused_however_it_arrives(make_cfg: Composer) -> None:
    with pytest.raises(ConfigError) as info:
        to_config(make_cfg("+train.bach_size=32"))
    assert info.value.key == "train.bach_size" and "did you mean train.batch_size" in str(info.value)


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [("+train.bach_size=32", "train.bach_size", 32), ("+dataset.extra.deep=1", "dataset.extra.deep", 1),
     ("+seed=3", "seed", 3), ("+dp.clip={a: 2}", "dp.clip.a", 2)],
)  # fmt: skip
def test_an_unknown_key_is_named_with_its_first_value(make_cfg: Composer, override: str, key: str, value: int) -> None:
    with pytest.raises(ConfigError) as info:
        to_config(make_cfg(override))
    assert (info.value.key, info.value.value) == (key, value)


def test_every_key_of_the_composed_config_is_known(make_cfg: Composer) -> None:
    # the defaults and an experiment file: nothing refused (the check compares names only)
    for overrides in [(), ("experiment=demo",), ("task=gan", "dataset=digits"), ("model=vgg16_frozen",)]:
        to_config(make_cfg(*overrides))


def test_epsilon_is_never_negative_even_where_the_conversion_says_so() -> None:
    schedule = poisson_schedule(1437, 64)
    orders = rdp.OPACUS_ORDERS
    curve = 10 * rdp.subsampled_gaussian(schedule.sample_rate, 1.0, orders)
    raw, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=curve, delta=0.5)
    assert raw < 0  # what Opacus's conversion gives for δ = 0.5: no guarantee can be negative
    assert epsilon(schedule, 1.0, 0.5, steps=10).epsilon == 0.0
    assert ledger.sound_epsilon(math.nan) == math.inf and ledger.sound_epsilon(-0.6) == 0.0


def test_large_delta_plans_a_sound_epsilon_and_an_untrustworthy_one_is_over_budget(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dp.delta=0.5", "dp.allow_large_delta=true", "sweep.max_epsilon=1"))
    plan = prepare(cfg, DIGITS)
    assert plan.privacy is not None and plan.privacy.epsilon == 0.0 and plan.over_budget is None
    tight = to_config(make_cfg("dp.noise_multiplier=0.3", "sweep.max_epsilon=1"))
    assert prepare(tight, DIGITS).over_budget is not None


@pytest.mark.parametrize("sweep_id", ["1e5", "123", "nan", "inf", "3804437e6765", "0x1f"])
def test_ids_survive_hydras_override_grammar(sweep_id: str) -> None:
    [parsed] = OverridesParser.create().parse_overrides([string_override("sweep.id", sweep_id)])
    assert parsed.value() == sweep_id and isinstance(parsed.value(), str)
    assert new_sweep_id()[0].isalpha() and len(new_sweep_id()) == 12


def test_a_quoted_id_reaches_the_config_as_written(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg(string_override("sweep.id", "3804437e6765")))
    assert cfg.sweep.id == "3804437e6765"


def test_a_dp_probe_releases_no_unnoised_loss(make_cfg: Composer, client: MlflowClient, experiment_name: str) -> None:
    train(make_cfg("train.probe=true", "train.batch_size=16"))
    train(make_cfg("train.probe=true", "train.batch_size=16", "dp=off"))
    metrics = {r.data.params["dp.enabled"]: r.data.metrics for r in runs_of(client, experiment_name)}
    assert "probe.loss" not in metrics["True"] and "system/memory/backward_mib" in metrics["True"]
    assert "probe.loss" in metrics["False"]


def test_a_corrupt_checkpoint_is_set_aside_and_the_run_starts_afresh(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    result = train(make_cfg(f"train.checkpoint_dir={ckpt}", "train.epochs=1"))
    [run] = runs_of(client, experiment_name)
    assert run.info.status == "FINISHED" and result.steps > 0
    aside = Path(run.data.tags["checkpoint.set_aside"])
    assert aside.parent == ckpt and aside.name.startswith("checkpoint.pt.corrupt-") and aside.exists()
    assert aside.read_bytes() == b"PK\x03\x04 truncated"


def test_a_store_that_is_not_a_database_is_bad_input_and_left_untouched(make_cfg: Composer, tmp_path: Path) -> None:
    db = tmp_path / "notes.db"
    db.write_text("not a database")
    with pytest.raises(ConfigError) as info:
        train(make_cfg(f"tracking.uri=sqlite:///{db}"))
    assert info.value.key == "tracking.uri" and "is not one" in str(info.value)
    assert db.read_text() == "not a database"


def test_a_digits_split_too_small_for_the_classes_names_the_key(make_cfg: Composer) -> None:
    from dpsweep.data import loaders

    with pytest.raises(ConfigError, match=r"dataset.test_fraction=0.001 is invalid: a share leaving each of the 10"):
        loaders.build(to_config(make_cfg("dataset.test_fraction=0.001")).dataset)


def test_a_corrupt_weights_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpsweep.models.classifiers import PretrainedWeightsError, _vgg16

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    weights = tmp_path / "hub" / "checkpoints" / "vgg16-397923af.pth"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"truncated download")
    with pytest.raises(PretrainedWeightsError) as info:
        _vgg16(pretrained=True)
    assert info.value.key == "model.pretrained" and str(weights) in str(info.value)


def test_memory_fit_on_a_table_that_is_not_csv_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpsweep.cli.memory import main

    bad = tmp_path / "probes.csv"
    bad.write_bytes(b'\x00\xff\xfe binary, "unterminated\nquote')
    assert main(["fit", "--csv", str(bad), "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpsweep-memory: error: --csv=") and str(bad) in err


def test_a_resume_under_another_experiment_name_is_refused(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    import torch

    from dpsweep.plan import config_hash
    from dpsweep.run import checkpoint

    ckpt = tmp_path / "ckpt"
    first = to_config(make_cfg(f"train.checkpoint_dir={ckpt}"))
    run_id = client.create_run(client.create_experiment(experiment_name)).info.run_id  # interrupted, in A
    state = checkpoint.TrainingState(config_hash(first), run_id, epoch=1, steps=22)
    model = torch.nn.Linear(1, 1)
    checkpoint.save(ckpt, state, model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    moved = make_cfg(f"train.checkpoint_dir={ckpt}", f"tracking.experiment_name={experiment_name}-B")
    with pytest.raises(ConfigError) as info:
        train(moved)
    assert info.value.key == "tracking.experiment_name" and f"{experiment_name!r}" in str(info.value)
    assert client.get_experiment_by_name(f"{experiment_name}-B") is None or not runs_of(client, f"{experiment_name}-B")
    assert client.get_run(run_id).info.status == "RUNNING"  # untouched: nothing was resumed into B


def test_an_output_directory_hydra_cannot_create_is_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra makes the job's directory before dpsweep runs; where it cannot (a read-only working
    directory, or, as here, a file in the way, which stops root too), exit 2 naming the key, not a
    traceback, and nothing is started."""
    from dpsweep.cli.train import unwritable_output

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    for args, key, value in (
        (["hydra.run.dir=afile/out"], "hydra.run.dir", "afile/out"),
        (["-m", "hydra.sweep.dir=afile/sweep", "dp.noise_multiplier=1,2"], "hydra.sweep.dir", "afile/sweep"),
    ):
        done = run_dpsweep(*args, "train.epochs=1")
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"dpsweep: error: {key}={value!r} is invalid: a directory dpsweep can create and write" in done.stderr
        assert "Not a directory" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no store, no outputs
    assert unwritable_output([], cwd=tmp_path) is None  # a writable working directory is fine
    assert unwritable_output(["hydra.run.dir=new/deeper"], cwd=tmp_path) is None  # created by Hydra
