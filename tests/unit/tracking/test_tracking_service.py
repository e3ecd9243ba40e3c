"""The tracking process (dpsweep.tracking.channel): MLflow in a child process that runs log through,
against a real sqlite store; and a run's process, which never imports MLflow."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import runs_of
from mlflow.tracking import MlflowClient
from opacus import PrivacyEngine

from dpsweep.config import ConfigError, TrackingConfig
from dpsweep.models.classifiers import OpacusCNN, released_copy
from dpsweep.tracking import Claim, Claimed, tracked_run
from dpsweep.tracking import channel as tracking_service
from dpsweep.tracking.channel import Child, TrackingError


@pytest.fixture(scope="module")
def child() -> Iterator[Child]:
    """One tracking process for the module's tests (it imports MLflow once: about 2 s)."""
    process = Child()
    yield process
    process.close()


@pytest.fixture()
def in_child(child: Child, monkeypatch: pytest.MonkeyPatch) -> Child:
    """dpsweep.tracking logs through ``child`` (the test session otherwise runs the ops in process)."""
    monkeypatch.setattr(tracking_service, "_SERVICE", child)
    return child


@pytest.mark.slow
def test_a_call_answers_plain_data_and_posts_run_in_order(mlflow_uri: str, experiment_name: str, child: Child) -> None:
    child.call("ensure_experiments", {(mlflow_uri, experiment_name)})
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    run_id = child.call("begin_run", tracking, {"config.hash": "abc"}, None, None, "host:1:2")
    for step in range(20):  # posted: not waited for, stored in the order sent
        child.post("log_metrics", mlflow_uri, run_id, {"m": float(step)}, step, 1000 + step)
    child.flush()
    history = MlflowClient(mlflow_uri).get_metric_history(run_id, "m")
    assert [(h.step, h.value) for h in history] == [(s, float(s)) for s in range(20)]
    child.call("end_run", mlflow_uri, run_id, "FINISHED")
    assert child.call("runs_by_hash", mlflow_uri, experiment_name, "FINISHED") == {"abc": run_id}
    assert type(child.call("runs_of_sweep", mlflow_uri, experiment_name, "none")) is dict


def test_a_failed_post_raises_at_the_next_flush_with_the_childs_traceback(mlflow_uri: str, child: Child) -> None:
    child.post("set_tags", mlflow_uri, "0" * 32, {"k": "v"})  # no such run
    with pytest.raises(TrackingError, match=r"(?s)mlflow.*Traceback.*set_tags"):
        child.flush()
    child.flush()  # reported once


def test_dpsweeps_own_errors_cross_as_themselves(
    tmp_path: Path, mlflow_uri: str, experiment_name: str, child: Child
) -> None:
    not_a_db = tmp_path / "notes.db"
    not_a_db.write_text("not a database")
    with pytest.raises(ConfigError, match=r"tracking\.uri=.*notes\.db.*is not one") as bad:
        child.call("open_store", f"sqlite:///{not_a_db}")
    assert bad.value.key == "tracking.uri"
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    held = child.call("begin_run", tracking, {"config.hash": "h1"}, None, Claim("h1"), "host:1:2")
    child.call("end_run", mlflow_uri, held, "FINISHED")
    with pytest.raises(Claimed) as claimed:
        child.call("begin_run", tracking, {"config.hash": "h1"}, None, Claim("h1"), "host:1:2")
    assert (claimed.value.run_id, claimed.value.status) == (held, "FINISHED")


def test_tracked_run_through_the_child_stores_everything_before_it_ends(
    in_child: Child, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    with tracked_run(TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name), tags={"k": 1}) as run:
        run.log_params({f"p{i}": i for i in range(150)})
        for step in range(1, 4):
            run.log_metrics({"acc": step / 4}, step=step)
        run.log_text("a: 1\n", "config.yaml")
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FINISHED" and len(r.data.params) == 150 and r.data.tags["k"] == "1"
    assert [m.value for m in client.get_metric_history(r.info.run_id, "acc")] == [0.25, 0.5, 0.75]
    assert [a.path for a in client.list_artifacts(r.info.run_id)] == ["config.yaml"]


