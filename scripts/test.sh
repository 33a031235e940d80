#!/usr/bin/env bash
# THE test command: installs the dependencies, builds with the tests on, and runs every test
# with ctest. Exits non-zero when the build or any test fails. Extra arguments go to CMake.
# COLLECTIVES_SKIP_DEPS=1 skips the dependency install (see scripts/build.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/build.sh -DCOLLECTIVES_BUILD_TESTS=ON "$@"

cd "${COLLECTIVES_BUILD_DIR:-build}"
ctest --output-on-failure -j2 --timeout 300
