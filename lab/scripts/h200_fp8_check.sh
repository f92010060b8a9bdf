#!/usr/bin/env bash
# The fp8 baselines on one H200, part 1 of 2 (about 5 minutes): do the real fp8 GEMM paths of the PyTorch baselines
# load and compute correctly, and what errors do their fp8 backward rows have? Eager (compile=false) throughout.
#   1. versions, and whether rowwise (torch._scaled_grouped_mm), blockwise (DeepGEMM) and blockwise_loop
#      (torch._scaled_mm per expert) are available here;
#   2. tests/test_fp8_gemm.py, GPU tests included (the real GEMMs against the pure-torch references);
#   3. lab/scripts/fp8_grad_errors.py: per-tensor errors of nccl bf16 / emulated / each real fp8 path against a float32
#      and the bf16 reference, glm_5_2 and qwen3_5_397b at EP=1;
#   4. harness rows with the current gate: nccl fp8 fwd + bwd, each fp8_gemm path, the same shapes, EP=1.
# Usage (repo root, GPU machine; .whl holds the hydra wheels and sgl_deep_gemm-0.2.5):
#   bash lab/scripts/h200_fp8_check.sh OUTDIR        Part 2: lab/scripts/h200_fp8_run.sh
set -uo pipefail
OUTDIR=${1:?output folder}
mkdir -p "$OUTDIR"
source scripts/gpu_env.sh "${WHEELS:-.whl}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}  # DeepGEMM builds its kernels at first use (nvcc / NVRTC)
export MOKBENCH_RUN_ID=${MOKBENCH_RUN_ID:-h200-fp8-check-$(date -u +%Y%m%dT%H%M%S)}
RES=${RES:-/tmp/mokbench-fp8-check}
{
  python - <<'PY'
import torch, importlib.metadata as md
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
try:
    print("sgl-deep-gemm", md.version("sgl-deep-gemm"))
except Exception as e:
    print("sgl-deep-gemm not installed:", e)
from baselines import fp8_gemm
for p in fp8_gemm.FP8_GEMM_PATHS:
    print(p, "->", fp8_gemm.path_unavailable(p, "cuda") or "available")
PY
} 2>&1 | tee "$OUTDIR/versions.txt"
timeout 420 python -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py -rs 2>&1 | tail -40 | tee "$OUTDIR/pytest_fp8_gemm.txt"
timeout 420 python lab/scripts/fp8_grad_errors.py "$OUTDIR" glm_5_2 qwen3_5_397b 2>&1 | grep -v -e Warning -e warnings.warn \
  | tee "$OUTDIR/fp8_grad_errors.txt"
C="ep_size=1 precision=fp8 compile=false timing=quick direction=fwd_and_bwd append=true results_dir=$RES hydra.sweep.dir=/tmp/mokbench-sweep hydra.run.dir=/tmp/mokbench-run"
for g in emulated rowwise blockwise blockwise_loop auto; do
  echo "+ nccl fp8_gemm=$g"
  timeout 400 python -m harness.run -m shape=glm_5_2,qwen3_5_397b backend=nccl fp8_gemm=$g $C 2>&1 \
    | grep -v -e Warning -e warnings.warn | tee -a "$OUTDIR/harness_check.txt"
done
python lab/scripts/merge_results.py "$RES" "$OUTDIR"
