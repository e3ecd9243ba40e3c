"""What a run records of where it ran: the source's git commit, torch's and Opacus's versions, the
device and how it was shared, the process (tags, in the run's process).

    environment_tags(torch.device("cpu"))   # {"git.commit": "4f0c…", "device.name": "cpu (x86_64, 2 threads)", …}
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where they are used: in the run's process
    import torch


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """Commit of the dpsweep source tree, with ``-dirty`` if it has uncommitted changes, asked once per
    process (at its first run: an edit during an inline sweep does not change the code it runs)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


# How the run's device was shared, set by a job of several trials (dpsweep.launchers.packing):
# time-slicing or mps; a run without it had its device to itself (exclusive).
DEVICE_SHARING_ENV = "DPSWEEP_DEVICE_SHARING"


def environment_tags(device: torch.device) -> dict[str, str]:
    import opacus
    import torch

    return {
        "git.commit": git_commit(),
        "torch.version": torch.__version__,
        "opacus.version": opacus.__version__,
        "device.name": device_name(device),
        "device.sharing": os.environ.get(DEVICE_SHARING_ENV, "exclusive"),
        "job.pid": str(os.getpid()),  # the process the run trained in (memory probes: one each)
    }
