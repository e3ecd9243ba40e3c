"""A toy launcher from this test file alone (issue 57, done-when: a launcher is a class, a spec and a yaml): its
spec registered in ``LAUNCHERS``, its class a :class:`dpsweep.launchers.base.DpsweepLauncher` (dpsweep's inline
launcher, extended by subclassing) registered with Hydra's plugins, and its two config nodes
(``hydra/launcher``, the class; ``launcher``, what a user's ``launcher=<name>`` selects, as
``conf/launcher/<name>.yaml`` would) stored in Hydra's ConfigStore, each removed afterwards. A two-job sweep
through it trains both runs in this process, and the toy counts the jobs it launched.

Hydra instantiates a plugin only from a class named under the ``hydra_plugins`` package: ``Plugins._instantiate``
refuses any other ``_target_`` ("not the hydra_plugins package"), looks the name up among the classes registered
with its public ``Plugins.instance().register`` (by ``cls.__module__ + "." + cls.__name__``), then imports the
``_target_`` by its path. So the toy class, defined here (importable as ``toy_launcher``: tests/toys/ is on
sys.path), is named under ``hydra_plugins.dpsweep_test_toy``, and that module name is this module, for this
module's tests (``sys.modules``); no file under ``hydra_plugins`` is needed, and no job unpickles the class (an
inline launcher's jobs run in the sweep's process)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
from helpers import FAST, child_runs, run_dpsweep
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher

from dpsweep.config.launcher import LAUNCHERS, LauncherSpec
from dpsweep.launchers.hydra_launchers import InlineLauncher

NAME = "toy_counting"
SPEC = LauncherSpec(NAME, title="the toy counting launcher")  # its jobs run one after another in the sweep's process
PLUGIN_MODULE = "hydra_plugins.dpsweep_test_toy"  # where Hydra's plugins must be named (module doc)


class CountingLauncher(InlineLauncher):
    """dpsweep's inline launcher (jobs one after another in this process, on Hydra's public ``run_job``),
    extended by subclassing under a spec of its own: each batch of jobs it launched is counted."""

    spec = SPEC
    launched: ClassVar[list[list[int]]] = []  # the job indices of each launch

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        returns = super().launch(job_overrides, initial_job_idx)
        CountingLauncher.launched.append(list(range(initial_job_idx, initial_job_idx + len(job_overrides))))
        return returns


CountingLauncher.__module__ = PLUGIN_MODULE  # the name Hydra's plugins look it up by (module doc)
TARGET = f"{PLUGIN_MODULE}.{CountingLauncher.__name__}"


@pytest.fixture(scope="module")
def toy_launcher() -> Iterator[None]:
    """The toy's spec, plugin class and config nodes, for this module only; each removed afterwards."""
    store, plugins = ConfigStore.instance(), Plugins.instance()
    LAUNCHERS.register(NAME)(SPEC)
    sys.modules[PLUGIN_MODULE] = sys.modules[__name__]  # the _target_'s module (module doc)
    plugins.register(CountingLauncher)
    store.store(group="hydra/launcher", name=NAME, node={"_target_": TARGET}, provider="test_toy_launcher")
    selected = {"defaults": [{"override /hydra/launcher": NAME}], "launcher": {"name": NAME}}  # conf/launcher/*.yaml
    store.store(group="launcher", name=NAME, node=selected, package="_global_", provider="test_toy_launcher")
    yield
    LAUNCHERS._entries.pop(NAME, None)
    sys.modules.pop(PLUGIN_MODULE, None)
    plugins.class_name_to_class.pop(TARGET, None)
    registered = plugins.plugin_type_to_subclass_list[Launcher]
    if CountingLauncher in registered:
        registered.remove(CountingLauncher)
    store.repo["hydra"]["launcher"].pop(f"{NAME}.yaml", None)
    store.repo["launcher"].pop(f"{NAME}.yaml", None)


@pytest.mark.usefixtures("toy_launcher")
def test_a_toy_launcher_registered_from_a_test_runs_a_sweep_end_to_end(tmp_path: Path) -> None:
    CountingLauncher.launched.clear()
    fast = [o for o in FAST if not o.startswith("train.epochs=")]
    done = run_dpsweep("-m", f"launcher={NAME}", "dp.noise_multiplier=1.0,1.5", "train.epochs=1", "model=mlp", *fast)
    assert done.returncode == 0, done.stderr
    assert [i for launch in CountingLauncher.launched for i in launch] == [0, 1]  # the sweep's two jobs: the toy's
    runs = child_runs(tmp_path)
    assert sorted(r.data.params["dp.noise_multiplier"] for r in runs) == ["1.0", "1.5"]
    assert all(r.info.status == "FINISHED" for r in runs), [r.info.status for r in runs]
