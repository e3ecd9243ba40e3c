"""Options that several commands share, stated once."""

from __future__ import annotations

import argparse
import os

from dpsweep.config import TrackingConfig


def add_tracking_uri(parser: argparse.ArgumentParser) -> None:
    """``--tracking-uri``: ``$MLFLOW_TRACKING_URI``, else dpsweep's default store (``TrackingConfig.uri``,
    read without importing MLflow, so that ``--help`` stays fast)."""
    default = TrackingConfig.uri
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", default),
                        help=f"MLflow tracking URI (default $MLFLOW_TRACKING_URI or {default})")  # fmt: skip
