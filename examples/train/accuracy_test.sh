#!/usr/bin/env bash
# ctest train_short_run_accuracy*: runs TRAIN with ARGS and passes when it exits 0, reports a
# test accuracy of at least MIN_ACCURACY, and says that its replicas hold identical weights.
#
#   accuracy_test.sh MIN_ACCURACY TRAIN [ARGS...]
#
# Exit status: 0 when all three hold, 1 otherwise (saying which), 2 on a bad command line.
set -u
if [[ $# -lt 2 ]]; then
  echo "usage: accuracy_test.sh MIN_ACCURACY TRAIN [ARGS...]" >&2
  exit 2
fi
min_accuracy=$1
shift
output=$("$@" 2>&1)
rc=$?
printf '%s\n' "${output}"
if [[ ${rc} -ne 0 ]]; then
  echo "FAIL: exit status ${rc}: $*"
  exit 1
fi
accuracy=$(sed -n 's/^test loss: [0-9.]* - test accuracy: \([0-9.]*\) .*/\1/p' <<<"${output}")
if [[ -z ${accuracy} ]]; then
  echo "FAIL: no test accuracy in the output"
  exit 1
fi
if ! awk -v a="${accuracy}" -v m="${min_accuracy}" 'BEGIN { exit !(a >= m) }'; then
  echo "FAIL: test accuracy ${accuracy} is below ${min_accuracy}"
  exit 1
fi
if ! grep -q '^weights: identical on all [0-9]* replicas$' <<<"${output}"; then
  echo "FAIL: the run did not report identical weights on its replicas"
  exit 1
fi
echo "ok: test accuracy ${accuracy} >= ${min_accuracy}, weights identical on every replica"
