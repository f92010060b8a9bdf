"""A training step through mok_hopper at EP=1, v0 (issue 23, in progress): :func:`mok_hopper_train` runs the fused
forward and records a backward made of the v0 backward GEMMs (:mod:`kernels.mok_hopper.bwd_gemm`), in the
recompute mode: the forward saves nothing beyond what the layer keeps (its pulled X rows and its schedule), and the
backward recomputes H (+1 read of W13). Checked against torch autograd under the Triton interpreter; not run on a
GPU, not yet a ``torch.library`` custom op or an ``nn.Module`` with parameters, not wired into the harness, EP=1
only (EP >= 2 needs the pull of dO rows and the push of dX rows across ranks). The shared expert's backward runs
the same GEMM kernels, as one expert over the T tokens.

Legend: T tokens, K top-k, H hidden, I ffn, L local experts, R capacity rows.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from kernels.mok_hopper import bwd_gemm
from kernels.mok_hopper.api import MoKHopperLayer
from kernels.mok_hopper.tiles import num_sms
from kernels.mok_hopper.twin import epilogue


def _blocks(n: int, cap: int) -> int:
    return next(b for b in (cap, 64, 32, 16) if b <= cap and n % b == 0)


BWD_STAGES = ("gather", "recompute_h", "dgate", "dx", "dx_sum", "dw13", "dw2", "shared")  # ``marks`` names


def layer_backward(layer: MoKHopperLayer, dO_TH: torch.Tensor, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor,
                   topk_w_TK: torch.Tensor, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor,
                   shared: Optional[Sequence[torch.Tensor]], marks: Optional[Callable[[str], None]] = None
                   ) -> dict[str, Any]:
    """The gradients of the layer's last forward (EP=1): x (bf16 [T, H]), topk_w (fp32 [T, K]), w13 (bf16
    [L, 2I, H]), w2 (bf16 [L, H, I]) and, with a shared expert, its (gate, up, down) gradients. H comes from the
    forward (``layer.save_h``) or is recomputed here from the layer's X rows. ``marks(stage)`` is called after
    each stage of :data:`BWD_STAGES` (diagnostics: a stage timer records an event there)."""
    assert layer.world == 1, "the v0 backward runs at EP=1 (issue 23: the cross-rank dO pull and dX push are next)"
    mark = marks or (lambda name: None)
    T, K, H, I, L = layer.T, layer.K, layer.H, layer.I, layer.L
    s = layer.sched
    R = layer.R
    dev = dO_TH.device
    codes = s.row_code_R.long()
    valid = codes >= 0
    c = torch.where(valid, codes, torch.zeros_like(codes))
    tok = c // K
    zero = torch.zeros((), dtype=torch.bfloat16, device=dev)
    dO_rows = torch.where(valid[:, None], dO_TH.to(torch.bfloat16)[tok], zero)
    s_rows = torch.where(valid, topk_w_TK.reshape(-1).float()[c], torch.zeros((), device=dev))
    x_rows = torch.where(valid[:, None], layer.x_rows, zero)  # the forward's pulled rows (padding rows: zero)
    mark("gather")
    bm, progs = layer.cfg.block_m, num_sms(dev)
    chunk = torch.stack([torch.zeros_like(s.num_tiles.reshape(())), s.num_tiles.reshape(())]).to(torch.int32)
    limit = layer.limit
    kw = dict(block_m=bm, programs=progs)
    if getattr(layer, "save_h", False):  # saved by the forward's up GEMM
        h, clip = layer.h_save, (layer.clip_save if limit is not None else None)
    else:  # recompute H (and, clamped, the clamp's decisions) from the X rows
        h = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=dev)
        clip = torch.zeros(R, 2 * I, dtype=torch.uint8, device=dev) if limit is not None else None
        bwd_gemm.bwd_rows(x_rows, w13_LIH.transpose(1, 2), h, s.tile_expert_M, s.tile_row_M1, chunk,
                          block_n=_blocks(2 * I, 64), block_k=_blocks(H, 64), limit=limit, save_clip=clip, **kw)
    mark("recompute_h")
    # dgate: dH, s*A, the router-weight partials
    bn = _blocks(I, 32)
    dH = torch.zeros(R, 2 * I, dtype=torch.bfloat16, device=dev)
    sA = torch.zeros(R, I, dtype=torch.bfloat16, device=dev)
    ds_parts = torch.zeros(R, I // bn, dtype=torch.float32, device=dev)
    bwd_gemm.bwd_rows(dO_rows, w2_LHI, dH, s.tile_expert_M, s.tile_row_M1, chunk, block_n=bn,
                      block_k=_blocks(H, 64), dgate=dict(h=h, clip=clip, s=s_rows, sa=sA, ds=ds_parts), limit=limit,
                      **kw)
    mark("dgate")
    # dX rows, then each to its slot and summed per token by the forward's epilogue order (k ascending, fp32)
    dX = torch.zeros(R, H, dtype=torch.bfloat16, device=dev)
    bwd_gemm.bwd_rows(dH, w13_LIH, dX, s.tile_expert_M, s.tile_row_M1, chunk, block_n=_blocks(H, 64),
                      block_k=_blocks(2 * I, 64), **kw)
    mark("dx")
    slots = torch.zeros(T * K, H, dtype=torch.bfloat16, device=dev)
    slots[codes[valid]] = dX[valid]
    live = topk_idx_TK >= 0
    dtopk = torch.zeros(T * K, dtype=torch.float32, device=dev)
    dtopk[codes[valid]] = bwd_gemm.router_grad(ds_parts)[valid]
    mark("dx_sum")
    # weight gradients, each expert's rows in schedule order
    starts = bwd_gemm.expert_rows(s.tile_expert_M, s.tile_row_M1, L)
    dW13 = torch.empty_like(w13_LIH)
    dW2 = torch.empty_like(w2_LHI)
    bwd_gemm.bwd_wgrad(dH, x_rows, dW13, s.row_code_R, starts, programs=progs, block_n=_blocks(2 * I, 64),
                       block_k=_blocks(H, 64))
    mark("dw13")
    bwd_gemm.bwd_wgrad(dO_rows, sA, dW2, s.row_code_R, starts, programs=progs, block_n=_blocks(H, 64),
                       block_k=_blocks(I, 64))
    mark("dw2")
    out = {"w13": dW13, "w2": dW2, "topk_w": dtopk.view(T, K) * live}
    sh = _shared_backward(layer, x_TH, dO_TH, shared, **kw) if shared is not None else None
    if sh is not None:
        out["shared"] = (sh["gate"], sh["up"], sh["down"])
    out["x"] = epilogue(slots, topk_idx_TK, None, sh["dx"] if sh is not None else None)
    mark("shared")
    return out


def _shared_backward(layer: MoKHopperLayer, x_TH: torch.Tensor, dO_TH: torch.Tensor, shared: Sequence[torch.Tensor],
                     *, block_m: int, programs: int) -> dict[str, torch.Tensor]:
    """The shared expert's gradients by the same GEMM kernels: one expert over the T tokens in order, router weight
    1, H recomputed (the forward's shared expert saves nothing). All bf16: dx [T, H], gate / up [I, H], down [H, I]."""
    T, H, I, dev = layer.T, layer.H, layer.I, dO_TH.device
    g_w, u_w, d_w = shared
    w13 = torch.cat([g_w, u_w]).unsqueeze(0)  # [1, 2I, H]
    w2 = d_w.unsqueeze(0)
    tiles, rows, chunk, code = layer.sh_tiles, layer.sh_rows, layer.sh_chunk, layer.sh_code
    limit = layer.limit
    kw = dict(block_m=block_m, programs=programs)
    x = x_TH.detach().to(torch.bfloat16).contiguous()
    dO = dO_TH.detach().to(torch.bfloat16).contiguous()
    h = torch.empty(T, 2 * I, dtype=torch.bfloat16, device=dev)
    clip = torch.zeros(T, 2 * I, dtype=torch.uint8, device=dev) if limit is not None else None
    bwd_gemm.bwd_rows(x, w13.transpose(1, 2), h, tiles, rows, chunk, block_n=_blocks(2 * I, 64),
                      block_k=_blocks(H, 64), limit=limit, save_clip=clip, **kw)
    bn = _blocks(I, 32)
    dH = torch.empty(T, 2 * I, dtype=torch.bfloat16, device=dev)
    sA = torch.empty(T, I, dtype=torch.bfloat16, device=dev)
    ds_parts = torch.empty(T, I // bn, dtype=torch.float32, device=dev)
    ones = torch.ones(T, dtype=torch.float32, device=dev)
    bwd_gemm.bwd_rows(dO, w2, dH, tiles, rows, chunk, block_n=bn, block_k=_blocks(H, 64),
                      dgate=dict(h=h, clip=clip, s=ones, sa=sA, ds=ds_parts), limit=limit, **kw)
    dx = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    bwd_gemm.bwd_rows(dH, w13, dx, tiles, rows, chunk, block_n=_blocks(H, 64), block_k=_blocks(2 * I, 64), **kw)
    starts = torch.tensor([0, T], dtype=torch.int32, device=dev)
    dW13 = torch.empty(1, 2 * I, H, dtype=torch.bfloat16, device=dev)
    dW2 = torch.empty(1, H, I, dtype=torch.bfloat16, device=dev)
    bwd_gemm.bwd_wgrad(dH, x, dW13, code, starts, programs=programs, block_n=_blocks(2 * I, 64),
                       block_k=_blocks(H, 64))
    bwd_gemm.bwd_wgrad(dO, sA, dW2, code, starts, programs=programs, block_n=_blocks(H, 64), block_k=_blocks(I, 64))
    return {"dx": dx, "gate": dW13[0, :I], "up": dW13[0, I:], "down": dW2[0]}


class _MoKHopperTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, x_TH, topk_idx_TK, topk_w_TK, w13_LIH, w2_LHI, *shared):  # type: ignore[override]
        out = layer(x_TH, topk_idx_TK, topk_w_TK)
        ctx.layer = layer
        ctx.has_shared = bool(shared)
        ctx.save_for_backward(x_TH, topk_idx_TK, topk_w_TK, w13_LIH, w2_LHI, *shared)
        return out

    @staticmethod
    def backward(ctx, dO_TH):  # type: ignore[override]
        x, idx, w, w13, w2, *shared = ctx.saved_tensors
        g = layer_backward(ctx.layer, dO_TH, x, idx, w, w13, w2, shared if ctx.has_shared else None)
        sh = list(g["shared"]) if ctx.has_shared else []
        return (None, g["x"], None, g["topk_w"].to(w.dtype), g["w13"], g["w2"], *sh)


def mok_hopper_train(layer: MoKHopperLayer, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                     w13_LIH: torch.Tensor, w2_LHI: torch.Tensor,
                     shared: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """The layer's forward, recorded for autograd: gradients flow to ``x_TH``, ``topk_w_TK``, the routed weights
    ``w13_LIH`` / ``w2_LHI`` (the tensors the layer was built from) and the shared expert's (gate, up, down). The
    backward must follow the forward before the layer runs again (it reads the layer's X rows and schedule)."""
    return _MoKHopperTrain.apply(layer, x_TH, topk_idx_TK, topk_w_TK, w13_LIH, w2_LHI, *(shared or ()))
