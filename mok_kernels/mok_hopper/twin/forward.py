"""Pure-torch twin of the kernel pipeline: the same schedule, the same roundings (bf16 rows, fp32 accumulation,
SwiGLU in fp32, bf16 hidden / combine rows), the same fixed-order epilogue. Not the kernel: it runs on any device,
for the CPU tests and for the harness's CPU (gloo) runs, where it is labelled as the twin.

Legend: P ranks, T tokens per rank, K top-k, H hidden, I ffn, L local experts, R capacity rows, BM tile rows.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from contract.fp8 import FP8_MAX, dequantize_blocks, quantize_blocks
from mok_kernels.mok_hopper.fp8 import quantize_expert_weights
from mok_kernels.mok_hopper.schedule import build_schedule, capacity_rows


def _swiglu_f32(g: torch.Tensor, u: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


def quant_rows(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x block e4m3 quantisation of the rows of x (what the stage kernel and the up GEMM epilogue do)."""
    return quantize_blocks(x, 1, block)


def expert_rows(x_RH: torch.Tensor, tile_expert_M: torch.Tensor, block_m: int, w13_LIH: torch.Tensor,
                w2_LHI: torch.Tensor, *, limit: Optional[float], fp8: bool,
                w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                x_scale: Optional[torch.Tensor] = None, h_block: int = 64) -> torch.Tensor:
    """fp32 [R, H] down-GEMM rows (before the router weight) of every tile; rows of unused tiles are zero.

    bf16: x and weights as given. fp8: x (e4m3 + 1x128 scales) and weights (e4m3 + 128x128 scales) are
    dequantised; the hidden rows are re-quantised 1 x ``h_block`` like the kernel's up-GEMM epilogue."""
    R, H = x_RH.shape
    I = w2_LHI.shape[2]
    L = w13_LIH.shape[0]
    y = torch.zeros(R, H, dtype=torch.float32, device=x_RH.device)
    te = tile_expert_M.tolist()
    for m, e in enumerate(te):
        if e >= L:
            continue
        r = slice(m * block_m, (m + 1) * block_m)
        if fp8:
            a = dequantize_blocks(x_RH[r], x_scale[r], 1, 128)
            w13 = dequantize_blocks(w13_LIH[e], w13_scale[e], 128, 128)
            w2 = dequantize_blocks(w2_LHI[e], w2_scale[e], 128, 128)
        else:
            a, w13, w2 = x_RH[r].float(), w13_LIH[e].float(), w2_LHI[e].float()
        h = _swiglu_f32(a @ w13[:I].t(), a @ w13[I:].t(), limit)
        if fp8:
            hq, hs = quant_rows(h, h_block)
            h = dequantize_blocks(hq, hs, 1, h_block)
        else:
            h = h.to(torch.bfloat16).float()
        y[r] = h @ w2.t()
    return y


def shared_rows(x_TH: torch.Tensor, shared: Sequence[torch.Tensor], limit: Optional[float]) -> torch.Tensor:
    """bf16 [T, H] shared-expert output, with the kernel's roundings."""
    g, u, d = (t.float() for t in shared)
    x = x_TH.float()
    h = _swiglu_f32(x @ g.t(), x @ u.t(), limit).to(torch.bfloat16).float()
    return (h @ d.t()).to(torch.bfloat16)


def epilogue(comb_SH: torch.Tensor, idx_TK: torch.Tensor, rw_TK: Optional[torch.Tensor],
             shared_TH: Optional[torch.Tensor]) -> torch.Tensor:
    """out[t] = sum_k comb[t*K+k] (x w) + shared[t], in fp32, k ascending (the kernel's order)."""
    T, K = idx_TK.shape
    comb = comb_SH.view(T, K, -1)
    acc = torch.zeros(T, comb.shape[-1], dtype=torch.float32, device=comb.device)
    for k in range(K):
        v = comb[:, k].float() * (idx_TK[:, k] >= 0).unsqueeze(-1)
        if rw_TK is not None:
            v = v * rw_TK[:, k : k + 1]
        acc = acc + v
    if shared_TH is not None:
        acc = acc + shared_TH.float()
    return acc.to(torch.bfloat16)


