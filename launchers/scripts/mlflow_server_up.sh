#!/usr/bin/env bash
# Bring up an MLflow tracking server backed by PostgreSQL on this machine, idempotently.
#
#   launchers/scripts/mlflow_server_up.sh        # prints the tracking URI as its last line
#   dpsweep tracking.uri=http://127.0.0.1:5005 ...
#
# Steps, each skipped when already done (a second run with everything up takes about a second):
#   1. install Debian's postgresql (apt-get) if missing;
#   2. create the PostgreSQL cluster $DPSWEEP_PG_CLUSTER listening on 127.0.0.1:$DPSWEEP_PG_PORT only,
#      and start it with pg_ctlcluster (no systemd needed);
#   3. create the role and database (password auth over loopback);
#   4. install the PostgreSQL driver that SQLAlchemy picks for the backend URI into $DPSWEEP_VENV;
#   5. start `mlflow server` detached (setsid + nohup, log and pid file in $DPSWEEP_MLFLOW_HOME)
#      unless /health already answers on the port, then wait until /health answers OK.
# Must run as root (apt-get, pg_createcluster). Stop everything with mlflow_server_down.sh.
#
# Environment (defaults in brackets):
#   DPSWEEP_VENV                 virtualenv whose `mlflow` runs the server      [<repo>/.venv]
#   DPSWEEP_PG_PORT              PostgreSQL port on 127.0.0.1                   [5433]
#   DPSWEEP_PG_VERSION           PostgreSQL major version                       [newest installed]
#   DPSWEEP_PG_CLUSTER           cluster name (pg_lsclusters)                   [dpsweep]
#   DPSWEEP_PG_USER / _PASSWORD / _DB   role, its password, database          [mlflow / mlflow / mlflow]
#   DPSWEEP_PG_MAX_CONNECTIONS   max_connections of the cluster      [max(200, workers x pool + 40)]
#   DPSWEEP_MLFLOW_HOST          interface mlflow binds to                      [127.0.0.1]
#   DPSWEEP_MLFLOW_PORT          mlflow port                                    [5005]
#   DPSWEEP_MLFLOW_WORKERS       uvicorn worker processes                       [4]
#   DPSWEEP_MLFLOW_HOME          log, pid file and artifacts/                   [/var/lib/dpsweep-mlflow]
#   DPSWEEP_MLFLOW_ALLOWED_HOSTS --allowed-hosts (needed when clients use a hostname that is
#                                not localhost or a private IP)                 [mlflow's default]
#   DPSWEEP_MLFLOW_START_TIMEOUT seconds to wait for /health                    [180]
#   MLFLOW_SERVER_ENABLE_JOB_EXECUTION  mlflow's GenAI job runner (7 extra huey processes of
#                                ~250 MB each; dpsweep does not use it)         [false]
#   MLFLOW_SQLALCHEMYSTORE_POOL_SIZE / _MAX_OVERFLOW  database connections per worker  [10 / 30]
set -euo pipefail

log() { printf '[mlflow_server_up] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${DPSWEEP_VENV:-$repo/.venv}
pg_port=${DPSWEEP_PG_PORT:-5433}
pg_cluster=${DPSWEEP_PG_CLUSTER:-dpsweep}
pg_user=${DPSWEEP_PG_USER:-mlflow}
pg_password=${DPSWEEP_PG_PASSWORD:-mlflow}
pg_db=${DPSWEEP_PG_DB:-mlflow}
mlflow_host=${DPSWEEP_MLFLOW_HOST:-127.0.0.1}
mlflow_port=${DPSWEEP_MLFLOW_PORT:-5005}
mlflow_workers=${DPSWEEP_MLFLOW_WORKERS:-4}
# Each uvicorn worker runs MLflow's (Flask) handlers in a pool of 40 threads but SQLAlchemy's default
# pool holds 5+10 connections: a burst of slow requests to one worker then waits up to 30 s for a
# connection, then fails. Give every thread a connection, and PostgreSQL room for all of them.
export MLFLOW_SQLALCHEMYSTORE_POOL_SIZE=${MLFLOW_SQLALCHEMYSTORE_POOL_SIZE:-10}
export MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW=${MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW:-30}
pool=$((MLFLOW_SQLALCHEMYSTORE_POOL_SIZE + MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW))
pg_max_connections=${DPSWEEP_PG_MAX_CONNECTIONS:-$((mlflow_workers * pool + 40 > 200 ? mlflow_workers * pool + 40 : 200))}
mlflow_home=${DPSWEEP_MLFLOW_HOME:-/var/lib/dpsweep-mlflow}
start_timeout=${DPSWEEP_MLFLOW_START_TIMEOUT:-180}
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}

python=$venv/bin/python
tracking_uri="http://127.0.0.1:$mlflow_port"
health_url="$tracking_uri/health"

