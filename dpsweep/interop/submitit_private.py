"""submitit's plugin interface, whose names are private: the door to it.

submitit takes new schedulers as plugins (its ``submitit`` entry points: dpsweep's Grid Engine
executor, ``dpsweep.launchers.sge``), and a plugin is written as its own Slurm and local executors
are: a subclass of ``PicklingExecutor``, ``InfoWatcher`` and ``JobEnvironment`` overriding their
underscored methods and keeping their underscored state. There is no public plugin API; these are
the names such a subclass uses, listed here so that a test fails the day one moves. Each job's
process is started as ``<python> -u -m submitit.core._submit <folder>``.

This module imports nothing from submitit: a sweep job's bootstrap (``dpsweep.launchers.job``) reads
:data:`SUBMIT_MODULE` before it imports anything heavy.
"""

from __future__ import annotations

# the module each job's process runs (submitit's own executors write this line; so does a plugin's)
SUBMIT_MODULE = "submitit.core._submit"

# base class (module:qualified name) -> the private names a plugin's subclass overrides or reads
PLUGIN_INTERFACE: dict[str, tuple[str, ...]] = {
    "submitit.core.core:Executor": (
        "_equivalence_dict", "_valid_parameters", "_internal_update_parameters", "_internal_process_submissions",
    ),
    "submitit.core.core:PicklingExecutor": (
        "_submitit_command_str", "_make_submission_file_text", "_num_tasks", "_make_submission_command",
        "_get_job_id_from_submission_command", "_throttle",
    ),
    "submitit.core.core:InfoWatcher()": (  # () : instance state, set by __init__
        "_make_command", "_registered", "_finished", "_num_calls", "_output", "_info_dict",
    ),
    "submitit.core.job_environment:JobEnvironment": ("_requeue",),
}  # fmt: skip


def plugin_names() -> frozenset[str]:
    """Every private name of :data:`PLUGIN_INTERFACE`: what a subclass of submitit's bases may use."""
    return frozenset(name for names in PLUGIN_INTERFACE.values() for name in names)
