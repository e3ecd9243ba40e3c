"""The command that starts a run's ranks: ``torchrun`` (PyTorch's own launcher, ``torch.distributed.run``)
with one process per device on this machine, each running the same ``dpsweep`` command line.

    torchrun_command(2, ["train.devices=2", "train.epochs=3"], "outputs/2026-11-27/12-00-00")
    # [python, -m, torch.distributed.run, --standalone, --nnodes=1, --nproc-per-node=2,
    #  -m, dpsweep.cli.train, train.devices=2, train.epochs=3, hydra.run.dir=outputs/2026-11-27/12-00-00]

Every rank writes into the output directory of the command that launched them (``hydra.run.dir``), so
the run has one directory and one checkpoint directory whatever second each rank starts in.
torchrun ends every rank when one fails, and exits non-zero.

When a rank fails, torchrun's own report (its agent's log lines, then a traceback of its own code and
a table of the failures: about 40 lines) says one thing a user needs, which rank failed first and how.
:func:`run_ranks` passes the ranks' own output through and keeps torchrun's report in a file of the
run's directory, whose root cause it returns in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPORT = "torchrun.log"  # torchrun's own lines, in the run's output directory
# torchrun's agent logs in glog's format: "E1128 20:03:20.039000 18420 torch/distributed/elastic/..."
_AGENT_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ torch/distributed/")
_TORCHRUN_FRAME = "torch/distributed/run.py"  # a traceback through torchrun's main: its ChildFailedError
_RANK_TRACEBACK = re.compile(r"^\[rank\d+\]:")  # a rank's uncaught exception, as torch prints it, line by line


def torchrun_command(devices: int, overrides: Sequence[str], output_dir: str) -> list[str]:
    """The command line (module doc): ``devices`` ranks on this machine, the same ``overrides``."""
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={devices}",
        "-m", "dpsweep.cli.train", *kept, f"hydra.run.dir={output_dir}",
    ]  # fmt: skip


@dataclass(frozen=True)
class RanksEnded:
    """How a run's ranks ended: torchrun's exit code, the first failure it observed (None: none), and
    the file that holds its report."""

    code: int
    root_cause: str | None
    report: Path


def run_ranks(command: Sequence[str], env: Mapping[str, str], output_dir: Path) -> RanksEnded:
    """Run torchrun's ``command``: the ranks' output as it comes, torchrun's own report into
    ``output_dir/torchrun.log`` (module docstring)."""
    report = output_dir / REPORT
    with report.open("w") as kept:
        proc = subprocess.Popen(command, env=dict(env), stderr=subprocess.PIPE, text=True, errors="replace")
        assert proc.stderr is not None
        pump = threading.Thread(target=_sort_lines, args=(proc.stderr, kept, sys.stderr), daemon=True)
        pump.start()
        code = proc.wait()
        pump.join()
    return RanksEnded(code, root_cause(report.read_text()), report)


def _sort_lines(stream: IO[str], kept: IO[str], shown: IO[str]) -> None:
    """Torchrun's lines into ``kept``, the ranks' into ``shown``. A traceback is held until its end, then
    goes to ``kept`` if it runs through torchrun's own code (everything after it is torchrun's report).
    A rank's traceback as torch prints it (``[rank0]: ...``) goes to ``kept`` too, its last line (the
    exception) shown."""
    block: list[str] = []
    rank_traceback: list[str] = []
    torchrun_failed = False
    for line in stream:
        if rank_traceback and not _RANK_TRACEBACK.match(line):
            shown.write(rank_traceback[-1])
            rank_traceback = []
        if torchrun_failed or _AGENT_LINE.match(line):
            kept.write(line)
            continue
        if _RANK_TRACEBACK.match(line):
            kept.write(line)
            rank_traceback.append(line)
            continue
        if line.startswith("Traceback (most recent call last):") and not block:
            block = [line]
            continue
        if block:
            block.append(line)
            if line.startswith((" ", "\t")):
                continue
            if any(_TORCHRUN_FRAME in b for b in block):
                kept.writelines(block)
                torchrun_failed = True
            else:
                shown.writelines(block)
                shown.flush()
            block = []
            continue
        shown.write(line)
        shown.flush()
    kept.writelines(block)
    shown.writelines(rank_traceback[-1:])


_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<code>-?\d+)[^\n]*?(?:\((?P<signal>SIG\w+)\))?\s*\n",
    re.S,
)


def root_cause(report: str) -> str | None:
    """The first failure torchrun observed, from its report: "rank 1 (exit code -9, SIGKILL)"."""
    found = _ROOT_CAUSE.search(report)
    if found is None:
        return None
    signal = f", {found['signal']}" if found["signal"] else ""
    return f"rank {found['rank']} (exit code {found['code']}{signal})"