def test_a_logging_call_that_failed_ends_the_run_failed(
    in_child: Child, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """MLflow refuses to change a logged param: the post fails in the child, and the run, which would
    otherwise have ended FINISHED with a record it did not write, ends FAILED with that error."""
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    with pytest.raises(TrackingError, match="Changing param values is not allowed"), tracked_run(tracking) as run:
        run.log_params({"lr": 0.1})
        run.log_params({"lr": 0.2})
        run.log_metrics({"after": 1.0})
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FAILED" and r.data.params["lr"] == "0.1"
    assert "Changing param values" in r.data.tags["error"] and r.data.tags["failure.kind"] == "exception"
    assert r.data.metrics["after"] == 1.0  # posts after the failed one still ran


def test_an_interrupted_run_still_ends_killed_through_a_child_that_ignores_sigint(
    in_child: Child, mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """A Ctrl-C reaches the whole process group: the child must outlive it to write KILLED."""
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    with pytest.raises(KeyboardInterrupt), tracked_run(tracking) as run:
        run.log_metrics({"acc": 0.5}, step=1)
        os.kill(in_child.process.pid, signal.SIGINT)
        os.kill(in_child.process.pid, signal.SIGTERM)
        raise KeyboardInterrupt
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "KILLED" and r.data.metrics["acc"] == 0.5
    assert in_child.process.poll() is None


@pytest.fixture()
def own_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """service() starts children here, as in a run's process (the test session serves in process)."""
    monkeypatch.setattr(tracking_service, "_IN_PROCESS", False)
    monkeypatch.setattr(tracking_service, "_SERVICE", None)
    monkeypatch.setattr(tracking_service, "_RESTARTS", 0)


@pytest.mark.slow
def test_a_dead_child_is_reported_and_replaced(
    own_children: None, mlflow_uri: str, capfd: pytest.CaptureFixture[str]
) -> None:
    first = tracking_service.service()
    assert isinstance(first, Child)
    first.call("open_store", mlflow_uri)
    first.process.kill()
    first.call("open_store", mlflow_uri)  # made again by a new child
    second = tracking_service.service()
    assert isinstance(second, Child) and second is not first
    assert f"pid {first.process.pid}) ended with exit code -9; started another (pid {second.process.pid})" in (
        capfd.readouterr().err
    )
    second.close()
    assert second.process.returncode is not None


@pytest.mark.slow
def test_posts_a_killed_child_had_not_run_are_sent_again_and_the_run_ends_finished_with_all(
    own_children: None, mlflow_uri: str, experiment_name: str, client: MlflowClient, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 39, item 2: the child stopped, then killed, with metrics, params and tags queued (more
    posts than CONFIRM_EVERY: the confirmation they ask for is never answered)."""
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    with tracked_run(tracking) as run:
        run.log_metrics({"acc": 0.001}, step=1)
        run.flush()
        first = tracking_service.service()
        assert isinstance(first, Child)
        os.kill(first.process.pid, signal.SIGSTOP)
        for step in range(2, 100):
            run.log_metrics({"acc": step / 1000}, step=step)
        run.log_params({"p": 1})
        run.set_tags({"t": "x"})
        os.kill(first.process.pid, signal.SIGKILL)
        run.log_metrics({"acc": 0.1}, step=100)  # sent to the dead child, or to the next one
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FINISHED" and r.data.params["p"] == "1" and r.data.tags["t"] == "x"
    history = client.get_metric_history(r.info.run_id, "acc")
    assert [(h.step, h.value) for h in history] == [(s, s / 1000) for s in range(1, 101)]  # each once
    assert f"pid {first.process.pid}) ended with exit code -9; started another" in capfd.readouterr().err


@pytest.mark.slow
def test_kept_posts_are_forgotten_once_confirmed_and_a_metrics_start_until_its_stop(
    own_children: None, mlflow_uri: str, experiment_name: str
) -> None:
    child = tracking_service.service()
    assert isinstance(child, Child)
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    run_id = child.call("begin_run", tracking, {}, None, None, "host:1:2")
    child.post("start_system_metrics", run_id, mlflow_uri, 3600.0, 10.0)
    for step in range(3 * tracking_service.CONFIRM_EVERY):
        child.post("log_metrics", mlflow_uri, run_id, {"m": 1.0}, step, 1000)
    child.flush()
    assert [op for _, op, _ in child._kept] == ["start_system_metrics"]
    child.post("stop_system_metrics", run_id)
    child.flush()
    assert child._kept == []
    child.close()


@pytest.mark.slow
@pytest.mark.parametrize("seen_dead", [False, True], ids=["dies_after_the_send", "dead_before_the_send"])
def test_a_run_is_not_begun_twice_and_the_service_gives_up_after_its_restart_limit(
    own_children: None, monkeypatch: pytest.MonkeyPatch, mlflow_uri: str, experiment_name: str, seen_dead: bool
) -> None:
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    monkeypatch.setattr(tracking_service, "RESTART_LIMIT", 1)
    first = tracking_service.service()
    assert isinstance(first, Child)
    first.call("open_store", mlflow_uri)
    os.kill(first.process.pid, signal.SIGSTOP)
    first.post("log_params", mlflow_uri, "0" * 32, {"x": 1})
    os.kill(first.process.pid, signal.SIGKILL)
    if seen_dead:  # the call's send then fails (broken pipe): the same error as a child dying after it
        with first._state:
            assert first._state.wait_for(lambda: first._ended is not None, timeout=30)
    with pytest.raises(TrackingError, match=r"begin_run: the tracking process \(pid \d+\) ended with exit code -9"):
        first.call("begin_run", tracking, {}, None, None, "host:1:2")  # it may have begun it: not again
    second = tracking_service.service()
    assert isinstance(second, Child) and [op for _, op, _ in second._kept] == ["log_params"]
    os.kill(second.process.pid, signal.SIGSTOP)
    os.kill(second.process.pid, signal.SIGKILL)
    lost = r"after 1 restarts\); 1 operation\(s\) it had not confirmed are lost: log_params"
    with pytest.raises(TrackingError, match=lost):
        second.flush()


@pytest.mark.slow
def test_closing_waits_for_what_was_posted(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    process = Child()
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    run_id = process.call("begin_run", tracking, {}, None, None, "host:1:2")
    process.post("log_metrics", mlflow_uri, run_id, {"last": 1.0}, 0, 0)
    process.post("end_run", mlflow_uri, run_id, "FINISHED")
    process.close()  # not killed: the posts were not confirmed yet
    assert process.process.returncode == 0
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["last"] == 1.0


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_released_copy_has_no_opacus_hooks_or_per_sample_state(mode: str) -> None:
    """The model a run logs: trained weights only, loadable without Opacus. (functorch: Opacus sets a
    vmapped closure on each layer, which a run's model could not be pickled with to be logged.)"""
    model = OpacusCNN((1, 28, 28), 10)
    data = torch.utils.data.TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    private, _, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
    )  # fmt: skip
    x, y = next(iter(loader))
    torch.nn.functional.cross_entropy(private(x), y).backward()
    assert any(p.grad_sample is not None for p in model.parameters())  # what a copy would carry along
    if mode == "hooks":
        assert "opacus" in pickle.dumps(model).decode("latin-1")

    released = released_copy(model)
    frozen = pickle.dumps(released).decode("latin-1")
    assert "opacus" not in frozen and "grad_sample" not in frozen
    assert all(not m._forward_hooks and not m._backward_hooks for m in released.modules())
    for mine, theirs in zip(released.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert not released.training
    assert model._forward_hooks or any(m._forward_hooks for m in model.modules())  # the original keeps them


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="sets the process's CPU affinity")
@pytest.mark.parametrize("one_core", [False, True], ids=["cores", "one-core"])
def test_a_run_logs_through_a_tracking_process_only_where_it_has_two_cores(tmp_path: Path, one_core: bool) -> None:
    """The point of the tracking process: a whole run (its model logged) in a process without MLflow,
    whose imports overlap the run's on another core. A process that may run on one core only (as
    ``taskset -c 0``, a one-CPU cluster job) has nothing to overlap: it logs in process, and starts no
    tracking process, whose imports would only add to its CPU time."""
    pin = "os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])\n" if one_core else ""
    script = (
        f"import os, sys\n{pin}"
        "from hydra import compose, initialize_config_module\n"
        "from dpsweep.run.runner import train\n"
        "from dpsweep.tracking import channel\n"
        "with initialize_config_module('dpsweep.conf', version_base='1.3'):\n"
        "    cfg = compose('config', overrides=['train.epochs=1', 'train.progress=false', "
        f"'tracking.uri=sqlite:///{tmp_path}/mlflow.db', 'tracking.experiment_name=solo'])\n"
        "result = train(cfg)\n"
        "heavy = ('mlflow', 'sqlalchemy', 'alembic')\n"
        "imported = sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in heavy})\n"
        "print(result.run_id, type(channel.service()).__name__, ','.join(imported) or '-')\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    run_id, service, imported = done.stdout.split()
    assert (service, imported) == (("InProcess", "alembic,mlflow,sqlalchemy") if one_core else ("Child", "-"))
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["model.logged"] == "true" and "epsilon" in run.data.metrics


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has loaded libtorch (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow  # 13.5 s on an idle 2-core VM: two tracking processes, one of which imports torch
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_the_tracking_process_imports_the_model_flavour_only_for_a_run_that_logs_its_model(
    mlflow_uri: str, experiment_name: str
) -> None:
    """mlflow.pytorch imports torch (and Lightning, torchmetrics and torchvision where installed: 10
    CPU-seconds a process on the H100 machine's image); a packed job's K tracking processes paid it K
    times while their trials started, for runs that log no model."""
    waited: dict[bool, float] = {}
    for log_model in (True, False):
        child = Child()
        try:
            child.call("ensure_experiments", {(mlflow_uri, experiment_name)})
            assert not _maps_torch(child.process.pid)  # the store opened without torch
            tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name, log_model=log_model)
            t0 = time.monotonic()
            child.call("begin_run", tracking, {}, None, None, "host:1:2")
            # the run logging its model: its flavour is imported in the background; the other: still
            # not, twice as long after (plus 2 s) as the first took to import it
            limit = 60.0 if log_model else 2 * waited[True] + 2.0
            while not _maps_torch(child.process.pid) and time.monotonic() - t0 < limit:
                time.sleep(0.1)
            waited[log_model] = time.monotonic() - t0
            assert _maps_torch(child.process.pid) is log_model, f"log_model={log_model} after {waited[log_model]:.1f} s"
        finally:
            child.close()
