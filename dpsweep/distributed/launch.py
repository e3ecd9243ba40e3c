"""The command that starts a run's ranks: ``torchrun`` (PyTorch's own launcher, ``torch.distributed.run``)
with one process per device on this machine, each running the same ``dpsweep`` command line.

    torchrun_command(2, ["train.devices=2", "train.epochs=3"], "outputs/2026-11-27/12-00-00")
    # [python, -m, torch.distributed.run, --standalone, --nnodes=1, --nproc-per-node=2,
    #  -m, dpsweep.cli.train, train.devices=2, train.epochs=3, hydra.run.dir=outputs/2026-11-27/12-00-00]

Every rank writes into the output directory of the command that launched them (``hydra.run.dir``), so
the run has one directory and one checkpoint directory whatever second each rank starts in.
torchrun ends every rank when one fails, and exits non-zero.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_command(devices: int, overrides: Sequence[str], output_dir: str) -> list[str]:
    """The command line (module doc): ``devices`` ranks on this machine, the same ``overrides``."""
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={devices}",
        "-m", "dpsweep.cli.train", *kept, f"hydra.run.dir={output_dir}",
    ]  # fmt: skip
