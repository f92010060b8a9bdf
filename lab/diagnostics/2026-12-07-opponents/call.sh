#!/usr/bin/env bash
# One GPU call of the opponents runs: `bash call.sh STEP...` runs the named steps in order, each within the
# call's time left (BUDGET_S, default 560 s), then packs the rows into $OUT/rows.tgz.
#   eager-<shape>-<precision>: torch, nccl (eager) and mok_hopper, fwd and bwd, published timing
#   compiled-<shape>-<precision>: torch_compiled and nccl compiled as published (compile_mode=published), mok_hopper
#   tcompiled-<shape>-<precision>: torch, torch_compiled (compile_mode=published) and mok_hopper
#   conly-<shape>-<precision>: torch_compiled and nccl compiled as published only (the run's eager rows come first)
#   full-<shape>-<precision>: torch (eager), torch_compiled and nccl compiled as published, and mok_hopper, one process
#   ncomp-<shape>-<precision>: nccl compiled as published only
#   weights-<shape>-<precision>: mok_hopper alone with mok_hopper.weights=plain, then =owned (bf16 only), same run
#   profile-<shape>-<precision>: torch.profiler kernel tables of torch and nccl (eager), fwd+bwd, into $OUT
# RUN_WHAT (default "opponents") names the runs: <RUN_WHAT>-<shape>_<hw>_<day>. A shape written glm_5_2@16epg runs
# with shape.local_experts=16 (run id <RUN_WHAT>-glm_5_2-16epg_<hw>_<day>).
#   cleanup-test: the GPU test that plants a backend holding memory, then runs mok_hopper
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=${TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC:-1}
export TORCHINDUCTOR_CACHE_DIR=/tmp/mokbench-inductor TRITON_CACHE_DIR=/tmp/mokbench-triton
BUDGET_S=${BUDGET_S:-560}
LOG=$OUT/call.log
ROWS=/tmp/rows
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 )) s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - t0) )); }
step "machine"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.total --format=csv 2>&1 | tee -a "$LOG"
source scripts/gpu_env.sh .whl || { echo "wheels failed" | tee -a "$LOG"; exit 1; }
python3 -c "import torch,triton,hydra,torchtitan;print(torch.__version__,triton.__version__,hydra.__version__,torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
HW=$(python3 -c "import torch;n=torch.cuda.get_device_name();print('h200x1' if 'H200' in n else 'h100x1')")
DAY=$(date +%Y%m%d)
RUN_WHAT=${RUN_WHAT:-opponents}
[ -f /tmp/mokbench-rows.tgz ] && tar -xzf /tmp/mokbench-rows.tgz -C / 2>/dev/null  # rows of an earlier call
for s in "$@"; do
  kind=${s%%-*}; rest=${s#*-}
  if [ "$kind" = profile ]; then
    shape=${rest%-*}; prec=${rest##*-}
    step "$s"
    timeout $(left) python3 -m mok_tools.profile_backends --backends torch,nccl --out $OUT/profile-$shape-$prec.txt \
      -- shape=$shape precision=$prec compile=false 2>&1 | tail -20 | tee -a "$LOG"
    continue
  fi
  if [ "$kind" = cleanup ]; then
    step "$s"
    timeout $(left) python3 -m pytest -q -x tests/test_gpu_cleanup.py -m gpu 2>&1 | tail -30 | tee -a "$LOG"
    continue
  fi
  shape=${rest%-*}; prec=${rest##*-}
  over=""
  if [[ $shape == *@*epg ]]; then  # glm_5_2@16epg: shape.local_experts=16, run id glm_5_2-16epg
    n=${shape#*@}; n=${n%epg}; shape=${shape%@*}; over="shape.local_experts=$n"
    rid="${RUN_WHAT}-${shape}-${n}epg_${HW}_${DAY}"
  else
    rid="${RUN_WHAT}-${shape}_${HW}_${DAY}"
  fi
  case $kind in
    eager) be='[torch,nccl,mok_hopper]'; extra="compile=false" ;;
    compiled) be='[torch_compiled,nccl,mok_hopper]'; extra="compile=true compile_mode=published" ;;
    tcompiled) be='[torch,torch_compiled,mok_hopper]'; extra="compile=true compile_mode=published" ;;
    conly) be='[torch_compiled,nccl]'; extra="compile=true compile_mode=published" ;;
    full) be='[torch,torch_compiled,nccl,mok_hopper]'; extra="compile=true compile_mode=published" ;;
    weights) be='[mok_hopper]'; extra="compile=false" ;;
    ncomp) be='[nccl]'; extra="compile=true compile_mode=published" ;;
  esac
  if [ "$kind" = weights ]; then
    ws="plain"; [ "$prec" = bf16 ] && ws="plain owned"
    for wv in $ws; do
      [ $(left) -lt 60 ] && { step "$s $wv: skipped, $(left) s left"; continue; }
      step "$s mok_hopper.weights=$wv -> $rid"
      timeout $(( $(left) - 20 )) python3 -m harness.run shape=$shape $over precision=$prec ep_size=1 "backends=$be" \
        $extra mok_hopper.weights=$wv timing=published 'directions=[fwd,bwd]' run_id=$rid append=true \
        results_dir=$ROWS print_table=false 2>&1 | grep -v -e Warning -e warnings.warn -e "^  warnings" | tail -30 \
        | tee -a "$LOG"
    done
    continue
  fi
  [ $(left) -lt 60 ] && { step "$s: skipped, $(left) s left"; continue; }
  step "$s -> $rid"
  timeout $(( $(left) - 20 )) python3 -m harness.run shape=$shape $over precision=$prec ep_size=1 "backends=$be" $extra \
    timing=published 'directions=[fwd,bwd]' run_id=$rid append=true results_dir=$ROWS print_table=false 2>&1 \
    | grep -v -e Warning -e warnings.warn -e "^  warnings" | tail -60 | tee -a "$LOG"
done
step "rows"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
from harness.core import results
d = results.load("/tmp/rows")
cols = ["run_id", "backend", "backend_options", "precision", "direction", "status", "latency_ms", "compile_mode", "mem_peak_own_bytes", "mem_graph_pool_bytes",
        "mem_peak_allocated_bytes", "mem_setup_bytes", "sm_clock_mhz", "rel_err", "setup_s", "notes", "error"]
print(d[[c for c in cols if c in d]].to_string(max_colwidth=90))
PY
tar -czf /tmp/mokbench-rows.tgz $ROWS 2>/dev/null; cp /tmp/mokbench-rows.tgz $OUT/rows.tgz
step "done"
