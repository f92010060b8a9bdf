"""Liger's autotuning in one to two minutes a shape: its Triton compiles done ahead, in parallel, into the user's
Triton cache.

    TRITON_CACHE_DIR=/path/to/cache python -m mok_tools.liger_precompile --shapes glm_5_2,qwen3_5_397b [--workers N]

Why: Liger's fused MoE autotunes each GEMM kernel over 16-40 configs keyed on (H, I), about 240 compiles per shape
(``baselines/liger.py``). Triton compiles every config inside the autotuning, one after another, at 1-3 s each. On
the H200 machine one shape's autotuning did not finish within 600 s (lab/diagnostics/2026-12-01-s12/), although
its benchmarks take about a minute. The compiles are what a parallel pass can take off.

What it does: N worker processes each run Liger's op (forward and backward) once on a small problem with the
shape's hidden size H, expert ffn I and top-k K (16 experts, 256 tokens). Each of Liger's autotuners in worker i
keeps only every N-th config, starting at the i-th. Liger's kernels take H and I as compile-time constants and
otherwise only pointers and strides that depend on H, I and K, so the kernels compiled here are the ones the
full shape uses. The workers' timings are thrown away: they benchmark on a shared GPU, and their autotuners neither
read nor write autotuning results (``cache_results`` off). The harness's ``liger`` setup then autotunes over
every config on the real inputs, as without this pass, and reads the compiled kernels from the cache instead of
compiling them. Its ``setup_s`` is then the benchmarking only; the row's notes say that the cache was prepared here
and how long it took (the record ``baselines.liger.PRECOMPILE_RECORD`` in the cache folder). A tool of
``mok_tools/``: it uses the liger backend's autotuners and the harness's table of shapes.

Needs a CUDA GPU, liger-kernel, and ``TRITON_CACHE_DIR`` (without it nothing would be reused: exit code 2).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from baselines.liger import AUTOTUNE_ENV, PRECOMPILE_RECORD, autotune_pinned
from mok_tools.shapes import precompile_inputs

EXPERTS, TOKENS = 16, 256  # the small problem: E a multiple of 16 like every published shape's, K <= E


def config_slice(configs: Sequence[Any], part: int, parts: int) -> list:
    """Worker ``part`` of ``parts``: every ``parts``-th config from the ``part``-th (the slices of all workers
    cover every config once). A worker left with no config of a kernel that has fewer configs than workers keeps
    the first (compiled twice, harmlessly)."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} is not in 0..{parts - 1}")
    return list(configs[part::parts]) or list(configs[:1])


def run_small_problem(H: int, I: int, K: int, device: str = "cuda") -> tuple:
    """Liger's op forward + backward on EXPERTS experts and TOKENS tokens with the shape's H, I, K (bf16; fp32 on the
    CPU, where Triton's interpreter runs Liger's kernels correctly in fp32 only: baselines/liger.py); returns the
    output and the input's gradient."""
    import torch
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(TOKENS, H, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w13 = (torch.randn(EXPERTS, 2 * I, H, generator=g) * 0.02).to(device, dtype).requires_grad_()
    w2 = (torch.randn(EXPERTS, H, I, generator=g) * 0.02).to(device, dtype).requires_grad_()
    scores = torch.randn(TOKENS, EXPERTS, generator=g)
    w_TK, idx_TK = torch.softmax(scores, dim=-1).topk(K, dim=-1)
    w_TK = w_TK.to(device).requires_grad_()
    out = LigerFusedMoEFunction.apply(x, w13, w2, idx_TK.to(device, torch.int32), w_TK)
    out.backward(torch.randn(out.shape, generator=g).to(device, out.dtype))
    if device == "cuda":
        torch.cuda.synchronize()
    return out.detach(), x.grad


def _worker(part: int, parts: int, dims: list[tuple[int, int, int]], device: str = "cuda") -> dict:
    from baselines.liger import autotuners

    kept = {}
    for name, tuner in autotuners().items():
        tuner.configs = config_slice(tuner.configs, part, parts)
        tuner.cache_results = False  # these timings run on a shared GPU: never read or keep them
        kept[name.strip("_")] = len(tuner.configs)
    t0 = time.perf_counter()
    for H, I, K in dims:
        run_small_problem(H, I, K, device=device)
    return {"part": part, "configs": kept, "seconds": round(time.perf_counter() - t0, 1)}


def _count_entries(cache: Path) -> int:
    return sum(1 for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mok_tools.liger_precompile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", required=True, help="comma-separated shape names (configs/shape)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel processes (default: CPUs)")
    args = ap.parse_args(argv)
    checked = precompile_inputs("liger_precompile", "TRITON_CACHE_DIR", "the harness's liger setup", args.shapes,
                                args.workers)
    if checked is None:
        return 2
    cache, dims = checked
    if autotune_pinned():
        print(f"liger_precompile: {AUTOTUNE_ENV}=0 pins one config per kernel, so there is nothing to "
              "precompile; unset it", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        from baselines.liger import INSTALL_HINT

        print(f"liger_precompile: liger-kernel is not installed; {INSTALL_HINT}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("liger_precompile: needs a CUDA GPU (Liger's autotuning benchmarks on it); nothing was compiled",
              file=sys.stderr)
        return 2
    cache_dir = Path(cache)
    before = _count_entries(cache_dir)
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        parts = pool.starmap(_worker, [(i, args.workers, dims) for i in range(args.workers)])
    seconds = time.perf_counter() - t0
    record = {"shapes": args.shapes, "dims_HIK": dims, "workers": args.workers, "seconds": round(seconds, 1),
              "cache_entries_before": before, "cache_entries_after": _count_entries(cache_dir),
              "small_problem": {"experts": EXPERTS, "tokens": TOKENS},
              "configs_per_kernel": {k: sum(p["configs"][k] for p in parts) for k in parts[0]["configs"]},
              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (cache_dir / PRECOMPILE_RECORD).write_text(json.dumps(record, indent=1))
    print(f"liger_precompile: {len(dims)} (H, I, K) over {args.workers} processes in {seconds:.1f} s; cache "
          f"entries {before} -> {record['cache_entries_after']} ({cache_dir / PRECOMPILE_RECORD})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
