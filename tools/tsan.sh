#!/usr/bin/env bash
# Runs the DP tests, the loader's and the prefetcher's, and DDP's (its ranks are TSAN builds of
# replica-train, so each rank's training, communication and heartbeat threads are checked)
# under ThreadSanitizer.
#   tools/tsan.sh            build into build-tsan (CPU only, RelWithDebInfo, -march=native as
#                            Release builds: the same kernels) and run
# TBB and OpenBLAS are not instrumented; tools/tsan.supp silences what happens inside them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${REPLICA_TSAN_BUILD_DIR:-$here/build-tsan}"
REPLICA_SKIP_BUILD=1 "$here/tools/setup.sh"
# Configured every time, as tools/asan.sh is: a folder made with other flags gets these.
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DREPLICA_CUDA=OFF \
      -DREPLICA_TSAN=ON -DCMAKE_CXX_FLAGS=-march=native >/dev/null
cmake --build "$build" -j "$(nproc)" --target test_dp_equivalence test_data test_loader \
      test_prefetch test_ddp test_ddp_faults replica-train replica-launch
export TSAN_OPTIONS="suppressions=$here/tools/tsan.supp halt_on_error=1 second_deadlock_stack=1"
"$build/bin/test_data"    # synthetic samples made in parallel
"$build/bin/test_loader"  # the loader thread against next(), release and restarts
# Batches staged a step ahead (on CPU devices too: prefetch_on_cpu), single and DP.
"$build/bin/test_prefetch" -tc="a step takes*,rows staged*,training on prefetched*"
# The full DP matrix is slow under TSAN; the CNN cases and the strategy test exercise every
# thread (workers, communication thread, loader) the same way.
"$build/bin/test_dp_equivalence" -tc="scatter*,bucket*,DP cnn*,tree*"
# A rank that sees a race exits 66, which fails the test that launched it.
"$build/bin/test_ddp" -tc="DDP on N ranks*,every rank holds*,grad-sync*"
"$build/bin/test_ddp_faults"
echo "tsan: no data races reported"
