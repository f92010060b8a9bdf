#!/usr/bin/env bash
# The Hopper anchors on one H200: nccl, liger (Liger-Kernel's fused MoE), sonicmoe (SonicMoE) and
# mok_hopper, bf16, EP=1, 2048 tokens per GPU, forward and backward timed in one process per point
# (direction=fwd_and_bwd), published timing (500 warmup / 100 timed), published compile modes, calibrated roofline.
#
# Usage (repo root, GPU machine):  bash lab/scripts/h200_anchors_run.sh OUTDIR [PART]
#   PART glm  : glm_5_2 and the compute-bound point glm_5_2 shape.local_experts=16 (16 experts on the GPU)
#   PART glm16: the compute-bound point alone
#   PART kq   : kimi_k2_7 and qwen3_5_397b
#   PART kimi, PART qwen: one of them
#   PART all  : both, one after another (default)
# Each point is one harness invocation; every point uses the same run_id (MOKBENCH_RUN_ID, default
# h200-anchors-<UTC time>), so rows of two calls on two leases still form one run in the report: pass the same
# MOKBENCH_RUN_ID to both calls.
# Liger autotuned (the default; LIGER_FUSED_MOE_AUTOTUNE=0 pins one config per kernel): first
# `python -m mok_tools.liger_precompile` compiles every config of the part's shapes in parallel into the Triton
# cache below (the compiles, not the benchmarks, are what made one shape's autotuning outlast 600 s on one H200:
# lab/diagnostics/2026-12-01-s12/). Each point then runs with its own copy of that cache, without autotuning results
# (*.autotune.json), so Liger autotunes on each point's own problem: its autotuning key is (H, I), and glm_5_2 and
# glm_5_2 at 16 experts (64 and 1024 rows an expert) would otherwise share one result.
#
# Environment, set here:
# * Wheels from WHEELS (default .whl: hydra-core, omegaconf, antlr4, submitit, liger-kernel 0.8.5) are installed
#   without network into /tmp/mokbench-site by scripts/gpu_env.sh (pip --target --no-deps: nothing of the image's
#   site-packages changes, and the image's torch 2.11 and Triton 3.6 stay the ones that run). SONIC_WHEELS=DIR adds
#   SonicMoE's wheels the same way (sonic-moe, quack-kernels, nvidia-cutlass-dsl and its libs): to try SonicMoE
#   with torch 2.11; parts made with `split` (NAME.whl.part-aa, -ab, ...) are joined first. Without them the
#   sonicmoe rows are `unsupported` with the reason.
# * BACKENDS overrides the list (default [nccl,liger,mok_hopper,sonicmoe]: SonicMoE last, so that a setup that outlasts
#   the call (its compiles: lab/diagnostics/2026-12-04-s30/) loses no other row); COMPILE=false runs nccl eager;
#   SETUP_TIMEOUT_S (default 300) is the harness's setup_timeout_s: a longer setup is a `timeout` row.
# * SonicMoE's GEMMs (QuACK) autotune in its setup; QUACK_COMPILE_WORKERS processes compile their configs. Before
#   the points, `python -m mok_tools.sonic_precompile` compiles every config once into QUACK_CACHE_DIR (default
#   /tmp/mokbench-quack-cache; more than 400 s on the H200 machine's 16 CPUs, with QUACK_COMPILE_WORKERS = the CPU
#   count), unless its record is already there: a cache prepared earlier and copied in, for instance one compiled
#   without a GPU by `sonic_precompile --cpu sm_90a --python 3.12` (a few minutes on two cores). Then the points'
#   setups only load and benchmark the kernels: 136 s (16 workers) and 156 s (QUACK_COMPILE_WORKERS=1) of SonicMoE
#   setup on qwen3_5_397b with every kernel cached (run h200x1-s31-anchors; lab/diagnostics/2026-12-04-s31/).
# * PROFILE_SETUP=1: each backend's setup under cProfile (the harness's profile_setup_dir), into OUTDIR/setup-profiles
#   (<run>-<point>-<backend>-rank0.txt / .prof), with QuACK's and Triton's autotuning printed (QUACK_PRINT_AUTOTUNING,
#   TRITON_PRINT_AUTOTUNING): where SonicMoE's 136-156 s of setup go (measured on a CPU,
#   lab/diagnostics/2026-12-04-s32/: QuACK's loop over its 80 cached kernels 3.9 s without GPU work, its Triton
#   reduction's 84 configs on qwen3_5_397b 32-33 s to compile). The rows' setup_s then include the profiler's overhead,
#   and their notes say so.
# * NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (no NVLink multicast).
# * TRITON_CACHE_DIR (the precompiled cache; each point copies it) and TORCHINDUCTOR_CACHE_DIR under /tmp, one
#   folder each for the whole call (the liger backend sets TRITON_CACHE_AUTOTUNING=1 where TRITON_CACHE_DIR is set,
#   so a point's autotuning results stay in its copy).
# Rows go to OUTDIR/runs/<run_id>/ and, after each point, bundled into OUTDIR/rows/<run_id>.csv
# (lab/scripts/merge_results.py; its table in OUTDIR/rows.txt); the log of each point to OUTDIR/anchors-<point>.log
# (glm, glm16, kimi, qwen), the precompile's to OUTDIR/precompile.log.
# Known (torch 2.11 / Triton 3.6): nccl compiled with max-autotune died in inductor's autotuning of the backward
# graph at EP=1 (an illegal memory access in one autotuning choice, after which every CUDA call failed; run
# h200x1-s16-compiled-nccl, lab/runs.md). With TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1 (each
# choice benchmarked in a subprocess), set below unless the caller sets it, it ran: h200x1-s18-compiled-nccl
# (qwen3_5_397b, about 220 s of compiling and autotuning in setup). COMPILE=false runs every backend eager.
set -uo pipefail
OUTDIR=${1:?output folder}
PART=${2:-all}
case $PART in glm|glm16|kq|kimi|qwen|all) ;; *) echo "PART must be glm, glm16, kq, kimi, qwen or all (got $PART)" >&2; exit 2 ;; esac
mkdir -p "$OUTDIR"
# the wheels of WHEELS and SONIC_WHEELS into /tmp/mokbench-site, PYTHONPATH, NVLink multicast off
source scripts/gpu_env.sh "${WHEELS:-.whl}" ${SONIC_WHEELS:+"$SONIC_WHEELS"} || exit 1
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-$(nproc)}
export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/tmp/mokbench-quack-cache}
export TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=${TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC:-1}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/mokbench-triton-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/mokbench-inductor-cache}
export MOKBENCH_RUN_ID=${MOKBENCH_RUN_ID:-h200-anchors-$(date -u +%Y%m%dT%H%M%S)}
PROFILE=()
if [ "${PROFILE_SETUP:-0}" = 1 ]; then
  PROFILE=("profile_setup_dir=$OUTDIR/setup-profiles")
  export QUACK_PRINT_AUTOTUNING=1 TRITON_PRINT_AUTOTUNING=1
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" \
  || echo "liger-kernel is not importable: its rows will be unsupported"
