#!/usr/bin/env bash
# One H200 call: the default GPU path with the new memory columns, the shared-GPU probe, the one-process
# several-ranks check in the concurrent mode, and its GPU test (broken variants must fail).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
LOG=$OUT/all.log
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
step "machine"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv 2>&1 | tee -a "$LOG"
source scripts/gpu_env.sh .whl || { echo "wheels failed" | tee -a "$LOG"; exit 1; }
python3 -c "import torch,triton,hydra;print(torch.__version__,triton.__version__,hydra.__version__,torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
step "1. harness rows: qwen3_5_397b EP=1 nccl eager + mok_hopper, fwd and bwd, quick timing (memory columns)"
timeout 210 python3 -m harness.run shape=qwen3_5_397b ep_size=1 'backends=[nccl,mok_hopper]' direction=fwd_and_bwd \
  compile=false timing=quick run_id=gpu-mem-check results_dir=/tmp/rows 2>&1 | grep -v -e Warning -e warnings.warn \
  | tail -30 | tee -a "$LOG"
python3 scripts/merge_results.py /tmp/rows "$OUT" > /dev/null 2>&1 || echo "merge failed" | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import pandas as pd, glob
from harness import results
d = results.load("/tmp/rows")
cols = ["backend", "direction", "status", "latency_ms", "mem_setup_bytes", "mem_activation_bytes",
        "mem_peak_allocated_bytes", "mem_device_used_before_bytes", "mem_device_used_peak_bytes", "sm_clock_mhz", "error"]
print(d[cols].to_string(max_colwidth=60))
PY
step "2. probe: P processes on one GPU"
timeout 130 python3 scripts/probe_shared_gpu.py --out "$OUT/probe" --timeout 50 2>&1 | tail -40 | tee -a "$LOG"
step "3. one process, P ranks, concurrent (event waits), P=2,4, bf16+fp8, idle rank, 20 repeats"
timeout 160 python3 -m benchmarks.mok_hopper.shared_gpu_check --out "$OUT/sg" --ranks 2,4 --mode concurrent \
  --repeats 20 2>&1 | grep -v -e Warning -e warnings.warn | tail -40 | tee -a "$LOG"
step "4. the GPU test: concurrent passes, broken variants fail"
left=$(( 585 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && timeout $left python3 -m pytest -q -m gpu tests/test_shared_gpu.py -x -p no:cacheprovider 2>&1 \
  | tail -30 | tee -a "$LOG"
step "done"
