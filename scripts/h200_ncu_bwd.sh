#!/usr/bin/env bash
# Where mok_hopper's bf16 backward spends its time, from the hardware counters (issue 23): Nsight Compute over the
# backward's Triton kernels (dgate and dX: _bwd_rows_kernel; dW13 and dW2: _bwd_wgrad_resident_kernel, or
# _bwd_wgrad_kernel; the fused and epilogue kernels where a variant runs them) in bwd_check's first backward of each shape, at EP=1,
# 2048 tokens, the forward saving H. Per launch: HBM bytes and throughput, L2 throughput and hit rate, SM and
# tensor pipe use, registers, occupancy, the largest warp stall reasons (benchmarks.mok_hopper.ncu_summary).
#
# Usage (repo root, the GPU machine, whose runtime reads the counters: device KINDS.md):
#   bash scripts/h200_ncu_bwd.sh OUTDIR [SHAPES]       SHAPES default qwen3_5_397b,glm_5_2 (comma-separated)
# SWEEP_ONLY="label part,..." also profiles those bwd_check sweep variants' launches (after the default's);
# COUNT (default 8 a shape, 4 launches a backward) how many matching launches ncu profiles; KERNELS the regex.
# The forward runs with ready_flags=0 (its up GEMM waits for the pull by a stream event, not by spinning on the
# pull's counters: ncu runs kernels one at a time, and a spinning GEMM before its pull would never end).
# ncu runs with --clock-control none (the clocks are left as the board sets them, as every timing here is) and
# replays each profiled kernel, restoring the memory it writes: the durations are of single launches at whatever
# clock the board holds, for reading the counters' proportions, not rows to compare with published timing.
# Writes OUTDIR/ncu-<shape>.ncu-rep (open it in Nsight Compute), -raw.csv, .txt (the summary), bwd-<shape>/ (bwd_check).
set -uo pipefail
OUTDIR=${1:?output folder}
SHAPES=${2:-qwen3_5_397b,glm_5_2}
mkdir -p "$OUTDIR"
source scripts/gpu_env.sh "${WHEELS:-.whl}" || exit 1
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
[ -x "$NCU" ] || { echo "ncu (Nsight Compute) not found: set NCU=/path/to/ncu" >&2; exit 2; }
KERNELS=${KERNELS:-'^_(bwd_rows|bwd_wgrad|bwd_wgrad_resident|dgate_dw2|dx_dw13|dgate_epilogue)_kernel'}
"$NCU" --version | tee "$OUTDIR/ncu-version.txt"
for shape in ${SHAPES//,/ }; do
  echo "+ ncu over bwd_check, $shape"
  timeout "${LIMIT_S:-400}" "$NCU" --clock-control none --target-processes all --replay-mode kernel \
    --kernel-name "regex:$KERNELS" --launch-count "${COUNT:-8}" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
    -f -o "$OUTDIR/ncu-$shape" \
    torchrun --nproc-per-node=1 -m benchmarks.mok_hopper.bwd_check --out "$OUTDIR/bwd-$shape" --shapes "$shape" \
      --modes save_h --no-nccl --repeats 1 --iters 1 --warmup 1 --stage-iters 1 --tile ready_flags=0 \
      ${SWEEP_ONLY:+--sweep --sweep-only "$SWEEP_ONLY" --no-sweep-bits} 2>&1 \
    | grep -v -e Warning -e warnings.warn | tail -40 | tee "$OUTDIR/ncu-$shape.log"
  "$NCU" --import "$OUTDIR/ncu-$shape.ncu-rep" --csv --page raw --print-units base > "$OUTDIR/ncu-$shape-raw.csv" \
    && python3 -m benchmarks.mok_hopper.ncu_summary "$OUTDIR/ncu-$shape-raw.csv" | tee "$OUTDIR/ncu-$shape.txt"
done
