"""MoK-style fused expert-parallel MoE forward for Hopper (Triton): pull dispatch and push combine over torch
symmetric memory, on-device schedule, grouped SwiGLU GEMMs, fixed-order (deterministic) epilogue; bf16 and fp8.

Public API: :class:`~mok_kernels.mok_hopper.api.MoKHopperLayer`, :func:`~mok_kernels.mok_hopper.api.mok_hopper_forward`
(imported lazily: importing this package needs neither Triton nor a GPU).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MoKHopperLayer", "mok_hopper_forward"]

# The Triton releases the kernels are checked on: every default and sweep kernel compiles for sm_90 without register
# spills on both ends (``python -m mok_tools.mok_hopper.aot_check --sweep``), and the GPU tests pass on 3.6 (the GPU
# image's). pyproject.toml's dependency names the same range (tests/test_mok_hopper_ops.py checks that they agree).
TRITON_SPEC = ">=3.6,<3.9"
TRITON_RANGE = ((3, 6), (3, 9))  # [lowest, first unsupported) (major, minor)


def triton_unsupported(version: str) -> str | None:
    """Why this Triton version is outside :data:`TRITON_SPEC`, or None."""
    try:
        got = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"cannot read the Triton version {version!r}; the kernels need triton{TRITON_SPEC}"
    lo, hi = TRITON_RANGE
    if lo <= got < hi:
        return None
    return (f"Triton {version} is outside the checked range triton{TRITON_SPEC} (register use and spills change "
            f"between releases): pip install 'triton{TRITON_SPEC}'")


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mok_kernels.mok_hopper import api

        return getattr(api, name)
    raise AttributeError(name)
