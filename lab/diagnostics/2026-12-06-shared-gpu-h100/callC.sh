#!/usr/bin/env bash
# One GPU call: several ranks on one GPU through the harness (P processes), the probe, the memory columns on the
# default path, and the one-process concurrent check.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
LOG=$OUT/all.log
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
left() { echo $(( $1 - ($(date +%s) - t0) )); }
step "machine"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv 2>&1 | tee -a "$LOG"
nvidia-smi -q | grep -i -A2 "compute mode" | tee -a "$LOG"
source scripts/gpu_env.sh .whl || { echo "wheels failed" | tee -a "$LOG"; exit 1; }
python3 -c "import torch,triton,hydra;print(torch.__version__,triton.__version__,hydra.__version__,torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
SHAPE="shape=custom shape.num_experts=16 shape.hidden=512 shape.ffn=256 shape.topk=4 workload.tokens_per_gpu=256"
COMMON="device=cuda compile=false timing=quick directions=[fwd,bwd] results_dir=/tmp/rows print_table=false watchdog_s=150"
step "0. the backends' own options on a GPU: fp8, nccl rowwise (alias) and mok_hopper recompute (scoped key)"
timeout 200 python3 -m harness.run $SHAPE device=cuda compile=false timing=quick 'directions=[fwd,bwd]' \
  results_dir=/tmp/rows print_table=false ep_size=1 precision=fp8 'backends=[nccl,mok_hopper]' fp8_gemm=rowwise \
  mok_hopper.forward=recompute run_id=gpu-options 2>&1 | grep -v -e Warning -e warnings.warn | tail -8 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
from harness import results
d = results.load("/tmp/rows/gpu-options")
print(d[["backend", "direction", "status", "backend_options", "scaling", "latency_ms", "rel_err", "error"]].to_string(max_colwidth=60))
PY
step "1. P=2 processes on one GPU: harness rows, bf16, uniform and an idle rank"
timeout 230 python3 -m harness.run -m $SHAPE $COMMON ep_size=2 ranks_per_gpu=2 'backends=[nccl,mok_hopper,liger]' \
  run_id=shared-p2 workload=uniform,hot_rank workload.hot_rank=1 workload.hot_ratio=0 2>&1 \
  | grep -v -e Warning -e warnings.warn | tail -40 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
from harness import results
d = results.load("/tmp/rows")
print(d[["run_id", "backend", "precision", "routing", "ep_size", "ranks_per_gpu", "shared_gpu", "direction", "status",
         "latency_ms", "rel_err", "max_abs_err", "setup_s", "error"]].to_string(max_colwidth=70))
PY
step "2. probe: P processes on one GPU"
timeout $(left 330) python3 scripts/probe_shared_gpu.py --out "$OUT/probe" --timeout 45 2>&1 | tail -40 | tee -a "$LOG"
step "3. memory columns: qwen3_5_397b EP=1 nccl eager + mok_hopper, fwd and bwd, quick timing"
timeout $(left 470) python3 -m harness.run shape=qwen3_5_397b ep_size=1 'backends=[nccl,mok_hopper]' \
  direction=fwd_and_bwd compile=false timing=quick run_id=gpu-mem-check results_dir=/tmp/rows print_table=false 2>&1 \
  | grep -v -e Warning -e warnings.warn | tail -20 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
from harness import results
d = results.load("/tmp/rows/gpu-mem-check")
cols = ["backend", "direction", "status", "latency_ms", "mem_setup_bytes", "mem_activation_bytes",
        "mem_peak_allocated_bytes", "mem_device_used_before_bytes", "mem_device_used_peak_bytes", "sm_clock_mhz", "error"]
print(d[[c for c in cols if c in d]].to_string(max_colwidth=60))
PY
step "4. one process, P ranks, concurrent (event waits), P=2,4, bf16+fp8, idle rank, 20 repeats"
timeout $(left 585) python3 -m benchmarks.mok_hopper.shared_gpu_check --out "$OUT/sg" --ranks 2,4 --mode concurrent \
  --repeats 20 2>&1 | grep -v -e Warning -e warnings.warn | tail -30 | tee -a "$LOG"
step "pack"
tar czf $OUT/rows.tgz -C /tmp rows 2>/dev/null
step "done"
