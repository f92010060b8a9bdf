#!/usr/bin/env bash
# mok_hopper's fp8 backward on one H200, EP=1, 2048 tokens per GPU.
#
# Usage (repo root, GPU machine; .whl holds the hydra wheels):  bash lab/scripts/h200_fp8_bwd.sh OUTDIR PART
#   PART check: mok_tools.mok_hopper.bwd_check --precision fp8 on kimi_k2_7, glm_5_2, qwen3_5_397b and the
#               compute-bound point (glm_5_2@16epg): every gradient against the reference in the fp8 gate, 20
#               repeats bitwise, stage times, memory (H saved); then qwen3_5_397b with H recomputed
#               (OUTDIR/bwd_check_<mode>/mok_hopper_bwd_check.csv, OUTDIR/bwd_check_<mode>.log)
#   PART sweep: the same on kimi_k2_7, glm_5_2, qwen3_5_397b (5 repeats) with bwd_check's FP8_SWEEP launch variants
#               (stage times, whether each variant's gradients are the default's bits)
#               (OUTDIR/bwd_check_sweep/mok_hopper_bwd_check.csv, OUTDIR/bwd_check_sweep.log)
#   PART rows:  the harness rows: mok_hopper and nccl (fp8_gemm=rowwise, the fastest real fp8 path in runs
#               h200x1-s21-fp8-nccl and h200x1-s24-v16-fp8, eager as in h200x1-s24-v16-fp8; FP8_GEMM=blockwise
#               for DeepGEMM, which must then be importable: docs/backends.md, "DeepGEMM (for fp8_gemm=blockwise)"),
#               forward and backward timed in one process per point (direction=fwd_and_bwd; DIRECTION=fwd for the forward alone),
#               published timing (500 warmup / 100 timed), calibrated roofline; the four points above, one run_id
#               (MOKBENCH_RUN_ID, default h200x1-fp8-bwd-<UTC time>) (OUTDIR/runs/<run_id>/*.csv,
#               OUTDIR/harness_<point>.log)
# MOKBENCH_GIT_SHA names the commit (the device copy has no .git of the checked-out commit).
set -uo pipefail
OUTDIR=${1:?output folder}
PART=${2:?PART: check, sweep or rows}
source scripts/gpu_env.sh "${WHEELS:-.whl}" || exit 1
export MOKBENCH_RUN_ID=${MOKBENCH_RUN_ID:-h200x1-fp8-bwd-$(date -u +%Y%m%dT%H%M%S)}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$OUTDIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
    --format=csv > "$OUTDIR/smi_$PART.txt" 2>&1
case "$PART" in
  check)
    timeout 420 torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --precision fp8 --no-nccl \
        --shapes kimi_k2_7,glm_5_2,qwen3_5_397b,glm_5_2@16epg --modes save_h --out "$OUTDIR/bwd_check_save_h" \
        2>&1 | grep -v -e Warning -e warnings.warn | tee "$OUTDIR/bwd_check_save_h.log"
    timeout 120 torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --precision fp8 --no-nccl \
        --shapes qwen3_5_397b --modes recompute --repeats 5 --out "$OUTDIR/bwd_check_recompute" \
        2>&1 | grep -v -e Warning -e warnings.warn | tee "$OUTDIR/bwd_check_recompute.log"
    ;;
  sweep)
    timeout 500 torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --precision fp8 --no-nccl --sweep \
        --shapes glm_5_2,qwen3_5_397b,kimi_k2_7 --modes save_h --repeats 5 --out "$OUTDIR/bwd_check_sweep" \
        2>&1 | grep -v -e Warning -e warnings.warn | tee "$OUTDIR/bwd_check_sweep.log"
    ;;
  rows)
    C="ep_size=1 precision=fp8 direction=${DIRECTION:-fwd_and_bwd} backends=[mok_hopper,nccl] fp8_gemm=${FP8_GEMM:-rowwise} compile=false"
    C="$C timing=published calibrate=true dist_timeout_s=900 run_id=$MOKBENCH_RUN_ID append=true results_dir=$OUTDIR/runs"
    C="$C hydra.run.dir=/tmp/mokbench-run hydra.sweep.dir=/tmp/mokbench-sweep"
    for point in ${POINTS:-kimi_k2_7 glm_5_2 qwen3_5_397b glm16}; do
      shape=$point extra=""
      [ "$point" = glm16 ] && shape=glm_5_2 extra="shape.local_experts=16"
      timeout 300 python -m harness.run -m shape=$shape $extra $C 2>&1 | grep -v -e Warning -e warnings.warn \
          > "$OUTDIR/harness_$point.log"
      tail -n 3 "$OUTDIR/harness_$point.log"
    done
    ;;
  *) echo "PART must be check, sweep or rows (got $PART)"; exit 2 ;;
esac
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUTDIR/smi_$PART.txt" 2>&1
