#!/usr/bin/env bash
# `bash gates.sh SHAPE-PREC...`: harness.gate of mok_hopper, NEW (.device/${NEW:-plain}.tgz: a tree with an option's
# default flipped) against BASE (.device/${BASE:-base}.tgz), named kmem-${TAG:-plain-vs-ee304c4}-..., ROUNDS
# interleaved rounds, mok_hopper alone,
# one gate per SHAPE-PREC, each within the call's time left (BUDGET_S); each gate's rows come back as gate-SHAPE-PREC.tgz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$(date +%s); left() { echo $(( ${BUDGET_S:-580} - ($(date +%s) - t0) )); }
LOG=$OUT/call.log
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,memory.total --format=csv | tee -a $LOG
source scripts/gpu_env.sh .whl >/dev/null 2>&1 || { echo wheels failed | tee -a $LOG; exit 1; }
HW=$(python3 -c "import torch;print('h200x1' if 'H200' in torch.cuda.get_device_name() else 'h100x1')")
rm -rf /tmp/g && mkdir -p /tmp/g/base /tmp/g/new && tar -xzf .device/${BASE:-base}.tgz -C /tmp/g/base \
  && tar -xzf .device/${NEW:-plain}.tgz -C /tmp/g/new
for sp in "$@"; do
  shape=${sp%-*}; prec=${sp##*-}
  [ $(left) -lt 120 ] && { echo "=== $sp skipped: $(left) s left" | tee -a $LOG; continue; }
  echo "=== [$(( $(date +%s) - t0 )) s] gate $sp ($(left) s left)" | tee -a $LOG
  timeout $(( $(left) - 10 )) python3 -m harness.gate --base-dir /tmp/g/base --new-dir /tmp/g/new \
    --rounds ${ROUNDS:-3} --backend mok_hopper --name kmem-${TAG:-plain-vs-ee304c4}-${shape}-${prec}_${HW}_$(date +%Y%m%d) \
    --out $OUT/gate -- shape=$shape precision=$prec 'backends=[mok_hopper]' ep_size=1 timing=published \
    'directions=[fwd,bwd]' 2>&1 | grep -v -e Warning -e warnings.warn | tail -30 | tee -a $LOG
  (cd $OUT/gate && tar -czf $OUT/gate-$shape-$prec.tgz */ 2>/dev/null)  # the rows' folders are too deep to come back
done
echo "=== [$(( $(date +%s) - t0 )) s] done" | tee -a $LOG
