# shellcheck shell=bash
# Installing, configuring and starting the daemons: munged, MariaDB, slurmdbd, slurmctld, slurmd per node.
# Sourced by cluster/dev/slurm.sh, which sets BASE, RUN, LOGS, the ports and NODE_NAMES first.

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
