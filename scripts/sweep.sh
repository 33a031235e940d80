#!/usr/bin/env bash
# The main job: installs the dependencies, builds (Release), runs 4-rank all-reduce sweeps from
# 8 B to 64 MiB with every result checked, AUTO (shared memory; rows in out/sweep_4_auto.csv) and
# RING over loopback TCP (out/sweep_4.csv), then a one-epoch run of the Fashion-MNIST training
# demo. Exits non-zero on any error, wrong result or failed training run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Only what this job runs, so that a test that does not compile cannot stop it (test.sh builds
# everything): the sweep and the training demo.
COLLECTIVES_BUILD_TARGETS=${COLLECTIVES_BUILD_TARGETS:-collectives_perf train} scripts/build.sh
BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
mkdir -p out

# AUTO first (every rank on this host: shared memory; the last column names the algorithm chosen
# per size), then RING, TCP over loopback, for comparison.
echo "== all-reduce sweep: 4 ranks, AUTO (shared memory on one host) =="
"${BUILD_DIR}/bench/collectives_perf" --local 4 --impl auto -b 8 -e 64M -f 2 -c all_reduce \
  --check --csv out/sweep_4_auto.csv
echo "== all-reduce sweep: 4 ranks, RING (TCP over loopback) =="
"${BUILD_DIR}/bench/collectives_perf" --local 4 --impl ring -b 8 -e 64M -f 2 -c all_reduce \
  --check --csv out/sweep_4.csv
echo "sweep: rows written to out/sweep_4_auto.csv and out/sweep_4.csv"

# ---- Training demo -------------------------------------------------------------------------
# A short run of the Fashion-MNIST demo (examples/train; scripts/train.sh runs the others): one
# epoch on 2 local replicas (MirroredStrategy) at global batch 256, then the test accuracy and
# samples per second.
echo "== training demo: Fashion-MNIST, mirrored strategy, 2 replicas, 1 epoch =="
timeout --foreground 300 "${BUILD_DIR}/examples/train/train" --strategy mirrored --replicas 2 --epochs 1 \
  --global-batch 256
# ---------------------------------------------------------------------------------------------
