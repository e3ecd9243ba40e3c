"""The shape issue 32 gave the code, kept: a folder per concept, small modules and functions, and
mechanism and task names where their seams are (its "Done when", as greps a maintainer would run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "dpsweep"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_ENTRIES = 500, 60, 20


def python_files(*roots: Path) -> list[Path]:
    found = [[root] if root.is_file() else root.rglob("*.py") for root in roots]
    return sorted(p for files in found for p in files if "__pycache__" not in p.parts)


def test_the_core_has_few_top_level_entries() -> None:
    entries = sorted(p.name for p in CORE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_TOP_ENTRIES, entries


def test_no_core_module_is_over_500_lines() -> None:
    lines = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in python_files(CORE)}
    long = {path: n for path, n in lines.items() if n > MAX_MODULE_LINES}
    assert not long, f"split these by concern (at most {MAX_MODULE_LINES} lines a module): {long}"


def test_no_core_function_is_over_60_lines() -> None:
    long = []
    for path in python_files(CORE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def hits(pattern: str, roots: list[Path], flags: int = 0) -> list[str]:
    """The lines of the Python files under ``roots`` that match ``pattern``, as grep shows them."""
    regex = re.compile(pattern, flags)
    return [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for path in python_files(*roots)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if regex.search(line)
    ]


def test_mechanism_names_appear_only_in_the_mechanisms_and_the_config_schema() -> None:
    """``grep -rnE "dpftrl|Mechanism\\.|PrivacyUnit\\." dpsweep launchers analysis``: a new mechanism is
    one module in ``dpsweep/mechanisms/``; nothing else branches on a mechanism's name."""
    found = hits(r"dpftrl|Mechanism\.|PrivacyUnit\.", [CORE, REPO / "launchers", REPO / "analysis"])
    outside = [h for h in found if not h.startswith(("dpsweep/mechanisms/", "dpsweep/config/"))]
    assert not outside, outside


@pytest.mark.parametrize("root", ["analysis", "launchers", "dpsweep/run", "dpsweep/plan.py"])
def test_no_task_is_named_by_the_runner_planning_launchers_or_reports(root: str) -> None:
    """``grep -rniw gan``: the GAN is one task among others, a module of ``dpsweep/tasks/``."""
    assert not hits(r"\bgan\b", [REPO / root], re.IGNORECASE)
