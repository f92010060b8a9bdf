"""The harness's fp8 format, defined once: DeepSeek-style block-scaled e4m3 (Hopper fp8), 1 x 128 blocks for
activations and 128 x 128 blocks for weights, fp32 scales, ``scale = max(amax, 1e-12) / 448``,
``q = (x / scale).to(e4m3)``. Baselines, kernels and the reference import it from here, so they quantise
identically."""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def quantize_blocks(x: torch.Tensor, block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 data [..., R, C] and fp32 scales [..., R/block_rows, C/block_cols]."""
    *lead, r, c = x.shape
    assert r % block_rows == 0 and c % block_cols == 0, f"{tuple(x.shape)} is not a multiple of the blocks"
    xb = x.float().reshape(*lead, r // block_rows, block_rows, c // block_cols, block_cols)
    amax = xb.abs().amax(dim=(-3, -1), keepdim=True).clamp_(min=1e-12)
    scale = amax / FP8_MAX
    q = (xb / scale).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale.squeeze(-1).squeeze(-2)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    *lead, r, c = q.shape
    qb = q.float().reshape(*lead, r // block_rows, block_rows, c // block_cols, block_cols)
    return (qb * scale.unsqueeze(-1).unsqueeze(-3)).reshape(q.shape)
