"""One kernel launch as :mod:`mok_tools.mok_hopper.aot_check` compiles it: the kernel, its argument types, its
constexprs and launch options (the forward's launches are listed in ``aot_check``, the backward's in ``aot_bwd``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Variant:
    label: str
    kernel: str  # a kernel's name in one of KERNEL_MODULES
    types: dict[str, str]  # runtime argument -> Triton type string
    constexprs: dict[str, Any]
    num_warps: int
    # i32 arguments compiled without divisibility by 16, as the launch sees them (the pull's and the epilogue's K
    # is the top-k, HS the hidden size / 128); every other i32 is a size the launch sees divisible by 16 (the
    # backward's K is a hidden size: compiled otherwise, its loads and stores are not those that run)
    plain: tuple[str, ...] = ()
    maxnreg: int = 0  # the registers a thread the launch caps the kernel at (0: none)
