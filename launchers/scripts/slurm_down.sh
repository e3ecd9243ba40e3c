#!/usr/bin/env bash
# slurm_down.sh -- stop the single-node Slurm cluster started by slurm_up.sh.
#
# Usage (as root):
#   bash launchers/scripts/slurm_down.sh          # stop slurmd, slurmctld, slurmdbd
#   bash launchers/scripts/slurm_down.sh --all    # ... and also mariadbd and munged
#
# Each daemon gets SIGTERM, then SIGKILL if it is still alive after 30 s.
# Idempotent: daemons that are not running are skipped, and the exit status
# is 0 unless a daemon could not be stopped.
# Slurm state is kept in /var/lib/slurm/slurmctld, so pending jobs survive a
# down/up cycle; jobs already running keep running in their slurmstepd.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

log() { printf '[slurm_down] %s\n' "$*"; }
die() { printf '[slurm_down] ERROR: %s\n' "$*" >&2; exit 1; }

ALL=0
case "${1:-}" in
    "") ;;
    --all) ALL=1 ;;
    *) die "usage: $0 [--all]" ;;
esac

[ "$(id -u)" -eq 0 ] || die "must be run as root"


stop_daemon() { # $1 = name, $2 = pidfile
    local name=$1 pidfile=$2 pid
    pid=$(daemon_pid "$name" "$pidfile")
    if [ -z "$pid" ]; then
        log "$name not running"
        return 0
    fi
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do
        if ! alive "$pid"; then
            return 0
        fi
        sleep 0.5
    done
    log "$name did not stop in 30 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
    if alive "$pid"; then
        die "could not stop $name (pid $pid)"
    fi
}

# Compute daemon first, controller next, then the accounting daemon.
# one slurmd a node (slurm_up.sh runs two): each found by its name, until none is left
stop_daemon slurmd /run/slurmd.pid
while [ -n "$(daemon_pid slurmd /run/slurmd.pid)" ]; do stop_daemon slurmd /run/slurmd.pid; done
stop_daemon slurmctld /run/slurmctld.pid
stop_daemon slurmdbd /run/slurmdbd.pid
if [ "$ALL" -eq 1 ]; then
    stop_daemon mariadbd /run/mysqld/mysqld.pid
    stop_daemon munged /run/munge/munged.pid
fi
log "stopped"
