# lib.sh -- helpers shared by the cluster scripts in this folder (sourced, not run):
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# Process helpers (Slurm's daemons).
alive() { # $1 = pid; true if it exists and is not a zombie
    local st
    st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [ -n "$st" ] && [ "${st#Z}" = "$st" ]
}

file_pid() { # $1 = command name, $2 = pidfile; the pid in the file if that process runs $1
    local name=$1 pidfile=$2 pid
    if [ -r "$pidfile" ]; then
        pid=$(tr -dc '0-9' <"$pidfile" || true)
        if [ -n "$pid" ] && alive "$pid" &&
            [ "$(ps -o comm= -p "$pid" 2>/dev/null || true)" = "$name" ]; then
            echo "$pid"
        fi
    fi
}

daemon_pid() { # $1 = command name, $2 = pidfile; prints pid or nothing
    # Zombies are skipped: PID 1 here may be slow to reap the intermediate
    # processes the daemons leave behind when they fork into the background.
    local pid
    pid=$(file_pid "$1" "$2")
    if [ -n "$pid" ]; then
        echo "$pid"; return 0
    fi
    ps -eo pid=,stat=,comm= | awk -v n="$1" '$3 == n && $2 !~ /^Z/ {print $1; exit}'
}

# Environment for Grid Engine's tools: Debian's wrappers in /usr/bin need SGE_ROOT/SGE_CELL, and
# the tools' output (dates, numbers) stays parseable under LC_ALL=C.
cpu_count() { # the cores this process may use
    # not plain `nproc`: it honours OMP_NUM_THREADS, which test runners set to 1 for torch, and a
    # cluster built under it would get one slot and run its jobs one at a time
    env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc
}

sge_environment() {
    export SGE_ROOT=/var/lib/gridengine
    export SGE_CELL=default
    export PATH="/usr/bin:/usr/sbin:/bin:/sbin:${PATH}"
    export LC_ALL=C
}
