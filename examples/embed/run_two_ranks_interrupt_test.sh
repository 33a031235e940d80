#!/usr/bin/env bash
# ctest run_two_ranks_interrupt: examples/embed/run_two_ranks.sh stops, and both ranks it
# started with it, on a Ctrl-C at the terminal (SIGINT to the script's process group) and on a
# TERM to the script alone, within 5 s. The ranks are a stand-in that hangs (as a rank waiting for
# a peer that never comes would): timeout(1) gives each a process group of its own, which neither
# signal reaches by itself, so unless the script passes the signal on they run until its time
# limit.
#
#   run_two_ranks_interrupt_test.sh
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
set -m  # each job in a process group of its own, with SIGINT not ignored: as at a terminal

work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
# The stand-in rank: a process named hang_rank that sleeps until it is killed.
cp /bin/sleep "${work}/hang_rank"
printf '#!/bin/sh\nexec "%s" 300\n' "${work}/hang_rank" >"${work}/rank.sh"
chmod +x "${work}/rank.sh"

# descendants, signal_and_wait
source "${root}/examples/interrupt_test_lib.sh"

# interrupt SIGNAL TARGET: starts run_two_ranks.sh on the stand-in, waits for its two ranks,
# sends SIGNAL to its process group (TARGET group) or to the script (TARGET script), and checks
# that the script and both ranks are gone within 5 s.
status=0
interrupt() {
  local signal=$1 target=$2 pid found=() p i
  bash "${root}/examples/embed/run_two_ranks.sh" "${work}/rank.sh" 60 >/dev/null 2>&1 &
  pid=$!
  for ((i = 0; i < 200 && ${#found[@]} < 2; ++i)); do
    found=()
    for p in $(descendants "${pid}"); do
      [[ $(cat "/proc/${p}/comm" 2>/dev/null) == hang_rank ]] && found+=("${p}")
    done
    sleep 0.05
  done
  if [[ ${#found[@]} -lt 2 ]]; then
    echo "FAIL: run_two_ranks.sh started ${#found[@]} of 2 ranks"
    status=1
  fi
  local left
  if ! left=$(signal_and_wait "${signal}" "${target}" "${pid}" 100 "${found[@]}"); then
    echo "FAIL: SIG${signal} to run_two_ranks.sh (${target}): ${left} still running after 5 s"
    kill -KILL "${found[@]}" 2>/dev/null
    kill -TERM "${pid}" 2>/dev/null
    status=1
  else
    echo "ok: SIG${signal} to run_two_ranks.sh (${target}) stopped it and its 2 ranks"
  fi
  wait "${pid}" 2>/dev/null
}

interrupt INT group
interrupt TERM script
exit "${status}"
