"""What a torch.compile leaves in a process, and how to drop it: used by the harness between two backends and by the
compiled baselines between two compile modes (baselines/compile_modes.py).

Inductor keeps compiled code and autotuning results in process caches, CUDA graph trees keep a private memory pool,
and its autotuning runs in subprocesses (``autotune_in_subproc``, pipelined autotuning) that hold device memory of
their own and outlive the compile that started them, failed or not. A backend that ran before another must cost it
nothing: :func:`drop_compiled_state` drops all of it.
"""

from __future__ import annotations

import gc
import sys
from typing import Any, Callable

import torch


def shutdown_autotune_workers() -> None:
    """Stop inductor's autotuning subprocesses (they hold device memory of their own, and outlive the compile that
    started them, failed or not): the tuning pool of ``autotune_in_subproc`` and the pipelined-autotuning pool. A pool
    that was never started is left alone (asking for it would start one)."""
    ap = sys.modules.get("torch._inductor.autotune_process")
    if ap is None:
        return
    getter = getattr(ap, "get_tuning_process_pool", None)
    info = getattr(getter, "cache_info", None)
    if callable(info) and info().currsize:  # a cached getter that has made its pool
        _quietly(getter().shutdown)
        getter.cache_clear()  # the next compile starts a fresh pool
    legacy = getattr(ap, "tuning_pool", None)  # older torch: a module-level pool
    if legacy is not None and getattr(legacy, "processes", None):
        _quietly(legacy.shutdown)
    single = getattr(ap, "AutotuneProcessPool", None)
    inst = getattr(single, "_instance", None)
    pool = getattr(inst, "_pool", None)
    if pool is not None:
        _quietly(lambda: pool.shutdown(wait=True, cancel_futures=True))
        inst._pool = None


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 (a pool already stopped, or half started: nothing left to stop)
        pass


def drop_compiled_state() -> None:
    """Everything a compile left in this process: dynamo's and inductor's caches, the autotuning subprocesses, the
    CUDA graph trees' pools, cycles holding tensors, the allocator's cached blocks."""
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is not None and hasattr(trees, "reset_cudagraph_trees"):
        trees.reset_cudagraph_trees()  # the graphs' private pool and the outputs it still tracks
    shutdown_autotune_workers()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
