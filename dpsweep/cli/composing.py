"""Composing ``dpsweep``'s config from a command line, and saying why it does not compose, one way for
every command that takes Hydra overrides (``dpsweep``, ``dpsweep-plan``).

    jobs, master = sweep_jobs(["dp.noise_multiplier=0.8,1.2", "train.seed=0,1"])   # as dpsweep -m expands them
    with composition_refused(argv): ...   # Hydra's errors raised as InputError: key, value, what is allowed
    did_you_mean("dp.noise")          # "; did you mean dp.noise_multiplier, dp.clip_count_noise?"

A misspelt key is answered with the nearest full keys of the schema: those of the key's own group
whose name starts with, or holds, the misspelt name first (``dp.noise``: ``dp.noise_multiplier``), then
the closest by spelling. A comma list given to a single run is a sweep: the answer says ``-m``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from dpsweep.cli.overrides import override_value
from dpsweep.errors import InputError

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONFIG_MODULE = "dpsweep.conf"  # the config tree of every command (hydra.main's pkg://dpsweep.conf)


def sweep_jobs(overrides: Sequence[str]) -> tuple[list[list[str]], DictConfig]:
    """The override lists of the jobs ``dpsweep -m <overrides>`` launches, in launch order
    (``dpsweep.launchers.expand``, with the composed config's ``hydra.sweeper.params``), and the
    sweep's master config (its fixed overrides composed, the hydra node included), as the sweeper has
    them. Needs Hydra initialised on dpsweep.conf; Hydra's errors are raised as they are."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from dpsweep.interop import hydra_private
    from dpsweep.launchers.expand import expand

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    hydra_private.check_multirun_overrides(parsed)  # what Hydra refuses of a multirun (a sweep over hydra.*)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line is not None]
    master = compose("config", overrides=fixed, return_hydra_config=True)
    node = master.hydra.sweeper.get("params")
    params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    assert isinstance(params, dict)
    return expand(overrides, params, GlobalHydra.instance().config_loader()), master


def composition_errors() -> tuple[type[BaseException], ...]:
    """Hydra's and OmegaConf's exception bases: what composing a config raises for bad overrides."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (HydraException, OmegaConfBaseException)


@contextmanager
def composition_refused(argv: Sequence[str]) -> Iterator[None]:
    """Hydra's composition errors in the block raised as bad input (:func:`composition_problem`)."""
    try:
        yield
    except composition_errors() as err:
        problem = composition_problem(err, argv)
        if problem is None:
            raise
        raise problem from None


def composition_problem(err: BaseException, argv: Sequence[str]) -> InputError | None:
    """``err`` as bad input naming the key, the value and what is allowed, where it is Hydra's failure
    to compose the overrides ``argv`` (an unknown option of a config group, a misspelt key, a value of
    the wrong type, a comma list without ``-m``); None for any other error."""
    from hydra.errors import MissingConfigException

    if not isinstance(err, composition_errors()):
        return None
    if isinstance(err, MissingConfigException):
        group, _, name = (err.missing_cfg_file or "").rpartition("/")
        options = [o for o in err.options or [] if not o.startswith("base_")]  # base_*: schemas, not options
        if group and options:
            return InputError(group, name, f"one of {', '.join(options)}")
        return InputError("config", err.missing_cfg_file, str(err).splitlines()[0])
    ambiguous = re.search(r"Ambiguous value for argument '([^']*)'", str(err))
    if ambiguous:  # Hydra's words for a comma list in a single run: a list, a string, or a sweep
        key, _, value = ambiguous.group(1).partition("=")
        given = " ".join(a for a in argv if a not in ("-m", "--multirun"))
        return InputError(
            key, value, f"one value for a single run: did you mean `-m`? (a comma list is a sweep: dpsweep -m "
            f"{given}; a list value is written [{value}], a string '{value}')",
        )  # fmt: skip
    why = str(err.__cause__ or err).splitlines()[0]
    found = re.search(r"override '?([^'=\s]+)'?", str(err))
    key = found.group(1) if found else "overrides"
    value = override_value(argv, key.lstrip("+~"))
    return InputError(
        key, value if found else " ".join(argv), f"a key and value of the config schema ({why}){did_you_mean(key)}"
    )


def did_you_mean(key: str) -> str:
    """``; did you mean <keys>?`` with the config keys and groups nearest a misspelt ``key``, each once
    (the module doc); empty where none is near."""
    from dpsweep.config.schema import nearest_keys

    close = nearest_keys(key.lstrip("+~"), known_keys())
    return f"; did you mean {', '.join(close)}?" if close else ""


def known_keys() -> list[str]:
    """The config groups (``dataset``, ``dp``) and every dotted key of the schema, each once."""
    from importlib import resources

    from dpsweep.config import schema

    groups = [p.name for p in resources.files(CONFIG_MODULE).iterdir() if p.is_dir() and not p.name.startswith("_")]
    return list(dict.fromkeys([*groups, *schema.schema_keys()]))
