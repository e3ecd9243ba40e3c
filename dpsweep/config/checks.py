"""What every group's checks raise: :class:`ConfigError`, and :func:`require` to raise it on a failed check."""

from __future__ import annotations

from typing import Any

from dpsweep.errors import InputError

# A configuration value out of its allowed range: ``<key>=<value> is invalid: <allowed>``. The one
# bad-input error of every command (dpsweep.errors), under the name the config module has always used.
ConfigError = InputError


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError(key, value, allowed)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, value, allowed)
