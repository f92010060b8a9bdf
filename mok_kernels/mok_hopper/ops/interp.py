"""The Triton interpreter shim: under ``TRITON_INTERPRET=1`` (the CPU tests) two interpreter gaps are worked
around, so that the kernels compute on the CPU what they compute on the GPU, and the interpreter's per-call patching
of ``triton.language`` is done once a launch. Every kernel module imports :data:`INTERPRET` from here, which applies
the fixes once."""

from __future__ import annotations

import os
from typing import Any

import torch
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_compat() -> None:
    """Two fixes to Triton 3.6's CPU interpreter, so that it computes what the GPU computes:

    * scalars are converted with ``int(array)``, an error since numpy 2.4;
    * fp32 -> bf16 and fp32 -> e4m3 conversions truncate (the GPU rounds to nearest even, as torch does).
    """
    import numpy as np
    import triton.runtime.interpreter as ti

    if getattr(ti, "_mok_patched", False) or not hasattr(ti, "_patch_lang_tensor") or not hasattr(ti, "_convert_float"):
        return
    orig_patch, orig_convert = ti._patch_lang_tensor, ti._convert_float

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    targets = {tl.bfloat16: (torch.bfloat16, torch.uint16), tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8)}

    def convert(data, src_ty, dst_ty, rounding_mode):  # type: ignore[no-untyped-def]
        if src_ty == tl.float32 and dst_ty in targets:
            to, bits = targets[dst_ty]
            src = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return src.to(to).view(bits).numpy().reshape(np.shape(data))
        return orig_convert(data, src_ty, dst_ty, rounding_mode)

    ti._patch_lang_tensor = patched
    ti._convert_float = convert
    ti._mok_patched = True


def _patch_once_a_launch() -> None:
    """The interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.core``, ``tl.math`` and the tensor
    class, about 3 ms) at each launch, and again at each call of a ``@triton.jit`` helper inside the kernel, where it
    finds everything patched already and changes nothing: two fifths of a CPU test's kernel time. A helper called
    while a launch holds the patch of the same language modules skips it; the launch's own patch and its restore
    are Triton's. Where ``_patch_lang`` returns no restorable scope (another Triton), nothing changes."""
    import inspect

    import triton.runtime.interpreter as ti

    if getattr(ti, "_mok_patch_once", False) or not hasattr(ti, "_patch_lang"):
        return
    orig = ti._patch_lang
    held: list[frozenset[int]] = []  # the language modules patched by the launch running now
    langs_of: dict[Any, frozenset[int]] = {}  # a jit function's language modules (its module's globals)

    class _Held:
        """What a helper's call gets: the launch's patch stays until the launch restores it."""

        def restore(self) -> None:
            pass

    def patch_lang(fn):  # type: ignore[no-untyped-def]
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        if held and langs and langs <= held[-1]:
            return _Held()
        scope = orig(fn)
        if held or not callable(getattr(scope, "restore", None)):
            return scope
        held.append(langs)
        restore = scope.restore

        def restore_and_release() -> None:
            try:
                restore()
            finally:
                held.pop()

        scope.restore = restore_and_release
        return scope

    ti._patch_lang = patch_lang
    ti._mok_patch_once = True


if INTERPRET:
    _interpreter_compat()
    _patch_once_a_launch()
