#!/usr/bin/env bash
# Fault tolerance of the training demo, shown end to end (Keras' BackupAndRestore in a custom
# loop over MultiWorkerMirroredStrategy):
#
#   1. a 2-worker job (two processes on loopback, RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)
#      trains 3 epochs with --checkpoint-dir and --save-every-steps;
#   2. in the middle of epoch 2, worker 1 (or --victim 0) gets SIGKILL;
#   3. the survivor must exit non-zero, with an error message, within a deadline (never hang);
#   4. the job is restarted (both workers, a new port, the same checkpoint folder): the chief must
#      say it restored from the checkpoint in epoch 2, and the job must finish;
#   5. the same job runs uninterrupted in a fresh checkpoint folder;
#   6. the final weights of 4 and 5 (written by the chief with --save-weights) must be equal,
#      bit for bit (cmp).
# Prints PASS or FAIL with the reasons; exits non-zero on failure. Every process runs under
# timeout(1).
#
#   scripts/kill-restart.sh [--quick] [--victim 0|1] [--train PATH] [--keep]
#
# --quick: a smaller subset and batch (ctest runs this). --train: the
# binary (default: build it with scripts/build.sh and use build/examples/train/train). --keep:
# leave the work folder (logs, checkpoints, weights) in place.
set -uo pipefail

quick=0
victim=1
train=""
keep=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) quick=1 ;;
    --victim | --train)
      if [[ $# -lt 2 ]]; then echo "kill-restart.sh: $1 needs a value" >&2; exit 2; fi
      if [[ $1 == --victim ]]; then victim=$2; else train=$2; fi
      shift
      ;;
    --keep) keep=1 ;;
    *) echo "kill-restart.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
# --train as given, resolved against the caller's folder before the cd below.
if [[ -n ${train} ]]; then train=$(realpath -m -- "${train}"); fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ${victim} != 0 && ${victim} != 1 ]]; then
  echo "kill-restart.sh: --victim must be 0 or 1" >&2
  exit 2
fi

if [[ -z ${train} ]]; then
  BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
  COLLECTIVES_BUILD_TARGETS=train scripts/build.sh >&2 || exit 1
  train="${BUILD_DIR}/examples/train/train"
fi
[[ -x ${train} ]] || { echo "kill-restart.sh: no binary at ${train}" >&2; exit 1; }

# The job. --throttle-ms slows every step down so that "the middle of epoch 2" lasts long enough
# to hit from a shell; it does not change any arithmetic.
if [[ ${quick} == 1 ]]; then
  # 4096 examples / global batch 128 = 32 steps per epoch.
  job=(--epochs 3 --train-limit 4096 --test-limit 1000 --global-batch 128 --replicas 1
       --save-every-steps 5 --throttle-ms 40)
else
  # 16384 / 256 = 64 steps per epoch, 2 local replicas per worker.
  job=(--epochs 3 --train-limit 16384 --test-limit 10000 --global-batch 256 --replicas 2
       --save-every-steps 10 --throttle-ms 30)
fi
job+=(--seed 7 --timeout 30)
LIMIT=120      # seconds any one process may run
DEADLINE=45    # seconds the survivor has to notice the loss of its peer and exit

