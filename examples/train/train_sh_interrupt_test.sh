#!/usr/bin/env bash
# ctest train_sh_interrupt: scripts/train.sh stops, and every train process it started with it,
# on a Ctrl-C at the terminal (SIGINT to the script's process group) and on a TERM to the script
# alone, within 10 s. (timeout(1) gives train a process group of its own, which neither reaches
# by itself: unless the script passes the signal on, the workers train on for up to
# TRAIN_TIME_LIMIT, an hour.) It leaves nothing in TMPDIR, --workers' folder of worker logs
# included.
#
#   train_sh_interrupt_test.sh BUILD_DIR
set -u
build_dir=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
set -m  # each job in a process group of its own, with SIGINT not ignored: as at a terminal

tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT

# descendants, signal_and_wait
source "${root}/examples/interrupt_test_lib.sh"

# interrupt SIGNAL TARGET TRAINS ARGS...: starts train.sh ARGS, waits for TRAINS train processes
# under it, sends SIGNAL to its process group (TARGET group) or to the script (TARGET script),
# and checks that the script and those processes are gone within 10 s.
status=0
interrupt() {
  local signal=$1 target=$2 trains=$3 pid found=() p i
  shift 3
  TMPDIR=${tmp} TRAIN_NO_BUILD=1 COLLECTIVES_BUILD_DIR=${build_dir} \
    "${root}/scripts/train.sh" "$@" \
    --epochs 100000 --train-limit 1024 --test-limit 100 --quiet-progress >/dev/null 2>&1 &
  pid=$!
  for ((i = 0; i < 400 && ${#found[@]} < trains; ++i)); do
    found=()
    for p in $(descendants "${pid}"); do
      [[ $(cat "/proc/${p}/comm" 2>/dev/null) == train ]] && found+=("${p}")
    done
    sleep 0.05
  done
  if [[ ${#found[@]} -lt ${trains} ]]; then
    echo "FAIL: train.sh $* started ${#found[@]} of ${trains} train processes"
    status=1
  fi
  local left
  if ! left=$(signal_and_wait "${signal}" "${target}" "${pid}" 200 "${found[@]}"); then
    echo "FAIL: SIG${signal} to train.sh $* (${target}): ${left} still running after 10 s"
    # The timeout(1) processes, then the script: TERM ends each with its train.
    kill -TERM $(pgrep -P "${pid}") "${pid}" "${found[@]}" 2>/dev/null
    status=1
  elif [[ -n $(ls "${tmp}") ]]; then
    echo "FAIL: SIG${signal} to train.sh $* (${target}) left $(ls "${tmp}") in TMPDIR"
    status=1
  else
    echo "ok: SIG${signal} to train.sh $* (${target}) stopped it and its ${trains} train processes"
  fi
  rm -rf "${tmp:?}"/*
}

interrupt INT group 2 --workers 2
interrupt INT group 5 --strategy parameter_server --workers 2 --ps 2
interrupt TERM script 1 --strategy one_device
exit "${status}"