python3 -c "import sonicmoe, importlib.metadata as m; print('sonic-moe', m.version('sonic-moe'), 'quack-kernels',
m.version('quack-kernels'))" 2>&1 | tail -4 || true

COMMON=(-m hydra/launcher=node ep_size=1 precision=bf16 direction=fwd_and_bwd workload.tokens_per_gpu=2048
        "backends=${BACKENDS:-[nccl,liger,mok_hopper,sonicmoe]}" "compile=${COMPILE:-true}" compile_mode=published
        timing=published calibrate=true dist_timeout_s=900 "setup_timeout_s=${SETUP_TIMEOUT_S:-300}"
        "run_id=$MOKBENCH_RUN_ID" append=true "results_dir=$OUTDIR/runs"
        hydra.sweep.dir=/tmp/mokbench-sweep hydra.run.dir=/tmp/mokbench-run ${PROFILE[@]+"${PROFILE[@]}"})
TUNE=${LIGER_FUSED_MOE_AUTOTUNE:-1}
precompile() {  # shapes: Liger's compiles ahead, in parallel (nothing to do when it is pinned)
  [ "$TUNE" = 0 ] && return 0
  echo "+ python3 -m mok_tools.liger_precompile --shapes $1"
  python3 -m mok_tools.liger_precompile --shapes "$1" 2>&1 | grep -v -e Warning -e warnings.warn \
    | tee -a "$OUTDIR/precompile.log"
}
sonic_precompile() {  # SonicMoE's QuACK kernels, compiled once into QUACK_CACHE_DIR (they do not depend on the shape)
  case ${BACKENDS:-sonicmoe} in *sonicmoe*) ;; *) return 0 ;; esac
  python3 -c "import sonicmoe" 2>/dev/null || return 0  # not importable: its rows say why
  if [ -f "$QUACK_CACHE_DIR/mokbench-sonic-precompile.json" ]; then
    echo "QuACK cache $QUACK_CACHE_DIR already prepared: $(cat "$QUACK_CACHE_DIR/mokbench-sonic-precompile.json" \
      | tr -d '\n ' | cut -c1-200)"
    return 0
  fi
  echo "+ QUACK_CACHE_DIR=$QUACK_CACHE_DIR python3 -m mok_tools.sonic_precompile --shapes $1"
  python3 -m mok_tools.sonic_precompile --shapes "$1" 2>&1 | grep -v -e Warning -e warnings.warn \
    | tee -a "$OUTDIR/sonic_precompile.log"
}
run() {  # point name, then the point's overrides
  local name=$1; shift
  local cache=$TRITON_CACHE_DIR-$name
  rm -rf "$cache"; mkdir -p "$TRITON_CACHE_DIR"; cp -r "$TRITON_CACHE_DIR" "$cache"
  find "$cache" -name '*.autotune.json' -delete
  find "$QUACK_CACHE_DIR" -name '*.autotune.json' -delete 2>/dev/null  # SonicMoE autotunes on the point's problem too
  echo "+ TRITON_CACHE_DIR=$cache python3 -m harness.run ${COMMON[*]} $*"
  echo "Triton cache entries before $name: $(ls "$cache" | wc -l)"
  TRITON_CACHE_DIR=$cache python3 -m harness.run "${COMMON[@]}" "$@" 2>&1 | grep -v -e Warning -e warnings.warn \
    | tee "$OUTDIR/anchors-$name.log"
  echo "Triton cache entries after $name: $(ls "$cache" | wc -l) (new ones: kernels compiled in the point)"
  # the rows so far, one file per run in OUTDIR/rows: a call that is cut off later keeps this point's rows, and the
  # rows leave the machine without runs/'s nested folders (a folder nested too deep for the transfer off the GPU
  # machine stays behind, and its rows with it)
  python3 lab/scripts/merge_results.py "$OUTDIR/runs" "$OUTDIR/rows" > "$OUTDIR/rows.txt" 2>&1 \
    || echo "merge_results failed: $OUTDIR/rows.txt"
}
glm() { precompile glm_5_2; run glm shape=glm_5_2; run glm16 shape=glm_5_2 shape.local_experts=16; }
kq() { precompile kimi_k2_7,qwen3_5_397b; run kimi shape=kimi_k2_7; run qwen shape=qwen3_5_397b; }
sonic_precompile qwen3_5_397b
case $PART in
  glm) glm ;;
  glm16) precompile glm_5_2; run glm16 shape=glm_5_2 shape.local_experts=16 ;;
  kq) kq ;;
  kimi) precompile kimi_k2_7; run kimi shape=kimi_k2_7 ;;
  qwen) precompile qwen3_5_397b; run qwen shape=qwen3_5_397b ;;
  all) glm; kq ;;
esac
echo "rows: $OUTDIR/runs/$MOKBENCH_RUN_ID; report: python3 -m harness.report $OUTDIR/runs/$MOKBENCH_RUN_ID --out $OUTDIR/report"
