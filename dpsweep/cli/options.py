"""Options that several commands share, stated once."""

from __future__ import annotations

import argparse
import os
import re

_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)  # reST's inline literal: ``dpsweep -m``
_LITERAL_BLOCK = re.compile(r"(?<=\S)::$", re.MULTILINE)  # reST's "script::" that opens an example block


def plain_text(text: str) -> str:
    """A docstring's reST as a terminal shows it, for ``--help``: each inline literal (code between two
    pairs of backticks) between single backticks, as Markdown and most command-line help write code, and
    the double colon that opens a literal block as one colon. The module docstrings stay reST for the
    docs and editors; the commands' descriptions and help strings pass through here."""
    return _LITERAL_BLOCK.sub(":", _LITERAL.sub(r"`\1`", text))


def add_tracking_uri(parser: argparse.ArgumentParser) -> None:
    """``--tracking-uri``: ``$MLFLOW_TRACKING_URI``, else dpsweep's default store (``TrackingConfig.uri``,
    read without importing MLflow, so that ``--help`` stays fast). dpsweep.config is imported here, not
    at the top: it registers the schemas with Hydra, which ``dpsweep-epsilon`` (that imports this module
    for ``plain_text``) never needs."""
    from dpsweep.config import TrackingConfig

    default = TrackingConfig.uri
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", default),
                        help=f"MLflow tracking URI (default $MLFLOW_TRACKING_URI or {default})")  # fmt: skip
