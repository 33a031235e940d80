#!/usr/bin/env bash
# ctest *.UsageErrorExitsOne and the like: runs COMMAND and checks its exit status.
#
#   exit_status_test.sh EXPECTED_STATUS COMMAND [ARGS...]
set -u
expected=$1
shift
"$@"
rc=$?
if [[ ${rc} -ne ${expected} ]]; then
  echo "FAIL: exit status ${rc}, expected ${expected}: $*"
  exit 1
fi
echo "ok: exit status ${rc}: $*"
