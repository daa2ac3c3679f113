# shellcheck shell=bash
# Daemons by pid file: is it alive, start it detached, stop it and wait; free ports.
# Sourced by cluster/dev/slurm.sh, which sets BASE, RUN, LOGS, the ports and NODE_NAMES first.

# --- processes ---------------------------------------------------------------------------------

pid_file() {
    case $1 in
        munged) echo "$MUNGE_DIR/munged.pid" ;;
        *) echo "$RUN/$1.pid" ;;
    esac
}

# The daemon's pid when its pid file names a live process of that name (slurmd-<node>: a slurmd).
# PID 1 does not reap here, so a stopped daemon stays a zombie: that counts as stopped.
daemon_pid() {
    local file pid stat
    file=$(pid_file "$1")
    # A daemon may remove its pid file at any moment: every read is allowed to fail.
    pid=$(tr -dc '0-9' 2>/dev/null <"$file") || return 1
    [[ -n $pid ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != [ZX] ]] || return 1
    # A stale pid file from before a reboot may name an unrelated process.
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "${1%%-*}" ]] || return 1
    echo "$pid"
}

wait_for() {
    local what=$1 logfile=$2 deadline=$((SECONDS + WAIT_S))
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$what not ready after ${WAIT_S}s" "$logfile"
        sleep 0.5
    done
}

# Daemons must not inherit the lock (fd 9) or our stdout: a caller reading our output until EOF
# would otherwise wait for as long as the daemon lives.
spawn() {
    local out=$1
    shift
    "$@" </dev/null >>"$out" 2>&1 9>&-
}

stop_daemon() {
    local name=$1 pid deadline
    if ! pid=$(daemon_pid "$name"); then
        log "$name: not running"
        return 0
    fi
    log "$name: stopping pid $pid"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 30))
    while daemon_pid "$name" >/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if daemon_pid "$name" >/dev/null; then
        log "$name: still alive after 30s, killing"
        kill -KILL "$pid" 2>/dev/null || true
        deadline=$((SECONDS + 10))
        while daemon_pid "$name" >/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    fi
    ! daemon_pid "$name" >/dev/null || die "$name (pid $pid) does not stop"
}

need_port() {
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null ||
        die "port $1 is taken: another cluster? ('down' it, or set TRAINFLOW_SLURM_PORT)"
}

# Before starting anything: a port held by another cluster would fail us half-way.
check_ports() {
    local k
    daemon_pid slurmctld >/dev/null || need_port "$CTLD_PORT"
    for k in "${!NODE_NAMES[@]}"; do
        daemon_pid "slurmd-${NODE_NAMES[k]}" >/dev/null || need_port "${NODE_PORTS[k]}"
    done
    daemon_pid slurmdbd >/dev/null || need_port "$DBD_PORT"
    daemon_pid mariadbd >/dev/null || need_port "$DB_PORT"
}
