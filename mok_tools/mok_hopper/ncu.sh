#!/usr/bin/env bash
# Where mok_hopper's kernels spend their time, from the hardware counters: Nsight Compute over
# the Triton kernels of one bf16 backward (bwd_check: dgate and dX are _bwd_rows_kernel; dW13 and dW2
# _bwd_wgrad_resident_kernel, or _bwd_wgrad_kernel; the fused and epilogue kernels where a variant runs them), of one
# fp8 backward (bwd_check --precision fp8: dgate and dX are _fp8_rows_kernel, the operands' token-major quantisation
# _tok_quant_t_kernel, the weight gradients _fp8_wgrad_kernel) or of one forward (gpu_check: _up_swiglu_kernel,
# _down_push_kernel), at EP=1, 2048 tokens. Per launch: HBM bytes and
# throughput, L2 throughput and hit rate, SM and tensor pipe use, registers, occupancy, the largest warp stall
# reasons (mok_tools.mok_hopper.ncu_summary).
#
# Usage (repository root, a GPU machine that lets Nsight Compute read the performance counters):
#   bash mok_tools/mok_hopper/ncu.sh OUTDIR [WHAT] [SHAPES]
#     WHAT: bwd (default; bf16, the forward saving H), bwd-fp8, fwd-bf16 or fwd-fp8
#     SHAPES: comma-separated, default kimi_k2_7,glm_5_2,qwen3_5_397b
# SWEEP_ONLY="label part,..." (bwd, bwd-fp8) also profiles those bwd_check sweep variants' launches after the default's;
# COUNT (default 8) how many matching launches ncu profiles a shape; KERNELS the kernel-name regex; LIMIT_S the
# seconds a shape may take (default 400).
# The forward runs with ready_flags=0 (its up GEMM waits for the pull by a stream event, not by spinning on the
# pull's counters): ncu runs kernels one at a time, and a spinning GEMM launched before its pull would never end.
# ncu runs with --clock-control none (the clocks are left as the board sets them, as every timing here is) and
# replays each profiled kernel, restoring the memory it writes: the durations are of single launches at whatever
# clock the board holds, for reading the counters' proportions, not rows to compare with published timing.
# Writes OUTDIR/ncu-<what>-<shape>.ncu-rep (open it in Nsight Compute), -raw.csv, .txt (the summary) and .log,
# and the driver's own CSV under OUTDIR/<what>-<shape>/.
set -uo pipefail
OUTDIR=${1:?output folder}
WHAT=${2:-bwd}
SHAPES=${3:-kimi_k2_7,glm_5_2,qwen3_5_397b}
case $WHAT in
  bwd) DEF='^_(bwd_rows|bwd_wgrad|bwd_wgrad_resident|dgate_dw2|dx_dw13|dgate_epilogue)_kernel' ;;
  bwd-fp8) DEF='^_(fp8_rows|tok_quant_t|fp8_wgrad|bwd_wgrad|bwd_wgrad_resident)_kernel' ;;
  fwd-bf16|fwd-fp8) DEF='^_(up_swiglu|down_push)_kernel' ;;
  *) echo "WHAT must be bwd, bwd-fp8, fwd-bf16 or fwd-fp8 (got $WHAT)" >&2; exit 2 ;;
esac
mkdir -p "$OUTDIR"
source scripts/gpu_env.sh "${WHEELS:-.whl}" || exit 1
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
[ -x "$NCU" ] || { echo "ncu (Nsight Compute) not found: set NCU=/path/to/ncu" >&2; exit 2; }
"$NCU" --version | tee "$OUTDIR/ncu-version.txt"
for shape in ${SHAPES//,/ }; do
  out=$OUTDIR/$WHAT-$shape
  if [ "${WHAT%-fp8}" = bwd ]; then
    precision=bf16; [ "$WHAT" = bwd-fp8 ] && precision=fp8
    driver=(-m mok_tools.mok_hopper.bwd_check --out "$out" --shapes "$shape" --modes save_h --no-nccl --repeats 1
            --iters 1 --warmup 1 --stage-iters 1 --tile ready_flags=0 --precision "$precision"
            ${SWEEP_ONLY:+--sweep --sweep-only "$SWEEP_ONLY" --no-sweep-bits})
  else
    driver=(-m mok_tools.mok_hopper.gpu_check --out "$out" --shapes "$shape" --precisions "${WHAT#fwd-}" --no-sweep
            --no-edge --iters 1 --warmup 1 --repeats 1 --tile ready_flags=0)
  fi
  echo "+ ncu over ${driver[1]}, $shape"
  timeout "${LIMIT_S:-400}" "$NCU" --clock-control none --target-processes all --replay-mode kernel \
    --kernel-name "regex:${KERNELS:-$DEF}" --launch-count "${COUNT:-8}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    -f -o "$OUTDIR/ncu-$WHAT-$shape" torchrun --nproc-per-node=1 "${driver[@]}" 2>&1 \
    | grep -v -e Warning -e warnings.warn | tail -40 | tee "$OUTDIR/ncu-$WHAT-$shape.log"
  "$NCU" --import "$OUTDIR/ncu-$WHAT-$shape.ncu-rep" --csv --page raw --print-units base \
    > "$OUTDIR/ncu-$WHAT-$shape-raw.csv" \
    && python3 -m mok_tools.mok_hopper.ncu_summary "$OUTDIR/ncu-$WHAT-$shape-raw.csv" \
    | tee "$OUTDIR/ncu-$WHAT-$shape.txt"
done
