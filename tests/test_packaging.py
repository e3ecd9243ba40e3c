"""Packaging: launchers/, analysis/ and conf/ install inside the dpsweep namespace only."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(repo),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = out.glob("dpsweep-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_subpackages_are_namespaced(wheel_names: set[str]) -> None:
    for module in ("dpsweep/train.py", "dpsweep/launchers/__init__.py", "dpsweep/analysis/__init__.py"):
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


def test_console_entry_point_is_the_hydra_app(wheel_names: set[str]) -> None:
    assert any(n.endswith("entry_points.txt") for n in wheel_names)
    from importlib.metadata import entry_points

    [ep] = [e for e in entry_points(group="console_scripts") if e.name == "dpsweep"]
    assert ep.value == "dpsweep.train:main"


def test_every_config_group_is_packaged(wheel_names: set[str], repo_root: Path) -> None:
    for yaml in (repo_root / "conf").rglob("*.yaml"):
        assert f"dpsweep/conf/{yaml.relative_to(repo_root / 'conf').as_posix()}" in wheel_names
