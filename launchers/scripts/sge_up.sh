#!/usr/bin/env bash
# sge_up.sh — idempotently bring up a single-node, loopback-only Son of Grid
# Engine (SGE 8.1.9, Debian packages) cluster on this machine, for tests.
#
# Usage (as root):
#   bash launchers/scripts/sge_up.sh
#
#   Environment knobs (all optional):
#     SGE_UP_SLOTS=<n>      slots of queue all.q (default: the cores, lib.sh cpu_count)
#     SGE_UP_TIMEOUT=<s>    seconds to wait for daemons / queue (default: 60)
#
# What it does (each step is a no-op when already in the desired state, so a
# second run takes about a second):
#   1. installs gridengine-master/-exec/-client (debconf preseeded) if missing
#   2. makes 127.0.0.1 resolve to `hostname` first in /etc/hosts (backup kept
#      in /etc/hosts.dpsweep-sge.bak) — qmaster rejects clients whose address
#      reverse-resolves to another name ("localhost")
#   3. writes that hostname to $SGE_ROOT/$SGE_CELL/common/act_qmaster
#   4. starts sge_qmaster, configures the cluster (submit/admin host, global
#      config with min_uid/min_gid 0 and immediate accounting flush, fast
#      scheduler, host group @allhosts, PE smp, queue all.q), starts sge_execd
#   5. clears error/disabled states of all.q@<host> and checks it is usable
#   6. writes /etc/profile.d/dpsweep-sge.sh (SGE_ROOT, SGE_CELL)
#
# Exit status: 0 when all.q@<host> is usable; non-zero with an "ERROR:" line
# on stderr otherwise. Daemons are started directly (no systemd needed); stop
# them with launchers/scripts/sge_down.sh.
#
# Client environment: qsub/qstat/qdel/qacct/qconf live in /usr/bin (Debian
# wrappers that default SGE_ROOT/SGE_CELL from /etc/default/gridengine), so a
# process only needs /usr/bin on PATH; exporting SGE_ROOT=/var/lib/gridengine
# and SGE_CELL=default is recommended and harmless.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
sge_environment

SLOTS="${SGE_UP_SLOTS:-$(cpu_count)}"
TIMEOUT="${SGE_UP_TIMEOUT:-60}"
HOST="$(hostname)"
COMMON="$SGE_ROOT/$SGE_CELL/common"
QMASTER_SPOOL=/var/spool/gridengine/qmaster
EXECD_SPOOL=/var/spool/gridengine/execd
PROFILE=/etc/profile.d/dpsweep-sge.sh
HOSTS_BACKUP=/etc/hosts.dpsweep-sge.bak
PKGS=(gridengine-master gridengine-exec gridengine-client)
TMP="$(mktemp -d /tmp/sge_up.XXXXXX)"
trap 'rm -rf "$TMP"' EXIT

log() { echo "[sge_up] $*"; }
die() { echo "[sge_up] ERROR: $*" >&2; exit 1; }

[[ "$(id -u)" == 0 ]] || die "must run as root"
[[ "$SLOTS" =~ ^[1-9][0-9]*$ ]] || die "bad SGE_UP_SLOTS=$SLOTS"

# --------------------------------------------------------------- helpers ---

# pid_alive <pidfile> <comm>: true if the pid in <pidfile> runs program <comm>.
pid_alive() {
  local pid
  [[ -r "$1" ]] || return 1
  pid="$(tr -dc 0-9 <"$1")"
  [[ -n "$pid" ]] || return 1
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]]
}
qmaster_running() { pid_alive "$QMASTER_SPOOL/qmaster.pid" sge_qmaster; }
execd_running() { pid_alive "$EXECD_SPOOL/$HOST/execd.pid" sge_execd; }

# start_daemon <binary>: start an SGE daemon with a clean environment, detached
# from our stdio (so callers capturing our output never hang on it).
start_daemon() {
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C \
    SGE_ROOT="$SGE_ROOT" SGE_CELL="$SGE_CELL" \
    setsid "$1" </dev/null >/dev/null 2>&1
}

# poll <seconds> <command...>: run a command every 0.25 s until it succeeds
# (return 0) or <seconds> have passed (return 1).
poll() {
  local deadline=$((SECONDS + $1))
  shift
  while :; do
    if "$@" >/dev/null 2>&1; then return 0; fi
    ((SECONDS < deadline)) || return 1
    sleep 0.25
  done
}

# wait_for <description> <command...>: poll for $TIMEOUT s or die.
wait_for() {
  local what="$1"
  shift
  poll "$TIMEOUT" "$@" || die "timed out after ${TIMEOUT}s waiting for $what"
}

