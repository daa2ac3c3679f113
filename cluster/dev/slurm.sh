#!/usr/bin/env bash
# A real single-node Slurm 22.05 with accounting (slurmdbd + MariaDB) on loopback, for development
# and CI. Installs, configures, starts, checks and stops it; every config, state file, log, pid
# file, spool and the database live under one base folder. Why each setting is there:
# /work/shared/notes/slurm.md and the comments below.
set -euo pipefail

usage() {
    cat <<EOF
usage: $(basename "$0") up [--fresh] [--nodes N] | down | status | env

  up       install what is missing (apt), write the configs, start munged, MariaDB, slurmdbd,
           slurmctld and one slurmd per node, and wait until every node is idle and accounting
           answers. Idempotent. --nodes N: emulate N nodes (tfnode1..tfnodeN, one slurmd each on
           its own loopback port; default: the base folder's last count, else 2). --fresh first
           stops everything and wipes the base folder (job ids restart at 1, so never reuse a
           submitit folder across a wipe).
  down     stop every daemon by its pid file and wait for it to exit. Keeps all state.
  status   daemons, their pids and sinfo -N; exit 0 only when everything is up and every node
           usable.
  env      print the line that points Slurm clients at this cluster.

Base folder: \${TRAINFLOW_SLURM_HOME:-/var/tmp/trainflow-slurm} (now: $BASE)
Ports:       \${TRAINFLOW_SLURM_PORT:-6817} (slurmctld), +2 slurmdbd, +3 MariaDB, +3+k node k
Configs:     rendered by cluster/dev/slurm_config.py (with \$TRAINFLOW_PYTHON, else python3)
EOF
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${TRAINFLOW_PYTHON:-python3}
BASE=${TRAINFLOW_SLURM_HOME:-/var/tmp/trainflow-slurm}
ETC=$BASE/etc
LOGS=$BASE/log
RUN=$BASE/run
SPOOL=$BASE/spool
DATADIR=$BASE/mariadb
FAKEDEV=$BASE/fakedev
MUNGE_DIR=$BASE/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
MARKER=$BASE/.trainflow-slurm
export SLURM_CONF=$ETC/slurm.conf

CLUSTER=trainflow
FAKE_GPUS=2
# A base folder remembers its ports and node count: another base folder with other ports runs a
# second cluster beside this one.
CTLD_PORT=${TRAINFLOW_SLURM_PORT:-$(cat "$ETC/port" 2>/dev/null || echo 6817)}
[[ $CTLD_PORT =~ ^[0-9]+$ ]] || { echo "bad TRAINFLOW_SLURM_PORT: $CTLD_PORT" >&2; exit 2; }
DBD_PORT=$((CTLD_PORT + 2))
DB_PORT=$((CTLD_PORT + 3))
NODES=$(cat "$ETC/nodes" 2>/dev/null || echo 2)
NODE_NAMES=()
NODE_PORTS=()
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
READY_STATES="idle mixed allocated completing planned"
WAIT_S=${TRAINFLOW_SLURM_WAIT_S:-90}

log() { printf '[slurm.sh %(%H:%M:%S)T] %s\n' -1 "$*"; }

die() {
    printf '[slurm.sh] error: %s\n' "$1" >&2
    if [[ -n ${2:-} && -f $2 ]]; then
        printf '[slurm.sh] last lines of %s:\n' "$2" >&2
        tail -n 25 "$2" >&2
    fi
    exit 1
}

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

# --- installation ------------------------------------------------------------------------------

install_packages() {
    local missing=() pkg
    for pkg in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null) == ii* ]] ||
            missing+=("$pkg")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ $EUID -eq 0 ]] || die "installing ${missing[*]} needs root"
    log "installing ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >"$LOGS/apt.log" 2>&1 || die "apt-get update failed" "$LOGS/apt.log"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$LOGS/apt.log" 2>&1 ||
        die "apt-get install failed" "$LOGS/apt.log"
}

make_dirs() {
    # The lock fd is already open, so BASE exists; the marker lets --fresh wipe only our folder.
    touch "$MARKER"
    mkdir -p "$ETC" "$LOGS" "$RUN" "$SPOOL/slurmctld" "$FAKEDEV"
    install -d -o munge -g munge -m 0755 "$MUNGE_DIR"
    local i
    for ((i = 0; i < FAKE_GPUS; i++)); do ln -sfn /dev/null "$FAKEDEV/nvidia$i"; done
}

# --- configuration -----------------------------------------------------------------------------

# Renders slurm.conf, slurmdbd.conf, gres.conf and the hosts line (cluster/dev/slurm_config.py),
# then reads back the node names and ports into NODE_NAMES / NODE_PORTS. Sets CONFIG_CHANGED.
# Never called in a condition: `set -e` would not stop on a failing renderer then.
write_configs() {
    local hw out name port
    hw=$(slurmd -C | head -n 1)
    [[ $hw == NodeName=* ]] || die "slurmd -C printed no node line: $hw"
    out=$("$PYTHON" "$HERE/slurm_config.py" write --base "$BASE" --port "$CTLD_PORT" \
        --nodes "$NODES" --hw "$hw")
    CONFIG_CHANGED=0
    [[ $(head -n 1 <<<"$out") == changed ]] && CONFIG_CHANGED=1
    read_nodes "$(tail -n +2 <<<"$out")"
}

