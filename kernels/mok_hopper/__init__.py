"""MoK-style fused expert-parallel MoE forward for Hopper (Triton): pull dispatch and push combine over torch
symmetric memory, on-device schedule, grouped SwiGLU GEMMs, fixed-order (deterministic) epilogue; bf16 and fp8.

Public API: :class:`~kernels.mok_hopper.api.MoKHopperLayer`, :func:`~kernels.mok_hopper.api.mok_hopper_forward`
(imported lazily: importing this package needs neither Triton nor a GPU).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MoKHopperLayer", "mok_hopper_forward"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kernels.mok_hopper import api

        return getattr(api, name)
    raise AttributeError(name)
