#!/usr/bin/env bash
# phase 1: each variant alone (compile + correctness) under a timeout; phase 2: the passing ones timed, interleaved
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.csv
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 500 > $OUT/smi.csv 2>&1 &
T0=$SECONDS
PASS=""
for v in "ours up default(tail32)" "ours up full" "simple up full s4" "simple down full s6" "WS up full s4" "WS down full s4" "WS up full s3" "WS up full s4 bn64" "WS down full s6" "WS up half s2"; do
  case "$v" in ours*) TO=100;; *) TO=${WSTO:-25};; esac
  ONLY="$v" ROUNDS=0 timeout -s KILL $TO python .device/wsbench/bench.py > "$OUT/p1-${v// /_}.log" 2>&1; rc=$?
  echo "phase1 [$v] rc=$rc at $((SECONDS-T0))s: $(grep '^check' "$OUT/p1-${v// /_}.log" | cut -c1-150)"
  [ $rc = 0 ] && PASS="$PASS;$v"
done
echo "pass: $PASS"
ONLY="$PASS;ours up default(tail32)" ROUNDS=${ROUNDS:-5} timeout 120 python .device/wsbench/bench.py > $OUT/p2-glm.log 2>&1; echo "p2 glm rc=$? at $((SECONDS-T0))s"
grep -E " ms " $OUT/p2-glm.log
if [ $((SECONDS-T0)) -lt 420 ]; then
  H=7168 I=3072 E=384 K=6 ONLY="$PASS" ROUNDS=3 timeout 100 python .device/wsbench/bench.py > $OUT/p2-dsv4.log 2>&1; echo "p2 dsv4 rc=$? at $((SECONDS-T0))s"
  grep -E " ms " $OUT/p2-dsv4.log
fi
kill %1
cd $OUT && tar czf ws.tgz *.log smi.csv gpu.csv *.json 2>/dev/null; ls $OUT | head -3
