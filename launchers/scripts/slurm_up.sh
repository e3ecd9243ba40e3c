#!/usr/bin/env bash
# slurm_up.sh -- idempotently bring up a single-node, loopback-only Slurm
# cluster on this machine (Debian 12, Slurm 22.05), for dpsweep's Slurm
# launcher tests.
#
# Usage (as root):
#   bash launchers/scripts/slurm_up.sh
#
# Environment (all optional):
#   SLURM_UP_TIMEOUT     seconds to wait for the node to become usable (default 60)
#   SLURM_UP_ACCOUNTING  none (default) or slurmdbd.
#                        none: AccountingStorageType=accounting_storage/none; every
#                          daemon listens on loopback only. dpsweep's Slurm launcher
#                          then reads job states from squeue (plain submitit needs
#                          sacct to notice jobs that died without a result).
#                        slurmdbd: MariaDB (unix socket only) + slurmdbd, so that
#                          `sacct` works; note that Slurm 22.05's slurmdbd listens on
#                          all addresses (port 6819): do not use it on a shared network.
#
# What it does, each step skipped when already done:
#   1. installs Debian's slurm-wlm and munge (+ slurmdbd, mariadb-server for
#      accounting); apt-get update only if the install fails without it;
#   2. prepares munge dirs, creates a key with `mungekey -c`, starts munged;
#   3. writes /etc/slurm/slurm.conf (+ slurmdbd.conf) only if missing or different;
#   4. starts mariadbd + slurmdbd (accounting), then slurmctld, then slurmd, as
#      plain daemons (no systemd), restarting those whose configuration changed;
#   5. waits until the node is idle/mixed/allocated (resuming it if it is
#      down or drained).
#
# Result: cluster "dpsweep", default partition "debug" with one node named
# `hostname -s`, NodeAddr 127.0.0.1, CPUs=$(cpu_count), RealMemory = 90% of
# MemTotal.  A second slurmd on this machine is a second node, `hostname -s`-n2
# (port 6828), and partition "nodes2" holds both: a job of several nodes
# (dpsweep's train.nodes) runs there for real, its tasks on two slurmd with
# their own SLURM_NODEID.  Both nodes count this machine's CPUs; only jobs
# sent to nodes2 use the second.  slurmctld (6817) and slurmd (6818) listen
# on 127.0.0.1 only --
# provided `hostname` resolves to 127.0.0.1, else on all addresses (see the
# CommunicationParameters note below).  MariaDB has no TCP listener (unix
# socket only).  NOTE: slurmdbd (6819) cannot be restricted to loopback in
# Slurm 22.05 and always binds 0.0.0.0 (it only accepts munge-authenticated
# requests).
# Exits 0 when the cluster accepts jobs, non-zero with a message otherwise.
# Stop it again with launchers/scripts/slurm_down.sh.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

log() { printf '[slurm_up] %s\n' "$*"; }
die() { printf '[slurm_up] ERROR: %s\n' "$*" >&2; exit 1; }

START_TS=$(date +%s)
TIMEOUT=${SLURM_UP_TIMEOUT:-60}
ACCOUNTING=${SLURM_UP_ACCOUNTING:-none}
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
CTLD_PID=/run/slurmctld.pid
SLURMD_PIDS=/run/slurmd-%n.pid   # %n: the node's name; one slurmd a node
DBD_PID=/run/slurmdbd.pid
MUNGE_PID=/run/munge/munged.pid
MARIADB_PID=/run/mysqld/mysqld.pid
CLUSTER=dpsweep

[ "$(id -u)" -eq 0 ] || die "must be run as root"
case "$ACCOUNTING" in
    slurmdbd|none) ;;
    *) die "SLURM_UP_ACCOUNTING must be 'slurmdbd' or 'none', not '$ACCOUNTING'" ;;
esac

