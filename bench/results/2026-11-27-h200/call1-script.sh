#!/usr/bin/env bash
# One call on the GPU machine: correctness first, then accuracy, then speed; a global deadline.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); END=$((T0 + ${BUDGET:-500}))
R=$OUT/r; mkdir -p $R
left() { echo $((END - $(date +%s))); }
step() {  # step NAME LIMIT CMD...: runs under min(LIMIT, time left), logs to $R/NAME.log
  local name=$1 lim=$2; shift 2; local l; l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 5 ]; then echo "NOT RUN $name (no time)" | tee -a $R/summary.txt; return; fi
  local s=$(date +%s)
  timeout -k 5 "$lim" "$@" > $R/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s" | tee -a $R/summary.txt
}
G="bash .gpu/gpu.sh run"
bash .gpu/gpu.sh run true  # unpack
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > $R/nvidia-smi.txt
cat $R/nvidia-smi.txt
git log -1 --format=%h > $R/commit.txt 2>/dev/null
BLD=/tmp/replica-gpu/build
step tests-gpu 200 $G ctest --test-dir $BLD -L gpu -E test_cuda_ddp --output-on-failure --timeout 150
grep -E 'Test +#|tests passed|Failed' $R/tests-gpu.log
step compare-transforms 60 $G python3 tools/compare_transforms.py --bin $BLD/bin
tail -5 $R/compare-transforms.log
for s in 0 1; do for p in fp32 bf16; do
  step main-$p-s$s 40 $G replica-train --devices cuda:0 --seed $s --precision $p --metrics-json $R/main-$p-s$s.json
  step r18-$p-s$s 60 $G replica-train --model resnet18 --epochs 1 --devices cuda:0 --seed $s --precision $p --metrics-json $R/r18-$p-s$s.json
done; done
grep -h 'test accuracy' $R/main-*.log $R/r18-*.log
step vs-r50-b256 90 $G python3 tools/replica_vs_pytorch.py --case resnet50:3x224x224:256 --precisions bf16 --out $R/vs-r50-b256 --bin $BLD/bin
step vs-r101 120 $G python3 tools/replica_vs_pytorch.py --case resnet101:1x28x28:256 --precisions fp32,bf16 --out $R/vs-r101 --bin $BLD/bin
step vs-r50-b64 70 $G python3 tools/replica_vs_pytorch.py --case resnet50:3x224x224:64 --precisions bf16 --out $R/vs-r50-b64 --bin $BLD/bin
cat $R/vs-*/table.md 2>/dev/null | grep '^|'
step ops-r101-fp32 40 $G replica-bench --suite ops --devices cuda:0 --model resnet101 --input-shape 1x28x28 --batch-per-device 256 --steps 10 --precision fp32 --json $R/ops-r101-fp32.jsonl
step tests-ddp 150 $G ctest --test-dir $BLD -R test_cuda_ddp --output-on-failure --timeout 140
grep -E 'Test +#|tests passed' $R/tests-ddp.log
cd $OUT && tar -czf results.tgz r && rm -rf r
echo "total $(( $(date +%s) - T0 ))s"
cat /dev/null
