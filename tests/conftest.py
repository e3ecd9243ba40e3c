"""Shared fixtures: composed configs and a real MLflow sqlite backend per test session."""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST, REPO, Composer
from hydra import compose, initialize_config_module
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n``, hand out the longest tests first, and keep ``xdist_group`` working.

    Under ``--dist loadgroup`` xdist sends the tests of a group to one worker by suffixing their node
    ids with ``@<group>`` on the workers. pytest-xdist 3.8 sets ``item._nodeid``, which pytest 9 no
    longer reads (a node's id is ``item._id``), so without this the groups are silently ignored:
    module fixtures are trained once per worker, and the scheduler tests run at the same time on
    one 2-slot node."""
    if not getattr(config.option, "loadgroup", False):
        return

    # The longest first (the scheduler hands tests out in this order, with --no-loadscope-reorder):
    # the scheduler tests, which run one after another on one worker; then the slow groups, whose
    # module fixtures train for up to a minute; then the other slow tests; the quick ones fill in.
    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("cluster"):
            return 0
        if item.get_closest_marker("slow"):
            return 1 if item.get_closest_marker("xdist_group") else 2
        return 3

    items.sort(key=rank)
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        suffix = "@" + "_".join(names)
        if not names or item.nodeid.endswith(suffix):
            continue
        if hasattr(item, "_id"):  # pytest >= 9
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
        else:
            item._nodeid = item.nodeid + suffix


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Hide what exists before a test from the garbage collector's object list.

    On CPU a run measures memory with a census of all live tensors (dpsweep.memory.stages.live_tensor_bytes),
    which walks ``gc.get_objects()`` several times per run. In a test process that has imported
    everything and run many tests that is about 1 M objects, twice a fresh process's, and the
    census was most of an in-process run's time. ``gc.freeze()`` moves the objects that exist now
    (none of them the test's own runs' tensors, which are made after it) out of that list; the
    previous test's cyclic garbage is collected first, so that it is freed rather than kept."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _no_tracking_uri_from_earlier_tests() -> None:
    """Each test starts without $MLFLOW_TRACKING_URI. ``mlflow.set_tracking_uri``, which every run in
    this process calls, also sets it, and a command a later test runs as its own process would take
    its default store from there (dpsweep-runs, dpsweep-report): another test's store."""
    os.environ.pop("MLFLOW_TRACKING_URI", None)


@pytest.fixture(scope="session", autouse=True)
def _session_in_tmp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Module and session fixtures (which run before a test's own directory is entered) run from a
    directory of the session's: a run they train puts its artifacts in ./mlruns, which was the
    repository's (2,000 runs had gathered there)."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs from its own directory: relative outputs (./mlruns artifacts of sqlite stores,
    outputs/, multirun/) never land in the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite MLflow store for the session (creating the schema takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture()
def experiment_name(request: pytest.FixtureRequest) -> str:
    """A fresh experiment per test, so each test sees only its own runs."""
    return "test-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)


@pytest.fixture()
def make_cfg(mlflow_uri: str, experiment_name: str) -> Iterator[Composer]:
    """Compose the real config tree with overrides, tracking into this test's experiment."""

    def _compose(*overrides: str, fast: bool = True) -> DictConfig:
        tracking = [f"tracking.uri={mlflow_uri}", f"tracking.experiment_name={experiment_name}"]
        return compose("config", overrides=[*(FAST if fast else []), *tracking, *overrides])

    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        yield _compose


@pytest.fixture()
def client(mlflow_uri: str) -> MlflowClient:
    return MlflowClient(mlflow_uri)


@pytest.fixture()
def repo_root() -> Path:
    return REPO
