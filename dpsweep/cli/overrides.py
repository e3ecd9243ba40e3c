"""Reading a Hydra command line before Hydra does: the value a ``key=value`` override gives a key.

override_value(["+train.seed=3", "dp=off"], "train.seed")   # "3"
"""

from __future__ import annotations

from collections.abc import Sequence


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value the first override of ``key`` gives it (``+key=`` and ``~key=`` forms included), or None."""
    for o in overrides:
        name, _, value = o.partition("=")
        if name.lstrip("+~") == key:
            return value
    return None
