#!/usr/bin/env bash
# test_cuda_channels_last's training cases (the residual branches damped) run on a CPU device
# with the layout forced (REPLICA_CHANNELS_LAST_ON_CPU=1): the test's own code, its GPU device
# replaced by the CPU. Prints the losses and update drifts the GPU run will print. From the
# project root, against a build/ tree: bash bench/results/2026-11-30-cpu/channels-last-on-cpu.sh
set -euo pipefail
t=$(mktemp -d)
python3 - "$t/case.cpp" <<'PY'
import sys
s = open("tests/test_cuda_channels_last.cpp").read()
head = s[:s.index("TEST_CASE(")]
body = s[s.index('TEST_CASE("ResNets trained with channels_last'):]
head = head.replace("const Device kGpu{DeviceType::CUDA, 0, 0};", "const Device kGpu{DeviceType::CPU, 0, 0};")
head = head.replace('bool have_bf16() { return test::have_tensor_cores("bf16 cases"); }', "bool have_bf16() { return true; }")
open(sys.argv[1], "w").write(head + body.replace("if (!test::have_gpu()) return;", ""))
PY
c++ -O2 -march=native -std=gnu++17 -DFMT_SHARED -I tests -I . -I build/generated "$t/case.cpp" \
  build/tests/CMakeFiles/replica_doctest_main.dir/Unity/unity_0_cxx.cxx.o -o "$t/case" \
  -Wl,-rpath,"$PWD/build/lib" -Lbuild/lib -lreplica_parallel -lreplica_layers -lreplica_engine \
  -ltbb -lfmt /usr/lib/libgloo.so.0.5.0 2>&1 | grep -v 'defined but not used' || true
REPLICA_CHANNELS_LAST_ON_CPU=1 "$t/case" | grep -E 'MESSAGE|Status'
rm -rf "$t"
