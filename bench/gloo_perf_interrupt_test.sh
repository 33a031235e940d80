#!/usr/bin/env bash
# ctest GlooPerf.InterruptRemovesTheStore: gloo_perf --local, interrupted (a TERM to the
# launcher alone, a Ctrl-C at the terminal: SIGINT to its process group) while its ranks run,
# ends by that signal within 5 s with its ranks gone and its FileStore folder (gloo_perf.XXXXXX
# in TMPDIR) removed, not left behind.
#
#   gloo_perf_interrupt_test.sh GLOO_PERF
set -u
gloo_perf=$1
set -m  # each job in a process group of its own, with SIGINT not ignored: as at a terminal

tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT

# interrupt SIGNAL TARGET: starts 2 ranks that run for hours (8-byte all-reduces), waits until
# both run and have written to the store folder, sends SIGNAL to the launcher (TARGET launcher)
# or its process group (TARGET group), and checks the launcher's status, the ranks and the folder.
status=0
interrupt() {
  local signal=$1 target=$2 pid ranks=() left=() i rc expected
  TMPDIR=${tmp} "${gloo_perf}" --local 2 -b 8 -e 8 -n 1000000000 -w 0 >/dev/null 2>&1 &
  pid=$!
  for ((i = 0; i < 200; ++i)); do
    read -r -a ranks <<<"$(pgrep -P "${pid}" | tr '\n' ' ')"
    [[ ${#ranks[@]} -ge 2 && -n $(ls "${tmp}"/gloo_perf.* 2>/dev/null) ]] && break
    sleep 0.05
  done
  if [[ ${#ranks[@]} -lt 2 || -z $(ls "${tmp}"/gloo_perf.* 2>/dev/null) ]]; then
    echo "FAIL: gloo_perf --local 2 started ${#ranks[@]} of 2 ranks, or no store folder with keys"
    status=1
  fi
  if [[ ${target} == group ]]; then kill "-${signal}" -- "-${pid}"; else kill "-${signal}" "${pid}"; fi
  for ((i = 0; i < 100; ++i)); do
    left=()
    for p in "${pid}" "${ranks[@]}"; do
      [[ -e /proc/${p} && $(cut -d' ' -f3 "/proc/${p}/stat" 2>/dev/null) != Z ]] && left+=("${p}")
    done
    [[ ${#left[@]} -eq 0 ]] && break
    sleep 0.05
  done
  [[ ${#left[@]} -gt 0 ]] && kill -KILL "${left[@]}" 2>/dev/null
  wait "${pid}"
  rc=$?
  expected=$((128 + $(kill -l "${signal}")))
  if [[ ${#left[@]} -gt 0 ]]; then
    echo "FAIL: SIG${signal} to gloo_perf (${target}): ${left[*]} still running after 5 s"
    status=1
  elif [[ -n $(ls "${tmp}") ]]; then
    echo "FAIL: SIG${signal} to gloo_perf (${target}) left $(ls "${tmp}") in TMPDIR"
    status=1
  elif [[ ${rc} -ne ${expected} ]]; then
    echo "FAIL: SIG${signal} to gloo_perf (${target}): exit status ${rc}, expected ${expected}"
    status=1
  else
    echo "ok: SIG${signal} to gloo_perf (${target}): status ${rc}, ranks gone, store folder removed"
  fi
  rm -rf "${tmp:?}"/*
}

interrupt TERM launcher
interrupt INT group
exit "${status}"
