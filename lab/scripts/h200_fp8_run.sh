#!/usr/bin/env bash
# The fp8 baselines on one H200, part 2 of 2 (part 1 is lab/scripts/h200_fp8_check.sh; about 7 minutes when it ran two
# fp8 paths, a third path adds its own share): the target rows. nccl at precision=fp8 with real fp8 GEMMs, blockwise
# (DeepGEMM), blockwise_loop (torch._scaled_mm per expert) and rowwise (torch._scaled_grouped_mm), forward and
# backward, EP=1, 2048 tokens per GPU, published timing and compile mode, on kimi_k2_7, glm_5_2, qwen3_5_397b and
# at the compute-bound point shape.local_experts=16 (CB_SHAPES, default glm_5_2). One run_id for all rows.
# Usage (repo root, GPU machine; .whl holds the hydra wheels and sgl_deep_gemm-0.2.5): bash lab/scripts/h200_fp8_run.sh OUTDIR
set -uo pipefail
OUTDIR=${1:?output folder}
source scripts/gpu_env.sh "${WHEELS:-.whl}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MOKBENCH_RUN_ID=${MOKBENCH_RUN_ID:-h200-fp8-$(date -u +%Y%m%dT%H%M%S)}
RES=${RES:-/tmp/mokbench-fp8}
C="ep_size=1 precision=fp8 timing=published compile=true compile_mode=published direction=fwd_and_bwd backend=nccl append=true results_dir=$RES hydra.sweep.dir=/tmp/mokbench-sweep hydra.run.dir=/tmp/mokbench-run"
run() { echo "+ $*"; timeout 580 python -m harness.run "$@" $C 2>&1 | grep -v -e Warning -e warnings.warn; }
for g in blockwise blockwise_loop rowwise; do
  run -m shape=kimi_k2_7,glm_5_2,qwen3_5_397b fp8_gemm=$g
  run -m shape=${CB_SHAPES:-glm_5_2} shape.local_experts=16 fp8_gemm=$g
done
mkdir -p "$OUTDIR"
python lab/scripts/merge_results.py "$RES" "$OUTDIR"
