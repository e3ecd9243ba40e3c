"""Every console script's ``--help`` reads as terminal text: no reST double backticks (issue 56, item 10).

The descriptions come from the command modules' reST docstrings; ``dpsweep.cli.options.plain_text``
turns their inline literals into single backticks. Each script of pyproject.toml's ``[project.scripts]``
runs as its own process, as a user types it, and so does each of its argparse subcommands.
"""

from __future__ import annotations

import re
import tomllib

import pytest
from helpers import REPO, run_script

from dpsweep.cli.options import plain_text

SCRIPTS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def _help(tmp_path_factory: pytest.TempPathFactory, *argv: str) -> str:
    done = run_script(argv[0], *argv[1:], "--help", cwd=tmp_path_factory.mktemp("help"), env={"COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_has_no_double_backticks(script: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The script's --help, and that of each subcommand it lists (``{probe,fit,predict}``)."""
    text = _help(tmp_path_factory, script)
    found = re.search(r"^  \{([\w,-]+)\}$", text, re.MULTILINE)
    texts = {script: text} | {
        f"{script} {sub}": _help(tmp_path_factory, script, sub) for sub in (found.group(1).split(",") if found else [])
    }
    stale = {command: [line for line in t.splitlines() if "``" in line] for command, t in texts.items()}
    assert not {command: lines for command, lines in stale.items() if lines}
    assert texts[script].strip()


def test_plain_text_turns_rest_literals_into_single_backticks() -> None:
    doc = "``dpsweep-epsilon``: the cost of ``dpsweep -m``, the\n``dp_sgd`` script::\n\n    x"
    assert plain_text(doc) == "`dpsweep-epsilon`: the cost of `dpsweep -m`, the\n`dp_sgd` script:\n\n    x"
    assert plain_text("a literal over ``two\nlines`` and a :: alone") == "a literal over `two\nlines` and a :: alone"
