# Process and health helpers of deploy/stack.sh (sourced by it, not run): pid files, starting
# a service marked with the stack's id, signalling and waiting, port and HTTP health checks.
# Uses the caller's STACK_DIR, MARK, GRACE_S and die/say.
# shellcheck shell=bash

# --- processes and pid files --------------------------------------------------------------

pidfile() { echo "$STACK_DIR/$1.pid"; }

# The pid of a running service, or nothing (a stale pid file is removed).
service_pid() {
  local file pid
  file=$(pidfile "$1")
  [[ -f $file ]] || return 0
  pid=$(<"$file")
  if [[ $pid =~ ^[0-9]+$ ]] && grep -qzxF "$MARK" "/proc/$pid/environ" 2>/dev/null; then
    echo "$pid"
  else
    rm -f "$file"
  fi
}

# Every live process started by this stack (servers, worker, flow runs, jobs, ranks).
marked_pids() {
  grep -lzxF "$MARK" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | grep -vx "$$" || true
}

# Start a service in its own session (so its whole process group can be signalled).
start() {
  local name=$1
  shift
  mkdir -p "$STACK_DIR"
  env "$MARK" PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_HOME="$STACK_DIR/prefect-home" setsid "$@" >"$STACK_DIR/$name.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$(pidfile "$name")"
  # Until `env` has exec'd, /proc/PID/environ is this shell's, without the mark: service_pid
  # would take the new service for a dead one (and drop its pid file). Return once it is marked.
  local tries=0
  while ! grep -qzxF "$MARK" "/proc/$pid/environ" 2>/dev/null && kill -0 "$pid" 2>/dev/null &&
    ((tries++ < 250)); do
    sleep 0.02
  done
}

# Send a signal to each pid's process group (or to the pid alone when it leads none).
signal_pids() {
  local sig=$1 pid
  shift
  for pid in "$@"; do kill "-$sig" "-$pid" 2>/dev/null || kill "-$sig" "$pid" 2>/dev/null || true; done
}

# Wait up to `grace` seconds for the pids to exit, then SIGKILL their groups.
wait_or_kill() {
  local grace=$1
  shift
  local deadline=$((SECONDS + grace))
  while alive "$@" && ((SECONDS < deadline)); do sleep 0.5; done
  if alive "$@"; then
    say "still running after ${grace} s, killing: $*"
    signal_pids KILL "$@"
  fi
}

# True while any of the pids is a live (non-zombie) process.
alive() {
  local pid
  for pid in "$@"; do
    [[ -r /proc/$pid/stat ]] || continue
    [[ $(cut -d')' -f2 "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f2) == Z ]] || return 0
  done
  return 1
}

# --- health -------------------------------------------------------------------------------

http_ok() { curl -fsS -o /dev/null --max-time 3 "$1" 2>/dev/null; }
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

check_port() {
  local name=$1 port=$2 var=$3
  port_busy "$port" || return 0
  die "port $port (for the $name) is already in use by another program. Stop it, or choose
       another port: $var=<free port> deploy/stack.sh up (and the same $var for deploy/down)"
}

wait_healthy() {
  local name=$1 url=$2 deadline=$((SECONDS + 180))
  until http_ok "$url"; do
    if [[ -z $(service_pid "$name") ]]; then
      tail -n 30 "$STACK_DIR/$name.log" >&2 || true
      die "the $name exited during start-up; its log is $STACK_DIR/$name.log"
    fi
    ((SECONDS < deadline)) || die "the $name is not healthy after 180 s; see $STACK_DIR/$name.log"
    sleep 0.5
  done
}
