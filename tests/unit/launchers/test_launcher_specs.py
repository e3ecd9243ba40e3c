"""A launcher is a class, a spec and a yaml (issue 57): each ``conf/launcher/*.yaml`` names a registered spec
and selects a Hydra plugin class that carries it, and the checks and the sweepers ask the spec (a toy
launcher's, registered here alone, is asked as the shipped ones are), never the launcher's name."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from helpers import REPO, Composer
from hydra import compose, initialize_config_module
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.utils import get_class

from dpsweep.cli.early import composed_and_checked
from dpsweep.cli.memory import probe_overrides
from dpsweep.config import Config, ConfigError, to_config, validate
from dpsweep.config.launcher import LAUNCHERS, LauncherSpec
from dpsweep.errors import InputError
from dpsweep.launchers.base import DpsweepLauncher
from dpsweep.launchers.preflight import Refused, check_launcher, check_rank_shapes, job_backend
from dpsweep.launchers.session import SweepSession

YAMLS = sorted((REPO / "conf" / "launcher").glob("*.yaml"))
# where a launcher's name may be compared: its spec's registry, and the plugin classes that carry the specs
OWNERS = ("dpsweep/config/launcher.py", "launchers/hydra_launchers.py", "launchers/sge/", "launchers/hydra_plugins/")
# a scheduler's launcher of the tests' own: its submit tool is on no PATH, its ranks are its job's tasks
TOY = LauncherSpec(
    "toy", processes=True, ranks=True, scheduler="toyq", submit_command="dpsweep-test-no-such-submit", rank_tasks=True,
    title="Toy Queue",
)  # fmt: skip
QUIET = LauncherSpec("quiet")  # a launcher that runs its jobs in the sweep's own process


@pytest.fixture()
def toys(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``toy`` and ``quiet`` registered for the test alone."""
    for spec in (TOY, QUIET):
        monkeypatch.setitem(LAUNCHERS._entries, spec.name, spec)
    yield


def test_every_launcher_yaml_names_its_spec_and_a_plugin_class_that_carries_it() -> None:
    assert {y.stem for y in YAMLS} == set(LAUNCHERS.names())
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        for yaml in YAMLS:
            cfg = compose("config", overrides=[f"launcher={yaml.stem}"], return_hydra_config=True)
            assert cfg.launcher.name == yaml.stem, yaml
            plugin = get_class(cfg.hydra.launcher._target_)
            assert issubclass(plugin, DpsweepLauncher), (yaml.name, plugin)
            assert getattr(plugin, "spec", None) is LAUNCHERS.get(yaml.stem), (yaml.name, plugin)


def launcher_literals(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each launcher name compared (``==``, ``!=``, ``in``: alone or in a collection), or
    kept in a module-level table (a tuple, list, set or dict of names)."""

    def constants(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [n for elt in node.elts for n in constants(elt)]
        if isinstance(node, ast.Dict):
            return [n for key in node.keys if key is not None for n in constants(key)]
        return []

    found = [
        (node.lineno, name)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        for operand in [node.left, *node.comparators]
        for name in constants(operand)
    ]
    for node in getattr(tree, "body", []):
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if value is not None and not isinstance(value, ast.Constant):
            found += [(node.lineno, name) for name in constants(value)]
    return [(line, name) for line, name in found if name in names]


def test_no_launcher_name_is_compared_outside_its_spec_and_plugin_classes() -> None:
    names = set(LAUNCHERS.names())
    outside = []
    for root in ("dpsweep", "launchers", "analysis"):
        for path in sorted((REPO / root).rglob("*.py")):
            where = str(path.relative_to(REPO))
            if not where.startswith(OWNERS):
                found = launcher_literals(ast.parse(path.read_text()), names)
                outside += [f"{where}:{line}: {name!r}" for line, name in found]
    assert not outside, "ask the launcher's spec (dpsweep.config.launcher.spec) instead:\n" + "\n".join(outside)


def typed(make_cfg: Composer, *overrides: str) -> Config:
    return to_config(make_cfg(*overrides))


def test_an_unknown_launcher_is_refused_with_the_registered_ones(make_cfg: Composer) -> None:
    with pytest.raises(InputError, match="launcher='nope' is invalid: unknown launcher 'nope'; valid: inline, local"):
        validate(typed(make_cfg, "launcher.name=nope"))


@pytest.mark.usefixtures("toys")
def test_the_checks_ask_a_toy_launchers_spec(make_cfg: Composer) -> None:
    toy = typed(make_cfg, "launcher.name=toy", "launcher.gpus_per_job=1")
    validate(toy)  # registered: a launcher as any other
    with pytest.raises(Refused, match="launcher=toy needs 'dpsweep-test-no-such-submit' on PATH"):
        check_launcher(toy.launcher)
    wide = typed(make_cfg, "launcher.name=toy", "train.devices=2")
    with pytest.raises(Refused, match=r"train.devices=1,2 is invalid: one value in a sweep on Toy Queue"):
        check_rank_shapes([toy, wide])
    assert job_backend(toy) == "cuda"  # its jobs get the GPU it asks for on its scheduler's hosts, whatever is here
    # trials share a device only where each is a process of its own
    quiet_k = r"launcher\.trials_per_device='2' is invalid: 1 with launcher=quiet .*launcher=local, sge, slurm or toy"
    with pytest.raises(ConfigError, match=quiet_k):
        validate(typed(make_cfg, "launcher.name=quiet", "launcher.trials_per_device=2"))
    validate(typed(make_cfg, "launcher.name=toy", "launcher.trials_per_device=2"))
    assert SweepSession(typed(make_cfg, "launcher.name=quiet"), "s").inline
    assert not SweepSession(toy, "s").inline


@pytest.mark.usefixtures("toys")
def test_a_toy_schedulers_launcher_takes_sweeps_and_probes() -> None:
    with pytest.raises(ConfigError, match=r"a scheduler takes sweeps: add -m .*launcher=toy"):
        composed_and_checked(["launcher.name=toy"])
    probe = probe_overrides(["launcher=toy"])
    assert "launcher.gpus_per_job=1" in probe  # probes of its hosts' GPUs, whatever this machine has
    assert not any(o.startswith("launcher.max_parallel=") for o in probe)  # not this machine's cores
    with pytest.raises(InputError, match="launcher='quiet' is invalid: one of local, sge, slurm, toy"):
        probe_overrides(["launcher=quiet"])


class ToyLauncher(DpsweepLauncher):
    spec = TOY

    def setup(self, **kwargs: Any) -> None:
        pass

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        return []


class ForeignLauncher(Launcher):  # a Hydra launcher of another project (hydra/launcher=joblib)
    def setup(self, **kwargs: Any) -> None:
        pass

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        return []


def test_the_sweepers_tell_a_dpsweep_launcher_of_each_job_and_a_foreign_one_nothing(make_cfg: Composer) -> None:
    session = SweepSession(typed(make_cfg, "launcher=local"), "s")
    toy, foreign = ToyLauncher(), ForeignLauncher()
    progress = session.progress(toy, 3)
    assert toy.on_job_done == progress.job_done
    assert (toy.trials_per_device, ToyLauncher.on_job_done) == (1, None)  # the base class's defaults
    toy.take_ranks(None)  # a launcher whose jobs' shape does not depend on the ranks takes them as nothing
    session.progress(foreign, 3)
    assert not hasattr(foreign, "on_job_done")
