#!/usr/bin/env bash
# The multi-GPU comparison on one Hopper node: EP = the GPUs given (2 or 8; 4 works too), every
# backend of the published figure plus hybridep, the anchors where they run and mok_hopper, 2048 tokens per GPU,
# through the `hopper_published` experiment (docs/reproduce.md, "Reproduce the published comparison"). A lease cannot hold all
# of it (30 device-minutes, 10 minutes a call), so the run is cut into PARTs; run each PART in its own call. One
# run_id per lease: export MOKBENCH_RUN_ID once per lease and pass it to every call of that lease.
#
# Usage (repo root, GPU machine, after DeepEP / TE / Megatron / DeepGEMM are installed as docs/backends.md says, or their
# wheels and builds are carried in WHEELS):
#   bash lab/scripts/hopper_ep_run.sh OUTDIR PART [EP]
#   PART control   the control pair every lease re-times first: mok_hopper and the fastest baseline (hybridep at
#                  EP=2 in every run so far) on glm_5_2, bf16, forward, published timing
#   PART bf16      the four published shapes, bf16, forward and backward, every backend, published timing
#   PART fp8       the four shapes, fp8, forward and backward, fp8_gemm=rowwise, =blockwise_loop and =blockwise
#                  (DeepGEMM; its rows are unsupported where it does not load) for the PyTorch baselines (three
#                  sweeps), every backend
#   PART epg       the published experts per GPU (shape.local_experts 6 / 4 / 8 / 6), bf16, fwd and bwd
#   PART idle      idle-rank checks of every backend (a rank whose experts get no token; quick timing)
# DRY=1 plans instead of running (each harness call gets hydra.launcher.dry_run=true; idle has no dry run).
# Rows go to OUTDIR/runs/<run_id>/; each part's log to OUTDIR/<part>.log; bundle OUTDIR into one tar for the trip
# back (the device returns at most 8 files).
set -uo pipefail
OUTDIR=${1:?output folder}
PART=${2:?part: control, bf16, fp8, epg or idle}
EP=${3:-2}
mkdir -p "$OUTDIR"
source scripts/gpu_env.sh "${WHEELS:-.whl}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/mokbench-triton-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/mokbench-inductor-cache}
export MOKBENCH_RUN_ID=${MOKBENCH_RUN_ID:-hopper-ep${EP}-$(date -u +%Y%m%dT%H%M%S)}
BASE=(-m +experiment=hopper_published "ep_size=$EP" "run_id=$MOKBENCH_RUN_ID" append=true "results_dir=$OUTDIR/runs"
      hydra.sweep.dir=/tmp/mokbench-sweep hydra.run.dir=/tmp/mokbench-run)
[ "${DRY:-0}" = 1 ] && BASE+=(hydra.launcher.dry_run=true "hydra.launcher.gpus_per_node=$EP")
ALL='backends=[nccl,deepep,hybridep,deepep_te,hybridep_megatron,liger,sonicmoe,mok_hopper]'
run() {
  local name=$1; shift
  echo "+ python3 -m harness.run $*" | tee -a "$OUTDIR/$name.log"
  python3 -m harness.run "$@" 2>&1 | grep -v -e Warning -e warnings.warn | tee -a "$OUTDIR/$name.log"
}
case $PART in
  control) run control "${BASE[@]}" shape=glm_5_2 precision=bf16 direction=fwd 'backends=[hybridep,mok_hopper]' ;;
  bf16) run bf16 "${BASE[@]}" precision=bf16 "$ALL" ;;
  fp8) for g in rowwise blockwise_loop blockwise; do run fp8 "${BASE[@]}" precision=fp8 fp8_gemm=$g "$ALL"; done ;;
  epg) for s in kimi_k2_7:6 glm_5_2:4 qwen3_5_397b:8 deepseek_v4_pro:6; do
         run epg "${BASE[@]}" shape=${s%:*} shape.local_experts=${s#*:} precision=bf16 "$ALL"; done ;;
  idle)
    IDLE=(shape=custom shape.num_experts=8 shape.hidden=1024 shape.ffn=512 shape.topk=2 workload.tokens_per_gpu=1
          workload.seed=16 timing=quick dist_timeout_s=300 direction=fwd_and_bwd "ep_size=$EP"
          "run_id=$MOKBENCH_RUN_ID-idle" append=true "results_dir=$OUTDIR/runs")
    B='backends=[nccl,deepep,hybridep,deepep_te,hybridep_megatron,mok_hopper]'
    run idle "${IDLE[@]}" "$B"
    run idle "${IDLE[@]}" 'backends=[nccl,deepep,hybridep]' compile_mode=default
    run idle "${IDLE[@]}" "$B" precision=fp8
    run idle "${IDLE[@]}" 'backends=[deepep_te,hybridep_megatron]' precision=fp8 te_fp8_recipe=delayed ;;
  *) echo "PART must be control, bf16, fp8, epg or idle (got $PART)" >&2; exit 2 ;;
esac
echo "rows: $OUTDIR/runs/$MOKBENCH_RUN_ID; report: python3 -m harness.report $OUTDIR/runs/$MOKBENCH_RUN_ID --out $OUTDIR/report"
