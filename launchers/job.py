"""A sweep job's process: submitit's job runner, ended without the interpreter's teardown.

    <interpreter> -u -m dpsweep.launchers.job -u -m submitit.core._submit <folder>

submitit's executors start each job as ``{python} -u -m submitit.core._submit <folder>``; dpsweep's
launchers (local, Slurm, Grid Engine) set ``python`` to ``<interpreter> -u -m dpsweep.launchers.job``,
so this module receives ``-u -m submitit.core._submit <folder>``. It runs submitit's own job runner
(``submitit.core.submission.submitit_main``: the job's pickled function, its result or error written
back, requeue on timeout) under :func:`dpsweep.process.shutdown.run_then_exit`, which spares each job the
interpreter's teardown (about 2 s with torch, MLflow and Hydra loaded).
"""

from __future__ import annotations

import sys
from typing import NoReturn

from dpsweep.process.shutdown import run_then_exit

SUBMITIT_ARGS = ["-u", "-m", "submitit.core._submit"]  # what submitit appends to the python command


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if args[:3] != SUBMITIT_ARGS or len(args) != 4:
        raise SystemExit(f"usage: python -u -m dpsweep.launchers.job {' '.join(SUBMITIT_ARGS)} FOLDER (got {args})")
    from submitit.core.submission import submitit_main

    from dpsweep.tracking import channel as tracking_service

    tracking_service.start()  # MLflow imports in the tracking process while the job imports torch

    sys.argv = [sys.argv[0], args[3]]  # submitit_main parses the job folder from sys.argv
    run_then_exit(submitit_main)


if __name__ == "__main__":
    main()
