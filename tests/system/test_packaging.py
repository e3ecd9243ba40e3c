"""Packaging: launchers/, analysis/ and conf/ install inside the dpsweep namespace only."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO

# What a build needs, copied so that the build writes nothing into the working tree (build/,
# *.egg-info), where a concurrent test or editable install could read half-written files.
IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "mlruns", "outputs", "multirun",
    "cache", "*.db",
)  # fmt: skip


def build_ignore(directory: str, names: list[str]) -> set[str]:
    """The patterns above anywhere, and the datasets' folder data/ at the top (not dpsweep/data/)."""
    return set(IGNORED(directory, names)) | ({"data"} & set(names) if Path(directory) == REPO else set())


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    source = tmp_path_factory.mktemp("source") / "dpsweep"
    shutil.copytree(REPO, source, ignore=build_ignore)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip wheel exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    [wheel] = out.glob("dpsweep-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_subpackages_are_namespaced(wheel_names: set[str]) -> None:
    for module in (
        "dpsweep/run/runner.py", "dpsweep/data/loaders.py", "dpsweep/cli/train.py", "dpsweep/tasks/classifier/task.py",
        "dpsweep/launchers/__init__.py", "dpsweep/analysis/__init__.py",
    ):  # fmt: skip
        assert module in wheel_names


def test_configs_ship_inside_the_package(wheel_names: set[str]) -> None:
    for yaml in (
        "config.yaml",
        "dataset/digits.yaml",
        "model/vgg16_frozen.yaml",
        "dp/off.yaml",
        "experiment/demo.yaml",
    ):
        assert f"dpsweep/conf/{yaml}" in wheel_names


def test_no_generic_top_level_module_leaks(wheel_names: set[str]) -> None:
    top = {name.split("/")[0] for name in wheel_names}
    # hydra_plugins is Hydra's namespace for plugins (a namespace package: no __init__.py of ours)
    assert {t for t in top if not t.endswith(".dist-info")} == {"dpsweep", "hydra_plugins"}
    assert {n for n in wheel_names if n.startswith("hydra_plugins/")} == {"hydra_plugins/dpsweep_launchers/__init__.py"}


COMMANDS = {"dpsweep": "train", "dpsweep-plan": "plan", "dpsweep-epsilon": "epsilon", "dpsweep-report": "report",
            "dpsweep-memory": "memory", "dpsweep-runs": "runs", "dpsweep-ui": "ui"}  # fmt: skip


def test_console_scripts_are_the_cli_modules(wheel_names: set[str]) -> None:
    [entry_points] = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    assert entry_points
    from importlib.metadata import entry_points as installed

    scripts = {e.name: e.value for e in installed(group="console_scripts") if e.name.startswith("dpsweep")}
    assert scripts == {name: f"dpsweep.cli.{module}:console" for name, module in COMMANDS.items()}
    for module in COMMANDS.values():
        assert f"dpsweep/cli/{module}.py" in wheel_names


def test_every_config_group_is_packaged(wheel_names: set[str], repo_root: Path) -> None:
    for yaml in (repo_root / "conf").rglob("*.yaml"):
        assert f"dpsweep/conf/{yaml.relative_to(repo_root / 'conf').as_posix()}" in wheel_names
