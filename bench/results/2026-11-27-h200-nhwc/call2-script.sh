#!/usr/bin/env bash
# Second call: cuDNN variants of the bf16 ResNet-50 step at batch 256 (graph API, timed plans)
# and of the seed recipe in fp32 (legacy calls against the graph API), then ResNet-50 against
# PyTorch in fp32 at batch 64 and TF32 at batch 128.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); END=$((T0 + ${BUDGET:-440}))
R=$OUT/r2; mkdir -p $R
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
OPS="replica-bench --suite ops --devices cuda:0 --steps 5"
R50="--model resnet50 --input-shape 3x224x224 --batch-per-device 256 --precision bf16 --memory-format channels_last"
R101="--model resnet101 --input-shape 1x28x28 --batch-per-device 256 --precision fp32"
step ops-r50-bf16-graph 25 env REPLICA_CUDNN_API=graph $G $OPS $R50 --json $R/ops-r50-bf16-graph.jsonl
step ops-r50-bf16-timed 40 $G $OPS $R50 --cudnn-benchmark --json $R/ops-r50-bf16-timed.jsonl
step ops-r101-fp32-legacy 25 $G $OPS $R101 --json $R/ops-r101-fp32-legacy.jsonl
step ops-r101-fp32-graph 25 env REPLICA_CUDNN_API=graph $G $OPS $R101 --json $R/ops-r101-fp32-graph.jsonl
for f in $R/ops-*.log; do echo "== $f"; head -14 $f; tail -3 $f | head -1; done
step vs-r50-fp32-b64 60 $G python3 tools/replica_vs_pytorch.py --case resnet50:3x224x224:64 --precisions fp32 --out $R/vs-r50-fp32 --bin $BLD/bin
step vs-r50-tf32-b128 60 $G python3 tools/replica_vs_pytorch.py --case resnet50:3x224x224:128 --precisions tf32 --out $R/vs-r50-tf32 --bin $BLD/bin
grep -h '^| res' $R/vs-r50-*/table.md
cd $OUT && tar -czf results2.tgz r2 && rm -rf r2
echo "total $(( $(date +%s) - T0 ))s"
