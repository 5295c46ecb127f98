#!/usr/bin/env bash
# Runs the unit suite (ctest -L unit) under AddressSanitizer + UndefinedBehaviorSanitizer.
#   tools/asan.sh                     build into build-asan/ (CPU only), run every unit test
#   tools/asan.sh -R 'test_idx|store' extra arguments go to ctest
#   REPLICA_ASAN_BUILD_DIR=dir        build somewhere else
#   REPLICA_ASAN_TARGETS="a b"        build only these targets (run them with -R)
# The sanitizer flags go on the cmake command line (CMAKE_CXX_FLAGS and the linker flags), so
# the build files are the ordinary ones; -march=native as in Release builds, so the kernels
# checked are the ones that run here (the direct convolution exists only in AVX-512 builds).
# Any ASan, LeakSanitizer or UBSan report aborts the process with a non-zero exit, which fails
# the test. Suppression files tools/asan.supp,
# tools/lsan.supp and tools/ubsan.supp are used when present; none is needed today (TBB,
# OpenBLAS and Gloo produce no reports in the unit suite).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${REPLICA_ASAN_BUILD_DIR:-$here/build-asan}"  # per tree, as tools/tsan.sh's
REPLICA_SKIP_BUILD=1 "$here/tools/setup.sh"
sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
# Configured every time, so that a build folder made with other flags gets these (re-running
# CMake on an unchanged folder takes a second and rebuilds nothing).
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DREPLICA_CUDA=OFF \
      "-DCMAKE_CXX_FLAGS=$sanitize -fno-omit-frame-pointer -march=native" \
      "-DCMAKE_EXE_LINKER_FLAGS=$sanitize" "-DCMAKE_SHARED_LINKER_FLAGS=$sanitize" >/dev/null
cmake --build "$build" -j "$(nproc)" ${REPLICA_ASAN_TARGETS:+--target $REPLICA_ASAN_TARGETS}

supp() { [ -f "$here/tools/$1" ] && echo ":suppressions=$here/tools/$1" || true; }
asan="halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1"
export ASAN_OPTIONS="$asan:check_initialization_order=1:strict_init_order=1$(supp asan.supp)"
export LSAN_OPTIONS="$(supp lsan.supp | cut -c2-)"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1$(supp ubsan.supp)"
start=$(date +%s)
status=0
ctest --test-dir "$build" -L unit --output-on-failure "$@" || status=$?
echo "asan: ctest -L unit took $(( $(date +%s) - start )) s under ASan+UBSan (exit $status)"
exit $status
