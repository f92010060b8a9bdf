#!/usr/bin/env bash
# session 11: v11's fused gate/up MMA and tile knobs, our GEMMs alone on one H200 (glm_5_2, deepseek_v4_pro, kimi_k2_7 rank 0, EP=2)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:$PYTHONPATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.csv
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 500 > $OUT/smi.csv 2>&1 &
T0=$SECONDS
timeout 240 python .device/wsbench/bench11.py > $OUT/glm.log 2>&1; echo "glm rc=$? at $((SECONDS-T0))s"; grep -E "check|ms " $OUT/glm.log
H=7168 I=3072 E=384 K=6 ONLY="up v10;up fused (v11)" timeout 120 python .device/wsbench/bench11.py > $OUT/dsv4.log 2>&1; echo "dsv4 rc=$? at $((SECONDS-T0))s"; grep -E "check|ms " $OUT/dsv4.log
H=7168 I=2048 E=384 K=8 ONLY="up v10;up fused (v11)" timeout 100 python .device/wsbench/bench11.py > $OUT/kimi.log 2>&1; echo "kimi rc=$? at $((SECONDS-T0))s"; grep -E "check|ms " $OUT/kimi.log
kill %1
cd $OUT && tar czf bench11.tgz *.log smi.csv gpu.csv *.json
