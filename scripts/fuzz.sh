#!/usr/bin/env bash
# Runs every libFuzzer target (tests/fuzz/*_fuzzer.cc) for FUZZ_SECONDS each (default 600), built
# with Clang, libFuzzer, ASan and UBSan in build-fuzz/. Each starts from the seed corpus kept in
# tests/fuzz/corpus/<target>/ and grows its own corpus in out/fuzz/<target>/ (the repo's seeds
# are not touched). Prints libFuzzer's run count per target; exits non-zero on the first failure
# (crash, leak, timeout: the fuzzer's exit status), leaving the input in out/fuzz/ (crash-*,
# leak-*, timeout-*).
#   scripts/fuzz.sh                 all targets, 10 minutes each
#   FUZZ_SECONDS=30 scripts/fuzz.sh wire
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# libclang-rt-dev holds libFuzzer and the sanitizer runtimes: clang only recommends it, and
# install-deps.sh installs without recommendations. Through sudo unless root, as the others.
scripts/install-deps.sh clang libclang-rt-dev

BUILD_DIR=${COLLECTIVES_FUZZ_BUILD_DIR:-build-fuzz}
SECONDS_EACH=${FUZZ_SECONDS:-600}
TARGETS=("$@")
if [[ ${#TARGETS[@]} -eq 0 ]]; then
  TARGETS=()
  for src in tests/fuzz/*_fuzzer.cc; do
    name=$(basename "${src}" .cc)
    TARGETS+=("${name%_fuzzer}")
  done
fi

CC=clang CXX=clang++ cmake -S . -B "${BUILD_DIR}" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCOLLECTIVES_BUILD_TESTS=ON -DCOLLECTIVES_FUZZ=ON -DCOLLECTIVES_SANITIZE="address;undefined" \
  -DCOLLECTIVES_BUILD_BENCHMARKS=OFF -DCOLLECTIVES_BUILD_EXAMPLES=OFF >/dev/null
names=()
for t in "${TARGETS[@]}"; do names+=("${t}_fuzzer"); done
cmake --build "${BUILD_DIR}" -j"$(nproc)" --target "${names[@]}"

mkdir -p out/fuzz
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
for t in "${TARGETS[@]}"; do
  corpus="out/fuzz/${t}"
  mkdir -p "${corpus}"
  echo "== fuzz ${t}: ${SECONDS_EACH} s =="
  # -close_fd_mask=2: the handshake server logs every refused stranger to stderr.
  # The fuzzer's own exit status decides (a crash, a leak, a timeout, any failure is non-zero);
  # the display filter's status does not matter.
  status=0
  "${BUILD_DIR}/tests/${t}_fuzzer" -max_total_time="${SECONDS_EACH}" -print_final_stats=1 \
    -close_fd_mask=2 -artifact_prefix="out/fuzz/${t}-" "${corpus}" "tests/fuzz/corpus/${t}" \
    >"out/fuzz/${t}.log" 2>&1 || status=$?
  grep -E '^(Done|INFO: seed|stat::number_of_executed_units|==[0-9]+==ERROR|SUMMARY)' \
    "out/fuzz/${t}.log" || true
  if [[ ${status} -ne 0 ]] ||
    grep -q -E 'ERROR: (libFuzzer|AddressSanitizer|LeakSanitizer|UndefinedBehavior)|runtime error' \
      "out/fuzz/${t}.log"; then
    echo "fuzz ${t}: FAILED (exit status ${status}), see out/fuzz/${t}.log" >&2
    exit 1
  fi
done
echo "fuzz: no crash in ${TARGETS[*]}"
