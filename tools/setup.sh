#!/usr/bin/env bash
# Installs the Debian packages replica builds against, then configures and builds it.
# Idempotent: packages already present are not touched, and an existing build is reused.
#   tools/setup.sh            install + configure + build (Release) into ./build
#   REPLICA_BUILD_DIR=dir     build somewhere else
#   REPLICA_CMAKE_ARGS="..."  extra CMake arguments (e.g. -DREPLICA_CUDA=OFF)
#   REPLICA_SKIP_BUILD=1      only install packages
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(
  build-essential cmake ninja-build pkg-config zlib1g-dev
  libtbb-dev libopenblas-pthread-dev doctest-dev libcli11-dev nlohmann-json3-dev libfmt-dev
  libgloo-dev dataset-fashion-mnist python3-matplotlib
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ "${REPLICA_SKIP_BUILD:-0}" = 1 ] && exit 0

build="${REPLICA_BUILD_DIR:-$here/build}"
nvcc_arg=()
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  nvcc_arg=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${nvcc_arg[@]}" ${REPLICA_CMAKE_ARGS:-}
fi
cmake --build "$build" -j "$(nproc)"