# NODE_NAMES / NODE_PORTS from the renderer's `<name> <port>` lines.
read_nodes() {
    local name port
    NODE_NAMES=() NODE_PORTS=()
    while read -r name port; do
        [[ -n $name ]] || continue
        NODE_NAMES+=("$name")
        NODE_PORTS+=("$port")
    done <<<"$1"
}

# The node layout of the written config, without writing anything (down, status).
known_nodes() {
    read_nodes "$("$PYTHON" "$HERE/slurm_config.py" names --base "$BASE" --port "$CTLD_PORT" \
        --nodes "$NODES")"
}

# --- starting ----------------------------------------------------------------------------------

munge_works() { munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"; }

start_munged() {
    daemon_pid munged >/dev/null && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "munged: creating /etc/munge/munge.key"
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    log "munged: starting"
    # As root munged refuses to start ("Logfile is insecure"), so it runs as munge; a socket of
    # its own under BASE keeps this cluster apart from any system munged or second cluster.
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    spawn "$LOGS/munged.out" runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" \
        --pid-file="$(pid_file munged)" --log-file="$MUNGE_DIR/munged.log" ||
        die "munged did not start" "$LOGS/munged.out"
    wait_for munged "$MUNGE_DIR/munged.log" munge_works
}

db_ping() { mariadb-admin --no-defaults --socket="$RUN/mariadbd.sock" ping; }

start_mariadb() {
    daemon_pid mariadbd >/dev/null && return 0
    if [[ ! -d $DATADIR/mysql ]]; then
        log "mariadb: creating the datadir"
        rm -rf "$DATADIR"
        spawn "$LOGS/mariadb-install.log" mariadb-install-db --no-defaults --user=root \
            --datadir="$DATADIR" --skip-test-db ||
            die "mariadb-install-db failed" "$LOGS/mariadb-install.log"
    fi
    log "mariadb: starting on 127.0.0.1:$DB_PORT"
    # A throw-away test database: no grant tables, reachable on loopback only.
    setsid mariadbd --no-defaults --datadir="$DATADIR" --user=root \
        --bind-address=127.0.0.1 --port="$DB_PORT" --socket="$RUN/mariadbd.sock" \
        --pid-file="$(pid_file mariadbd)" --log-error="$LOGS/mariadbd.log" --skip-grant-tables \
        --skip-name-resolve --innodb-buffer-pool-size=256M --innodb-log-file-size=48M \
        --innodb-lock-wait-timeout=900 --max-allowed-packet=64M \
        </dev/null >>"$LOGS/mariadbd.out" 2>&1 9>&- &
    wait_for mariadb "$LOGS/mariadbd.log" db_ping
}

dbd_answers() { timeout 10 sacctmgr -n -P show cluster format=Cluster; }

start_slurmdbd() {
    daemon_pid slurmdbd >/dev/null && return 0
    log "slurmdbd: starting"
    spawn "$LOGS/slurmdbd.out" slurmdbd || die "slurmdbd did not start" "$LOGS/slurmdbd.log"
    wait_for slurmdbd "$LOGS/slurmdbd.log" dbd_answers
}

ctld_answers() { timeout 10 scontrol ping | grep -q 'is UP'; }

start_slurmctld() {
    daemon_pid slurmctld >/dev/null && return 0
    log "slurmctld: starting"
    spawn "$LOGS/slurmctld.out" slurmctld || die "slurmctld did not start" "$LOGS/slurmctld.log"
    wait_for slurmctld "$LOGS/slurmctld.log" ctld_answers
}

start_slurmds() {
    local name
    for name in "${NODE_NAMES[@]}"; do
        daemon_pid "slurmd-$name" >/dev/null && continue
        log "slurmd $name: starting"
        mkdir -p "$SPOOL/slurmd-$name"
        spawn "$LOGS/slurmd-$name.out" slurmd -N "$name" ||
            die "slurmd $name did not start" "$LOGS/slurmd-$name.log"
        # slurmd writes its pid file just after its parent returns.
        wait_for "slurmd $name" "$LOGS/slurmd-$name.log" daemon_pid "slurmd-$name"
    done
}

# `<node> <state>` for every node sinfo knows.
node_states() { timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null; }

# A node left down or drained by an earlier run (a stopped slurmd, a failed kill) is resumed.
wait_nodes() {
    local deadline=$((SECONDS + WAIT_S)) last_resume=-10 states name state not_ready resumed
    while :; do
        states=$(node_states || true)
        not_ready=()
        resumed=0
        for name in "${NODE_NAMES[@]}"; do
            state=$(awk -v n="$name" '$1 == n { print $2; exit }' <<<"$states")
            [[ -n $state && " $READY_STATES " == *" $state "* ]] && continue
            not_ready+=("$name:${state:-unknown}")
            if [[ $state =~ ^(down|drain|drained|draining|fail)$ ]] &&
                ((SECONDS - last_resume >= 5)); then
                log "node $name is $state: resuming it"
                scontrol update NodeName="$name" State=RESUME >/dev/null 2>&1 || true
                resumed=1
            fi
        done
        ((${#not_ready[@]} == 0)) && return 0
        ((resumed)) && last_resume=$SECONDS
        ((SECONDS < deadline)) ||
            die "nodes not usable after ${WAIT_S}s: ${not_ready[*]}" "$LOGS/slurmctld.log"
        sleep 0.5
    done
}

cluster_registered() { dbd_answers | grep -qx "$CLUSTER"; }
sacct_answers() { timeout 10 sacct -n -X -S now-1minutes; }

cmd_up() {
    local fresh=""
    while (($#)); do
        case $1 in
            --fresh) fresh=1 ;;
            --nodes)
                [[ ${2:-} =~ ^[1-8]$ ]] || die "--nodes needs a count from 1 to 8 (got '${2:-}')"
                NODES=$2
                shift
                ;;
            *) die "unknown option '$1' (usage: up [--fresh] [--nodes N])" ;;
        esac
        shift
    done
    [[ $EUID -eq 0 ]] || die "up needs root (munge user, packages, daemons as root)"
    (( ${#BASE} < 80 )) || die "base folder path too long for unix sockets: $BASE"
    mkdir -p "$BASE"
    lock
    [[ -z $fresh ]] || wipe
    mkdir -p "$LOGS"
    local start=$SECONDS
    install_packages
    make_dirs
    write_configs
    if ((CONFIG_CHANGED)) && any_slurm_daemon_alive; then
        log "configs changed: restarting the Slurm daemons and MariaDB"
        stop_slurm_daemons
        stop_daemon mariadbd
    fi
    check_ports
    start_munged
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmds
    wait_nodes
    wait_for "cluster registration" "$LOGS/slurmctld.log" cluster_registered
    wait_for sacct "$LOGS/slurmdbd.log" sacct_answers
    log "up in $((SECONDS - start))s: $(sinfo -h -o '%P %a %D nodes %T %c CPUs/node %G' | head -n 1)"
    cmd_env
}

# Every slurmd with a pid file (also of nodes a smaller --nodes dropped), then the rest.
slurm_daemons() {
    local file
    for file in "$RUN"/slurmd-*.pid "$RUN"/slurmd.pid; do
        [[ -e $file ]] && basename "$file" .pid
    done
    echo slurmctld
    echo slurmdbd
}

any_slurm_daemon_alive() {
    local name
    for name in $(slurm_daemons); do
        daemon_pid "$name" >/dev/null && return 0
    done
    return 1
}

stop_slurm_daemons() {
    local name
    for name in $(slurm_daemons); do stop_daemon "$name"; done
}

wipe() {
    if [[ ! -f $MARKER && -n $(find "$BASE" -mindepth 1 -maxdepth 1 ! -name .lock -print -quit) ]]
    then
        die "refusing to wipe $BASE: it has no $MARKER, so it may not be ours"
    fi
    stop_all
    log "wiping $BASE"
    find "$BASE" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf {} +
}

stop_all() {
    local name
    stop_slurm_daemons
    for name in mariadbd munged; do stop_daemon "$name"; done
}

cmd_down() {
    [[ -d $BASE ]] || { log "nothing under $BASE"; return 0; }
    lock
    stop_all
    log "down (state kept under $BASE)"
}

cmd_status() {
    local name pid ok=0 out states bad
    known_nodes
    for name in munged mariadbd slurmdbd slurmctld "${NODE_NAMES[@]/#/slurmd-}"; do
        if pid=$(daemon_pid "$name"); then
            printf '%-16s pid %-8s alive\n' "$name" "$pid"
        else
            printf '%-16s %-12s dead\n' "$name" '-'
            ok=1
        fi
    done
    # Without slurmctld, sinfo would retry for ~10 s before giving up.
    if [[ ! -f $SLURM_CONF ]] || ! daemon_pid slurmctld >/dev/null; then
        echo "no controller under $BASE (run 'up')"
        return 1
    fi
    out=$(timeout 10 sinfo -N -o '%N %P %a %l %T %c %G' 2>&1) || ok=1
    echo "$out"
    states=$(node_states || true)
    bad=$(awk -v ready=" $READY_STATES " 'index(ready, " " $2 " ") == 0 { print $1 ":" $2 }' \
        <<<"$states" | sort -u | tr '\n' ' ')
    if [[ -z $states || -n $bad ]]; then
        echo "nodes not usable: ${bad:-none listed}"
        ok=1
    fi
    return "$ok"
}

cmd_env() { echo "export SLURM_CONF=$SLURM_CONF"; }

# One 'up' or 'down' at a time.
lock() {
    exec 9>"$BASE/.lock"
    flock -w 600 9 || die "another slurm.sh holds $BASE/.lock"
}

main() {
    case ${1:-} in
        up)
            shift
            cmd_up "$@"
            ;;
        down) cmd_down ;;
        status) cmd_status ;;
        env) cmd_env ;;
        -h | --help | help) usage ;;
        *)
            usage >&2
            exit 2
            ;;
    esac
}

main "$@"
