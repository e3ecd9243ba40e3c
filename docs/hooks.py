"""MkDocs hook: the generated parts of dpsweep's docs (declared under ``hooks:`` in docs/mkdocs.yml).

Markers in the Markdown sources are replaced when the site is built:

- ``<!-- generated: config -->``: the config schema, walked from the root ``dpsweep.config.Config``
  dataclass: every key with its type, default and the comment next to it in the source.
- ``<!-- generated: commands -->``: the ``--help`` of every console script in pyproject.toml's
  ``[project.scripts]`` (and of each subcommand), run as processes of this virtualenv.

Nothing here needs a network or a GPU. A command that fails stops the build with its stderr.
It also publishes the GAN sample grids of ``analysis/data/gan_samples/`` under ``assets/``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import html
import inspect
import io
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import tokenize
import tomllib
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parent.parent
CONFIG_MARKER = "<!-- generated: config -->"
COMMANDS_MARKER = "<!-- generated: commands -->"
GAN_SAMPLES = REPO / "analysis" / "data" / "gan_samples"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Publish the committed GAN sample grids as assets/gan_samples/*.png (one copy, in analysis/data)."""
    for png in sorted(GAN_SAMPLES.glob("*.png")):
        files.append(File.generated(config, f"assets/gan_samples/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if COMMANDS_MARKER in markdown:
        markdown = markdown.replace(COMMANDS_MARKER, commands_reference())
    return markdown


# ---------------------------------------------------------------------------------------------
# The config reference
# ---------------------------------------------------------------------------------------------
def config_reference() -> str:
    """One table per schema, from the root Config down; a group typed Any lists each option's schema."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from dpsweep import config as schema

    schema.register_configs()
    store = ConfigStore.instance().repo
    sections: list[str] = []
    for name, hint in typing.get_type_hints(schema.Config).items():
        classes: list[object] = [c for c in (typing.get_args(hint) or (hint,)) if is_schema(c)]
        if not classes:  # task, dataset, model, optimizer: the schemas registered for the group's options
            classes = [OmegaConf.get_type(node.node) for node in store.get(name, {}).values()]
        sections.extend(schema_section(name, cls) for cls in classes if is_schema(cls))
    return "\n\n".join(sections)


def is_schema(hint: object) -> typing.TypeGuard[type]:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def schema_section(prefix: str, cls: type) -> str:
    doc = " ".join((ast.get_docstring(class_node(cls)[0]) or "").split())  # the source's, not dataclass's
    rows = ["| key | type | default | what |", "| --- | --- | --- | --- |", *schema_rows(prefix, cls)]
    return "\n".join([f"### `{prefix}`: `{cls.__name__}`", "", *([cell(doc), ""] if doc else []), *rows])


def schema_rows(prefix: str, cls: type) -> list[str]:
    """A row per field: key, type (an enum's values), default and its comment; nested schemas recursively."""
    rows: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}.{f.name}", hints[f.name]
        if is_schema(hint):
            rows.extend(schema_rows(key, hint))
            continue
        members: list[enum.Enum] = list(hint) if isinstance(hint, enum.EnumMeta) else []
        kind = " | ".join(str(m.value) for m in members) if members else str(f.type)
        what = comments(owner(cls, f.name)).get(f.name, "")
        rows.append(f"| `{key}` | {cell(kind)} | `{default(f)}` | {cell(what)} |")
    return rows


def default(f: dataclasses.Field[Any]) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return yaml(f.default_factory())
    return "(none)" if f.default is dataclasses.MISSING else yaml(f.default)


def yaml(value: object) -> str:
    """A default as it would be written in a config file or an override."""
    if value == "???":  # omegaconf.MISSING: set by the group's option
        return "??? (set by the option)"
    if isinstance(value, list):
        return "[" + ", ".join(yaml(v) for v in value) + "]"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value.value if isinstance(value, enum.Enum) else value)


def owner(cls: type, name: str) -> type:
    """The class in cls's MRO whose body declares the field (where its comment is written)."""
    return next(c for c in cls.__mro__ if name in inspect.get_annotations(c))


def class_node(cls: type) -> tuple[ast.ClassDef, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef), cls
    return node, source


@functools.cache
def comments(cls: type) -> dict[str, str]:
    """Each field's comments in the class body: the comment lines just above it, then its own line's."""
    node, source = class_node(cls)
    lines = source.splitlines()
    found = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    out: dict[str, str] = {}
    for field in node.body:
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
            above: list[str] = []
            line = field.lineno - 1
            while line in found and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, found[line])
                line -= 1
            own = [found[n] for n in range(field.lineno, (field.end_lineno or field.lineno) + 1) if n in found]
            out[field.target.id] = " ".join(above + own)
    return out


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return html.escape(text, quote=False).replace("|", "\\|")


# ---------------------------------------------------------------------------------------------
# The commands reference
# ---------------------------------------------------------------------------------------------
def commands_reference() -> str:
    """Every console script's --help, each followed by its subcommands' (argparse subparsers)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    with ThreadPoolExecutor() as pool:
        helps = dict(zip(scripts, pool.map(run_help, [[name] for name in scripts]), strict=True))
        subs = [(name, sub) for name, text in helps.items() for sub in subcommands(text)]
        sub_helps = dict(zip(subs, pool.map(run_help, [list(s) for s in subs]), strict=True))
    sections: list[str] = []
    for name, text in helps.items():
        sections.append(f"## `{name}`\n\n```text\n{text.rstrip()}\n```")
        for (parent, sub), sub_text in sub_helps.items():
            if parent == name:
                sections.append(f"### `{name} {sub}`\n\n```text\n{sub_text.rstrip()}\n```")
    return "\n\n".join(sections)


def subcommands(help_text: str) -> list[str]:
    """The subcommands argparse lists alone on a line under "positional arguments": ``  {probe,fit}``."""
    found = re.search(r"^  \{([\w,-]+)\}$", help_text, re.MULTILINE)
    return found.group(1).split(",") if found else []


def run_help(argv: list[str]) -> str:
    """``<script> [subcommand] --help``, the script from this virtualenv's bin/, in an empty directory."""
    script = Path(sys.executable).parent / argv[0]
    env = {**os.environ, "COLUMNS": "100"}  # argparse wraps at the terminal's width: the same on every machine
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([str(script), *argv[1:], "--help"], capture_output=True, text=True, cwd=cwd, env=env)
    command = " ".join([*argv, "--help"])
    if done.returncode != 0:
        raise PluginError(f"`{command}` exited {done.returncode}; its stderr:\n{done.stderr}")
    if done.stderr:  # shown, not swallowed, but no reason to fail the build
        print(f"`{command}` wrote to stderr:\n{done.stderr}", file=sys.stderr)
    return done.stdout
