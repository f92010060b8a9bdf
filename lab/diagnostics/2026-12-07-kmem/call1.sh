#!/usr/bin/env bash
# kimi_k2_7 bf16 on one 80 GB card with mok_hopper.weights=plain beside torch, then the gate of plain-as-default
# (HEAD with the option's default flipped, .device/plain.tgz) against ee304c4 (.device/base.tgz) on qwen3_5_397b.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$(date +%s); left() { echo $(( ${BUDGET_S:-580} - ($(date +%s) - t0) )); }
LOG=$OUT/call.log
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,memory.total --format=csv | tee -a $LOG
source scripts/gpu_env.sh .whl >/dev/null 2>&1 || { echo wheels failed | tee -a $LOG; exit 1; }
HW=$(python3 -c "import torch;print('h200x1' if 'H200' in torch.cuda.get_device_name() else 'h100x1')")
echo "=== [$(( $(date +%s) - t0 )) s] kimi" | tee -a $LOG
timeout ${KIMI_S:-230} python3 -m harness.run shape=kimi_k2_7 precision=bf16 'backends=[torch,mok_hopper]' \
  mok_hopper.weights=plain ep_size=1 timing=published 'directions=[fwd,bwd]' compile=false \
  run_id=kmem-kimi_k2_7_${HW}_20261207 results_dir=$OUT/rows print_table=false 2>&1 \
  | grep -v -e Warning -e warnings.warn | tail -25 | tee -a $LOG
mkdir -p /tmp/g/base /tmp/g/plain && tar -xzf .device/base.tgz -C /tmp/g/base && tar -xzf .device/plain.tgz -C /tmp/g/plain
echo "=== [$(( $(date +%s) - t0 )) s] gate ($(left) s left)" | tee -a $LOG
timeout $(( $(left) - 15 )) python3 -m harness.gate --base-dir /tmp/g/base --new-dir /tmp/g/plain --rounds ${ROUNDS:-3} \
  --backend mok_hopper --name kmem-plain-vs-ee304c4-qwen_${HW}_20261207 --out $OUT/gate -- shape=qwen3_5_397b \
  precision=bf16 'backends=[mok_hopper]' ep_size=1 timing=published 'directions=[fwd,bwd]' 2>&1 \
  | grep -v -e Warning -e warnings.warn | tail -40 | tee -a $LOG
python3 - <<'PY' 2>&1 | tee -a $LOG
import glob, pandas as pd
fs = glob.glob(__import__("os").environ["OUT"] + "/**/*.parquet", recursive=True) + glob.glob(__import__("os").environ["OUT"] + "/**/*.csv", recursive=True)
print(fs[:20])
PY
echo "=== [$(( $(date +%s) - t0 )) s] done" | tee -a $LOG
