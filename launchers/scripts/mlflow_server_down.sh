#!/usr/bin/env bash
# Stop what mlflow_server_up.sh started: the mlflow server, then the PostgreSQL cluster. Idempotent.
#
#   launchers/scripts/mlflow_server_down.sh           # stop; data and artifacts are kept
#   launchers/scripts/mlflow_server_down.sh --purge   # also delete the cluster, its data and the artifacts
#
# Reads the same DPSWEEP_* variables as mlflow_server_up.sh (DPSWEEP_PG_VERSION, DPSWEEP_PG_CLUSTER,
# DPSWEEP_MLFLOW_PORT, DPSWEEP_MLFLOW_HOME). Only the server recorded in the pid file is stopped; a
# process of someone else's answering on the port is left alone (and reported).
set -euo pipefail

log() { printf '[mlflow_server_down] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

purge=no
case ${1:-} in
    --purge) purge=yes ;;
    "") ;;
    *) die "usage: $0 [--purge]" ;;
esac

pg_cluster=${DPSWEEP_PG_CLUSTER:-dpsweep}
mlflow_port=${DPSWEEP_MLFLOW_PORT:-5005}
mlflow_home=${DPSWEEP_MLFLOW_HOME:-/var/lib/dpsweep-mlflow}
stop_timeout=${DPSWEEP_MLFLOW_STOP_TIMEOUT:-30}
pid_file=$mlflow_home/mlflow.pid

[[ $(id -u) -eq 0 ]] || die "run as root"

# --- the mlflow server: its whole process group (CLI, uvicorn parent, workers) -------------------
pid=$(cat "$pid_file" 2>/dev/null || true)
# mlflow_server_up.sh started the server with setsid, so its processes (the mlflow CLI, uvicorn and
# its workers) form the process group $pid; stop them all, even if the CLI itself has died.
members=
[[ $pid =~ ^[0-9]+$ ]] && members=$(ps -eo pgid=,args= | awk -v g="$pid" '$1 == g')
if grep -q 'mlflow' <<<"$members"; then
    log "stopping mlflow server (process group $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || true
    deadline=$((SECONDS + stop_timeout))
    while kill -0 -- "-$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            log "still running after ${stop_timeout}s; sending SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
else
    log "no mlflow server started by mlflow_server_up.sh is running"
fi
rm -f "$pid_file"
if curl -fsS --max-time 3 "http://127.0.0.1:$mlflow_port/health" >/dev/null 2>&1; then
    log "WARNING: something else still answers on port $mlflow_port; not touching it"
fi

# --- the PostgreSQL cluster ---------------------------------------------------------------------
if command -v pg_lsclusters >/dev/null; then
    if [[ -z ${DPSWEEP_PG_VERSION:-} ]]; then
        DPSWEEP_PG_VERSION=$(pg_lsclusters -h | awk -v c="$pg_cluster" '$2 == c {print $1}' | sort -n | tail -n1)
    fi
    pg_version=$DPSWEEP_PG_VERSION
    status=$(pg_lsclusters -h | awk -v v="$pg_version" -v c="$pg_cluster" '$1 == v && $2 == c {print $4}')
    if [[ $status == online* ]]; then
        log "stopping PostgreSQL cluster $pg_version/$pg_cluster"
        pg_ctlcluster "$pg_version" "$pg_cluster" stop -m fast
    elif [[ -z $status ]]; then
        log "no PostgreSQL cluster '$pg_cluster'"
    else
        log "PostgreSQL cluster $pg_version/$pg_cluster is already $status"
    fi
    if [[ $purge == yes && -n $status ]]; then
        log "deleting cluster $pg_version/$pg_cluster and its data"
        pg_dropcluster "$pg_version" "$pg_cluster"
    fi
    if [[ $purge == yes && -n $pg_version ]]; then  # pg_dropcluster keeps files it did not create (conf.d/)
        rm -rf -- "/etc/postgresql/$pg_version/$pg_cluster"
    fi
fi
if [[ $purge == yes && -d $mlflow_home ]]; then
    log "deleting $mlflow_home (artifacts, log)"
    rm -rf -- "$mlflow_home"
fi