# Short hostname: the node name slurmd derives for itself.
HOST=$(hostname -s)
[ -n "$HOST" ] || die "cannot determine hostname"
HOST2="${HOST}-n2"   # the second node: a second slurmd on this machine
NODES=("$HOST" "$HOST2")
slurmd_pidfile() { echo "${SLURMD_PIDS//%n/$1}"; }

# ---------------------------------------------------------------------------
# 1. Packages
# ---------------------------------------------------------------------------
pkg_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 \
        install -y --no-install-recommends "$@"
}

wanted=(slurm-wlm munge)
[ "$ACCOUNTING" = slurmdbd ] && wanted+=(slurmdbd mariadb-server)
missing=()
for p in "${wanted[@]}"; do
    pkg_installed "$p" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    if ! apt_install "${missing[@]}"; then
        log "install failed; running apt-get update and retrying"
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update
        apt_install "${missing[@]}" || die "could not install ${missing[*]}"
    fi
fi
for b in slurmctld slurmd munged mungekey sinfo scontrol; do
    command -v "$b" >/dev/null || die "$b not found after install"
done

# ---------------------------------------------------------------------------
# Process helpers.  A daemon is "running" when its pidfile names a live
# process with the expected command name, or (fallback) a live process with
# exactly that command name exists.
# ---------------------------------------------------------------------------

