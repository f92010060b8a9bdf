#!/usr/bin/env bash
# One device call of the kernel-memory checks: `bash call.sh STEP...` runs the steps in order within the call's time
# left (BUDGET_S, default 560 s), on the trees lab/diagnostics/2026-12-07-kmem/prep.sh wrote into .device/.
#   gate-<shape>-<prec>: harness.gate of mok_hopper, .device/${NEW:-packed}.tgz against .device/${BASE:-base}.tgz,
#                        ROUNDS interleaved rounds (default 3), mok_hopper alone, published timing, fwd and bwd
#   mem-<shape>-<prec>:  torch (eager) and mok_hopper with mok_hopper.rows=${ROWS_OPT:-packed} in one run
#                        (kmem-<shape>_<hw>_<day>, appended), published timing, fwd and bwd, memory columns
#   stacked-test:        the GPU tests of the stacked gate/up TMA box
# Rows come back as $OUT/rows.tgz and $OUT/gate-<shape>-<prec>.tgz; the log as $OUT/call.log.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/mokbench-triton
t0=$(date +%s); left() { echo $(( ${BUDGET_S:-560} - ($(date +%s) - t0) )); }
LOG=$OUT/call.log; ROWS=/tmp/rows
step() { echo "=== [$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,memory.total --format=csv | tee -a $LOG
source scripts/gpu_env.sh .whl >/dev/null 2>&1 || { echo wheels failed | tee -a $LOG; exit 1; }
HW=$(python3 -c "import torch;print('h200x1' if 'H200' in torch.cuda.get_device_name() else 'h100x1')")
DAY=$(date +%Y%m%d)
[ -f /tmp/mokbench-rows.tgz ] && tar -xzf /tmp/mokbench-rows.tgz -C / 2>/dev/null  # rows of an earlier call
if [ ! -d /tmp/g/base ]; then
  mkdir -p /tmp/g/base /tmp/g/new && tar -xzf .device/${BASE:-base}.tgz -C /tmp/g/base \
    && tar -xzf .device/${NEW:-packed}.tgz -C /tmp/g/new
fi
quiet() { grep -v -e Warning -e warnings.warn -e "^  warnings"; }
for s in "$@"; do
  kind=${s%%-*}; rest=${s#*-}; shape=${rest%-*}; prec=${rest##*-}
  case $kind in
    gate)
      [ $(left) -lt 150 ] && { step "$s skipped: $(left) s left"; continue; }
      step "$s ($(left) s left)"
      timeout $(( $(left) - 10 )) python3 -m harness.gate --base-dir /tmp/g/base --new-dir /tmp/g/new \
        --rounds ${ROUNDS:-3} --backend mok_hopper --name kmem-${TAG:-packed-vs-ee304c4}-${shape}-${prec}_${HW}_${DAY} \
        --out $OUT/gate -- shape=$shape precision=$prec 'backends=[mok_hopper]' ep_size=1 timing=published \
        'directions=[fwd,bwd]' 2>&1 | quiet | tail -30 | tee -a $LOG
      (cd $OUT/gate && tar -czf $OUT/gate-$shape-$prec.tgz */ 2>/dev/null) ;;
    mem)
      [ $(left) -lt 60 ] && { step "$s skipped: $(left) s left"; continue; }
      rid="kmem-${shape}_${HW}_${DAY}"
      step "$s -> $rid ($(left) s left)"
      timeout $(( $(left) - 10 )) python3 -m harness.run shape=$shape precision=$prec ep_size=1 \
        'backends=[torch,mok_hopper]' mok_hopper.rows=${ROWS_OPT:-packed} compile=false timing=published \
        'directions=[fwd,bwd]' run_id=$rid append=true results_dir=$ROWS print_table=false 2>&1 | quiet | tail -40 \
        | tee -a $LOG ;;
    stacked)
      step "$s"
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m gpu tests/test_mok_hopper_gpu.py -k stacked 2>&1 | tail -15 \
        | tee -a $LOG ;;
  esac
done
step "rows"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import os
from harness.core import results
if os.path.isdir("/tmp/rows"):
    d = results.load("/tmp/rows")
    cols = ["run_id", "shape", "backend", "backend_options", "precision", "direction", "status", "latency_ms",
            "mem_peak_own_bytes", "mem_peak_allocated_bytes", "mem_setup_bytes", "sm_clock_mhz", "rel_err", "notes",
            "error"]
    print(d[[c for c in cols if c in d]].to_string(max_colwidth=70))
PY
[ -d $ROWS ] && { tar -czf /tmp/mokbench-rows.tgz $ROWS 2>/dev/null; cp /tmp/mokbench-rows.tgz $OUT/rows.tgz; }
step "done"
