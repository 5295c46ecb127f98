#!/usr/bin/env bash
# Third call, on 16e5cc8: the graph API as every precision's default, the
# per-channel sums a warp each and the flat staging copies four elements a load. The GPU suites,
# the bf16 ResNet-50 step op by op and against PyTorch, the seed recipe and ResNet-50 fp32
# against PyTorch, then each kernel's time in one bf16 ResNet-50 step (ncu) for the next steps.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); END=$((T0 + ${BUDGET:-330}))
R=$OUT/r3; mkdir -p $R
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
BLD=/tmp/replica-gpu/build
VS="python3 tools/replica_vs_pytorch.py --bin $BLD/bin"
step tests-gpu 100 $G ctest --test-dir $BLD -L gpu -E test_cuda_ddp --output-on-failure --timeout 90
grep -E 'Test +#|tests passed|ERROR|FAILED' $R/tests-gpu.log | head -30
step ops-r50-bf16-b256 20 $G replica-bench --suite ops --devices cuda:0 --model resnet50 --input-shape 3x224x224 --batch-per-device 256 --steps 5 --precision bf16 --memory-format channels_last --json $R/ops-r50-bf16-b256.jsonl
head -14 $R/ops-r50-bf16-b256.log; tail -3 $R/ops-r50-bf16-b256.log | head -1
step vs-r101-fp32 60 $G $VS --case resnet101:1x28x28:256 --precisions fp32 --out $R/vs-r101-fp32
step vs-r50-b256-bf16 75 $G $VS --case resnet50:3x224x224:256 --precisions bf16 --out $R/vs-r50-b256
step vs-r50-b64-fp32 60 $G $VS --case resnet50:3x224x224:64 --precisions fp32 --out $R/vs-r50-b64
grep -h '^| res' $R/vs-*/table.md
step ncu-r50-bf16 60 $G ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --log-file $R/ncu-r50-bf16.csv replica-bench --suite dp --device-counts 1 --devices cuda:0 --model resnet50 --input-shape 3x224x224 --batch-per-device 256 --precision bf16 --memory-format channels_last --warmup 1 --steps 2 --repeat 1
wc -l $R/ncu-r50-bf16.csv 2>/dev/null; tail -3 $R/ncu-r50-bf16.log
step vs-r101-tf32 60 $G $VS --case resnet101:1x28x28:256 --precisions tf32 --out $R/vs-r101-tf32
grep -h '^| res' $R/vs-r101-tf32/table.md
cd $OUT && tar -czf results3.tgz r3 && rm -rf r3
echo "total $(( $(date +%s) - T0 ))s"
