#!/usr/bin/env bash
# Runs the training demo (Fashion-MNIST, examples/train): builds it first (scripts/build.sh,
# target `train`), then
#
#   scripts/train.sh [ARGS...]                  one process: train ARGS
#       e.g. scripts/train.sh --strategy mirrored --replicas 4 --epochs 5
#            scripts/train.sh --strategy central_storage --replicas 4 --epochs 5
#   scripts/train.sh --workers N [ARGS...]      N worker processes on this host, found through
#                                               RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (a
#                                               free port), each `train --strategy multi_worker ARGS`;
#                                               worker 0 (the chief) prints, the others log to files
#       e.g. scripts/train.sh --workers 2 --replicas 2 --epochs 1 --global-batch 256
#   scripts/train.sh --strategy parameter_server --workers N --ps M [PS-FLAGS] [ARGS...]
#                                               ParameterServerStrategy on loopback: a coordinator
#                                               (TF_CONFIG "chief"), N workers and M parameter
#                                               servers, each `train --strategy parameter_server
#                                               ARGS` with its own TF_CONFIG; the coordinator
#                                               prints, the servers log to files. PS-FLAGS:
#                                               --compare   then the same ARGS on N workers of
#                                                           multi_worker; both samples/s printed
#                                               --kill-worker I / --kill-ps I   SIGKILL that task
#                                                           once the coordinator reports epoch 2
#                                                           (a worker is restarted after
#                                                           --restart-after S seconds, default 2)
#       e.g. scripts/train.sh --strategy parameter_server --workers 2 --ps 2 --epochs 3
#   scripts/train.sh --workers N --evaluator [ARGS...]
#                                               the same, and a sidecar evaluator beside them
#                                               (`train --evaluator`, not part of the training
#                                               collective): the chief exports a checkpoint every
#                                               epoch (and every --export-every-steps steps) to
#                                               --export-checkpoints DIR (default: a scratch
#                                               folder), the evaluator evaluates each on the test
#                                               set as it appears, prints a line per checkpoint,
#                                               and writes them to --eval-log FILE (default
#                                               evaluations.jsonl, written afresh); draw it with
#                                               scripts/plot-evaluations.py FILE
#   scripts/train.sh --throughput [ARGS...]     samples per second, 1 epoch at global batch 256
#                                               each: one_device vs mirrored with 2 replicas, and
#                                               1 worker vs 2 workers; prints the two ratios
#   scripts/train.sh --table [ARGS...]          every strategy x model (mlp, cnn), 5 epochs each
#                                               at one global batch: a markdown table of test
#                                               accuracy and samples/s (scripts/train-table.sh)
#
# Under mpirun instead (nothing to export): mpirun -np 2 build/examples/train/train --strategy multi_worker
# Environment: COLLECTIVES_BUILD_DIR (default build); TRAIN_NO_BUILD=1 skips the build;
# TRAIN_TIME_LIMIT (seconds, default 3600) bounds every process. The processes run in the
# caller's folder, so paths in ARGS (--save-weights, --checkpoint-dir) are the caller's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
[[ ${BUILD_DIR} == /* ]] || BUILD_DIR="${ROOT}/${BUILD_DIR}"  # as for scripts/build.sh
TRAIN="${BUILD_DIR}/examples/train/train"
LIMIT=${TRAIN_TIME_LIMIT:-3600}

if [[ ${TRAIN_NO_BUILD:-0} != 1 ]]; then
  COLLECTIVES_BUILD_TARGETS=${COLLECTIVES_BUILD_TARGETS:-train} "${ROOT}/scripts/build.sh" >&2
fi
if [[ ! -x ${TRAIN} ]]; then
  echo "train.sh: ${TRAIN} was not built (Eigen, zlib and CLI11 are needed)" >&2
  exit 1
fi

# timeout(1) runs its command in a process group of its own, which a Ctrl-C at the terminal does
# not reach: every command here therefore runs in the background, the script waits for it with
# `wait` (which a trapped signal interrupts at once), and on INT or TERM the trap sends TERM to
# every one still running (timeout hands it on to train) and removes run_workers' folder of
# worker logs before the script exits.
limited=()
work=""
stop_limited() {
  if [[ ${#limited[@]} -gt 0 ]]; then kill -TERM "${limited[@]}" 2>/dev/null; fi
  if [[ -n ${work} ]]; then rm -rf "${work}"; fi
  return 0
}
# set_stop_traps: the traps, set by each function that starts something (and again each time: a
# subshell, as the --throughput runs are, starts without them).
set_stop_traps() {
  trap 'stop_limited; exit 130' INT
  trap 'stop_limited; exit 143' TERM
}
# start_limited ARGS...: `timeout $LIMIT ARGS` in the background, its pid in $! and in limited.
start_limited() {
  set_stop_traps
  timeout "$LIMIT" "$@" &
  limited+=($!)
}
# run_limited ARGS...: the same, waited for; returns its status.
run_limited() {
  local rc=0
  start_limited "$@"
  wait $! || rc=$?
  limited=()
  return $rc
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# With evaluator=1, run_workers also starts `train --evaluator` (the sidecar; stdout shared
# with the chief's, its lines start with "evaluator:") on export_dir (default $work/export) and
# eval_log, and the workers export checkpoints there. The evaluator stops after the final
# checkpoint; when a worker fails it is stopped.
evaluator=0
export_dir=""
eval_log=evaluations.jsonl

# run_workers N ARGS...: N processes of `train --strategy multi_worker ARGS` on loopback. The
# chief's output goes to stdout, the others' to $work/worker<i>.log (printed if they fail).
# Returns non-zero if any worker (or the evaluator) fails.
run_workers() {
  local n=$1
  shift
  local port pids=() rc=0 i
  set_stop_traps  # before the folder exists
  port=$(free_port)
  work=$(mktemp -d)
  # A fresh job token unless one is given: every connection of the job proves it.
  export COLLECTIVES_JOB_TOKEN=${COLLECTIVES_JOB_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
  local eval_pid=""
  if [[ ${evaluator} == 1 ]]; then
    local dir=${export_dir:-$work/export}
    : >"${eval_log}"
    # ARGS first, so that the evaluator's own flags win; the evaluator reads files only.
    start_limited env -u TF_CONFIG -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE \
      "$TRAIN" "$@" --evaluator --export-checkpoints "$dir" --eval-log "${eval_log}"
    eval_pid=$!
    set -- "$@" --export-checkpoints "$dir"
  fi
  for ((i = 1; i < n; ++i)); do
    start_limited env -u TF_CONFIG -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE \
      RANK=$i WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$TRAIN" --strategy multi_worker "$@" >"$work/worker$i.log" 2>&1
    pids+=($!)
  done
  start_limited env -u TF_CONFIG -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE \
    RANK=0 WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$TRAIN" --strategy multi_worker "$@"
  wait $! || rc=$?
  for ((i = 1; i < n; ++i)); do
    if ! wait "${pids[i - 1]}"; then
      echo "train.sh: worker $i failed:" >&2
      cat "$work/worker$i.log" >&2
      rc=1
    fi
  done
  if [[ -n ${eval_pid} ]]; then
    if [[ $rc != 0 ]]; then kill -TERM "${eval_pid}" 2>/dev/null || true; fi
    if ! wait "${eval_pid}" && [[ $rc == 0 ]]; then
      echo "train.sh: the evaluator failed" >&2
      rc=1
    fi
    if [[ $rc == 0 ]]; then
      echo "train.sh: evaluations in ${eval_log}; draw them: scripts/plot-evaluations.py ${eval_log}"
    fi
  fi
  limited=()
  rm -rf "$work"
  work=""
  return $rc
}

# free_ports N: N distinct free ports on loopback, one per line (bound all at once, so that no
# two are the same).
free_ports() {
  python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# train_pid_of PID: the train process that timeout(1) PID runs (empty while it has none).
train_pid_of() { pgrep -P "$1" | head -1; }

# start_task ROLE INDEX ARGS...: one task of the job that run_parameter_server sets up
# ($ps_cluster, $ps_job_id), in the background; its timeout(1) pid in $!.
ps_cluster=""
ps_job_id=""
start_task() {
  local role=$1 index=$2
  shift 2
  start_limited env -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u RANK -u WORLD_SIZE \
    COLLECTIVES_JOB_ID="$ps_job_id" \
    TF_CONFIG="$(printf '{"cluster":%s,"job_id":"%s","task":{"type":"%s","index":%d}}' \
      "$ps_cluster" "$ps_job_id" "$role" "$index")" \
    "$TRAIN" --strategy parameter_server "$@" >>"$work/$role$index.log" 2>&1
}

# run_parameter_server N M KILL_ROLE KILL_INDEX RESTART_AFTER ARGS...: a ParameterServerStrategy
# job on loopback, every task `train --strategy parameter_server ARGS` with its own TF_CONFIG:
#   {"cluster": {"chief": [A0], "worker": [A1..AN], "ps": [..]}, "task": {"type": T, "index": I}}
# (free ports, one job token for all). The coordinator's output goes to $work/chief0.log and is
# shown as it comes; the servers log to $work/<role><i>.log, shown when one fails. With
# KILL_ROLE (worker or ps), that task gets SIGKILL once the coordinator reports progress in
# epoch 2 (with --quiet-progress, at that epoch's end); a worker is started again RESTART_AFTER seconds later, with the same TF_CONFIG. Once
# the coordinator has exited, servers that have not stopped by themselves within 5 s (at once when
# it failed) get TERM.
# Returns the coordinator's status (1 if a server failed on its own otherwise); sets
# $samples_per_s from its throughput line.
run_parameter_server() {
  local n=$1 m=$2 kill_role=$3 kill_index=$4 restart_after=$5
  shift 5
  local ports=() cluster roles=() indices=() pids=() i rc=0 chief_pid tail_pid
  set_stop_traps  # before the folder exists
  work=$(mktemp -d)
  mapfile -t ports < <(free_ports $((1 + n + m)))
  export COLLECTIVES_JOB_TOKEN=${COLLECTIVES_JOB_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
  local addr=()
  for i in "${!ports[@]}"; do addr+=("\"127.0.0.1:${ports[i]}\""); done
  cluster=$(IFS=,; printf '{"chief":[%s],"worker":[%s],"ps":[%s]}' "${addr[0]}" \
    "${addr[*]:1:n}" "${addr[*]:1+n:m}")
  ps_cluster=$cluster
  ps_job_id="ps-$(basename "$work")"
  for ((i = 0; i < m; ++i)); do
    start_task ps "$i" "$@"
    roles+=(ps) indices+=("$i") pids+=($!)
  done
  for ((i = 0; i < n; ++i)); do
    start_task worker "$i" "$@"
    roles+=(worker) indices+=("$i") pids+=($!)
  done
  : >"$work/chief0.log"
  start_task chief 0 "$@"
  chief_pid=$!
  tail -n +1 -f --pid="$chief_pid" "$work/chief0.log" &
  tail_pid=$!
  limited+=("$tail_pid")

  # The kill and the restart, while the coordinator runs.
  local victim=-1 killed_at="" restarted=0 victim_pid
  if [[ -n ${kill_role} ]]; then
    for i in "${!roles[@]}"; do
      [[ ${roles[i]} == "$kill_role" && ${indices[i]} == "$kill_index" ]] && victim=$i
    done
  fi
  while kill -0 "$chief_pid" 2>/dev/null; do
    if [[ ${victim} -ge 0 && -z ${killed_at} ]] &&
        awk '/^Epoch 2\//{e=1; next} e && /accuracy/ {found=1} END {exit !found}' \
          "$work/chief0.log"; then
      victim_pid=$(train_pid_of "${pids[victim]}")
      if [[ -n ${victim_pid} ]] && kill -KILL "$victim_pid" 2>/dev/null; then
        killed_at=$(date +%s.%N)
        wait "${pids[victim]}" 2>/dev/null || true  # reaped here, so bash reports no "Killed"
        echo "train.sh: SIGKILL to ${kill_role} ${kill_index} (pid ${victim_pid}) in epoch 2" >&2
      fi
    fi
    if [[ -n ${killed_at} && ${kill_role} == worker && ${restarted} == 0 ]] &&
        awk -v a="$killed_at" -v b="$(date +%s.%N)" -v d="$restart_after" 'BEGIN {exit !(b - a >= d)}'; then
      start_task worker "$kill_index" "$@"
      pids[victim]=$!
      restarted=1
      echo "train.sh: worker ${kill_index} restarted" >&2
    fi
    sleep 0.05
  done
  wait "$chief_pid" || rc=$?
  wait "$tail_pid" 2>/dev/null || true
  if [[ -n ${killed_at} ]]; then
    awk -v a="$killed_at" -v b="$(date +%s.%N)" -v rc="$rc" -v who="${kill_role} ${kill_index}" \
      'BEGIN {printf "train.sh: the coordinator exited with status %d, %.2f s after the SIGKILL to %s\n", rc, b - a, who}' >&2
  fi

  # The servers: stopped by the coordinator at the end of its training, or by a TERM 5 s later;
  # at once when it failed (they would wait for another coordinator).
  local deadline=$((SECONDS + 5)) alive status
  [[ ${rc} == 0 ]] || deadline=${SECONDS}
  while :; do
    alive=0
    for i in "${!pids[@]}"; do kill -0 "${pids[i]}" 2>/dev/null && alive=1; done
    [[ ${alive} == 0 || ${SECONDS} -ge ${deadline} ]] && break
    sleep 0.05
  done
  local termed=()
  for i in "${!pids[@]}"; do
    if kill -0 "${pids[i]}" 2>/dev/null; then kill -TERM "${pids[i]}" 2>/dev/null; termed[i]=1; fi
  done
  for i in "${!pids[@]}"; do
    status=0
    wait "${pids[i]}" || status=$?
    if [[ ${status} != 0 && -z ${termed[i]:-} && ${i} != "${victim}" ]]; then
      echo "train.sh: ${roles[i]} ${indices[i]} failed (status ${status}):" >&2
      cat "$work/${roles[i]}${indices[i]}.log" >&2
      [[ ${rc} != 0 ]] || rc=1
    fi
  done
  samples_per_s=$(sed -n 's/^throughput: \([0-9.]*\) samples\/s.*/\1/p' "$work/chief0.log" | tail -1)
  limited=()
  rm -rf "$work"
  work=""
  return $rc
}

# throughput LABEL COMMAND...: runs it, echoes its output, and sets $samples_per_s.
# The copy goes through this script's own stderr (tee /dev/stderr would open the caller's file
# again and truncate it when stderr is a file).
samples_per_s=0
throughput() {
  local label=$1 out copy rc=0
  shift
  echo "== ${label} =="
  copy=$(mktemp)
  "$@" | tee "${copy}" >&2 || rc=$?
  out=$(<"${copy}")
  rm -f "${copy}"
  if [[ ${rc} != 0 ]]; then exit "${rc}"; fi
  samples_per_s=$(sed -n 's/^throughput: \([0-9.]*\) samples\/s.*/\1/p' <<<"$out" | tail -1)
  if [[ -z ${samples_per_s} ]]; then
    echo "train.sh: no throughput line from ${label}" >&2
    exit 1
  fi
}

# --strategy parameter_server, anywhere among the arguments, selects the coordinator-and-servers
# launch; its own flags (--workers, --ps and the PS-FLAGS above) are taken out, the rest goes to
# every task.
strategy=""
for ((i = 1; i <= $#; ++i)); do
  arg=${!i}
  if [[ ${arg} == --strategy ]]; then j=$((i + 1)); strategy=${!j:-}; fi
  if [[ ${arg} == --strategy=* ]]; then strategy=${arg#--strategy=}; fi
done
if [[ ${strategy} == parameter_server ]]; then
  workers=2 servers=1 compare=0 kill_role="" kill_index=0 restart_after=2 rest=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --workers | --ps | --kill-worker | --kill-ps | --restart-after)
        if [[ $# -lt 2 ]]; then echo "train.sh: $1 needs a value" >&2; exit 2; fi
        case "$1" in
          --workers) workers=$2 ;;
          --ps) servers=$2 ;;
          --kill-worker) kill_role=worker kill_index=$2 ;;
          --kill-ps) kill_role=ps kill_index=$2 ;;
          --restart-after) restart_after=$2 ;;
        esac
        shift 2
        ;;
      --compare) compare=1; shift ;;
      --strategy) shift 2 ;;
      --strategy=*) shift ;;
      *) rest+=("$1"); shift ;;
    esac
  done
  # Checked here: bash's arithmetic below would read any other text as an expression.
  for pair in "--workers:${workers}" "--ps:${servers}"; do
    if [[ ! ${pair#*:} =~ ^[1-9][0-9]{0,2}$ ]]; then
      echo "train.sh: ${pair%%:*} needs a number of tasks (1 to 999), got '${pair#*:}'" >&2
      exit 2
    fi
  done
  if [[ -n ${kill_role} ]]; then
    limit=${workers}; [[ ${kill_role} == ps ]] && limit=${servers}
    if [[ ! ${kill_index} =~ ^[0-9]{1,3}$ ]] || ((kill_index >= limit)); then
      echo "train.sh: --kill-${kill_role} needs an index below ${limit}, got '${kill_index}'" >&2
      exit 2
    fi
  fi
  if [[ ! ${restart_after} =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
    echo "train.sh: --restart-after needs a number of seconds, got '${restart_after}'" >&2
    exit 2
  fi
  rc=0
  run_parameter_server "$workers" "$servers" "$kill_role" "$kill_index" "$restart_after" \
    "${rest[@]}" || rc=$?
  if [[ ${compare} == 1 && ${rc} == 0 ]]; then
    ps_rate=${samples_per_s:-0}
    echo "== multi_worker, ${workers} workers, the same arguments =="
    # Shown through this script's own stdout, copied to a file (tee to /dev/stderr would open the
    # caller's file again, truncating it, when the output goes to a file).
    work=$(mktemp -d)
    run_workers "$workers" "${rest[@]}" 2>&1 | tee "$work/compare.log" || rc=$?
    mw_rate=$(sed -n 's/^throughput: \([0-9.]*\) samples\/s.*/\1/p' "$work/compare.log" | tail -1)
    rm -rf "$work"
    work=""
    echo "== throughput (samples/s, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)) =="
    printf '%-40s %10.0f\n' "parameter_server, ${workers} workers, ${servers} ps" "${ps_rate}" \
      "multi_worker, ${workers} workers" "${mw_rate:-0}"
  fi
  exit $rc
fi

case "${1:-}" in
  --workers)
    n=${2:-}
    # Checked here: bash's arithmetic below would read any other text as an expression.
    if [[ ! ${n} =~ ^[1-9][0-9]{0,3}$ ]]; then
      echo "train.sh: --workers needs a number of workers (1 to 9999), got '${n}'" >&2
      exit 2
    fi
    shift 2
    # --evaluator, --eval-log and --export-checkpoints are the script's; the rest go to train.
    args=()
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --evaluator) evaluator=1 ;;
        --eval-log | --export-checkpoints)
          if [[ $# -lt 2 ]]; then
            echo "train.sh: $1 needs a value" >&2
            exit 2
          fi
          if [[ $1 == --eval-log ]]; then eval_log=$2; else export_dir=$2; fi
          shift
          ;;
        --eval-log=*) eval_log=${1#*=} ;;
        --export-checkpoints=*) export_dir=${1#*=} ;;
        *) args+=("$1") ;;
      esac
      shift
    done
    if [[ ${evaluator} == 0 && -n ${export_dir} ]]; then args+=(--export-checkpoints "${export_dir}"); fi
    run_workers "$n" ${args[@]+"${args[@]}"}
    ;;
  --throughput)
    shift
    common=(--epochs 1 --global-batch 256 --quiet-progress "$@")
    throughput "one_device" run_limited "$TRAIN" --strategy one_device "${common[@]}" 2>&1
    one_device=$samples_per_s
    throughput "mirrored, 2 replicas" run_limited "$TRAIN" --strategy mirrored --replicas 2 \
      "${common[@]}" 2>&1
    mirrored=$samples_per_s
    throughput "multi_worker, 1 worker" run_workers 1 "${common[@]}" 2>&1
    one_worker=$samples_per_s
    throughput "multi_worker, 2 workers" run_workers 2 "${common[@]}" 2>&1
    two_workers=$samples_per_s
    # Other work on the machine takes cores from the 2-replica runs first: say how busy it was.
    echo "== throughput (samples/s, global batch 256, 1 epoch, $(nproc) cores," \
      "load average $(cut -d' ' -f1-3 /proc/loadavg)) =="
    printf '%-28s %10.0f\n' "one_device" "$one_device" "mirrored, 2 replicas" "$mirrored" \
      "multi_worker, 1 worker" "$one_worker" "multi_worker, 2 workers" "$two_workers"
    awk -v a="$mirrored" -v b="$one_device" -v c="$two_workers" -v d="$one_worker" 'BEGIN {
      printf "ratio mirrored 2 replicas / one_device: %.2fx\n", a / b
      printf "ratio 2 workers / 1 worker:             %.2fx\n", c / d }'
    ;;
  --table)
    shift
    # Not under one time limit: each of its runs has TRAIN_TIME_LIMIT. A TERM stops it and its run.
    set_stop_traps
    bash "${ROOT}/scripts/train-table.sh" "$@" &
    limited+=($!)
    wait $!
    ;;
  *)
    run_limited "$TRAIN" "$@"
    ;;
esac
