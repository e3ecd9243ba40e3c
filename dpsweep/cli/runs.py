"""``dpsweep-runs``: the runs of a store, as seen from their processes.

    dpsweep-runs reconcile                                   # every experiment of ./mlflow.db
    dpsweep-runs reconcile --experiment demo --dry-run       # what would be closed, closing nothing
    dpsweep-runs reconcile --tracking-uri http://mlflow:5000

``reconcile`` ends KILLED every RUNNING run whose process is gone (see ``dpsweep.tracking.dead_runs``: a dead
process on this host, or no heartbeat for 5 minutes from another host), with the reason in its
``error`` tag, and deletes its checkpoint. ``dpsweep -m`` and ``dpsweep-report`` do the same for
their experiment before they start. A store that cannot be opened (an unknown scheme, a server that
refuses or does not answer within seconds) exits 2 naming ``--tracking-uri``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from dpsweep.cli.errors import exits_on_bad_input
from dpsweep.cli.options import add_tracking_uri, plain_text
from dpsweep.cli.script import run_script
from dpsweep.errors import InputError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsweep-runs", description=plain_text(__doc__.split("\n")[0]))
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("reconcile", help="end KILLED the RUNNING runs whose process is gone")
    rec.add_argument("--experiment", metavar="NAME", help="only this experiment (default: every experiment)")
    add_tracking_uri(rec)
    rec.add_argument("--dry-run", action="store_true", help="list the dead runs without closing them")
    return p


@exits_on_bad_input("dpsweep-runs")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from dpsweep.tracking.dead_runs import reconcile  # MLflow: after the arguments parse

    try:
        dead = reconcile(args.tracking_uri, args.experiment, dry_run=args.dry_run)
    except InputError as err:  # the store's checks name the config key: name this command's option
        if err.key != "tracking.uri":
            raise
        raise InputError("--tracking-uri", err.value, err.allowed) from err
    verb = "would end" if args.dry_run else "ended"
    for run in dead:
        removed = f"; deleted {run.checkpoint_removed}" if run.checkpoint_removed else ""
        print(f"dpsweep-runs: {verb} run {run.run_id} KILLED: {run.reason}{removed}")
    print(f"dpsweep-runs: {len(dead)} dead run(s) {verb} KILLED")
    return 0


def console() -> NoReturn:
    """The console script: its secrets handed over (a store's password leaves ``--tracking-uri`` for
    its client's setting), ``main``, then its exit (``dpsweep.cli.script``)."""
    run_script(main, "dpsweep-runs")


if __name__ == "__main__":
    console()
