#!/usr/bin/env bash
# sge_down.sh — idempotently stop the single-node Son of Grid Engine daemons
# (sge_execd, then sge_qmaster) started by launchers/scripts/sge_up.sh.
#
# Usage (as root):
#   bash launchers/scripts/sge_down.sh [--kill-jobs]
#
#   --kill-jobs   also kill running jobs (qconf -kej). Without it, running
#                 jobs keep running under their sge_shepherd and are picked up
#                 again by the next sge_up.sh (standard SGE behaviour).
#
# Exits 0 when neither daemon is running (also when nothing was running),
# non-zero with an "ERROR:" line otherwise. Configuration, spool and
# accounting data are kept; sge_up.sh brings the same cluster back.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
sge_environment

HOST="$(hostname)"
QMASTER_PID="/var/spool/gridengine/qmaster/qmaster.pid"
EXECD_PID="/var/spool/gridengine/execd/$HOST/execd.pid"
KILL_JOBS=0

log() { echo "[sge_down] $*"; }
die() { echo "[sge_down] ERROR: $*" >&2; exit 1; }

for arg in "$@"; do
  case "$arg" in
    --kill-jobs) KILL_JOBS=1 ;;
    -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
    *) die "unknown argument: $arg" ;;
  esac
done
[[ "$(id -u)" == 0 ]] || die "must run as root"

# daemon_pids <comm> <pidfile>: pids of running <comm> processes — the one in
# the pid file plus any stray instance owned by sgeadmin.
daemon_pids() {
  local pid
  {
    if [[ -r "$2" ]]; then
      pid="$(tr -dc 0-9 <"$2")"
      if [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$1" ]]; then echo "$pid"; fi
    fi
    pgrep -x -u sgeadmin "$1" || true
  } | sort -u
}

# stop_daemon <comm> <pidfile> <qconf-args...>: ask politely via qconf (wait
# up to 30 s: sge_qmaster's controlled shutdown takes ~10 s, sge_execd's ~2 s),
# then SIGTERM (15 s), then SIGKILL (5 s) the pids found.
stop_daemon() {
  local comm="$1" pidfile="$2" pids alive i stage
  local -A wait_s=([qconf]=30 [TERM]=15 [KILL]=5)
  shift 2
  pids="$(daemon_pids "$comm" "$pidfile")"
  if [[ -z "$pids" ]]; then
    log "$comm not running"
    rm -f "$pidfile"
    return 0
  fi
  log "stopping $comm (pid $(paste -sd" " <<<"$pids"))"
  for stage in qconf TERM KILL; do
    case "$stage" in
      qconf) qconf "$@" >/dev/null 2>&1 || true ;;
      *) for p in $pids; do kill "-$stage" "$p" 2>/dev/null || true; done ;;
    esac
    for ((i = 0; i < wait_s[$stage] * 4; i++)); do
      alive=""
      for p in $pids; do [[ -d "/proc/$p" ]] && alive+=" $p"; done
      [[ -z "$alive" ]] && break
      sleep 0.25
    done
    if [[ -z "$alive" ]]; then
      rm -f "$pidfile"
      log "$comm stopped"
      return 0
    fi
    pids="$alive"
  done
  die "could not stop $comm (pids:$alive)"
}

# execd first (needs the qmaster to receive the qconf request), then qmaster.
if ((KILL_JOBS)); then
  stop_daemon sge_execd "$EXECD_PID" -kej "$HOST"
else
  stop_daemon sge_execd "$EXECD_PID" -ke "$HOST"
fi
stop_daemon sge_qmaster "$QMASTER_PID" -km
log "OK: SGE daemons stopped"