def simulate(xs_PTH: Sequence[torch.Tensor], idx_PTK: Sequence[torch.Tensor], w_PTK: Sequence[torch.Tensor],
             w13_PLIH: Sequence[torch.Tensor], w2_PLHI: Sequence[torch.Tensor], *,
             shared: Optional[Sequence[torch.Tensor]] = None, limit: Optional[float] = None, fp8: bool = False,
             block_m: int = 128, capacity_multiplier: Optional[float] = 0.5,
             router_weight_in: str = "expert", h_block: int = 64) -> list[torch.Tensor]:
    """Every rank's output, all ranks in one process (the twin of a P-rank forward)."""
    P = len(xs_PTH)
    T, K = idx_PTK[0].shape
    idx_all = torch.stack([i.reshape(-1) for i in idx_PTK]).to(torch.int32)
    x_all = torch.cat(list(xs_PTH))
    w_all = torch.cat([w.reshape(-1) for w in w_PTK])
    combs = [torch.zeros(T * K, x_all.shape[1], dtype=torch.bfloat16, device=x_all.device) for _ in range(P)]
    for r in range(P):
        for slot_code, y in rank_rows(x_all, idx_all, w_all, w13_PLIH[r], w2_PLHI[r], rank=r, limit=limit,
                                      fp8=fp8, block_m=block_m, capacity_multiplier=capacity_multiplier,
                                      apply_w=router_weight_in == "expert", h_block=h_block):
            src, slot = divmod(slot_code, T * K)
            combs[src][slot] = y
    outs = []
    for r in range(P):
        sh = shared_rows(xs_PTH[r], shared, limit) if shared is not None else None
        rw = None if router_weight_in == "expert" else w_PTK[r]
        outs.append(epilogue(combs[r], idx_PTK[r], rw, sh))
    return outs


def rank_rows(x_all: torch.Tensor, idx_all_PS: torch.Tensor, w_all_S: torch.Tensor, w13_LIH: torch.Tensor,
              w2_LHI: torch.Tensor, *, rank: int, limit: Optional[float], fp8: bool, block_m: int,
              capacity_multiplier: Optional[float], apply_w: bool,
              w_quant: Optional[tuple] = None, h_block: int = 64) -> list[tuple[int, torch.Tensor]]:
    """(slot code, bf16 combine row) for every row this rank's experts compute, in schedule order."""
    P, S_per = idx_all_PS.shape
    T = x_all.shape[0] // P
    K = S_per // T
    L = w13_LIH.shape[0]
    R = capacity_rows(ep=P, tokens=T, topk=K, local_experts=L, block_m=block_m,
                      capacity_multiplier=capacity_multiplier)
    sch = build_schedule(idx_all_PS, rank=rank, local_experts=L, block_m=block_m, capacity=R)
    codes = sch.row_code_R.long()
    valid = codes >= 0
    c = torch.where(valid, codes, torch.zeros_like(codes))
    src, slot = c // (T * K), c % (T * K)
    tok_global = src * T + slot // K
    xs = None
    if fp8:
        xq, xs_all = quant_rows(x_all)  # each source rank quantises its own rows
        x_rows = torch.where(valid[:, None], xq[tok_global].float(), 0.0).to(torch.float8_e4m3fn)
        xs = torch.where(valid[:, None], xs_all[tok_global], 0.0)
        if w_quant is None:
            w_quant = (*quantize_expert_weights(w13_LIH), *quantize_expert_weights(w2_LHI))
        q13, s13, q2, s2 = w_quant
        y = expert_rows(x_rows, sch.tile_expert_M, block_m, q13, q2, limit=limit, fp8=True, w13_scale=s13,
                        w2_scale=s2, x_scale=xs, h_block=h_block)
    else:
        x_rows = torch.where(valid[:, None], x_all[tok_global], torch.zeros((), dtype=x_all.dtype))
        y = expert_rows(x_rows, sch.tile_expert_M, block_m, w13_LIH, w2_LHI, limit=limit, fp8=False)
    if apply_w:
        y = y * torch.where(valid, w_all_S[c], 0.0)[:, None]  # the code is the flat slot index
    y = y.to(torch.bfloat16)
    idx = valid.nonzero().flatten().tolist()
    return [(int(codes[i]), y[i]) for i in idx]


__all__ = ["FP8_MAX", "simulate", "rank_rows", "expert_rows", "shared_rows", "epilogue"]
