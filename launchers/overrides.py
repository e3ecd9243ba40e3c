"""The overrides dpsweep's sweepers add to every job, written so that Hydra's grammar keeps them strings.

    string_override("sweep.id", "3804437e6765")   # "sweep.id='3804437e6765'", not the float 3.8e6771 (inf)
    new_sweep_id()                                 # "s1a2b3c4d5e6": starts with a letter

Hydra parses an unquoted override value as the most specific type it can: ``3804437e6765`` is a float
(inf), ``123`` an int. Ids, MLflow run ids and storage URLs are quoted, and new sweep ids start with a
letter, so that they survive any override grammar (one pasted by hand included).
"""

from __future__ import annotations

import uuid


def new_sweep_id() -> str:
    """A fresh sweep id: ``s`` and 11 hex digits (12 characters), never a number in any grammar."""
    return "s" + uuid.uuid4().hex[:11]


def string_override(key: str, value: object) -> str:
    """``key='value'``: a quoted Hydra override (backslashes and quotes escaped), always a string."""
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"{key}='{text}'"