[[ $(id -u) -eq 0 ]] || die "run as root (it installs packages and manages a PostgreSQL cluster)"
[[ -x $venv/bin/mlflow ]] || die "no mlflow in the virtualenv $venv (set DPSWEEP_VENV)"

health_ok() { [[ $(curl -fsS --max-time 3 "$health_url" 2>/dev/null) == OK ]]; }
as_postgres() { runuser -u postgres -- "$@"; }
psql_admin() { as_postgres psql -X -q -v ON_ERROR_STOP=1 -p "$pg_port" -d postgres "$@"; }

# --- 1. PostgreSQL packages ---------------------------------------------------------------------
missing=()
dpkg-query -W -f='${Status}' postgresql 2>/dev/null | grep -q 'install ok installed' || missing+=(postgresql)
command -v curl >/dev/null || missing+=(curl)
if ((${#missing[@]})); then
    # Debian's postinst also creates (and tries to start) a cluster 'main' on port 5432; it is left alone.
    log "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
if [[ -z ${DPSWEEP_PG_VERSION:-} ]]; then
    DPSWEEP_PG_VERSION=$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -n | tail -n1)
fi
pg_version=$DPSWEEP_PG_VERSION
[[ -x /usr/lib/postgresql/$pg_version/bin/postgres ]] || die "PostgreSQL $pg_version is not installed"

# --- 2. the cluster: 127.0.0.1:$pg_port only, started without systemd ------------------------------
install -d -o postgres -g postgres -m 2775 /var/run/postgresql  # socket dir (tmpfiles.d without systemd)
if ! pg_lsclusters -h | awk -v v="$pg_version" -v c="$pg_cluster" '$1 == v && $2 == c {found = 1} END {exit !found}'
then
    log "creating PostgreSQL $pg_version cluster '$pg_cluster' on 127.0.0.1:$pg_port"
    pg_createcluster --quiet --port "$pg_port" --locale C.UTF-8 --start-conf manual \
        "$pg_version" "$pg_cluster" -- --auth-local=peer --auth-host=scram-sha-256 >&2
fi
restart=no
if [[ $(pg_conftool -s "$pg_version" "$pg_cluster" show port 2>/dev/null) != "$pg_port" ]]; then
    log "setting port=$pg_port"
    pg_conftool "$pg_version" "$pg_cluster" set port "$pg_port"
    restart=yes
fi
# Not with pg_conftool/pg_createcluster -o: they write 127.0.0.1 unquoted (it looks like a number),
# a syntax error for PostgreSQL. The conf.d/ file is read after postgresql.conf, so it wins.
conf_d=/etc/postgresql/$pg_version/$pg_cluster/conf.d/dpsweep.conf
want_conf=$(printf "# written by dpsweep's mlflow_server_up.sh\nlisten_addresses = '127.0.0.1'\nmax_connections = %d\n" \
    "$pg_max_connections")
if [[ ! -f $conf_d || $(<"$conf_d") != "$want_conf" ]]; then
    log "writing $conf_d"
    install -d -o postgres -g postgres "$(dirname "$conf_d")"
    printf '%s\n' "$want_conf" >"$conf_d"
    chown postgres:postgres "$conf_d"
    restart=yes
fi
status=$(pg_lsclusters -h | awk -v v="$pg_version" -v c="$pg_cluster" '$1 == v && $2 == c {print $4}')
if [[ $status == online* && $restart == yes ]]; then
    log "restarting cluster '$pg_cluster' for the new settings"
    pg_ctlcluster "$pg_version" "$pg_cluster" restart
elif [[ $status != online* ]]; then
    log "starting cluster '$pg_cluster'"
    pg_ctlcluster "$pg_version" "$pg_cluster" start
fi

# --- 3. role and database -----------------------------------------------------------------------
# psql variables (:'x' literal, :"x" identifier) do the quoting; they only work on stdin, not -c.
psql_admin -v role="$pg_user" -v pw="$pg_password" <<'SQL'
SELECT NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') AS missing \gset
\if :missing
CREATE ROLE :"role" LOGIN;
\endif
ALTER ROLE :"role" WITH LOGIN PASSWORD :'pw';
SQL
# The MLflow backend store, and a second database for Optuna studies (storage
# postgresql://<user>:<password>@127.0.0.1:<port>/<optuna db>): both keep an alembic_version
# table, so they cannot share one database.
pg_optuna_db=${DPSWEEP_PG_OPTUNA_DB:-optuna}
for db in "$pg_db" "$pg_optuna_db"; do
    if [[ -z $(psql_admin -tA -v db="$db" <<<"SELECT 1 FROM pg_database WHERE datname = :'db'") ]]; then
        log "creating database '$db'"
        as_postgres createdb -p "$pg_port" -O "$pg_user" -E UTF8 "$db"
    fi
done

# --- 4. the driver SQLAlchemy uses for the backend URI --------------------------------------------
# postgresql:// means psycopg (v3) with SQLAlchemy >= 2.1 and psycopg2 with SQLAlchemy < 2.1.
backend_uri=$("$python" - "$pg_user" "$pg_password" "$pg_port" "$pg_db" <<'PY'
import sys
from urllib.parse import quote

user, password, port, db = sys.argv[1:]
print(f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{port}/{quote(db, safe='')}")
PY
)
driver=$("$python" - "$backend_uri" <<'PY'
import sys

from sqlalchemy.engine import make_url

dialect = make_url(sys.argv[1]).get_dialect()
try:
    dialect.import_dbapi()
    print("ok")
except ImportError:
    print(dialect.driver)
PY
)
case $driver in
    ok) ;;
    psycopg) requirement="psycopg[binary]>=3.1" ;;
    psycopg2) requirement="psycopg2-binary>=2.9" ;;
    *) die "unexpected PostgreSQL driver '$driver' for $backend_uri" ;;
