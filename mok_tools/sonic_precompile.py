"""SonicMoE's kernels compiled once, ahead, into QuACK's kernel cache, so that each harness point only benchmarks.

    QUACK_CACHE_DIR=/path/to/cache python -m mok_tools.sonic_precompile [--shapes qwen3_5_397b] [--workers N]

Why: SonicMoE's GEMMs are QuACK's CuTe DSL kernels, and QuACK autotunes each GEMM on its first call: it compiles
every config of that GEMM (9-22 on SM90), in ``QUACK_COMPILE_WORKERS`` processes, then benchmarks them. On the H200
machine (16 CPUs) the first GEMM's 9 configs took 76 s on 9 workers, the second's 22 took 144 s on 16, the third's 9
did not finish in 175 s, and three more GEMMs follow: more than one 600 s command holds (the journal,
lab/perf-notes.md: SonicMoE on the GPU image; lab/diagnostics/2026-12-04-s30/).

What it does: one SonicMoE forward and backward (``baselines.sonicmoe.sonic_routed``, the adapter's own call) on a
small problem with each named shape's H, I and K (16 experts, 256 tokens, bf16). QuACK's compile keys are the
dtypes, majors, tiles, clusters and epilogue, never the problem's sizes, so the kernels compiled here are the ones
every shape's GEMMs use; QuACK writes them to ``QUACK_CACHE_DIR`` as .o files (a few MB for all of them), which a
later process loads instead of compiling. The small problem's autotuning results are keyed by its own sizes, so the
harness's ``sonicmoe`` setup still autotunes on each point's real inputs (and its ``setup_s`` is then the
benchmarking). The record ``baselines.sonicmoe.PRECOMPILE_RECORD`` in the cache folder says what was done, and the
rows' notes cite it. The folder can be copied to another machine with the same Python, CUTLASS DSL, tvm-ffi and
QuACK (QuACK's cache fingerprint).

Needs a CUDA GPU of SM90 / SM100, sonic-moe, and ``QUACK_CACHE_DIR`` (without it the kernels would go to a per-user
temporary folder: exit code 2).

Without a GPU: ``--cpu sm_90a [--python 3.12]`` compiles the same kernels on the CPU for that arch (and for the GPU
machine's Python, whose version names QuACK's cache folder), in a few minutes on two cores
(``mok_tools.sonic_cpu_compile`` says how, and what it changes in QuACK for it). Copy the folder to the GPU
machine; the record says where and how it was compiled.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Sequence

from mok_tools.shapes import precompile_inputs

EXPERTS, TOKENS = 16, 256  # the small problem (QuACK's compiled kernels do not depend on its sizes)


def run_small_problem(H: int, I: int, K: int, device: str = "cuda", dtype=None):
    """SonicMoE's routed layer, forward and backward, on EXPERTS experts and TOKENS tokens (default dtype: bf16 on the
    GPU, fp32 elsewhere); returns the output and the input's gradient."""
    import torch

    from baselines.sonicmoe import sonic_routed

    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(TOKENS, H, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w13 = (torch.randn(EXPERTS, 2 * I, H, generator=g) * 0.02).to(device, dtype).requires_grad_()
    w2 = (torch.randn(EXPERTS, H, I, generator=g) * 0.02).to(device, dtype).requires_grad_()
    w_TK, idx_TK = torch.softmax(torch.randn(TOKENS, EXPERTS, generator=g), dim=-1).topk(K, dim=-1)
    w_TK = w_TK.to(device).requires_grad_()
    out = sonic_routed(x, idx_TK.to(device), w_TK, w13, w2)
    out.backward(torch.randn(out.shape, generator=g).to(device, out.dtype))
    if device == "cuda":
        torch.cuda.synchronize()
    return out.detach(), x.grad


def _files(cache: Path) -> int:
    return sum(1 for p in cache.rglob("*.o")) if cache.is_dir() else 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_tools.sonic_precompile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3_5_397b",
                    help="comma-separated shape names (configs/shape); one is enough: the kernels do not depend on it")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="QUACK_COMPILE_WORKERS, the processes that compile (default: the CPUs)")
    ap.add_argument("--cpu", metavar="ARCH", help="compile on this machine's CPU, without a GPU, for ARCH (sm_90a for "
                    "Hopper): mok_tools.sonic_cpu_compile")
    ap.add_argument("--python", metavar="X.Y", help="with --cpu: the GPU machine's Python version, which names QuACK's "
                    "cache folder (default: this one's)")
    args = ap.parse_args(argv)
    checked = precompile_inputs("sonic_precompile", "QUACK_CACHE_DIR", "the harness's sonicmoe setup", args.shapes,
                                args.workers)
    if checked is None:
        return 2
    cache, dims = checked
    if args.python and (not args.cpu or not re.fullmatch(r"3\.\d+", args.python)):
        print("sonic_precompile: --python takes a version like 3.12, with --cpu", file=sys.stderr)
        return 2
    if args.cpu:
        from mok_tools import sonic_cpu_compile

        try:
            sonic_cpu_compile.parse_arch(args.cpu)
        except ValueError as e:
            print(f"sonic_precompile: {e}", file=sys.stderr)
            return 2
        reason = sonic_cpu_compile.check_versions()
        if reason:
            print(f"sonic_precompile: {reason}", file=sys.stderr)
            return 2
        sonic_cpu_compile.set_environment(args.cpu)  # before triton, cutlass and quack are imported
    import importlib.util

    from baselines.sonicmoe import INSTALL_HINT, PRECOMPILE_RECORD

    if importlib.util.find_spec("sonicmoe") is None:
        print(f"sonic_precompile: sonic-moe is not installed; {INSTALL_HINT}", file=sys.stderr)
        return 2
    import torch

    if args.cpu:
        sonic_cpu_compile.apply(args.python)
        where = {"mode": "cpu", "arch": args.cpu, "host_cpu": sonic_cpu_compile.host_cpu(),
                 "fingerprint_python": args.python or f"{sys.version_info.major}.{sys.version_info.minor}",
                 "fingerprint": sonic_cpu_compile.fingerprint()}
        device, dtype, workers = "cpu", torch.bfloat16, 1
    elif not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        print("sonic_precompile: needs a Hopper (SM90) or Blackwell (SM100) GPU, where SonicMoE's GEMMs run, or --cpu "
              "sm_90a (no GPU); nothing was compiled", file=sys.stderr)
        return 2
    else:
        os.environ["QUACK_COMPILE_WORKERS"] = str(args.workers)
        where = {"mode": "gpu", "device": torch.cuda.get_device_name()}
        device, dtype, workers = "cuda", None, args.workers
    cache_dir = Path(cache)
    before = _files(cache_dir)
    t0 = time.perf_counter()
    for H, I, K in dims:
        run_small_problem(H, I, K, device=device, dtype=dtype)
    seconds = time.perf_counter() - t0
    if args.cpu:  # the "autotuning" above timed nothing: its results must not be loaded as a choice
        for p in cache_dir.rglob("*.autotune.json"):
            p.unlink()
    record = {"shapes": args.shapes, "dims_HIK": dims, "workers": workers, "seconds": round(seconds, 1),
              "compiled_on": where,
              "kernel_files_before": before, "kernel_files_after": _files(cache_dir),
              "small_problem": {"experts": EXPERTS, "tokens": TOKENS},
              "versions": {d: _version(d) for d in ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl-libs-cu13",
                                                    "nvidia-cutlass-dsl-libs-base", "apache-tvm-ffi")},
              "torch": torch.__version__, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (cache_dir / PRECOMPILE_RECORD).write_text(json.dumps(record, indent=1))
    print(f"sonic_precompile: {len(dims)} (H, I, K) with {workers} compile workers in {seconds:.1f} s; kernel "
          f"files {before} -> {record['kernel_files_after']} ({cache_dir / PRECOMPILE_RECORD})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
