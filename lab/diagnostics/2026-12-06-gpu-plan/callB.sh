#!/usr/bin/env bash
# Second GPU call: the rest of the P-process matrix through the harness (P=2 fp8, P=4 bf16 and fp8, uniform and an
# idle rank), then the GPU tests of several ranks on one GPU (the broken variants first).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
LOG=$OUT/all.log
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
left() { echo $(( $1 - ($(date +%s) - t0) )); }
step "machine"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv 2>&1 | tee -a "$LOG"
source scripts/gpu_env.sh .whl || { echo "wheels failed" | tee -a "$LOG"; exit 1; }
SHAPE="shape=custom shape.num_experts=16 shape.hidden=512 shape.ffn=256 shape.topk=4 workload.tokens_per_gpu=256"
COMMON="device=cuda compile=false timing=quick directions=[fwd,bwd] results_dir=/tmp/rows print_table=false watchdog_s=150"
step "1. P=2 fp8; P=4 bf16 and fp8; uniform and an idle rank"
timeout $(left 150) python3 -m harness.run -m $SHAPE $COMMON ep_size=2 ranks_per_gpu=2 'backends=[nccl,mok_hopper]' \
  precision=fp8 run_id=shared-p2-fp8 workload=uniform,hot_rank workload.hot_rank=1 workload.hot_ratio=0 2>&1 \
  | grep -v -e Warning -e warnings.warn | grep -e "rows" -e rror -e "point #" | tail -8 | tee -a "$LOG"
timeout $(left 330) python3 -m harness.run -m $SHAPE $COMMON ep_size=4 ranks_per_gpu=4 'backends=[nccl,mok_hopper]' \
  precision=bf16,fp8 run_id=shared-p4 workload=uniform,hot_rank workload.hot_rank=3 workload.hot_ratio=0 2>&1 \
  | grep -v -e Warning -e warnings.warn | grep -e "rows" -e rror | tail -8 | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
from harness import results
d = results.load("/tmp/rows")
print(d[["run_id", "backend", "precision", "routing", "ep_size", "ranks_per_gpu", "direction", "status",
         "latency_ms", "rel_err", "setup_s", "error"]].to_string(max_colwidth=70))
PY
tar czf $OUT/rows.tgz -C /tmp rows 2>/dev/null
step "2. GPU tests: broken variants, then the concurrent check"
timeout $(left 585) python3 -m pytest -q -m gpu tests/test_shared_gpu.py -p no:cacheprovider \
  -k "broken or concurrent_ranks" 2>&1 | tail -30 | tee -a "$LOG"
step "done"
