#!/usr/bin/env bash
# The harness-core measurement on a 2xH200 machine: nccl on the four published shapes (bf16, fwd + bwd, EP=2,
# 2048 tokens/GPU) with calibration, plus the published experts-per-GPU, tokens, routing and EP=1 variants for the
# charts. One run_id for all. Usage (repo root, GPU machine): bash lab/scripts/h200_nccl_run.sh OUTDIR
set -uo pipefail
OUTDIR=${1:?output folder}
source scripts/gpu_env.sh "${WHEELS:-.whl}"
export MOKBENCH_RUN_ID=${MOKBENCH_RUN_ID:-h200x2-nccl-$(date -u +%Y%m%dT%H%M%S)}
RES=${RES:-/tmp/mokbench-results}
C="compile=false timing=published timing.num_warmup=50 calibrate=true append=true results_dir=$RES hydra.sweep.dir=/tmp/mokbench-sweep hydra.run.dir=/tmp/mokbench-run"
run() { echo "+ $*"; timeout 300 python -m harness.run "$@" $C 2>&1 | grep -v -e Warning -e warnings.warn; }
run -m shape=kimi_k2_7,glm_5_2,qwen3_5_397b,deepseek_v4_pro direction=fwd_and_bwd
for s in kimi_k2_7:6 glm_5_2:4 qwen3_5_397b:8 deepseek_v4_pro:6; do
  run shape=${s%:*} shape.local_experts=${s#*:} direction=fwd
done
run -m shape=qwen3_5_397b workload.tokens_per_gpu=1024,4096 direction=fwd
run -m shape=qwen3_5_397b workload=zipf,hot_experts,hot_rank direction=fwd
run shape=glm_5_2 ep_size=1 direction=fwd
mkdir -p "$OUTDIR"
python lab/scripts/merge_results.py "$RES" "$OUTDIR"
