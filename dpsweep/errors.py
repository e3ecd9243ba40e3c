"""One error for bad input, whatever the command: :class:`InputError` names the key, the bad value and
what is allowed, and every command turns it into one line on stderr and exit code 2
(``dpsweep.cli.errors``)::

    raise InputError("dp.noise_multiplier", -1.0, "a positive noise multiplier")
    # dp.noise_multiplier=-1.0 is invalid: a positive noise multiplier

Its subclasses say where the input came from (a config value, a memory model file, an MLflow report
query); they carry the same three fields and print the same way.
"""

from __future__ import annotations

import re
from typing import Any

EXIT_BAD_INPUT = 2  # every command's exit code for bad input (as argparse's for a malformed command line)


class InputError(ValueError):
    """Bad input: ``key`` (a config key, a flag or a file field), the bad ``value`` and what is ``allowed``.

    The message is always ``<key>=<value!r> is invalid: <allowed>``.
    """

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(redact(f"{key}={value!r} is invalid: {allowed}"))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across submitit and multiprocessing
        return (type(self), (self.key, self.value, self.allowed))


# The password of a URL's user information (RFC 3986, section 3.2.1: "user:password@host"): what
# tracking.uri (an MLflow server) or sweep.storage (Optuna's database) may hold.
_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s'\"]*):(?P<password>[^/@\s'\"]+)@")
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (the user name is kept):
    what dpsweep logs (params, tags, ``config.yaml``) and prints (errors, the "next:" line)."""
    return _CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)


def redacted(values: dict[str, Any]) -> dict[str, Any]:
    """A mapping's string values :func:`redact`-ed (other values as they are)."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in values.items()}