# conf_value <file> <key>: value of <key> in a qconf "key value..." listing
# (continuation lines ending in "\" are joined first).
conf_value() {
  sed -e ':a' -e '/\\$/N; s/\\\n[[:space:]]*/ /; ta' "$1" |
    awk -v k="$2" '$1 == k { $1 = ""; sub(/^ +/, ""); print; exit }'
}

# set_conf_value <file> <key> <value>: rewrite <file> with <key> set.
set_conf_value() {
  sed -e ':a' -e '/\\$/N; s/\\\n[[:space:]]*/ /; ta' "$1" |
    awk -v k="$2" -v v="$3" '
      $1 == k { printf "%-32s %s\n", k, v; found = 1; next }
      { print }
      END { if (!found) printf "%-32s %s\n", k, v }' >"$1.new"
  mv "$1.new" "$1"
}

# ------------------------------------------------- 1. packages (debconf) ---

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' ||
    missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]} (debconf preseeded: cell=$SGE_CELL master=$HOST)"
  debconf-set-selections <<EOF
gridengine-common shared/gridengineconfig boolean true
gridengine-common shared/gridenginecell string $SGE_CELL
gridengine-common shared/gridenginemaster string $HOST
EOF
  apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 \
      install -y --no-install-recommends "${PKGS[@]}" >"$TMP/apt.log" 2>&1
  }
  if ! apt_install; then
    log "apt-get install failed; running apt-get update and retrying"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update \
      >>"$TMP/apt.log" 2>&1 || true
    apt_install || { tail -20 "$TMP/apt.log" >&2; die "apt-get install failed"; }
  fi
fi

# The postinst only initialises the cluster spool when the debconf answer
# shared/gridengineconfig was true; do it ourselves if that did not happen.
if [[ ! -e /var/spool/gridengine/spooldb/sge ]]; then
  log "initialising cluster spool"
  mkdir -p "$COMMON" "$QMASTER_SPOOL/job_scripts" /var/spool/gridengine/spooldb "$EXECD_SPOOL"
  chown sgeadmin:sgeadmin "$SGE_ROOT" "$SGE_ROOT/$SGE_CELL" "$COMMON" \
    "$QMASTER_SPOOL" "$QMASTER_SPOOL/job_scripts" /var/spool/gridengine/spooldb "$EXECD_SPOOL"
  [[ -e "$COMMON/bootstrap" ]] ||
    install -m0644 -o sgeadmin -g sgeadmin /usr/share/gridengine/default-bootstrap "$COMMON/bootstrap"
  su -s /bin/sh -c "/usr/share/gridengine/scripts/init_cluster $SGE_ROOT $SGE_CELL /var/spool/gridengine/spooldb sgeadmin" sgeadmin \
    >"$TMP/init.log" 2>&1 || { cat "$TMP/init.log" >&2; die "init_cluster failed"; }
fi

# ------------------------------------------------------- 2. /etc/hosts ---

# The first line of /etc/hosts must be "127.0.0.1 <host> localhost" so that
# <host> -> 127.0.0.1 (loopback only) and 127.0.0.1 -> <host> (not localhost).
first="$(awk '!/^[[:space:]]*(#|$)/ { print $1, $2; exit }' /etc/hosts)"
if [[ "$first" != "127.0.0.1 $HOST" ]]; then
  log "/etc/hosts: putting '127.0.0.1 $HOST localhost' first (backup: $HOSTS_BACKUP)"
  [[ -e "$HOSTS_BACKUP" ]] || cp -a /etc/hosts "$HOSTS_BACKUP"
  {
    printf '127.0.0.1\t%s localhost\t# dpsweep-sge\n' "$HOST"
    grep -v '# dpsweep-sge$' /etc/hosts || true
  } >"$TMP/hosts"
  cat "$TMP/hosts" >/etc/hosts # in place: keeps inode/owner/mode
fi
resolved="$(getent hosts 127.0.0.1 | awk '{ print $2; exit }')"
[[ "$resolved" == "$HOST" ]] || die "127.0.0.1 resolves to '$resolved', expected '$HOST'"
addr="$(getent ahostsv4 "$HOST" | awk '{ print $1; exit }')"
[[ "$addr" == "127.0.0.1" ]] || die "$HOST resolves to '$addr', expected 127.0.0.1"

# ----------------------------------------------------------- 3. qmaster ---

# stop_qmaster: SIGTERM sge_qmaster (controlled shutdown, ~10 s), SIGKILL it
# if it is still there after 30 s.
stop_qmaster() {
  local pid
  pid="$(tr -dc 0-9 <"$QMASTER_SPOOL/qmaster.pid")"
  kill -TERM "$pid" 2>/dev/null || true
  kill -CONT "$pid" 2>/dev/null || true
  if ! poll 30 bash -c "! [[ -d /proc/$pid ]]"; then
    kill -KILL "$pid" 2>/dev/null || true
    wait_for "sge_qmaster to stop" bash -c "! [[ -d /proc/$pid ]]"
  fi
}
start_qmaster() {
  log "starting sge_qmaster"
  start_daemon /usr/sbin/sge_qmaster
  wait_for "sge_qmaster (see $QMASTER_SPOOL/messages)" qmaster_running
}

