"""A sweep job's process: submitit's job runner, with a rank's environment where a job has several tasks.

    <interpreter> -u -m dpsweep.launchers.job -u -m submitit.core._submit <folder>

submitit's executors start each job as ``{python} -u -m submitit.core._submit <folder>``; dpsweep's
launchers (local, Slurm, Grid Engine) set ``python`` to ``<interpreter> -u -m dpsweep.launchers.job``,
so this module receives ``-u -m submitit.core._submit <folder>``. It runs submitit's own job runner
(``submitit.core.submission.submitit_main``: the job's pickled function, its result or error written
back, requeue on timeout), after exporting, in a Slurm job of several tasks, each task's rank for
torch.distributed (:func:`ranks_from_slurm`).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from dpsweep.interop import submitit_private
from dpsweep.process import RANKS_ENV
from dpsweep.process.shutdown import run_then_exit

SUBMITIT_ARGS = ["-u", "-m", submitit_private.SUBMIT_MODULE]  # what submitit appends to the python command


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if args[:3] != SUBMITIT_ARGS or len(args) != 4:
        raise SystemExit(f"usage: python -u -m dpsweep.launchers.job {' '.join(SUBMITIT_ARGS)} FOLDER (got {args})")
    from submitit.core.submission import submitit_main

    ranks_from_slurm()
    sys.argv = [sys.argv[0], args[3]]  # submitit_main parses the job folder from sys.argv
    run_then_exit(submitit_main)


def ranks_from_slurm() -> bool:
    """In a job of several tasks (a run across ``train.devices`` devices on Slurm, one task a rank), this
    task's rank for torch.distributed (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, from submitit's own ``TorchDistributedEnvironment``), and the mark that it is a
    rank of dpsweep's (``dpsweep.process.RANKS_ENV``); whether it is one. A job of one task is left as it is."""
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return False
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)  # a rank picks its GPU by LOCAL_RANK
    os.environ[RANKS_ENV] = "1"
    return True


if __name__ == "__main__":
    main()