# kill_tree PID: stops PID, then each process under it in turn (a stopped process starts no
# other), then kills them all.
kill_tree() {
  local tree=("$1") i=0 child
  while [[ $i -lt ${#tree[@]} ]]; do
    kill -STOP "${tree[i]}" 2>/dev/null
    for child in $(pgrep -P "${tree[i]}"); do tree+=("${child}"); done
    i=$((i + 1))
  done
  kill -KILL "${tree[@]}" 2>/dev/null
}
# On any exit, a Ctrl-C or a TERM included: every worker this script started and has not waited
# for yet, with its timeout(1) and train (in a process group of their own, which a Ctrl-C does not
# reach). The workers are the shell's jobs, which `jobs -p` knows from the moment each starts,
# before start_job has found its train pid. Set before anything is created or started.
work=""
cleanup() {
  local job
  for job in $(jobs -p); do kill_tree "${job}"; done
  [[ -n ${work} ]] || return 0
  if [[ ${keep} == 1 ]]; then echo "kill-restart: work folder kept: ${work}"; else rm -rf "${work}"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

work=$(mktemp -d /tmp/kill-restart.XXXXXX)
started=$(date +%s.%N)
failures=()
fail() { failures+=("$1"); echo "kill-restart: FAIL: $1"; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_job NAME CKPT: starts both workers in the background; sets job_pid0/1 (a subshell around
# timeout(1) around train, so that bash reports no "Killed" job when we kill one) and
# train_pid0/1; logs go to $work/NAME.worker<i>.{out,err}, weights to $work/NAME.weights.
start_job() {
  local name=$1 ckpt=$2 port i
  port=$(free_port)
  # A fresh job token unless one is given: every connection of the job proves it.
  export COLLECTIVES_JOB_TOKEN=${COLLECTIVES_JOB_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
  for i in 0 1; do
    (
      env -u TF_CONFIG -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE \
        RANK=$i WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
        timeout -s KILL "$LIMIT" "$train" --strategy multi_worker "${job[@]}" \
        --checkpoint-dir "$ckpt" --save-weights "$work/$name.weights" \
        >"$work/$name.worker$i.out" 2>"$work/$name.worker$i.err"
      status=$?
      exit $status
    ) 2>/dev/null &
    eval "job_pid$i=$!"
  done
  for i in 0 1; do
    local var="job_pid$i"
    train_pid_under "${!var}"
    eval "train_pid$i=${train_pid}"
  done
}

# wait_job: waits for both workers of the last start_job; sets rc0/rc1.
wait_job() {
  wait "$job_pid0"; rc0=$?
  wait "$job_pid1"; rc1=$?
}

show_logs() {
  local name=$1 i
  for i in 0 1; do
    echo "---- $name, worker $i: stdout ----"; cat "$work/$name.worker$i.out"
    echo "---- $name, worker $i: stderr ----"; cat "$work/$name.worker$i.err"
  done
}

# Sets train_pid to the pid of the train process under `pid` (subshell -> timeout -> train): the
# end of the chain of first children, once it is the train binary. Empty if none appears within
# 250 polls (at least 5 s). It runs in this shell, not in a command substitution, so
# that a Ctrl-C or a TERM meanwhile is handled at once: the shell runs a trap only once the
# command it waits for has ended.
train_pid_under() {
  local pid name child
  train_pid=""
  for _ in $(seq 250); do
    pid=$1
    while child=$(pgrep -P "$pid" | head -1) && [[ -n ${child} ]]; do pid=${child}; done
    name=$(cat "/proc/${pid}/comm" 2>/dev/null)
    if [[ ${name} == "$(basename "${train}" | cut -c1-15)" ]]; then
      train_pid=${pid}
      return
    fi
    sleep 0.02
  done
}

# ---- 1-3: the interrupted run ----
echo "kill-restart: 2 workers, ${job[*]}"
start_job killed "$work/ckpt"
survivor=$((1 - victim))
victim_pid_var="train_pid${victim}"
victim_pid=${!victim_pid_var}
survivor_job_var="job_pid${survivor}"
survivor_pid_var="train_pid${survivor}"

# Wait until the chief has printed a progress line of epoch 2 (it prints one per quarter of an
# epoch when its stdout is a file), then kill.
killed_at=""
for _ in $(seq 3000); do  # up to 60 s
  if awk '/^Epoch 2\//{e=1; next} e && /accuracy/ {found=1} END {exit !found}' \
      "$work/killed.worker0.out" 2>/dev/null; then
    kill -9 "${victim_pid}" && killed_at=$(date +%s.%N)
    break
  fi
  kill -0 "$job_pid0" 2>/dev/null || break
  sleep 0.02
done
if [[ -z ${victim_pid} || -z ${killed_at} ]]; then
  fail "the job never reached epoch 2 (or the kill failed)"
  show_logs killed
  exit 1
fi
echo "kill-restart: SIGKILL to worker ${victim} (pid ${victim_pid}) in epoch 2"

# The survivor must fail, not hang: poll it for up to DEADLINE seconds.
survivor_done=0
for _ in $(seq $((DEADLINE * 50))); do
  if ! kill -0 "${!survivor_job_var}" 2>/dev/null; then survivor_done=1; break; fi
  sleep 0.02
done
if [[ ${survivor_done} == 0 ]]; then
  fail "worker ${survivor} still running ${DEADLINE} s after its peer was killed (a hang)"
  kill -9 "${!survivor_pid_var}" 2>/dev/null
fi
wait_job
noticed=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN {printf "%.2f", b - a}')
survivor_rc_var="rc${survivor}"
survivor_rc=${!survivor_rc_var}
survivor_err="$work/killed.worker${survivor}.err"
if [[ ${survivor_rc} == 0 ]]; then
  fail "worker ${survivor} exited 0 after its peer was killed"
elif [[ ${survivor_rc} == 137 || ${survivor_rc} == 124 ]]; then
  fail "worker ${survivor} was killed by the time limit (status ${survivor_rc})"
elif ! grep -q "worker ${survivor}: error" "${survivor_err}"; then
  fail "worker ${survivor} exited ${survivor_rc} without an error message"
else
  echo "kill-restart: worker ${survivor} exited with status ${survivor_rc} within ${noticed} s:"
  sed 's/^/    /' "${survivor_err}"
fi
if grep -q "^Epoch 3/" "$work/killed.worker0.out"; then
  fail "the kill landed after epoch 2 had ended"
fi
[[ -f "$work/ckpt/checkpoint" ]] || fail "no checkpoint in $work/ckpt after the kill"

# ---- 4: the restart ----
start_job resumed "$work/ckpt"
wait_job
restored=$(grep -m1 "^restored from checkpoint" "$work/resumed.worker0.out")
if [[ ${rc0} != 0 || ${rc1} != 0 ]]; then
  fail "the restarted job failed (status ${rc0}, ${rc1})"
  show_logs resumed
elif [[ ${restored} != "restored from checkpoint: epoch 2,"* ]]; then
  fail "the restarted chief did not restore a checkpoint of epoch 2 (it said: ${restored:-nothing})"
  show_logs resumed
else
  echo "kill-restart: restart: ${restored}"
  grep -E "^test accuracy|^test loss" "$work/resumed.worker0.out" | sed 's/^/    /'
fi

# ---- 5: the uninterrupted reference ----
start_job reference "$work/ckpt-reference"
wait_job
if [[ ${rc0} != 0 || ${rc1} != 0 ]]; then
  fail "the uninterrupted job failed (status ${rc0}, ${rc1})"
  show_logs reference
fi

# ---- 6: the weights ----
if [[ -f "$work/resumed.weights" && -f "$work/reference.weights" ]]; then
  if cmp -s "$work/resumed.weights" "$work/reference.weights"; then
    echo "kill-restart: final weights of the resumed and the uninterrupted job are identical" \
         "($(stat -c %s "$work/reference.weights") bytes, cmp)"
  else
    fail "final weights differ: $(cmp "$work/resumed.weights" "$work/reference.weights" | head -1)"
  fi
else
  fail "a weights file is missing"
fi

elapsed=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
if [[ ${#failures[@]} -eq 0 ]]; then
  echo "kill-restart: PASS (${elapsed} s)"
  exit 0
fi
echo "kill-restart: FAIL (${#failures[@]} problem(s), ${elapsed} s):"
printf '  - %s\n' "${failures[@]}"
exit 1
