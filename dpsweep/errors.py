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
from urllib.parse import urlsplit, urlunsplit

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


# A URL in free text: a scheme, "://", then everything up to white space (RFC 3986, section 3.1). Each one
# found is parsed by urllib.parse (the user information ends at the authority's last "@", so a password
# may hold "@", ":" or quotes), and its password and secret query values are replaced.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pwd", "token", "access_token", "api_key", "apikey", "secret"})
REDACTED = "***"


def _redact_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    user, at, after = rest.rpartition("@")
    if at and "/" in user and ":" in user and "/" not in user.partition(":")[0]:
        # a password with a raw "/" (it should be %2F): the authority would end there; redact up to the "@"
        return (
            f"{scheme}://{user.partition(':')[0]}:{REDACTED}@{_redact_url(f'{scheme}://{after}').partition('://')[2]}"
        )
    parts = urlsplit(url)
    netloc = parts.netloc
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:{REDACTED}@{host}"
    query = "&".join(
        f"{k}={REDACTED}" if (k := pair.partition("=")[0]).lower() in SECRET_QUERY_KEYS else pair
        for pair in parts.query.split("&")
    )
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str) -> str:
    """``text`` with the password of every URL in it, and every secret of its query (``token=``,
    ``password=``), replaced by ``***`` (the user name is kept): what dpsweep logs (params, tags,
    ``config.yaml``) and prints (errors, the "next:" line). Defence in depth: the commands take secrets
    out of URIs at start-up (``dpsweep.tracking.credentials``)."""
    return _URL.sub(lambda m: _redact_url(m[0]), text)


def redacted(values: dict[str, Any]) -> dict[str, Any]:
    """A mapping's string values :func:`redact`-ed (other values as they are)."""
    return {k: redact(v) if isinstance(v, str) else v for k, v in values.items()}
