"""The Triton interpreter shim: under ``TRITON_INTERPRET=1`` (the CPU tests) two interpreter gaps are worked
around, so that the kernels compute on the CPU what they compute on the GPU. Every kernel module imports
:data:`INTERPRET` from here, which applies the fixes once."""

from __future__ import annotations

import os

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


if INTERPRET:
    _interpreter_compat()
