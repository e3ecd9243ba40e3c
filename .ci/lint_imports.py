"""Check dpsweep's import layers with import-linter (the contracts are in pyproject.toml).

    .venv/bin/python .ci/lint_imports.py          # run by `make lint`

launchers/, analysis/ and conf/ install inside the dpsweep namespace (setuptools ``package-dir``), so
a graph drawn from the repository's directories would not see ``dpsweep.launchers`` or
``dpsweep.analysis`` at all. This script copies the Python files into the layout they are installed
in, under a temporary directory, and runs ``lint-imports`` against that copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def installed_layout(target: Path) -> None:
    """Copy every package's .py files to where ``pip install`` puts them (pyproject's package-dir)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    for package in setuptools["packages"]:
        owner = max((p for p in package_dir if package == p or package.startswith(p + ".")), key=len)
        source = REPO / package_dir[owner] / package[len(owner) :].lstrip(".").replace(".", "/")
        destination = target / package.replace(".", "/")
        destination.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, destination / module.name)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="dpsweep-imports-") as tmp:
        installed_layout(Path(tmp))
        env = os.environ | {"PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        lint = Path(sys.executable).with_name("lint-imports")
        done = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"], env=env, cwd=tmp)
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
