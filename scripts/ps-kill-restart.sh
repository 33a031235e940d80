#!/usr/bin/env bash
# Failures of a ParameterServerStrategy job, shown end to end (scripts/train.sh --strategy
# parameter_server: a coordinator, 2 workers and 2 parameter servers on loopback):
#
#   --victim worker (the default)
#     1. the job trains 3 epochs' worth of steps, uninterrupted: its test accuracy is the
#        yardstick, and must be at least --min-accuracy (default 0.80; 0.75 with --quick);
#     2. the same job again, with worker 1 SIGKILLed in epoch 2 and started again 1 s later: the
#        coordinator must run the dead worker's unfinished steps on the other worker, take the
#        restarted one back, finish with status 0, and reach a test accuracy within
#        --tolerance (default 0.01, one point; 0.03 with --quick) of the uninterrupted run's;
#   --victim ps
#     1. the job runs with --checkpoint-dir; parameter server 1 is SIGKILLed in epoch 2: the
#        coordinator must exit with an error that names "ps 1", within --deadline seconds
#        (default 20);
#     2. the whole job is started again with the same checkpoint folder: the coordinator must
#        restore the checkpoint of epoch 2 and finish with status 0.
# Prints PASS or FAIL with the reasons; exits non-zero on failure, 2 on a bad command line.
#
#   scripts/ps-kill-restart.sh [--quick] [--victim worker|ps] [--tolerance T] [--deadline S]
#                              [--min-accuracy A] [--keep]
#
# --quick: a subset of the data (ctest runs this form). --keep: leave the work folder (logs,
# checkpoints) in place. Environment as for scripts/train.sh (COLLECTIVES_BUILD_DIR,
# TRAIN_NO_BUILD, TRAIN_TIME_LIMIT).
set -uo pipefail

quick=0
victim=worker
tolerance=""
deadline=20
min_accuracy=""
keep=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) quick=1 ;;
    --victim | --tolerance | --deadline | --min-accuracy)
      if [[ $# -lt 2 ]]; then echo "ps-kill-restart.sh: $1 needs a value" >&2; exit 2; fi
      case "$1" in
        --victim) victim=$2 ;;
        --tolerance) tolerance=$2 ;;
        --deadline) deadline=$2 ;;
        --min-accuracy) min_accuracy=$2 ;;
      esac
      shift
      ;;
    --keep) keep=1 ;;
    *) echo "ps-kill-restart.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [[ ${victim} != worker && ${victim} != ps ]]; then
  echo "ps-kill-restart.sh: --victim must be worker or ps, got '${victim}'" >&2
  exit 2
fi
# Asynchronous training ends at a different point each run (the workers' updates interleave
# differently): the quick form's accuracy varies by about a point between uninterrupted runs, the
# full form's by less. Hence the quick form's wider default tolerance.
if [[ -z ${tolerance} ]]; then
  tolerance=0.01
  [[ ${quick} == 1 ]] && tolerance=0.03
fi
if [[ -z ${min_accuracy} ]]; then
  min_accuracy=0.80
  [[ ${quick} == 1 ]] && min_accuracy=0.75
