"""dpsweep.launchers.composed: an inline job's config, served from the sweeper's composition, is the
config a fresh composition of the launcher's overrides gives, hydra node included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

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
