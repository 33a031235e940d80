# Sourced by the scripts' interrupt tests (examples/embed/run_two_ranks_interrupt_test.sh,
# examples/train/{kill_restart,train_sh}_interrupt_test.sh).

# descendants PID: every process under PID, one per line.
descendants() {
  local p
  for p in $(pgrep -P "$1"); do
    echo "$p"
    descendants "$p"
  done
}

# signal_and_wait SIGNAL TARGET PID TRIES [PID...]: sends SIGNAL to the script PID (TARGET
# script) or to its process group (TARGET group, as a Ctrl-C at the terminal does), then waits
# up to TRIES x 50 ms for PID and the other PIDs to end (a zombie counts as ended). Returns 0
# once all have; else prints those still running and returns 1.
signal_and_wait() {
  local signal=$1 target=$2 pid=$3 tries=$4 left=() i p
  shift 4
  if [[ ${target} == group ]]; then kill "-${signal}" -- "-${pid}"; else kill "-${signal}" "${pid}"; fi
  for ((i = 0; i < tries; ++i)); do
    left=()
    for p in "${pid}" "$@"; do
      [[ -e /proc/${p} && $(cut -d' ' -f3 "/proc/${p}/stat" 2>/dev/null) != Z ]] && left+=("${p}")
    done
    [[ ${#left[@]} -eq 0 ]] && return 0
    sleep 0.05
  done
  echo "${left[*]}"
  return 1
}
