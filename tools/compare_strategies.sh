#!/usr/bin/env bash
# Compares training strategies on this machine through replica-train itself, same model, data
# and global batch for every row, and prints samples/s with ratios measured in this one run:
#   single device x 1 thread | DP cpu*1 x 1 | DP cpu*N x 1 | DP cpu x N threads |
#   DDP 1 rank x 1 | DDP N ranks x 1
#   tools/compare_strategies.sh [--model cnn] [--batch-size 64] [--steps 300] [--devices 2]
# Synthetic data of the model's shape; no evaluation; the first 10% of steps are warm-up
# (replica-train's samples/s covers the whole run, so use enough steps to amortise it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${REPLICA_BIN:-$here/build/bin}"
model=cnn batch=64 steps=300 n=2 port=29650
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --batch-size) batch="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --devices) n="$2"; shift 2 ;;
    *) echo "compare_strategies: error: unknown argument $1" >&2; exit 2 ;;
  esac
done
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
common=(--model "$model" --synthetic --synthetic-size $((batch * steps)) --batch-size "$batch"
        --max-steps "$steps" --no-eval --quiet --seed 1)
[ "$model" = cnn ] || common+=(--input-shape 1x28x28)

run() {  # name, then the command; prints "name samples/s"
  local name="$1"; shift
  "$@" --metrics-json "$tmp/m.json" >/dev/null
  python3 -c "import json;print('$name', json.load(open('$tmp/m.json'))['samples_per_sec'])"
}

{
  run "single-1x1t" "$bin/replica-train" --mode single --devices cpu --threads-per-device 1 "${common[@]}"
  run "dp-cpu*1x1t" "$bin/replica-train" --mode dp --devices "cpu*1" --threads-per-device 1 "${common[@]}"
  run "dp-cpu*${n}x1t" "$bin/replica-train" --mode dp --devices "cpu*$n" --threads-per-device 1 "${common[@]}"
  run "dp-cpu*1x${n}t" "$bin/replica-train" --mode dp --devices cpu --threads-per-device "$n" "${common[@]}"
  run "ddp-1rankx1t" "$bin/replica-launch" --nproc-per-node 1 --master-port $port -- \
      "$bin/replica-train" --mode ddp --threads-per-device 1 "${common[@]}"
  run "ddp-${n}ranksx1t" "$bin/replica-launch" --nproc-per-node "$n" --master-port $((port + 1)) -- \
      "$bin/replica-train" --mode ddp --threads-per-device 1 "${common[@]}"
} > "$tmp/rows"

echo "model $model, global batch $batch, $steps steps, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$tmp/rows" "$n" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
n = sys.argv[2]
sps = {name: float(v) for name, v in rows}
print(f"{'configuration':18} {'samples/s':>10}  ratio")
base = {"dp": sps["dp-cpu*1x1t"], "ddp": sps["ddp-1rankx1t"], "single": sps["single-1x1t"]}
for name, v in sps.items():
    ref = base["ddp"] if name.startswith("ddp") else base["dp"] if name.startswith("dp") else base["single"]
    print(f"{name:18} {v:10.0f}  {v / ref:5.2f}x")
print(f"DP {n} devices vs 1:        {sps[f'dp-cpu*{n}x1t'] / sps['dp-cpu*1x1t']:.2f}x")
print(f"DDP {n} ranks vs 1:         {sps[f'ddp-{n}ranksx1t'] / sps['ddp-1rankx1t']:.2f}x")
print(f"DP {n}x1 thread vs 1x{n}:    {sps[f'dp-cpu*{n}x1t'] / sps[f'dp-cpu*1x{n}t']:.2f}x")
print(f"DDP {n} ranks vs DP {n} devs: {sps[f'ddp-{n}ranksx1t'] / sps[f'dp-cpu*{n}x1t']:.2f}x")
PY
