#!/usr/bin/env bash
# Installs the Debian packages replica builds against, then configures and builds it.
# Idempotent: packages already present are not touched, and an existing build is reused.
#   tools/setup.sh            what the main job needs: replica-train (and, where a GPU is found,
#                             the CUDA and NCCL plugins, compiled for that GPU only)
#   tools/setup.sh --all      everything: every program, the tests, and the CUDA plugins
#                             whenever nvcc is found, GPU or not (what CI builds and tests)
#   REPLICA_BUILD_DIR=dir     build somewhere else
#   REPLICA_CMAKE_ARGS="..."  extra CMake arguments at the first configure (e.g. -DREPLICA_CUDA=OFF)
#   REPLICA_SKIP_BUILD=1      only install packages
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

all=0
for arg in "$@"; do
  case "$arg" in
    --all) all=1 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

packages=(
  build-essential cmake ninja-build pkg-config zlib1g-dev libjpeg62-turbo-dev libpng-dev
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
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  cmake_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
# A GPU here: its architectures only (9.0 -> 90), not every architecture replica supports.
gpu_archs=""
if command -v nvidia-smi >/dev/null; then
  gpu_archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
              tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd';' || true)
fi
if [ ! -f "$build/build.ninja" ]; then
  [ -n "$gpu_archs" ] && cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=$gpu_archs")
  # No GPU and only the main job: CUDA is not even looked for (5 s of configuring), until a
  # later --all turns it on.
  [ -z "$gpu_archs" ] && [ "$all" = 0 ] && cmake_args+=(-DREPLICA_CUDA=OFF -DREPLICA_CUDA_DEFERRED=ON)
  # shellcheck disable=SC2086
  cmake -S "$here" -B "$build" "${cmake_args[@]}" ${REPLICA_CMAKE_ARGS:-} >/dev/null
elif [ -n "$gpu_archs" ] && ! grep -q "^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=$gpu_archs\$" "$build/CMakeCache.txt"; then
  cmake "$build" -DREPLICA_CUDA=ON -DREPLICA_CUDA_DEFERRED=OFF "-DCMAKE_CUDA_ARCHITECTURES=$gpu_archs" >/dev/null
fi
if [ "$all" = 1 ] && grep -q "^REPLICA_CUDA_DEFERRED:BOOL=ON" "$build/CMakeCache.txt"; then
  cmake "$build" -DREPLICA_CUDA=ON -DREPLICA_CUDA_DEFERRED=OFF >/dev/null
fi

targets=()
if [ "$all" = 0 ]; then
  targets=(replica-train)
  if [ -n "$gpu_archs" ]; then
    for plugin in replica_cuda replica_nccl; do
      grep -q "^build $plugin:" "$build/build.ninja" 2>/dev/null && targets+=("$plugin")
    done
  fi
fi
start=$SECONDS
cmake --build "$build" -j "$(nproc)" ${targets[@]:+--target "${targets[@]}"}
echo "setup: built ${targets[*]:-everything} in $((SECONDS - start)) s ($build)"
