"""Block-scaled e4m3 (Hopper fp8) in plain torch: 128 x 128 weight blocks, 1 x 128 activation blocks.

The one definition of the harness's fp8 format (``scale = max(amax, 1e-12) / 448``, ``q = (x / scale).to(e4m3)``):
the PyTorch baselines import it from here, so baselines and kernel quantize identically.
"""

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
