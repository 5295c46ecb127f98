#!/usr/bin/env bash
# Second call: the mended bf16 ResNet-18 check, then where ResNet-50 bf16's time goes at 256.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); END=$((T0 + ${BUDGET:-200}))
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
bash .gpu/gpu.sh run true
BLD=/tmp/replica-gpu/build
step bf16-storage 40 $G $BLD/bin/test_cuda_bf16_storage
grep -E 'resnet18|ERROR|test cases' $R/bf16-storage.log
step precision 30 $G $BLD/bin/test_cuda_precision
grep -E 'test cases' $R/precision.log
step ops-r50-bf16-b256 45 $G replica-bench --suite ops --devices cuda:0 --model resnet50 --input-shape 3x224x224 --batch-per-device 256 --steps 5 --precision bf16 --memory-format channels_last --json $R/ops-r50-bf16-b256.jsonl
head -24 $R/ops-r50-bf16-b256.log
step ops-r50-bf16-b64 30 $G replica-bench --suite ops --devices cuda:0 --model resnet50 --input-shape 3x224x224 --batch-per-device 64 --steps 10 --precision bf16 --memory-format channels_last --json $R/ops-r50-bf16-b64.jsonl
head -24 $R/ops-r50-bf16-b64.log
step vs-r50-bench 80 $G python3 tools/replica_vs_pytorch.py --cudnn-benchmark --case resnet50:3x224x224:256 --precisions bf16 --out $R/vs-r50-bench --bin $BLD/bin
step vs-r101-bench 70 $G python3 tools/replica_vs_pytorch.py --cudnn-benchmark --case resnet101:1x28x28:256 --precisions fp32 --out $R/vs-r101-bench --bin $BLD/bin
grep -h '^| res' $R/vs-*/table.md
cd $OUT && tar -czf results2.tgz r2 && rm -rf r2
echo "total $(( $(date +%s) - T0 ))s"
