#!/usr/bin/env bash
# Installs the dependencies, then configures (CMake, Ninja, Release) and builds the project into
# build/. Extra arguments go to the CMake configure step, e.g.
#   scripts/build.sh -DCOLLECTIVES_BUILD_TESTS=ON -DCOLLECTIVES_SANITIZE="address;undefined"
# Environment: COLLECTIVES_BUILD_DIR (default build) picks the build folder;
# COLLECTIVES_BUILD_TARGETS (default: everything) names the targets to build, space-separated;
# COLLECTIVES_SKIP_DEPS=1 skips the dependency install (scripts/install-deps.sh), for a machine
# that has them or where apt-get may not run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ${COLLECTIVES_SKIP_DEPS:-0} != 1 ]]; then
  scripts/install-deps.sh
fi

BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
cmake -S . -B "${BUILD_DIR}" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
TARGETS=()
if [[ -n ${COLLECTIVES_BUILD_TARGETS:-} ]]; then
  read -r -a names <<<"${COLLECTIVES_BUILD_TARGETS}"
  TARGETS=(--target "${names[@]}")
fi
cmake --build "${BUILD_DIR}" -j"$(nproc)" "${TARGETS[@]}"
