#!/usr/bin/env bash
# session 15, the one call (one H200): harness rows of the v4 backward at EP=1 (glm_5_2, qwen3_5_397b; mok_hopper
# training forward, liger pinned, nccl eager; fwd and bwd, published timing, calibrated roofline), then the GPU tests
# of the training layer and save_h, then bwd_check's repeat check and stage times on qwen3_5_397b with what is left
set -o pipefail
source scripts/gpu_env.sh .whl
export CUDA_HOME=/usr/local/cuda TRITON_CACHE_DIR=/tmp/tc TORCHINDUCTOR_CACHE_DIR=/tmp/ic LIGER_FUSED_MOE_AUTOTUNE=0
export MOKBENCH_GIT_SHA=$SHA
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,power.limit --format=csv | tee $OUT/smi.txt
timeout 290 python3 -m harness.run -m hydra/launcher=node ep_size=1 precision=bf16 direction=fwd_and_bwd \
  shape=glm_5_2,qwen3_5_397b 'backends=[mok_hopper,liger,nccl]' compile=false timing=published \
  calibrate=true dist_timeout_s=900 run_id=h200x1-s15-bwd results_dir=$OUT/runs hydra.sweep.dir=/tmp/sw \
  hydra.run.dir=/tmp/rd 2>&1 | grep -v -e Warning -e warnings.warn > $OUT/harness.log
grep -e "median\|rows\|error\|mismatch\|Error" $OUT/harness.log | cut -c1-200 | tail -16
echo "harness done at +$(($(date +%s)-T0)) s"
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader | tee -a $OUT/smi.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mok_hopper_module.py tests/test_mok_hopper_gpu.py \
  -k "save_h or toy or twenty" --tb=short 2>&1 | grep -v -e Warning -e warnings.warn > $OUT/pytest_gpu.txt; tail -4 $OUT/pytest_gpu.txt
echo "pytest done at +$(($(date +%s)-T0)) s"
LEFT=$((500 - $(date +%s) + T0))
[ $LEFT -gt 40 ] && timeout $LEFT torchrun --nproc-per-node=1 -m benchmarks.mok_hopper.bwd_check --out $OUT \
  --shapes qwen3_5_397b --modes save_h --no-nccl 2>&1 | grep -v -e Warning -e warnings.warn > $OUT/bwd_check.log
grep -v "^\[rank" $OUT/bwd_check.log | cut -c1-220 | tail -14
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader | tee -a $OUT/smi.txt
