"""SonicMoE's QuACK kernels compiled on a machine without a GPU: ``mok_tools.sonic_precompile --cpu sm_90a``.

Why: compiling SonicMoE's GEMMs (80 CuTe DSL kernels: every autotuning config of its six GEMMs) outlasted 600 s on the
H200 machine twice (lab/diagnostics/2026-12-04-s30/), while the compile itself needs no GPU: CuTe DSL generates the
device code for the arch it is told (``CUTE_DSL_ARCH``) and QuACK compiles from shapes and dtypes alone (its compile
workers use fake tensors). On a 2-core CPU machine the whole set takes a few minutes. The resulting cache folder is then
copied to the GPU machine, where QuACK loads the kernels instead of compiling them.

What this module changes, in this process only, each because the machine has no GPU or driver:

* CuTe DSL's check that the CUDA driver initialises (``cuInit``) before it JITs a module: skipped. QuACK exports
  the module to an object file; nothing is loaded or launched.
* ``quack.cache_utils.COMPILE_ONLY``: on, QuACK's own compile-only mode (its compile workers run in it): each kernel
  is compiled and written to ``QUACK_CACHE_DIR``, and the launch is skipped.
* QuACK's GEMM custom ops are registered for CUDA; their own Python function is registered for CPU tensors too.
* QuACK's autotuner: no GPU warm-up, and its "benchmark" of a config compiles that config (one call in
  compile-only mode) and returns 0 ms. So every config is compiled, sequentially, in this process. The
  autotuning results it leaves are meaningless and ``mok_tools.sonic_precompile`` deletes them.
* Triton kernels (SonicMoE's routing metadata, its reductions) run under ``TRITON_INTERPRET=1`` as no-ops: their
  values are never read on the host, and no GEMM runs.
* QuACK's cache folder name (its source fingerprint) includes the Python minor version. ``python`` writes the cache
  for another Python (the GPU image's 3.12) by computing that fingerprint with QuACK's own function. The kernels
  themselves do not depend on the Python version: the 40 kernel files of a partial cache compiled on the H200
  machine (Python 3.12) have the same keys as the ones compiled here (Python 3.11) and byte-identical device code
  (cubins), and the H200 loaded and ran all 80 compiled here (run
  mok_hopper-bf16-fwd-bwd-qwen3_5_397b_h200x1_20261204-2; lab/diagnostics/2026-12-04-s31/).

The host-side launch code in each object file is compiled by LLVM for *this* machine's CPU (CuTe DSL has no
option for it): the GPU machine's CPU must have the same instruction set extensions (the record holds this CPU's
model and flags, and the rows' notes cite it).

Written against quack-kernels 0.3.11 and nvidia-cutlass-dsl 4.4.2 (``check_versions`` refuses others).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import types
from typing import Optional

VERSIONS = {"quack-kernels": "0.3.11", "nvidia-cutlass-dsl": "4.4.2"}  # whose internals are patched below


def parse_arch(arch: str) -> str:
    """``sm_90a`` / ``sm_100a`` -> the same, checked (CuTe DSL's spelling); ValueError otherwise."""
    if not re.fullmatch(r"sm_(90|100|103|110)a", arch):
        raise ValueError(f"--cpu takes an arch like sm_90a (Hopper) or sm_100a (Blackwell), got {arch!r}")
    return arch


def check_versions() -> Optional[str]:
    """Why this module cannot run here (a missing or other release of what it patches), or None."""
    for dist, want in VERSIONS.items():
        try:
            got = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist}=={want} is not installed (pip install --no-deps {dist}=={want})"
        if got != want:
            return f"--cpu is written for {dist}=={want} (its internals are patched); this is {got}"
    return None


def host_cpu() -> dict:
    """This machine's CPU model and its SIMD flags (the object files' host code is compiled for them)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = sorted(v for v in line.split(":", 1)[1].split() if v.startswith(("avx", "sse", "fma")))
                    break
    except OSError:
        pass
    return {"model": model, "simd_flags": flags}


def set_environment(arch: str) -> None:
    """Before quack, cutlass, sonicmoe or triton are imported: the target arch and Triton's interpreter."""
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["QUACK_ARCH"] = arch[3:].rstrip("a")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["QUACK_COMPILE_WORKERS"] = "1"  # compile in this process, where the changes below hold


def apply(python: Optional[str] = None) -> None:
    """The changes listed in the module docstring, for this process. ``python`` ("3.12"): the fingerprint's
    Python version (default: this interpreter's)."""
    import triton.runtime.autotuner as triton_autotuner
    import triton.runtime.interpreter as triton_interpreter
    from cutlass.base_dsl import compiler as cute_compiler
    from torch._library.custom_ops import CustomOpDef

    import quack.autotuner as quack_autotuner
    import quack.cache_utils as quack_cache
    import quack.gemm_interface as quack_gemm

    cute_compiler.Compiler._check_cuda_dependencies_once = lambda self, shared_libs: None
    quack_cache.COMPILE_ONLY = True
    for name in dir(quack_gemm):
        op = getattr(quack_gemm, name)
        if isinstance(op, CustomOpDef):
            op.register_kernel("cpu", op._init_fn)

    def compile_once(fn, quantiles=None, **_):
        fn()
        return [0.0, 0.0, 0.0] if quantiles else 0.0

    quack_autotuner._gpu_warmup = lambda *a, **k: None
    quack_autotuner.Autotuner.do_bench = property(lambda self: compile_once)
    triton_autotuner.Autotuner.do_bench = property(lambda self: (lambda fn, quantiles=None, **_: [0.0, 0.0, 0.0]))
    triton_interpreter.InterpretedFunction.run = lambda self, *a, **k: None
    if python:
        major, minor = (int(v) for v in python.split("."))
        version = types.SimpleNamespace(major=major, minor=minor)
        quack_cache.sys = types.SimpleNamespace(version_info=version)  # read by _compute_source_fingerprint only
        quack_cache._compute_source_fingerprint.cache_clear()


def fingerprint() -> str:
    """The folder under ``QUACK_CACHE_DIR`` that QuACK writes to and loads from (after ``apply``)."""
    import quack.cache_utils as quack_cache

    return quack_cache._compute_source_fingerprint()