fi
for pair in "--tolerance:${tolerance}" "--deadline:${deadline}" "--min-accuracy:${min_accuracy}"; do
  if [[ ! ${pair#*:} =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
    echo "ps-kill-restart.sh: ${pair%%:*} needs a number, got '${pair#*:}'" >&2
    exit 2
  fi
done
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The job. --throttle-ms slows every step down so that epoch 2 lasts long enough for the kill
# and the restart to land in it; it changes no arithmetic.
if [[ ${quick} == 1 ]]; then
  # 8192 examples / 64 per step = 128 steps per epoch.
  job=(--epochs 3 --train-limit 8192 --test-limit 10000 --global-batch 64 --throttle-ms 10)
else
  job=(--epochs 3 --global-batch 128 --throttle-ms 5)
fi
job+=(--seed 7)
run=("${ROOT}/scripts/train.sh" --strategy parameter_server --workers 2 --ps 2)

# Build once, here, rather than in every run below.
if [[ ${TRAIN_NO_BUILD:-0} != 1 ]]; then
  COLLECTIVES_BUILD_TARGETS=train "${ROOT}/scripts/build.sh" >&2 || exit 1
fi
export TRAIN_NO_BUILD=1

# train.sh stops its tasks on INT and TERM; this script waits for it in the background so that a
# signal reaches the trap at once, and hands it on.
work=""
child=""
cleanup() {
  if [[ -n ${child} ]]; then kill -TERM "${child}" 2>/dev/null; wait "${child}" 2>/dev/null; fi
  [[ -n ${work} ]] || return 0
  if [[ ${keep} == 1 ]]; then echo "ps-kill-restart: work folder kept: ${work}"; else rm -rf "${work}"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
work=$(mktemp -d /tmp/ps-kill-restart.XXXXXX)
started=$(date +%s.%N)
failures=()
fail() { failures+=("$1"); echo "ps-kill-restart: FAIL: $1"; }

# job NAME ARGS...: runs train.sh with the job and ARGS, output in $work/NAME.log; sets rc.
job() {
  local name=$1
  shift
  rc=0
  TMPDIR=${work} "${run[@]}" "${job[@]}" "$@" >"${work}/${name}.log" 2>&1 &
  child=$!
  wait "${child}" || rc=$?
  child=""
}
accuracy_of() { sed -n 's/^test loss: [0-9.]* - test accuracy: \([0-9.]*\) .*/\1/p' "$1" | tail -1; }
show() { echo "---- $1 ----"; cat "${work}/$1.log"; }

echo "ps-kill-restart: victim ${victim}; 1 coordinator, 2 workers, 2 ps; ${job[*]}"
if [[ ${victim} == worker ]]; then
  job reference
  reference=$(accuracy_of "${work}/reference.log")
  if [[ ${rc} != 0 || -z ${reference} ]]; then
    fail "the uninterrupted job failed (status ${rc})"
    show reference
  elif ! awk -v a="${reference}" -v m="${min_accuracy}" 'BEGIN {exit !(a >= m)}'; then
    fail "the uninterrupted job's test accuracy ${reference} is below ${min_accuracy}"
  else
    echo "ps-kill-restart: uninterrupted: test accuracy ${reference} (at least ${min_accuracy})"
  fi

  job killed --kill-worker 1 --restart-after 1
  killed=$(accuracy_of "${work}/killed.log")
  grep -E "^train.sh: (SIGKILL|worker 1 restarted)|^workers:" "${work}/killed.log" | sed 's/^/    /'
  if ! grep -q "^train.sh: SIGKILL to worker 1" "${work}/killed.log"; then
    fail "worker 1 was not killed"
    show killed
  elif ! grep -q "^train.sh: worker 1 restarted" "${work}/killed.log"; then
    fail "worker 1 was not restarted before the training ended"
    show killed
  elif [[ ${rc} != 0 || -z ${killed} ]]; then
    fail "the job with a killed worker failed (status ${rc})"
    show killed
  else
    echo "ps-kill-restart: worker 1 killed and restarted: test accuracy ${killed}"
    if ! grep -q "^workers: 2 of 2 available at the end" "${work}/killed.log"; then
      fail "the restarted worker did not rejoin"
    fi
    if [[ -n ${reference} ]]; then
      if awk -v a="${killed}" -v b="${reference}" -v t="${tolerance}" \
          'BEGIN {d = a - b; if (d < 0) d = -d; exit !(d <= t + 1e-9)}'; then
        echo "ps-kill-restart: accuracies ${killed} and ${reference} differ by at most ${tolerance}"
      else
        fail "test accuracy ${killed} with the kill, ${reference} without: more than ${tolerance} apart"
      fi
    fi
  fi
else
  job killed --kill-ps 1 --checkpoint-dir "${work}/ckpt"
  grep -E "^train.sh: (SIGKILL|the coordinator)|error" "${work}/killed.log" | sed 's/^/    /'
  took=$(sed -n 's/^train.sh: the coordinator exited with status [0-9]*, \([0-9.]*\) s after.*/\1/p' \
    "${work}/killed.log")
  if ! grep -q "^train.sh: SIGKILL to ps 1" "${work}/killed.log"; then
    fail "parameter server 1 was not killed"
    show killed
  elif [[ ${rc} == 0 ]]; then
    fail "the job exited 0 after a parameter server was killed"
    show killed
  elif ! grep -q "^train: coordinator: error: .*ps 1" "${work}/killed.log"; then
    fail "the coordinator's error does not name ps 1"
    show killed
  elif [[ -z ${took} ]] || ! awk -v a="${took}" -v d="${deadline}" 'BEGIN {exit !(a <= d)}'; then
    fail "the coordinator took ${took:-?} s to exit, more than ${deadline} s"
  else
    echo "ps-kill-restart: the coordinator named ps 1 and exited ${took} s after the kill"
  fi

  job resumed --checkpoint-dir "${work}/ckpt"
  restored=$(grep -m1 "^restored from checkpoint" "${work}/resumed.log")
  if [[ ${rc} != 0 ]]; then
    fail "the restarted job failed (status ${rc})"
    show resumed
  elif [[ ${restored} != "restored from checkpoint: epoch 2,"* ]]; then
    fail "the restarted coordinator did not restore a checkpoint of epoch 2 (it said: ${restored:-nothing})"
    show resumed
  else
    echo "ps-kill-restart: restart: ${restored}; test accuracy $(accuracy_of "${work}/resumed.log")"
  fi
fi

elapsed=$(awk -v a="${started}" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
if [[ ${#failures[@]} -eq 0 ]]; then
  echo "ps-kill-restart: PASS (${elapsed} s)"
  exit 0
fi
echo "ps-kill-restart: FAIL (${#failures[@]} problem(s), ${elapsed} s):"
printf '  - %s\n' "${failures[@]}"
exit 1
