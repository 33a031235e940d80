#!/usr/bin/env bash
# Runs an embedding example as a job of two processes on this host, the way torchrun would:
# ranks 0 and 1 in the background, both with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (a
# port that was free a moment ago); a Ctrl-C or a TERM stops both. Fails if either rank exits
# non-zero, runs past the time limit, or prints no final checksum, or if the two final checksums
# differ.
#
#   run_two_ranks.sh BINARY [TIME_LIMIT_SECONDS]     (default 60; without an executable BINARY or
#                                                     with a limit that is not 1, 2, ...: exit 2)
set -u
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 BINARY [TIME_LIMIT_SECONDS]   (BINARY: e.g. build/examples/embed_cpp or embed_c)" >&2
  exit 2
fi
binary=$1
limit=${2:-60}
# Usage errors, before anything starts (a rank could not say them more clearly than timeout(1)).
if [ ! -f "$binary" ] || [ ! -x "$binary" ]; then
  echo "run_two_ranks.sh: BINARY '$binary' is not an executable file" >&2
  exit 2
fi
case $limit in
  '' | *[!0-9]* | 0 | 00*)
    echo "run_two_ranks.sh: TIME_LIMIT_SECONDS '$limit' is not a number of seconds (1, 2, ...)" >&2
    exit 2
    ;;
esac

# A free port: bind port 0 and read what the kernel picked; without python3, a random one.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null) \
  || port=$((20000 + RANDOM % 30000))

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# timeout(1) runs its command in a process group of its own, which a Ctrl-C at the terminal does
# not reach: both ranks therefore run in the background, the script waits for them with `wait`
# (which a trapped signal interrupts at once), and on INT or TERM the trap sends TERM to every
# job still running (timeout hands it on to the rank) before the script exits. `jobs -p` also
# knows a rank whose pid the script has not stored yet.
stop_ranks() {
  local running
  running=$(jobs -p)
  if [ -n "$running" ]; then kill -TERM $running 2>/dev/null; fi
  return 0
}
trap 'stop_ranks; exit 130' INT
trap 'stop_ranks; exit 143' TERM

# start_rank R: rank R under timeout in the background (env execs timeout: $! is its pid).
start_rank() {
  env -u TF_CONFIG -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u COLLECTIVES_JOB_ID \
    RANK="$1" WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    timeout "$limit" "$binary" >"$work/rank$1.out" 2>&1 &
}

start_rank 1
pid1=$!
start_rank 0
pid0=$!
wait "$pid0"
rc0=$?
wait "$pid1"
rc1=$?

for r in 0 1; do
  echo "---- rank $r ----"
  cat "$work/rank$r.out"
done

status=0
for r in 0 1; do
  rc_var="rc$r"
  if [ "${!rc_var}" -ne 0 ]; then
    echo "FAIL: rank $r exited with status ${!rc_var} (124: timed out after ${limit} s)"
    status=1
  fi
done
sum0=$(sed -n 's/.*final weights checksum \([0-9a-f]*\).*/\1/p' "$work/rank0.out")
sum1=$(sed -n 's/.*final weights checksum \([0-9a-f]*\).*/\1/p' "$work/rank1.out")
if [ -z "$sum0" ] || [ -z "$sum1" ]; then
  echo "FAIL: a rank printed no final weights checksum"
  status=1
elif [ "$sum0" != "$sum1" ]; then
  echo "FAIL: the ranks' final weights differ: $sum0 vs $sum1"
  status=1
else
  echo "PASS: both ranks end with weights checksum $sum0"
fi
exit $status
