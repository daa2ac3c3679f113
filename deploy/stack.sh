#!/usr/bin/env bash
# The local trainflow stack: a Prefect server (SQLite), one process worker and an MLflow server.
#
#   deploy/stack.sh up       start what is not running yet, wait until healthy, print the UIs
#   deploy/stack.sh deploy   register the deployments of deploy/prefect.yaml on that server
#   deploy/stack.sh status   say what runs
#   deploy/stack.sh down     stop worker, flow runs and servers; nothing is left behind
#
# Settings (environment):
#   TRAINFLOW_STACK_DIR       state: pid files, logs, Prefect's SQLite DB (trainflow-work/stack)
#   PREFECT_PORT, MLFLOW_PORT loopback ports of the two servers (4200, 5000)
#   TRAINFLOW_POOL            the process work pool the worker serves (trainflow-local)
#   TRAINFLOW_MLFLOW_STORE    MLflow backend store (sqlite:///<repo>/trainflow-work/mlflow.db,
#                             the store `trainflow run` uses by default)
#   TRAINFLOW_MLFLOW_ARTIFACTS  artifact folder of the MLflow server (<repo>/trainflow-work/mlartifacts)
#   TRAINFLOW_STACK_GRACE_S   seconds a process gets to stop before SIGKILL (30)
#
# Every process the stack starts carries TRAINFLOW_STACK_ID=<state dir> in its environment, and
# so do the flow runs, training jobs and ranks the worker starts: `down` finds them all by it.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=$REPO/.venv/bin
abs() { [[ $1 == /* ]] && echo "$1" || echo "$PWD/$1"; }
STACK_DIR=$(abs "${TRAINFLOW_STACK_DIR:-$REPO/trainflow-work/stack}")
PREFECT_PORT=${PREFECT_PORT:-4200}
MLFLOW_PORT=${MLFLOW_PORT:-5000}
POOL=${TRAINFLOW_POOL:-trainflow-local}
MLFLOW_STORE=${TRAINFLOW_MLFLOW_STORE:-sqlite:///$REPO/trainflow-work/mlflow.db}
MLFLOW_ARTIFACTS=$(abs "${TRAINFLOW_MLFLOW_ARTIFACTS:-$REPO/trainflow-work/mlartifacts}")
GRACE_S=${TRAINFLOW_STACK_GRACE_S:-30}
PREFECT_API=http://127.0.0.1:$PREFECT_PORT/api
MLFLOW_URL=http://127.0.0.1:$MLFLOW_PORT
MARK=TRAINFLOW_STACK_ID=$STACK_DIR
SERVICES=(prefect-server mlflow-server worker)

die() { echo "stack: error: $*" >&2; exit 1; }
say() { echo "stack: $*"; }

# Processes, pid files and health checks: pidfile, service_pid, marked_pids, start, signal_pids,
# wait_or_kill, alive, http_ok, port_busy, check_port, wait_healthy.
# shellcheck source=deploy/stack-services.sh
source "$REPO/deploy/stack-services.sh"

# --- up -----------------------------------------------------------------------------------

up_prefect() {
  if [[ -n $(service_pid prefect-server) ]]; then
    say "prefect server already running (pid $(service_pid prefect-server))"
  else
    check_port "Prefect server" "$PREFECT_PORT" PREFECT_PORT
    PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$STACK_DIR/prefect.db" \
      start prefect-server "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT"
    say "starting the prefect server on port $PREFECT_PORT"
  fi
  wait_healthy prefect-server "$PREFECT_API/health"
}

up_mlflow() {
  if [[ -n $(service_pid mlflow-server) ]]; then
    say "mlflow server already running (pid $(service_pid mlflow-server))"
  else
    check_port "MLflow server" "$MLFLOW_PORT" MLFLOW_PORT
    if [[ $MLFLOW_STORE == sqlite:///* ]]; then mkdir -p "$(dirname "${MLFLOW_STORE#sqlite://}")"; fi
    mkdir -p "$MLFLOW_ARTIFACTS"
    # New experiments get a file: artifact root rather than the mlflow-artifacts: proxy, so
    # that `trainflow run` on the SQLite store directly (no server URI) can still log
    # artifacts to an experiment a deployment run created (the proxy URI needs an http client).
    # No MLflow job runner: trainflow runs no MLflow GenAI jobs (tasks/tracking/mlflow_server.py).
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false start mlflow-server \
      "$BIN/mlflow" server \
      --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 --backend-store-uri "$MLFLOW_STORE" \
      --default-artifact-root "file://$MLFLOW_ARTIFACTS" --artifacts-destination "$MLFLOW_ARTIFACTS"
    say "starting the mlflow server on port $MLFLOW_PORT ($MLFLOW_STORE)"
  fi
  wait_healthy mlflow-server "$MLFLOW_URL/health"
}

ensure_pool() {
  local status
  status=$(curl -s -o /dev/null -w '%{http_code}' "$PREFECT_API/work_pools/$POOL")
  if [[ $status == 404 ]]; then
    PREFECT_API_URL=$PREFECT_API "$BIN/prefect" work-pool create "$POOL" --type process >/dev/null
    say "created the process work pool '$POOL'"
  elif [[ $status != 200 ]]; then
    die "could not look up work pool '$POOL' at $PREFECT_API (HTTP $status)"
  fi
}

up_worker() {
  if [[ -n $(service_pid worker) ]]; then
    say "worker already running (pid $(service_pid worker))"
    return
  fi
  # The worker's environment is every flow run's: runs log to this stack's MLflow server.
  PREFECT_API_URL=$PREFECT_API MLFLOW_TRACKING_URI=$MLFLOW_URL \
    start worker "$BIN/prefect" worker start --pool "$POOL" --name "trainflow-worker-$POOL"
  say "started a worker for pool '$POOL' (log: $STACK_DIR/worker.log)"
}

cmd_up() {
  [[ -x $BIN/prefect && -x $BIN/mlflow ]] || die "no virtualenv at $REPO/.venv: run make setup"
  up_prefect
  ensure_pool
  up_mlflow
  up_worker
  cat <<EOF

trainflow stack is up (state in $STACK_DIR)
  Prefect UI   http://127.0.0.1:$PREFECT_PORT
  MLflow UI    $MLFLOW_URL
  work pool    $POOL (one process worker)

Point your shell at it:
  export PREFECT_API_URL=$PREFECT_API MLFLOW_TRACKING_URI=$MLFLOW_URL
Next: register the deployments with   deploy/stack.sh deploy   (or: make stack-deploy)
EOF
}

# --- deploy -------------------------------------------------------------------------------

cmd_deploy() {
  http_ok "$PREFECT_API/health" || die "no Prefect server answers at $PREFECT_API: run deploy/stack.sh up first"
  mkdir -p "$STACK_DIR"
  cd "$REPO"  # the recorded working directory: the worker runs flows from the repository root
  # One `prefect deploy --all` registers every deployment (~6 CPU s a call). --all ignores
  # --pool, so it reads a copy of deploy/prefect.yaml with the pool ($TRAINFLOW_POOL) in it.
  local file="$STACK_DIR/prefect.yaml" names name
  names=$("$BIN/python" - deploy/prefect.yaml "$file" "$POOL" <<'PY'
import re, sys, yaml
source, copy, pool = sys.argv[1:]
spec = yaml.safe_load(open(source))
for deployment in spec["deployments"]:
    deployment["work_pool"] = {**deployment["work_pool"], "name": pool}
    path, func = deployment["entrypoint"].split(":")  # the flow's name, as Prefect shows it
    flow = re.search(rf'@flow\(name="([^"]+)"[^)]*\)\s*def {func}\(', open(path).read())
    print(f"{flow.group(1) if flow else func}/{deployment['name']}")
with open(copy, "w") as out:
    yaml.safe_dump(spec, out, sort_keys=False)
PY
  ) || die "cannot read deploy/prefect.yaml"
  PREFECT_API_URL=$PREFECT_API "$BIN/prefect" --no-prompt deploy --prefect-file "$file" --all \
    >"$STACK_DIR/deploy.log" 2>&1 \
    || { cat "$STACK_DIR/deploy.log" >&2; die "deploying deploy/prefect.yaml failed (log above)"; }
  for name in $names; do
    say "deployed $name on pool '$POOL'"
  done
  cat <<EOF

Run the pipeline now (results in the Prefect UI http://127.0.0.1:$PREFECT_PORT and MLflow $MLFLOW_URL):
  export PREFECT_API_URL=$PREFECT_API
  $BIN/prefect deployment run trainflow-pipeline/adhoc --param preset=tiny
See the nightly schedule:
  $BIN/prefect deployment inspect trainflow-pipeline/nightly
Search a space with Optuna (docs/search.md):
  $BIN/prefect deployment run trainflow-search/adhoc --param preset=tiny \\
    --param space='{"train.lr": "loguniform(1e-4,1e-1)"}' --param trials=4
EOF
}

# --- down and status ----------------------------------------------------------------------

cmd_down() {
  local worker servers=() runs=() pid group name
  worker=$(service_pid worker)
  for name in prefect-server mlflow-server; do
    pid=$(service_pid "$name")
    [[ -z $pid ]] || servers+=("$pid")
  done
  # SIGINT, as the worker ignores SIGTERM for 25+ s. It then takes no new flow runs but waits
  # for those it started, so these get SIGTERM, as a Prefect cancel sends: they cancel their
  # training job and mark their MLflow runs KILLED while the servers are still up.
  if [[ -n $worker ]]; then say "stopping the worker (pid $worker)"; signal_pids INT "$worker"; fi
  for pid in $(marked_pids); do
    # A process that ends meanwhile (the worker's children do, now) is skipped: under
    # `set -e -o pipefail` the failed ps would end this script with status 1 and no message.
    group=$(ps -o pgid= -p "$pid" | tr -d ' ') || continue
    [[ -z $group || " ${servers[*]} $worker " == *" $group "* ]] || runs+=("$pid")
  done
  if ((${#runs[@]})); then
    say "stopping running flow runs and their jobs (pids ${runs[*]})"
    signal_pids TERM "${runs[@]}"
    wait_or_kill "$GRACE_S" "${runs[@]}"
  fi
  # Prefect 3.8.8's worker often does not finish a SIGINT shutdown (measured: still running
  # after 50 s, idle); its runs are stopped by now, so after a short wait it is killed, as
  # Prefect itself does on a second Ctrl-C.
  [[ -z $worker ]] || wait_or_kill 5 "$worker"
  if ((${#servers[@]})); then
    say "stopping the servers (pids ${servers[*]})"
    signal_pids INT "${servers[@]}"
    wait_or_kill "$GRACE_S" "${servers[@]}"
  fi
  local left
  left=$(marked_pids)
  # shellcheck disable=SC2086
  [[ -z $left ]] || { say "killing leftovers: $left"; kill -KILL $left 2>/dev/null || true; }
  for name in "${SERVICES[@]}"; do rm -f "$(pidfile "$name")"; done
  say "stopped (state kept in $STACK_DIR)"
}

cmd_status() {
  local name pid
  for name in "${SERVICES[@]}"; do
    pid=$(service_pid "$name")
    if [[ -n $pid ]]; then printf '%-15s running (pid %s)\n' "$name" "$pid"
    else printf '%-15s stopped\n' "$name"; fi
  done
  http_ok "$PREFECT_API/health" && echo "Prefect UI      http://127.0.0.1:$PREFECT_PORT (healthy)"
  http_ok "$MLFLOW_URL/health" && echo "MLflow UI       $MLFLOW_URL (healthy)"
  echo "state           $STACK_DIR"
  [[ -z $(service_pid prefect-server) ]] || echo "export PREFECT_API_URL=$PREFECT_API"
}

case "${1:-}" in
  up) cmd_up ;;
  deploy) cmd_deploy ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|deploy|status|down" >&2; exit 2 ;;
esac
