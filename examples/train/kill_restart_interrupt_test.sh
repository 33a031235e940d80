#!/usr/bin/env bash
# ctest kill_restart_interrupt: scripts/kill-restart.sh stops every worker it started when it is
# interrupted (a TERM to the script alone, a Ctrl-C at the terminal: SIGINT to its process group)
# at the start of a job, before it knows the workers' train pids, within 5 s. The workers are a
# stand-in train that takes its time to start (a script whose child is not yet the train
# binary), which the script's search for the train pid does not find for seconds; left to
# themselves they would run on until the script's 120 s limit.
#
#   kill_restart_interrupt_test.sh
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
set -m  # each job in a process group of its own, with SIGINT not ignored: as at a terminal

work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
# The stand-in: `train`, a script that runs `starting` (a copy of sleep) for 300 s.
mkdir "${work}/bin"
cp /bin/sleep "${work}/bin/starting"
printf '#!/bin/sh\n"%s" 300\n' "${work}/bin/starting" >"${work}/bin/train"
chmod +x "${work}/bin/train"

# descendants, signal_and_wait
source "${root}/examples/interrupt_test_lib.sh"

# interrupt SIGNAL TARGET: starts kill-restart.sh on the stand-in, waits for both workers'
# `starting` processes, sends SIGNAL to the script (TARGET script) or its process group (TARGET
# group), and checks that the script and every process of both workers (timeout, train,
# starting) are gone within 5 s.
status=0
interrupt() {
  local signal=$1 target=$2 pid found=() workers=() p i name
  COLLECTIVES_JOB_TOKEN=0123456789abcdef0123456789abcdef \
    bash "${root}/scripts/kill-restart.sh" --quick --train "${work}/bin/train" >/dev/null 2>&1 &
  pid=$!
  for ((i = 0; i < 200; ++i)); do
    found=()
    workers=()
    for p in $(descendants "${pid}"); do
      name=$(cat "/proc/${p}/comm" 2>/dev/null)
      [[ ${name} == starting ]] && workers+=("${p}")
      [[ ${name} == starting || ${name} == train || ${name} == timeout ]] && found+=("${p}")
    done
    [[ ${#workers[@]} -ge 2 ]] && break
    sleep 0.05
  done
  if [[ ${#workers[@]} -lt 2 ]]; then
    echo "FAIL: kill-restart.sh started ${#workers[@]} of 2 workers"
    status=1
  fi
  local left
  if ! left=$(signal_and_wait "${signal}" "${target}" "${pid}" 100 "${found[@]}"); then
    echo "FAIL: SIG${signal} to kill-restart.sh (${target}): ${left} still running after 5 s"
    kill -KILL "${found[@]}" "${pid}" 2>/dev/null
    status=1
  else
    echo "ok: SIG${signal} to kill-restart.sh (${target}) stopped it and both workers"
  fi
  wait "${pid}" 2>/dev/null
}

interrupt TERM script
interrupt INT group
exit "${status}"
