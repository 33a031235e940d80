#!/usr/bin/env bash
# THE main job: installs the dependencies, builds (Release), and runs a 4-rank all-reduce sweep
# over loopback TCP from 8 B to 64 MiB with every result checked; the rows also go to
# out/sweep_4.csv. A few minutes at most on 2 cores. Exits non-zero on any error or wrong result.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Only what this job runs, so that a test that does not compile cannot stop it (test.sh builds
# everything). The demo's target joins the list when it arrives.
COLLECTIVES_BUILD_TARGETS=${COLLECTIVES_BUILD_TARGETS:-collectives_perf} scripts/build.sh
BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
mkdir -p out

echo "== all-reduce sweep: 4 ranks on loopback =="
"${BUILD_DIR}/bench/collectives_perf" --local 4 -b 8 -e 64M -f 2 -c all_reduce --check \
  --csv out/sweep_4.csv
echo "sweep: rows written to out/sweep_4.csv"

# ---- Training demo -------------------------------------------------------------------------
# The training demo (Fashion-MNIST, strategy layer) joins here with the strategy issue.
# ---------------------------------------------------------------------------------------------
