"""Other projects' private names, each behind one named function, in one module per library.

    from dpsweep.interop import hydra_private
    hydra_private.apply_value_overrides(values, cfg)

A name with a leading underscore is a project's own business: it may move in any release. dpsweep
uses a few where the project offers no public way to do what it needs; each sits here, behind a
function whose docstring names the private name and why there is no public one, and
``tests/unit/interop/test_interop_names.py`` fails the day one of them moves. The libraries behind
these doors have an upper bound in ``pyproject.toml``. No module outside this folder uses another
project's private name (``tests/unit/interop/test_private_names.py`` scans ``dpsweep/`` and
``launchers/``).

This package imports nothing, and each module only its own library: a module that needs Hydra's door
does not pull in torch.
"""
