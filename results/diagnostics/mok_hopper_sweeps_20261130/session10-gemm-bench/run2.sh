#!/usr/bin/env bash
# tiled weights (TileConfig.w_tiled) against the row-major weights: our up and down GEMMs alone, one H200
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.csv
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 500 > $OUT/smi.csv 2>&1 &
T0=$SECONDS
V="ours up default(tail32);ours up default(tail32) tiled;ours up default(tail32) again;ours up full;ours up full tiled;ours down default(tail32);ours down default(tail32) tiled;ours down full;ours down full tiled"
ONLY="$V" ROUNDS=7 timeout 200 python .device/wsbench/bench.py > $OUT/glm.log 2>&1; echo "glm rc=$? at $((SECONDS-T0))s"
grep -E "check|ms " $OUT/glm.log
H=7168 I=3072 E=384 K=6 ONLY="$V" ROUNDS=5 timeout 120 python .device/wsbench/bench.py > $OUT/dsv4.log 2>&1; echo "dsv4 rc=$? at $((SECONDS-T0))s"
grep -E " ms " $OUT/dsv4.log
H=7168 I=2048 E=384 K=8 ONLY="$V" ROUNDS=5 timeout 100 python .device/wsbench/bench.py > $OUT/kimi.log 2>&1; echo "kimi rc=$? at $((SECONDS-T0))s"
grep -E " ms " $OUT/kimi.log
kill %1
cd $OUT && tar czf tiled.tgz *.log smi.csv gpu.csv *.json