# A qmaster started while 127.0.0.1 resolved to "localhost" names itself
# "localhost" (it rewrites act_qmaster) and rejects clients: restart it.
if [[ "$(cat "$COMMON/act_qmaster" 2>/dev/null)" != "$HOST" ]]; then
  log "act_qmaster := $HOST"
  echo "$HOST" >"$COMMON/act_qmaster"
  chown sgeadmin:sgeadmin "$COMMON/act_qmaster"
  chmod 644 "$COMMON/act_qmaster"
  if qmaster_running; then
    log "restarting sge_qmaster for the new master name"
    stop_qmaster
  fi
fi

install -d -m 0755 -o sgeadmin -g sgeadmin /run/gridengine
started=0
if ! qmaster_running; then
  start_qmaster
  started=1
fi
if ((started)); then
  wait_for "qmaster to answer qconf (see $QMASTER_SPOOL/messages)" qconf -sh
elif ! poll 15 timeout -k 1 5 qconf -sh; then
  log "sge_qmaster runs but does not answer; restarting it"
  stop_qmaster
  start_qmaster
  wait_for "qmaster to answer qconf (see $QMASTER_SPOOL/messages)" qconf -sh
fi

# ------------------------------------------------- 4. cluster configuration ---

# Admin and submit host (the master host is an admin host by default).
if ! qconf -sh 2>/dev/null | grep -qx "$HOST"; then
  log "adding admin host $HOST"
  qconf -ah "$HOST" >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; die "qconf -ah failed"; }
fi
if ! qconf -ss 2>/dev/null | grep -qx "$HOST"; then
  log "adding submit host $HOST"
  qconf -as "$HOST" >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; die "qconf -as failed"; }
fi

# Global configuration: let root (uid/gid 0) run jobs, write accounting records
# immediately (accounting_flush_time=0) so qacct sees a job as soon as it ends,
# and report load every 10 s (execd also reports job clean-ups then; a job that
# failed before starting cannot be re-dispatched until that report).
qconf -sconf global >"$TMP/global"
global_changed=0
declare -A GLOBAL=(
  [min_uid]=0
  [min_gid]=0
  [load_report_time]=00:00:10
  [reporting_params]="accounting=true reporting=false flush_time=00:00:15 joblog=false sharelog=00:00:00 accounting_flush_time=00:00:00"
)
keys=()
for k in "${!GLOBAL[@]}"; do
  if [[ "$(conf_value "$TMP/global" "$k")" != "${GLOBAL[$k]}" ]]; then
    set_conf_value "$TMP/global" "$k" "${GLOBAL[$k]}"
    keys+=("$k")
  fi
