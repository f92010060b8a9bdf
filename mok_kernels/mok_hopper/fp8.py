"""The kernel's use of the harness's fp8 format (:mod:`contract.fp8`, where it is defined): stacked expert weights
quantised in 128 x 128 blocks, a few experts at a time."""

from __future__ import annotations

import torch

from contract.fp8 import FP8_MAX, dequantize_blocks, quantize_blocks  # noqa: F401 (re-exported)


def quantize_expert_weights(w_LNK: torch.Tensor, block: int = 128,
                            experts_per_step: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 block quantisation of stacked expert weights, a few experts at a time (bounded fp32 scratch)."""
    L, N, Kd = w_LNK.shape
    q = torch.empty(L, N, Kd, dtype=torch.float8_e4m3fn, device=w_LNK.device)
    s = torch.empty(L, N // block, Kd // block, dtype=torch.float32, device=w_LNK.device)
    for lo in range(0, L, experts_per_step):
        q[lo : lo + experts_per_step], s[lo : lo + experts_per_step] = quantize_blocks(
            w_LNK[lo : lo + experts_per_step], block, block)
    return q, s
