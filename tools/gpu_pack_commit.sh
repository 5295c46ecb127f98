#!/usr/bin/env bash
# Packs one program of another commit for the GPU machine, beside what ../shared/gpu/pack.sh packs
# of the working tree, so that one `run` call can time the two builds against each other (the
# device machines differ from call to call and their hosts set the pace of launch-bound steps:
# only a same-call comparison says whether a change made something slower).
#
#   tools/gpu_pack_commit.sh COMMIT [TARGET]     # TARGET: replica-bench unless given
#   then, on the GPU machine: tar -xJf .gpu/commit-COMMIT.tar.xz -C /
#                             bash .gpu/gpu.sh run /tmp/replica-COMMIT/build/bin/TARGET ...
#
# Built as pack.sh builds (Release, -march=x86-64-v3, sm_90) in /tmp/replica-COMMIT/, from
# `git archive` of the commit. d9253e9's program links replica's libraries statically; the
# Debian libraries it needs come from pack.sh's libs/, which .gpu/gpu.sh puts on
# LD_LIBRARY_PATH. Later commits build replica's libraries shared: such a program is refused
# rather than packed without them.
set -euo pipefail
commit=${1:?usage: tools/gpu_pack_commit.sh COMMIT [TARGET]}
target=${2:-replica-bench}
root=$(git rev-parse --show-toplevel)
short=$(git -C "$root" rev-parse --short=7 "$commit^{commit}")
W=/tmp/replica-$short
if [ ! -f "$W/build/build.ninja" ]; then
  rm -rf "$W" && mkdir -p "$W/src"
  git -C "$root" archive "$short" | tar -x -C "$W/src"
  sed -i 's/-march=native/-march=x86-64-v3/' "$W/src/CMakeLists.txt"
  cmake -S "$W/src" -B "$W/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
fi
cmake --build "$W/build" -j"$(nproc)" --target "$target"
deps=$(ldd "$W/build/bin/$target")
if grep -q 'libreplica' <<<"$deps"; then
  echo "gpu_pack_commit: $short's $target loads replica's own shared libraries; not packed" >&2
  exit 1
fi
mkdir -p "$root/.gpu"
tar -C / -cJf "$root/.gpu/commit-$short.tar.xz" "${W#/}/build/bin/$target"
du -h "$root/.gpu/commit-$short.tar.xz"