stop_daemon() { # $1 = name, $2 = pidfile; SIGTERM, wait up to 30 s, SIGKILL
    local name=$1 pidfile=$2 pid
    pid=$(daemon_pid "$name" "$pidfile")
    [ -n "$pid" ] || return 0
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do
        alive "$pid" || return 0
        sleep 0.5
    done
    log "$name did not stop in 30 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

wait_for() { # $1 = tries (0.5 s apart), $2 = failure message, rest = command
    local tries=$1 msg=$2
    shift 2
    for _ in $(seq 1 "$tries"); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    die "$msg"
}

# ---------------------------------------------------------------------------
# 2. Munge
# ---------------------------------------------------------------------------
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/log/munge /etc/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
if [ ! -s /etc/munge/munge.key ]; then
    log "creating munge key"
    runuser -u munge -- mungekey -c -k /etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key
chmod 0600 /etc/munge/munge.key

if [ -z "$(daemon_pid munged "$MUNGE_PID")" ]; then
    log "starting munged"
    # A stale socket/lock from a killed munged would make it refuse to start.
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock "$MUNGE_PID"
    runuser -u munge -- munged
fi
munge_ok() { munge -n | unmunge; }
wait_for 20 "munge does not work (see /var/log/munge/munged.log)" munge_ok

# ---------------------------------------------------------------------------
# 3. Configuration files
# ---------------------------------------------------------------------------
NCPU=$(cpu_count)
MEM_KB=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
REAL_MEM=$((MEM_KB * 9 / 10 / 1024))   # ~90% of MemTotal, in MiB

install -d -m 0755 /etc/slurm /var/log/slurm "/var/spool/slurmd/$HOST" "/var/spool/slurmd/$HOST2"
install -d -m 0755 /var/lib/slurm /var/lib/slurm/slurmctld

tmpdir=$(mktemp -d)
trap 'rm -rf "$tmpdir"' EXIT

# Loopback-only binding.  With CommunicationParameters=NoInAddrAny Slurm
# 22.05 binds slurmctld, slurmd and srun's listening sockets to the address
# that `hostname` resolves to (not to SlurmctldHost's/NodeAddr's address), and
# they fail outright when the hostname does not resolve.  So use it only when
# the hostname resolves to exactly 127.0.0.1; otherwise listen on all
# addresses (INADDR_ANY), which works whatever /etc/hosts says.
HOST_IP=$(getent ahostsv4 "$HOST" 2>/dev/null | awk 'NR == 1 {print $1}' || true)
if [ "$HOST_IP" = 127.0.0.1 ]; then
    COMM_LINES="# $HOST resolves to 127.0.0.1: bind slurmctld, slurmd and srun to it
# instead of INADDR_ANY (loopback only).
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"
else
    log "WARNING: $HOST resolves to '${HOST_IP:-nothing}', not 127.0.0.1: slurmctld/slurmd will listen on all addresses"
    COMM_LINES="# $HOST does not resolve to 127.0.0.1 (got '${HOST_IP:-nothing}'), so the daemons
# bind INADDR_ANY (NoInAddrAny would bind to that address or fail)."
fi

if [ "$ACCOUNTING" = slurmdbd ]; then
    ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819"
else
    ACCT_LINES="AccountingStorageType=accounting_storage/none"
fi

cat >"$tmpdir/slurm.conf" <<EOF
# Generated by dpsweep launchers/scripts/slurm_up.sh -- do not edit by hand,
# the script rewrites it whenever its content differs.
# Single-node, loopback-only test cluster.
ClusterName=${CLUSTER}
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldAddr=127.0.0.1
${COMM_LINES}
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CryptoType=crypto/munge
# Job credential lifetime; also how long a requeued job must wait before it
# may start again (Slurm's default of 120 s is far too long for tests).
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${SLURMD_PIDS}
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# batch_sched_delay=0: try to start batch jobs at submit time (default: up to
# 3 s later).  sched_interval=5: the full main scheduling pass -- the one that
# starts jobs whose BeginTime has passed, e.g. requeued jobs -- runs every 5 s
# instead of 60 s.  bf_interval=5: backfill every 5 s instead of 30 s.
SchedulerParameters=batch_sched_delay=0,sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
${ACCT_LINES}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Jobs are requeueable by default (no --requeue needed).
JobRequeue=1
ReturnToService=2
MaxArraySize=10001
MaxJobCount=50000
# Finished jobs stay visible to scontrol/squeue for 5 minutes.
MinJobAge=300
# Seconds between SIGTERM and SIGKILL when a job is cancelled/requeued/timed out.
KillWait=10
InactiveLimit=0
SlurmctldTimeout=120
SlurmdTimeout=300
Waittime=0
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${NCPU} RealMemory=${REAL_MEM} State=UNKNOWN
NodeName=${HOST2} NodeAddr=127.0.0.1 Port=6828 CPUs=${NCPU} RealMemory=${REAL_MEM} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=nodes2 Nodes=${HOST},${HOST2} MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

cat >"$tmpdir/slurmdbd.conf" <<EOF
# Generated by dpsweep launchers/scripts/slurm_up.sh -- do not edit by hand.
AuthType=auth/munge
DbdHost=${HOST}
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=/var/log/slurm/slurmdbd.log
PidFile=${DBD_PID}
DebugLevel=info
# MariaDB via its unix socket ("localhost"), as root (unix_socket auth).
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF

update_file() { # $1 = new content file, $2 = target, $3 = mode; 0 if changed
    if [ -f "$2" ] && cmp -s "$1" "$2"; then
        return 1
    fi
    log "writing $2"
    install -m "$3" "$1" "$2"
    return 0
}

conf_changed=0
if update_file "$tmpdir/slurm.conf" "$CONF" 0644; then
    conf_changed=1
    log "node $HOST: CPUs=$NCPU RealMemory=$REAL_MEM, accounting=$ACCOUNTING"
fi
dbd_conf_changed=0
if [ "$ACCOUNTING" = slurmdbd ] && update_file "$tmpdir/slurmdbd.conf" "$DBD_CONF" 0600; then
    dbd_conf_changed=1
fi

# Restart whatever runs with an old configuration.
if [ "$conf_changed" -eq 1 ]; then
    stop_daemon slurmd /run/slurmd.pid   # (one node, as earlier versions of this script ran it)
    for node in "${NODES[@]}"; do stop_daemon slurmd "$(slurmd_pidfile "$node")"; done
    stop_daemon slurmctld "$CTLD_PID"
fi
if [ "$dbd_conf_changed" -eq 1 ]; then
    stop_daemon slurmdbd "$DBD_PID"
fi

# ---------------------------------------------------------------------------
# 4a. Accounting: MariaDB (no TCP listener) and slurmdbd
# ---------------------------------------------------------------------------
if [ "$ACCOUNTING" = slurmdbd ]; then
    install -d -o mysql -g mysql -m 0755 /run/mysqld /var/log/mysql
    if [ ! -d /var/lib/mysql/mysql ]; then
        log "initialising MariaDB data directory"
        mariadb-install-db --user=mysql --datadir=/var/lib/mysql \
            --auth-root-authentication-method=socket >/dev/null
    fi
    if [ -z "$(daemon_pid mariadbd "$MARIADB_PID")" ]; then
        log "starting mariadbd"
        # --no-defaults: independent of /etc/mysql; --skip-networking: unix
        # socket only, no TCP port.  setsid + redirections: fully detached.
        setsid mariadbd --no-defaults --user=mysql --skip-networking \
            --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
            --pid-file="$MARIADB_PID" --log-error=/var/log/mysql/error.log \
            --innodb-buffer-pool-size=1024M --innodb-lock-wait-timeout=900 \
            </dev/null >/dev/null 2>&1 &
    fi
    wait_for 60 "MariaDB does not answer (see /var/log/mysql/error.log)" \
        mariadb-admin --no-defaults --socket=/run/mysqld/mysqld.sock ping

    if [ -z "$(daemon_pid slurmdbd "$DBD_PID")" ]; then
        log "starting slurmdbd"
        slurmdbd || die "slurmdbd failed to start (see /var/log/slurm/slurmdbd.log)"
    fi
    # The first start creates the database tables (~10 s).
    wait_for 120 "slurmdbd does not answer (see /var/log/slurm/slurmdbd.log)" \
        sacctmgr -n list cluster
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        log "registering cluster $CLUSTER in slurmdbd"
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
fi

# ---------------------------------------------------------------------------
# 4b. slurmctld, then slurmd
# ---------------------------------------------------------------------------
if [ -z "$(daemon_pid slurmctld "$CTLD_PID")" ]; then
    log "starting slurmctld"
    slurmctld || die "slurmctld failed to start (see /var/log/slurm/slurmctld.log)"
fi
# slurmd registers with slurmctld, so let the controller answer first.
ctld_up() { scontrol ping | grep -q 'is UP'; }
wait_for 40 "slurmctld does not answer (see /var/log/slurm/slurmctld.log)" ctld_up

for node in "${NODES[@]}"; do
    if [ -z "$(file_pid slurmd "$(slurmd_pidfile "$node")")" ]; then
        log "starting slurmd of node $node"
        slurmd -N "$node" || die "slurmd of $node failed to start (see /var/log/slurm/slurmd-$node.log)"
    fi
done

# ---------------------------------------------------------------------------
# 5. Wait for the node to be usable
# ---------------------------------------------------------------------------
deadline=$(( $(date +%s) + TIMEOUT ))
for node in "${NODES[@]}"; do
    last_resume=0
    state=""
    while :; do
        state=$(sinfo -h -n "$node" -o %T 2>/dev/null | head -n1 || true)
        case "$state" in
            idle|mixed|allocated|completing)
                break ;;
            down*|drain*|fail*)
                # A "*" suffix means not responding.  Resume at most every 5 s.
                now=$(date +%s)
                if [ $((now - last_resume)) -ge 5 ]; then
                    log "node $node is '$state'; resuming it"
                    scontrol update nodename="$node" state=resume 2>/dev/null || true
                    last_resume=$now
                fi ;;
        esac
        if [ "$(date +%s)" -ge "$deadline" ]; then
            die "node $node not ready after ${TIMEOUT}s (state '${state:-unknown}'); see /var/log/slurm/slurmd-$node.log and slurmctld.log"
        fi
        sleep 0.5
    done
done

log "ready: cluster $CLUSTER, partition debug, node $HOST, partition nodes2, nodes ${NODES[*]} ($state), accounting=$ACCOUNTING, $(( $(date +%s) - START_TS ))s"
