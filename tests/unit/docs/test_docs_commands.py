"""The docs' marked commands, run for real, print what the docs show (issue 56, item 10).

A transcript in README.md or a page of docs/src/ is tested when the line before its fence is a marker::

    <!-- test -->            run here, in the fast tier (dpsweep-epsilon, dpsweep-plan, --help)
    <!-- test: slow -->      run by the slow tier (commands that train)

followed by a ``console`` block: each ``$ command`` line (``.venv/bin/NAME`` or ``NAME``, a console
script of pyproject.toml; a ``# comment`` after it is ignored) and, under it, the lines it prints on
stdout. Lines compare with their runs of spaces made one. ``...`` alone on a line stands for any
lines; inside a line, for any text (e.g. ``ε = 0.640111 ...``). The command must exit 0; it runs in an
empty directory (no store: a fresh clone's state) with ``COLUMNS=100``. Fast commands run in this
process, through their module's ``main(argv)``; slow ones as processes of this virtualenv.

So a change of a default or of the maths cannot leave a stale figure in a marked transcript. Mark
figures that come from the maths (ε, σ, plans), not lines other work reshapes (a run's result line).
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import BIN, REPO, run_main

MARKED = re.compile(r"^<!-- test(?:: (slow))? -->\n```console\n(.*?)^```", re.MULTILINE | re.DOTALL)
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def doc_files() -> list[Path]:
    """README.md and every page of the site (the changelog keeps its old figures on purpose)."""
    pages = sorted((REPO / "docs" / "src").rglob("*.md"))
    return [REPO / "README.md", *(p for p in pages if p.name != "CHANGELOG.md")]


@dataclass(frozen=True)
class Transcript:
    doc: Path
    line: int  # of the command, 1-based
    argv: list[str]  # the console script's name, then its arguments
    expected: list[str]
    slow: bool

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def transcripts(doc: Path) -> list[Transcript]:
    """The marked commands of one Markdown file, each with the lines shown under it."""
    text = doc.read_text()
    found: list[Transcript] = []
    for block in MARKED.finditer(text):
        first = text.count("\n", 0, block.start(2)) + 1
        for offset, line in enumerate(block.group(2).splitlines()):
            if line.startswith("$ "):
                argv = shlex.split(line[2:], comments=True)
                argv[0] = argv[0].removeprefix(".venv/bin/")
                assert argv[0] in SCRIPTS, f"{doc}:{first + offset}: {argv[0]} is not a console script"
                found.append(Transcript(doc, first + offset, argv, [], block.group(1) == "slow"))
            else:
                assert found and found[-1].line >= first, f"{doc}:{first + offset}: output before any $ command"
                found[-1].expected.append(line)
    return found


ALL = [t for doc in doc_files() for t in transcripts(doc)]


def _normal(line: str) -> str:
    return " ".join(line.split())


def _line_matches(expected: str, actual: str) -> bool:
    pattern = ".*?".join(re.escape(part) for part in _normal(expected).split("..."))
    return re.fullmatch(pattern, _normal(actual)) is not None


def matches(expected: Sequence[str], actual: Sequence[str]) -> bool:
    """``expected`` (with its ``...`` lines and ``...`` in lines) against all of ``actual``."""
    if not expected:
        return not actual
    if expected[0].strip() == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and _line_matches(expected[0], actual[0]) and matches(expected[1:], actual[1:])


def main_of(script: str) -> Callable[[Sequence[str]], int]:
    """The ``main(argv)`` beside the console script's entry point (``dpsweep.cli.epsilon:console``)."""
    module = importlib.import_module(SCRIPTS[script].split(":")[0])
    main: Callable[[Sequence[str]], int] = module.main
    return main


def check(transcript: Transcript, stdout: str, stderr: str, code: int) -> None:
    where = f"{transcript.name}: $ {shlex.join(transcript.argv)}"
    assert code == 0, f"{where} exited {code}; its stderr:\n{stderr}"
    expected, actual = "\n".join(transcript.expected), stdout.rstrip("\n")
    assert matches(transcript.expected, actual.splitlines()), (
        f"{where}: the doc shows\n{expected}\nbut the command printed\n{actual}\nstderr:\n{stderr}"
    )


@pytest.mark.parametrize("transcript", [t for t in ALL if not t.slow], ids=lambda t: t.name)
def test_doc_command(transcript: Transcript, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert transcript.argv[0] != "dpsweep", f"{transcript.name}: dpsweep runs mark `<!-- test: slow -->`"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    done = run_main(main_of(transcript.argv[0]), *transcript.argv[1:])
    check(transcript, done.stdout, done.stderr, done.returncode)


@pytest.mark.slow
@pytest.mark.parametrize("transcript", [t for t in ALL if t.slow], ids=lambda t: t.name)
def test_doc_command_slow(transcript: Transcript, tmp_path: Path) -> None:
    import subprocess

    env = {**os.environ, "COLUMNS": "100", "HYDRA_FULL_ERROR": "0"}
    done = subprocess.run(
        [str(BIN / transcript.argv[0]), *transcript.argv[1:]], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    check(transcript, done.stdout, done.stderr, done.returncode)


# Guides whose ε and plan commands cannot run in a fresh directory, and why.
UNMARKED = {"memory.md": "its dpsweep-plan --memory-model needs a model fitted from GPU probes first"}


def test_the_readme_tour_and_the_guides_mark_their_figures() -> None:
    """What issue 56 asked to be kept honest: the tour's ε and plans, and in each guide that gives a
    dpsweep-epsilon or dpsweep-plan command in a code block (a line that starts with it), a tested
    transcript of that command."""
    marked = {(t.doc.name, t.argv[0]) for t in ALL}
    assert {("README.md", "dpsweep-epsilon"), ("README.md", "dpsweep-plan")} <= marked
    for page in sorted((REPO / "docs" / "src" / "guides").glob("*.md")):
        blocks = "\n".join(re.findall(r"^```\w*\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL))
        used = set(re.findall(r"^(?:\$ )?(?:\.venv/bin/)?(dpsweep-epsilon|dpsweep-plan) ", blocks, re.MULTILINE))
        if page.name not in UNMARKED:
            assert used <= {name for doc, name in marked if doc == page.name}, (page.name, used)


def test_every_marker_opens_a_console_transcript() -> None:
    """A marker before anything else (a ``bash`` block, a blank line) would test nothing: refused."""
    for doc in doc_files():
        markers = re.findall(r"^<!-- test\b.*$", doc.read_text(), re.MULTILINE)
        assert len(markers) == len(MARKED.findall(doc.read_text())), (doc.name, markers)


def test_matching_rules() -> None:
    assert matches(["a 1", "...", "z"], ["a  1", "b", "c", "z"])
    assert matches(["... ε = 0.640 ..."], ["DP-SGD ... ε = 0.640 and δ"])
    assert not matches(["ε = 0.724"], ["ε = 0.640"])
    assert not matches(["a"], ["a", "b"])  # every printed line is shown, or elided with ...
    assert not matches(["a", "b"], ["a"])
