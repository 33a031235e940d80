#!/usr/bin/env bash
# Builds the test suite with sanitizers and runs it.
#   scripts/sanitize.sh address   ASan + UBSan, into build-asan/ (the whole suite)
#   scripts/sanitize.sh thread    TSan, into build-tsan/ (the whole suite; slower)
# Extra arguments go to ctest (e.g. -R Ring). Exits non-zero on any failure or report.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

kind=${1:-address}
shift || true
case "${kind}" in
  address) sanitize="address;undefined"; dir=build-asan ;;
  thread) sanitize="thread"; dir=build-tsan ;;
  *) echo "usage: scripts/sanitize.sh address|thread [ctest args]" >&2; exit 2 ;;
esac

COLLECTIVES_BUILD_DIR=${dir} scripts/build.sh -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCOLLECTIVES_BUILD_TESTS=ON -DCOLLECTIVES_BUILD_BENCHMARKS=OFF \
  -DCOLLECTIVES_SANITIZE="${sanitize}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:atexit_sleep_ms=0}
cd "${dir}"
ctest --output-on-failure -j2 --timeout 900 "$@"
