#!/usr/bin/env bash
# First call: the GPU suites (test_cuda_channels_last is new), where ResNet-50 bf16's step goes at
# batch 256 now that activations stay channels_last (replica's parts beside PyTorch's profile),
# then issue 12's open rows against PyTorch: ResNet-50 bf16 at 256, the seed recipe in tf32, the
# CNN at 32/64/256, and issue 11's DP overlap traces.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); END=$((T0 + ${BUDGET:-440}))
R=$OUT/r1; mkdir -p $R
left() { echo $((END - $(date +%s))); }
step() {
  local name=$1 lim=$2; shift 2; local l; l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 5 ]; then echo "NOT RUN $name (no time)" | tee -a $R/summary.txt; return; fi
  local s=$(date +%s)
  timeout -k 5 "$lim" "$@" > $R/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s" | tee -a $R/summary.txt
}
G="bash .gpu/gpu.sh run"
$G true
git log -1 --format=%H > $R/commit.txt 2>/dev/null || true
nvidia-smi > $R/nvidia-smi.txt 2>&1
BLD=/tmp/replica-gpu/build
step tests-gpu 130 $G ctest --test-dir $BLD -L gpu -E test_cuda_ddp --output-on-failure --timeout 100
grep -E 'Test +#|tests passed|ERROR|FAILED' $R/tests-gpu.log | head -30
step ops-r50-bf16-b256 30 $G replica-bench --suite ops --devices cuda:0 --model resnet50 --input-shape 3x224x224 --batch-per-device 256 --steps 5 --precision bf16 --memory-format channels_last --json $R/ops-r50-bf16-b256.jsonl
head -40 $R/ops-r50-bf16-b256.log
step vs-r50-b256 80 $G python3 tools/replica_vs_pytorch.py --case resnet50:3x224x224:256 --precisions bf16 --out $R/vs-r50-b256 --bin $BLD/bin
grep '^|' $R/vs-r50-b256/table.md
step pt-profile-r50 50 $G python3 tools/pytorch_bench.py --mode dp --device-counts 1 --devices cuda:0 --model resnet50 --input-shape 3x224x224 --batch-per-device 256 --precision bf16 --memory-format channels_last --steps 10 --repeat 1 --profile-ops $R/pytorch-r50-bf16-b256-profile.txt --out $R/pt-profile-rows.jsonl
head -30 $R/pytorch-r50-bf16-b256-profile.txt
step vs-r101-tf32 60 $G python3 tools/replica_vs_pytorch.py --case resnet101:1x28x28:256 --precisions tf32 --out $R/vs-r101-tf32 --bin $BLD/bin
grep '^|' $R/vs-r101-tf32/table.md
step vs-cnn 70 $G python3 tools/replica_vs_pytorch.py --case cnn:1x28x28:32 --case cnn:1x28x28:64 --case cnn:1x28x28:256 --precisions fp32 --cuda-graphs --out $R/vs-cnn --bin $BLD/bin
grep '^|' $R/vs-cnn/table.md
step overlap 90 $G python3 tools/gpu_checks.py overlap --quick --out $R/checks --budget 85
cat $R/checks/overlap/summary.md 2>/dev/null | head -60
cd $OUT && tar -czf results1.tgz r1 && rm -rf r1
echo "total $(( $(date +%s) - T0 ))s"
