"""No module outside ``dpsweep/interop/`` uses another project's private name (issue 57, item 3).

An AST scan of ``dpsweep/`` and ``launchers/`` flags, outside ``dpsweep/interop/``:

- an import from a module path with a ``_``-prefixed part (``hydra._internal...``), or of a
  ``_``-prefixed name, from anything but dpsweep;
- ``X._name`` (not a dunder) where ``X`` is a name the module imported from another project
  (``torch._foreach_lerp_``, ``ConfigLoaderImpl._apply_overrides_to_config``, ``threading._shutdown``);
- ``obj._name`` on any other object, and ``getattr(obj, "_name")`` and its kin, where dpsweep itself
  defines no ``_name`` anywhere (a function, a class, an attribute it assigns, a name it binds):
  ``study._storage``, ``self._is_last_step_skipped`` in a subclass of Opacus's optimizer;
- a string naming a module path with a ``_``-prefixed part of another project (``"submitit.core._submit"``).

Exclusions, each because it is public by its owner's documentation or because it is a plugin
interface declared in ``dpsweep/interop/`` (whose test checks each name still exists):
:data:`DOCUMENTED` (``os._exit``; a named tuple's ``_replace``, ``_asdict``, ``_fields``, ``_make``),
and the names of ``submitit_private.plugin_names()`` and ``hydra_submitit_private.plugin_names()``
(submitit's and hydra-submitit-launcher's subclass interfaces, which have no public form).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator

from helpers import REPO

from dpsweep.interop import hydra_submitit_private, submitit_private

ROOTS = ("dpsweep", "launchers")
DOOR = REPO / "dpsweep" / "interop"
OWN = {"dpsweep", "launchers", "hydra_plugins.dpsweep_launchers"}  # the project's own import roots
# underscored names that their owners document as public
DOCUMENTED = {"_exit", "_replace", "_asdict", "_fields", "_make"}
EXEMPT = DOCUMENTED | submitit_private.plugin_names() | hydra_submitit_private.plugin_names()
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}
# the libraries whose module paths a string may name (with the standard library's)
THIRD_PARTY = {"hydra", "omegaconf", "opacus", "torch", "torchvision", "mlflow", "optuna", "submitit", "dp_accounting"}
PRIVATE_PATH = re.compile(r"^[a-z]\w*(\.\w+)*\._[a-z]\w*(\.\w+)*$")

# Uses in modules whose owners are changing them as this is written (issue 57's other parts): each is
# to be replaced by a call into dpsweep/interop or a public way (the report of issue 57, item 3 gives each
# line). The test below fails once one is gone, so that it leaves this list.
PENDING: set[tuple[str, str]] = set()


def modules() -> Iterator[tuple[str, ast.Module]]:
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if DOOR not in path.parents:
                yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), str(path))


def own_names(trees: list[ast.Module]) -> set[str]:
    """Every ``_``-prefixed name dpsweep defines: functions, classes, names it binds, attributes it assigns,
    keyword parameters (a dataclass's ``_field``)."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
                if not isinstance(node.value, ast.Name) or node.value.id in {"self", "cls"}:
                    names.add(node.attr)  # assigned on its own objects (not on an imported module)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def imported_names(tree: ast.Module) -> set[str]:
    """The local names a module binds to another project's modules or objects by import."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in OWN:
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and not own_module(node.module):
            bound.update(alias.asname or alias.name for alias in node.names)
    return bound


def own_module(module: str) -> bool:
    return module.split(".")[0] in OWN or module == "__future__"


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of ``tree`` (text about a name, not a use of it)."""
    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    bodies = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    return {
        id(body.body[0].value)
        for body in bodies
        if body.body and isinstance(body.body[0], ast.Expr) and isinstance(body.body[0].value, ast.Constant)
    }


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in EXEMPT


def uses(tree: ast.Module, own: set[str]) -> Iterator[tuple[int, str]]:
    """(line, private name) for each use of another project's private name in ``tree``."""
    foreign, texts = imported_names(tree), docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if own_module(node.module):
                continue
            parts = [p for p in node.module.split(".") if private(p)]
            parts += [a.name for a in node.names if private(a.name)]
            yield from ((node.lineno, p) for p in parts)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in OWN:
                    yield from ((node.lineno, p) for p in alias.name.split(".") if private(p))
        elif isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if (isinstance(base, ast.Name) and base.id in foreign) or node.attr not in own:
                yield node.lineno, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS:
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                name = node.args[1].value
                if private(name) and name not in own:
                    yield node.lineno, name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in texts:
            for word in node.value.split():
                if PRIVATE_PATH.match(word) and word.split(".")[0] in sys.stdlib_module_names | THIRD_PARTY:
                    yield node.lineno, word


def found() -> set[tuple[str, int, str]]:
    trees = dict(modules())
    own = own_names(list(trees.values()))
    return {(path, line, name) for path, tree in trees.items() for line, name in uses(tree, own)}


def test_no_private_name_of_another_project_outside_the_door() -> None:
    outside = sorted(f"{path}:{line}: {name}" for path, line, name in found() if (path, name) not in PENDING)
    assert not outside, "another project's private names outside dpsweep/interop/:\n" + "\n".join(outside)


def test_pending_uses_are_still_there() -> None:
    """An entry of PENDING whose use is gone must leave the list (it would hide a new one)."""
    still = {(path, name) for path, _, name in found()}
    assert still >= PENDING, f"gone, remove from PENDING: {sorted(PENDING - still)}"


def test_the_scan_sees_each_kind_of_use() -> None:
    """The scan flags each form it is meant to flag, and leaves dpsweep's own names alone."""
    code = """
import threading
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from torch import nn
class Own:
    def _mine(self): return self._count
    def __init__(self): self._count = 0
def f(study, optimizer):
    threading._shutdown()
    nn.modules.batchnorm._BatchNorm
    study._storage
    getattr(optimizer, "_is_last_step_skipped", False)
    Own()._mine()
    "-u -m submitit.core._submit"
"""
    tree = ast.parse(code)
    names = sorted(name for _, name in uses(tree, own_names([tree])))
    assert names == sorted(["_internal", "_shutdown", "_BatchNorm", "_storage", "_is_last_step_skipped",
                            "submitit.core._submit"])  # fmt: skip
