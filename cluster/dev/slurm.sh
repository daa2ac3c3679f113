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

# The parts: daemons by pid (processes.sh); install, configure, start (daemons.sh).
# shellcheck source=cluster/dev/slurm-lib/processes.sh
source "$HERE/slurm-lib/processes.sh"
# shellcheck source=cluster/dev/slurm-lib/daemons.sh
source "$HERE/slurm-lib/daemons.sh"

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