esac
if [[ $driver != ok ]]; then
    log "installing $requirement into $venv"
    "$python" -m pip install --quiet "$requirement" >&2
fi

# --- 5. the mlflow server -----------------------------------------------------------------------
pid_file=$mlflow_home/mlflow.pid
log_file=$mlflow_home/mlflow.log
install -d -m 0755 "$mlflow_home" "$mlflow_home/artifacts"
# Process group of the server this script started (setsid: the group id is the CLI's pid), if any of
# its processes still run ("" for a stale pid file or a reused pid).
server_pid() {
    local pid
    pid=$(cat "$pid_file" 2>/dev/null) || return 0
    [[ $pid =~ ^[0-9]+$ ]] && ps -eo pgid=,args= | awk -v g="$pid" '$1 == g' | grep -q mlflow && echo "$pid"
    return 0
}

if health_ok; then
    if [[ -n $(server_pid) ]]; then
        log "mlflow server already up on port $mlflow_port (pid $(server_pid))"
    else
        log "WARNING: something not started by this script answers /health on port $mlflow_port; using it"
    fi
else
    if [[ -n $(server_pid) ]]; then
        log "mlflow server (pid $(server_pid)) is running but not healthy yet; waiting for it"
    else
        args=(server --host "$mlflow_host" --port "$mlflow_port" --workers "$mlflow_workers"
            --serve-artifacts --artifacts-destination "$mlflow_home/artifacts")
        # --app-name dpsweep: MLflow's app with a page that opens every way in on model training, not
        # MLflow 3's GenAI overview (dpsweep.tracking.ui_server, the entry point mlflow.app), where the
        # venv has dpsweep; a venv of MLflow alone serves MLflow's own page
        if "$venv/bin/python" -c 'import sys, importlib.metadata as m; sys.exit(not any(e.name == "dpsweep" for e in m.entry_points(group="mlflow.app")))' 2>/dev/null; then
            args+=(--app-name dpsweep)
        else
            log "no dpsweep in $venv: MLflow's own page (links without workflowType open on its GenAI view)"
        fi
        [[ -n ${DPSWEEP_MLFLOW_ALLOWED_HOSTS:-} ]] && args+=(--allowed-hosts "$DPSWEEP_MLFLOW_ALLOWED_HOSTS")
        log "starting mlflow server on $mlflow_host:$mlflow_port (log: $log_file)"
        printf '\n=== %s mlflow %s (backend store: %s)\n' "$(date -Is)" "${args[*]}" \
            "$(sed -E 's#(//[^:/]*:)[^@]*@#\1***@#' <<<"$backend_uri")" >>"$log_file"
        # The backend URI goes in mlflow's env var MLFLOW_BACKEND_STORE_URI, not on the command line,
        # so the password does not show in ps.
        export MLFLOW_BACKEND_STORE_URI=$backend_uri
        # setsid: own session and process group, so the server outlives this shell and its caller's
        # process group, and mlflow_server_down.sh can stop the CLI, uvicorn and its workers together.
        # The child is no group leader here, so setsid does not fork and $! is the server's pid.
        cd "$mlflow_home"
        setsid nohup "$venv/bin/mlflow" "${args[@]}" >>"$log_file" 2>&1 </dev/null &
        echo $! >"$pid_file"
        cd - >/dev/null
    fi
    deadline=$((SECONDS + start_timeout))
    until health_ok; do
        # not server_pid: setsid may not have run yet; a zombie counts as dead (PID 1 may reap late)
        if [[ $(ps -o stat= -p "$(cat "$pid_file")" 2>/dev/null || echo Z) == Z* ]]; then
            tail -n 40 "$log_file" >&2
            die "mlflow server exited during start-up (log: $log_file)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 40 "$log_file" >&2
            die "mlflow server did not answer $health_url within ${start_timeout}s (log: $log_file)"
        fi
        sleep 0.5
    done
    log "mlflow server is up (pid $(server_pid))"
fi
echo "$tracking_uri"
