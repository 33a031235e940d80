#!/usr/bin/env bash
# Installs the Debian 12 packages that building, testing, benchmarking and the training demo
# need. Idempotent: packages already installed are skipped (dpkg-query), so a second run is fast
# and works offline; `apt-get update` runs only when a missing package has no install candidate
# (or once more if installing from stale package lists fails). Runs apt-get through sudo unless
# already root. Packages given as arguments are installed too (scripts/fuzz.sh adds clang).
#
#   install-deps.sh [EXTRA_PACKAGE...]
set -euo pipefail

PACKAGES=(
  g++ cmake ninja-build make
  libasio-dev openmpi-bin libopenmpi-dev libpmix-dev
  libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
  nlohmann-json3-dev libcli11-dev libssl-dev libeigen3-dev zlib1g-dev
  dataset-fashion-mnist
  python3 python3-matplotlib
  python3-dev python3-numpy python3-pybind11 python3-pytest python3-torch libtorch-dev
  # Debian's torch calls BLAS through libblas.so.3, which without this is the reference BLAS:
  # OpenBLAS (it takes that name at a higher alternatives priority) makes the DDP example's
  # matrix products about 4x faster, so that its samples/s measure the gradient sync, not BLAS.
  libopenblas0-openmp
  time iproute2 procps
  "$@"
)

is_installed() {
  dpkg-query -W -f='${Status}\n' "$1" 2>/dev/null | grep -q ' installed$'
}

missing=()
for package in "${PACKAGES[@]}"; do
  is_installed "${package}" || missing+=("${package}")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages are installed"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if ! command -v sudo >/dev/null; then
    echo "install-deps: not root and sudo is missing; install as root: ${missing[*]}" >&2
    exit 1
  fi
  SUDO=(sudo env DEBIAN_FRONTEND=noninteractive)  # sudo's env_reset drops the export below
fi
export DEBIAN_FRONTEND=noninteractive

has_candidate() {
  apt-cache policy "$1" 2>/dev/null | grep -q 'Candidate: [^(]'
}

need_update=0
for package in "${missing[@]}"; do
  has_candidate "${package}" || { need_update=1; break; }
done
if [[ ${need_update} -eq 1 ]]; then
  "${SUDO[@]}" apt-get update
fi

install() {
  "${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
}
if ! install; then
  if [[ ${need_update} -eq 0 ]]; then
    echo "install-deps: install failed; refreshing the package lists and retrying" >&2
    "${SUDO[@]}" apt-get update
    install
  else
    exit 1
  fi
fi
echo "install-deps: done"
