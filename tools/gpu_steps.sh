# Budgeted steps for a script of checks on a GPU machine lent for a few minutes (tools/gpu_checks.py
# is the same idea for its own parts). Source it, then run each command as a step:
#
#   BUDGET=300 OUT=/path/to/out; source tools/gpu_steps.sh results
#   step tests 100 ctest --test-dir build -L gpu --output-on-failure
#   step ops 20 build/bin/replica-bench --suite ops --devices cuda:0 ...
#   gpu_steps_pack                        # $OUT/results.tgz of everything the steps wrote
#
# A step runs under the smaller of its own limit and what is left of BUDGET seconds (counted
# from the source), its output in $R/NAME.log ($R = $OUT/<name given to source>), and adds
# "NAME rc=CODE SECONDSs" to $R/summary.txt; a step with under 5 s left is listed as NOT RUN.
# So a call that runs out of time still brings back what ran, and says what did not.
GPU_STEPS_T0=$(date +%s)
GPU_STEPS_END=$((GPU_STEPS_T0 + ${BUDGET:-300}))
R=${OUT:?set OUT, the folder that comes back}/${1:-steps}
mkdir -p "$R"
export PYTHONUNBUFFERED=1

left() { echo $((GPU_STEPS_END - $(date +%s))); }

step() {
  local name=$1 lim=$2 l s rc
  shift 2
  l=$(left)
  [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -lt 5 ]; then echo "NOT RUN $name (no time)" | tee -a "$R/summary.txt"; return; fi
  s=$(date +%s)
  timeout -k 5 "$lim" "$@" > "$R/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - s))s" | tee -a "$R/summary.txt"
}

gpu_steps_pack() {
  local dir
  dir=$(basename "$R")
  (cd "$(dirname "$R")" && tar -czf "$dir.tgz" "$dir" && rm -rf "$dir")
  echo "total $(($(date +%s) - GPU_STEPS_T0))s"
}