done
if ((${#keys[@]})); then
  log "updating global configuration: ${keys[*]}"
  sed -i '/^#global:/d' "$TMP/global"
  qconf -Mconf "$TMP/global" >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; die "qconf -Mconf failed"; }
  global_changed=1
fi

# Scheduler: run every second and right after submits/finishes; no artificial
# load adjustments (with 2 cores they push the queue into alarm state).
qconf -ssconf >"$TMP/sconf"
declare -A SCHED=(
  [schedule_interval]=0:0:1
  [flush_submit_sec]=1
  [flush_finish_sec]=1
  [job_load_adjustments]=NONE
  [load_adjustment_decay_time]=0:0:0
)
keys=()
for k in "${!SCHED[@]}"; do
  if [[ "$(conf_value "$TMP/sconf" "$k")" != "${SCHED[$k]}" ]]; then
    set_conf_value "$TMP/sconf" "$k" "${SCHED[$k]}"
    keys+=("$k")
  fi
done
if ((${#keys[@]})); then
  log "updating scheduler configuration: ${keys[*]}"
  qconf -Msconf "$TMP/sconf" >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; die "qconf -Msconf failed"; }
fi

# Host group @allhosts = this host.
if ! qconf -shgrp @allhosts >"$TMP/hgrp" 2>/dev/null; then
  log "creating host group @allhosts"
  printf 'group_name @allhosts\nhostlist %s\n' "$HOST" >"$TMP/allhosts"
  qconf -Ahgrp "$TMP/allhosts" >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; die "qconf -Ahgrp failed"; }
elif [[ "$(conf_value "$TMP/hgrp" hostlist)" != "$HOST" ]]; then
  log "setting @allhosts hostlist to $HOST"
  qconf -mattr hostgroup hostlist "$HOST" @allhosts >"$TMP/out" 2>&1 ||
    { cat "$TMP/out" >&2; die "qconf -mattr hostgroup failed"; }
fi

# Parallel environment "smp" (all slots on one host) for multi-core jobs:
# qsub -pe smp <ncpus>.
if ! qconf -sp smp >/dev/null 2>&1; then
  log "creating parallel environment smp"
  cat >"$TMP/smp" <<'EOF'
pe_name            smp
slots              99999
user_lists         NONE
xuser_lists        NONE
start_proc_args    NONE
stop_proc_args     NONE
allocation_rule    $pe_slots
control_slaves     FALSE
job_is_first_task  TRUE
urgency_slots      min
accounting_summary FALSE
qsort_args         NONE
EOF
  qconf -Ap "$TMP/smp" >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; die "qconf -Ap smp failed"; }
fi

# Queue all.q on @allhosts. Attributes we insist on:
declare -A QUEUE=(
  [hostlist]=@allhosts
  [slots]="$SLOTS"
  [shell]=/bin/bash
  [load_thresholds]=NONE
  [pe_list]=smp
)
if ! qconf -sq all.q >"$TMP/q" 2>/dev/null; then
  log "creating queue all.q (slots=$SLOTS)"
  qconf -sq >"$TMP/q" # the built-in template
  set_conf_value "$TMP/q" qname all.q
  for k in "${!QUEUE[@]}"; do set_conf_value "$TMP/q" "$k" "${QUEUE[$k]}"; done
  qconf -Aq "$TMP/q" >"$TMP/out" 2>&1 || { cat "$TMP/out" >&2; die "qconf -Aq all.q failed"; }
else
  for k in "${!QUEUE[@]}"; do
    if [[ "$(conf_value "$TMP/q" "$k")" != "${QUEUE[$k]}" ]]; then
      log "all.q: $k := ${QUEUE[$k]}"
      qconf -mattr queue "$k" "${QUEUE[$k]}" all.q >"$TMP/out" 2>&1 ||
        { cat "$TMP/out" >&2; die "qconf -mattr queue $k failed"; }
    fi
  done
fi

# ------------------------------------------------------------- 5. execd ---

# A running execd only picks up a changed global configuration lazily (jobs
# were refused with "gid of user root (0) less than minimum allowed" for ~40 s):
# restart it. Running jobs survive (their sge_shepherd keeps running).
if ((global_changed)) && execd_running; then
  log "restarting sge_execd to apply the global configuration"
  pid="$(tr -dc 0-9 <"$EXECD_SPOOL/$HOST/execd.pid")"
  qconf -ke "$HOST" >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true
  wait_for "sge_execd to stop" bash -c "! [[ -d /proc/$pid ]]"
fi
if ! execd_running; then
  log "starting sge_execd"
  start_daemon /usr/sbin/sge_execd
  wait_for "sge_execd (see $EXECD_SPOOL/$HOST/messages)" execd_running
fi

# Queue instance state: the column after "arch" in `qstat -f` (empty = OK).
qi_state() { qstat -f -q "all.q@$HOST" | awk -v q="all.q@$HOST" '$1 == q { print ($6 == "" ? "ok" : $6) }'; }
qi_usable() { [[ "$(qi_state)" == ok ]]; }
state="$(qi_state)"
if [[ "$state" == *E* ]]; then log "clearing error state of all.q@$HOST"; qmod -c "all.q@$HOST" >/dev/null 2>&1 || true; fi
if [[ "$state" == *d* ]]; then log "enabling all.q@$HOST"; qmod -e "all.q@$HOST" >/dev/null 2>&1 || true; fi
if ! qi_usable; then
  log "waiting for all.q@$HOST (state: ${state:-missing})"
  poll "$TIMEOUT" qi_usable ||
    die "all.q@$HOST not usable after ${TIMEOUT}s (state: $(qi_state)); see: qstat -f -explain aAcE"
fi

# ---------------------------------------------------- 6. client environment ---

cat >"$TMP/profile" <<EOF
# Written by dpsweep launchers/scripts/sge_up.sh: Son of Grid Engine client env.
export SGE_ROOT=$SGE_ROOT
export SGE_CELL=$SGE_CELL
EOF
if ! cmp -s "$TMP/profile" "$PROFILE"; then
  log "writing $PROFILE"
  install -m 0644 "$TMP/profile" "$PROFILE"
fi
command -v qsub >/dev/null || die "qsub not on PATH"

log "OK: all.q@$HOST usable ($(qstat -f -q "all.q@$HOST" | awk -v q="all.q@$HOST" '$1 == q { print "resv/used/tot " $3 }'))"
echo "export SGE_ROOT=$SGE_ROOT SGE_CELL=$SGE_CELL  # qsub: $(command -v qsub)"
