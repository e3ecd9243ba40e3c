"""dpsweep.launchers.composed: a job's config built from a shared composition of its config groups,
and an inline job's config served from the sweeper's composition, are the configs a fresh composition
of the same overrides gives, hydra node included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from dpsweep.launchers.composed import ComposedJobs
from dpsweep.launchers.overrides import string_override

PARENT = string_override("sweep.parent_run_id", "0123456789abcdef0123456789abcdef")
JOBS = [
    ["train.seed=1", string_override("sweep.id", "20261125-1")],
    ["experiment=demo", "dp.noise_multiplier=0.8", "+dp.target_epsilon=3", string_override("sweep.id", "x y")],
    ["dataset=digits", "model=mlp", "dataset.image_size=null", "++train.checkpoint_dir=/tmp/ckpt"],
]


@pytest.fixture
def loader_and_master() -> Iterator[tuple[ComposedJobs, DictConfig]]:
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration("config", ["hydra.job.chdir=false"], RunMode.MULTIRUN)
        yield ComposedJobs(loader), master


def everything(cfg: DictConfig) -> dict[str, object]:
    container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    return container


@pytest.mark.parametrize("job", JOBS, ids=["seed", "experiment", "groups"])
def test_a_served_config_is_a_fresh_composition(
    loader_and_master: tuple[ComposedJobs, DictConfig], job: list[str]
) -> None:
    composer, master = loader_and_master
    checked = composer.compose(master, job)
    assert "hydra" not in checked and "hydra" in composer.kept[tuple(job)]
    served = composer.load_sweep_config(master, [*job, PARENT])
    assert composer.served == 1
    fresh = composer.loader.load_sweep_config(master, [*job, PARENT])
    assert everything(served) == everything(fresh)
    assert served.sweep.parent_run_id == "0123456789abcdef0123456789abcdef"
    assert list(served.hydra.overrides.task)[-1] == PARENT
    # a copy each time: what a job does to its config leaves the kept one as it was
    served.train.epochs = 99
    again = composer.load_sweep_config(master, [*job, PARENT])
    assert everything(again) == everything(fresh) and composer.served == 2


def test_a_group_or_an_unknown_job_is_composed_afresh(loader_and_master: tuple[ComposedJobs, DictConfig]) -> None:
    composer, master = loader_and_master
    composer.compose(master, JOBS[0])
    for overrides in ([*JOBS[0], "model=mlp"], [*JOBS[0], "hydra.job.chdir=true"], ["train.seed=7"]):
        got = composer.load_sweep_config(master, overrides)
        assert everything(got) == everything(composer.loader.load_sweep_config(master, overrides))
    assert composer.served == 0


def test_a_composer_that_keeps_nothing_serves_nothing(loader_and_master: tuple[ComposedJobs, DictConfig]) -> None:
    loader, master = loader_and_master
    composer = ComposedJobs(loader.loader, keep=False)  # submitit launchers compose in their own processes
    composer.compose(master, JOBS[0])
    composer.load_sweep_config(master, [*JOBS[0], PARENT])
    assert composer.kept == {} and composer.served == 0


GRID = [  # a sweep over values and one group, values given before the group, added and forced
    [*values, group, string_override("sweep.id", "s1")]
    for group in ("model=cnn", "model=mlp")
    for values in (["train.seed=0", "dp.noise_multiplier=0.8"], ["train.seed=1", "++train.checkpoint_dir=/tmp/c"],
                   ["train.seed=2", "+dp.target_epsilon=3", "train={epochs:3}"])
]  # fmt: skip


def test_jobs_that_differ_in_values_share_one_composition(
    loader_and_master: tuple[ComposedJobs, DictConfig],
) -> None:
    composer, master = loader_and_master
    for job in GRID:
        composed = composer.compose(master, job)
        fresh = composer.loader.load_sweep_config(master, job)
        assert everything(composer.kept[tuple(job)]) == everything(fresh), job
        assert "hydra" not in composed
    assert composer.composed == 2 and set(composer.skeletons) == {("model=cnn",), ("model=mlp",)}
    first, last = composer.kept[tuple(GRID[0])], composer.kept[tuple(GRID[-1])]
    assert (first.train.seed, first.dp.noise_multiplier, first.model.name) == (0, 0.8, "cnn")
    assert (last.train.seed, last.train.epochs, last.dp.target_epsilon, last.model.name) == (2, 3, 3, "mlp")
    assert composer.kept[tuple(GRID[1])].train.checkpoint_dir == "/tmp/c"
    assert list(last.hydra.overrides.task) == GRID[-1]
    # a copy each: one job's changes leave the skeleton and the other jobs as they were
    first.train.epochs = 99
    again = composer.compose(master, GRID[1])  # the same skeleton as the first job's
    assert everything(again) == everything(_without_hydra(composer.loader.load_sweep_config(master, GRID[1])))


def test_a_composer_that_keeps_nothing_gives_each_job_a_fresh_compositions_config(
    loader_and_master: tuple[ComposedJobs, DictConfig],
) -> None:
    """keep=False (the submitit launchers, dpsweep-plan) copies skeletons without their hydra node."""
    loader, master = loader_and_master
    composer = ComposedJobs(loader.loader, keep=False)
    for job in GRID:
        composed = composer.compose(master, job)
        assert everything(composed) == everything(_without_hydra(composer.loader.load_sweep_config(master, job))), job
        composed.train.epochs = 99  # its own copy: the next job of its skeleton is unaffected
    assert composer.composed == 2 and set(composer.bare_skeletons) == {("model=cnn",), ("model=mlp",)}
    assert "hydra" in composer.skeletons[("model=cnn",)]


def test_a_hydra_override_or_a_bad_value_is_composed_afresh(
    loader_and_master: tuple[ComposedJobs, DictConfig],
) -> None:
    composer, master = loader_and_master
    job = ["train.seed=3", "hydra.job.chdir=true"]
    assert everything(composer.compose(master, job)) == everything(
        _without_hydra(composer.loader.load_sweep_config(master, job))
    )
    assert composer.skeletons == {} and composer.composed == 1
    for bad in ("train.no_such_key=1", "~train.seed"):  # unknown; deleting from a structured config
        with pytest.raises(Exception, match=bad) as from_skeleton:
            composer.compose(master, ["train.seed=4", bad])
        with pytest.raises(Exception, match=bad) as fresh:
            composer.loader.load_sweep_config(master, ["train.seed=4", bad])
        assert type(from_skeleton.value) is type(fresh.value) and str(from_skeleton.value) == str(fresh.value)


def _without_hydra(cfg: DictConfig) -> DictConfig:
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


TYPED_GRID = [  # plain leaves of every type (typed from the skeleton's typed config), then lines that are not
    ["train.seed=3", "dp.noise_multiplier=1.2", "optimizer.lr=0.05", string_override("sweep.id", "a b")],
    ["model=mlp", "dp.grad_sample_mode=ghost", "train.progress=false", "dataset.image_size=null"],
    ["experiment=demo", "tracking.run_name=abc", "train.epochs=2", "launcher.max_parallel=3"],
    ["train.seed=3", "+dp.target_epsilon=3"],  # an added key
    ["train={epochs:3}", "train.seed=4"],  # a dict value
    ["train.seed=${train.epochs}"],  # an interpolation
]
PLAIN = 3  # the first three


def _typed_fresh(composer: ComposedJobs, master: DictConfig, job: list[str]) -> object:
    from dpsweep.config import to_config

    return to_config(_without_hydra(composer.loader.load_sweep_config(master, job)))


def test_a_typed_config_is_that_of_a_fresh_composition(loader_and_master: tuple[ComposedJobs, DictConfig]) -> None:
    keeping, master = loader_and_master
    composer = ComposedJobs(keeping.loader, keep=False)  # as dpsweep-plan and a submitit launcher's sweep type
    for job in TYPED_GRID:
        typed = composer.typed(master, job)
        assert typed == _typed_fresh(composer, master, job), job
    assert composer.typed_from_leaves == PLAIN
    first, second = composer.typed(master, TYPED_GRID[0]), composer.typed(master, TYPED_GRID[1])
    assert (first.train.seed, first.dp.noise_multiplier, first.sweep.id) == (3, 1.2, "a b")
    assert second.dp.grad_sample_mode.value == "ghost" and second.dataset.image_size is None
    assert second.model.name == "mlp" and second.train.progress is False
    # jobs share the skeleton's untouched parts, never a changed one
    again = composer.typed(master, ["train.seed=5", string_override("sweep.id", "a b")])
    assert again.train.seed == 5 and first.train.seed == 3 and again.model is first.model
    # a composer that keeps each job's config (the inline launcher's) composes it, and keeps it to serve
    assert keeping.typed(master, TYPED_GRID[0]) == first
    assert keeping.typed_from_leaves == 0 and tuple(TYPED_GRID[0]) in keeping.kept


def test_a_leaf_that_an_interpolation_reads_is_typed_from_its_composition(
    loader_and_master: tuple[ComposedJobs, DictConfig],
) -> None:
    from dpsweep.launchers.composed import _interpolations

    cfg = OmegaConf.create({"a": {"b": "${train.seed}", "c": 1}, "d": [1, "${oc.env:HOME}"], "e": "x"})
    assert list(_interpolations(cfg)) == ["${train.seed}", "${oc.env:HOME}"]
    keeping, master = loader_and_master
    composer = ComposedJobs(keeping.loader, keep=False)
    composer.typed(master, ["train.epochs=2"])
    composer.typed_skeletons[()][1].append("${train.seed}")  # as if the config read train.seed
    job = ["train.seed=9", "optimizer.lr=0.3"]
    assert composer.typed(master, job) == _typed_fresh(composer, master, job)
    assert composer.typed_from_leaves == 1 and composer.leaves[((), "train.seed=9")] is None
    assert composer.leaves[((), "optimizer.lr=0.3")] is not None  # no interpolation reads optimizer.*
    composer.typed(master, ["train.epochs=3"])  # a key beside the one read, in its section: composed, to be safe
    assert composer.typed_from_leaves == 1 and composer.leaves[((), "train.epochs=3")] is None
