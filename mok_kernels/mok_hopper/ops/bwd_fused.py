"""The bf16 backward's weight-streaming stages fused in pairs (the journal, lab/perf-notes.md: backward v7): each reads
one expert weight block and writes the gradient block of the same place in one step, so HBM sees one stream of reads and
writes, as in a copy, instead of a read-only stage followed by a write-only one. Measured on one H200 against the
separate stages' sum: dX + dW13 by pointer stores 6-8% faster in 64-row blocks but no faster in the harness's backward,
11% slower in 128-row blocks; dgate + dW2 1.15-1.4x slower. Both are options of
:func:`mok_kernels.mok_hopper.train._tiles` (off).

* :func:`dgate_dw2` - work items (expert, I block): G = dO rows @ W2[e][:, I block] accumulated over the H blocks,
  and in the same step dW2[e][H block, I block] = dO rows^T @ (s A) rows, s A = s SwiGLU(H) computed once per
  work item from the saved H; then dgate's epilogue on G (dH, the router-weight gradient's partial sums:
  :func:`~mok_kernels.mok_hopper.ops.bwd_gemm._bwd_rows_epilogue`). s A is never written.
* :func:`dx_dw13` - work items (expert, H block): dX rows[:, H block] = dH rows @ W13[e][:, H block] accumulated
  over the 2I blocks, and in the same step dW13[e][2I block, H block] = dH rows^T @ X rows[:, H block]; then the
  dX rows pushed to their token slots (the push of :func:`~mok_kernels.mok_hopper.ops.bwd_gemm.bwd_rows`).

An expert of at most ``block_r`` rows (the fast path: every published shape at EP=1 with the launch's block_r)
holds its rows in one block; a larger one runs the two halves one after the other in the same program (the
GEMM over row blocks, then each gradient block over the row blocks in order), reading its weight strip once per
row block. Every sum has a fixed order: no atomics, no split-K, bitwise deterministic. Padding rows (code < 0)
add nothing. Plain weights only ([L, 2I, H], [L, H, I]; the tiled layout keeps the separate stages).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mok_kernels.mok_hopper.ops.bwd_gemm import _bwd_rows_epilogue
from mok_kernels.mok_hopper.ops.gemm_common import _mma
from mok_kernels.mok_hopper.ops.interp import INTERPRET


@triton.jit
def _load_w(w_ptr, e, r0, c0, NR, NC, BR_: tl.constexpr, BC: tl.constexpr, WTMA: tl.constexpr):
    """Block [r0, r0 + BR_) x [c0, c0 + BC) of W[e] (row-major [L, NR, NC]): by TMA (``w_ptr`` a descriptor over
    [L NR, NC], blocks [BR_, BC]) or pointers."""
    if WTMA:
        w = w_ptr.load([e * NR + r0, c0])
    else:
        r = (r0 + tl.arange(0, BR_)).to(tl.int64)
        c = c0 + tl.arange(0, BC)
        w = tl.load(w_ptr + e.to(tl.int64) * NR * NC + r[:, None] * NC + c[None, :])
    return w


@triton.jit
def _store_w(dw_ptr, acc, e, r0, c0, NR, NC, BR_: tl.constexpr, BC: tl.constexpr, TMA: tl.constexpr):
    """dW[e] block [r0, r0 + BR_) x [c0, c0 + BC) = acc (bf16), by TMA (asynchronous) or pointers."""
    if TMA:
        dw_ptr.store([e * NR + r0, c0], acc.to(dw_ptr.dtype))
    else:
        r = (r0 + tl.arange(0, BR_)).to(tl.int64)
        c = c0 + tl.arange(0, BC)
        tl.store(dw_ptr + e.to(tl.int64) * NR * NC + r[:, None] * NC + c[None, :], acc.to(dw_ptr.dtype.element_ty))


@triton.jit
def _scaled_act(h_ptr, clip_ptr, s_ptr, rows, rmask, cols, I, limit, HAS_LIMIT: tl.constexpr):
    """s SwiGLU(H) of rows x cols (bf16 [BR, BI]): the forward's A, with its clamp, times the router weight (0 for
    rows outside ``rmask``)."""
    off = rows[:, None] * (2 * I) + cols[None, :]
    g = tl.load(h_ptr + off, mask=rmask[:, None], other=0.0).to(tl.float32)
    u = tl.load(h_ptr + off + I, mask=rmask[:, None], other=0.0).to(tl.float32)
    if HAS_LIMIT:
        clip_g = tl.load(clip_ptr + off, mask=rmask[:, None], other=0) != 0
        clip_u = tl.load(clip_ptr + off + I, mask=rmask[:, None], other=0) != 0
        g = tl.where(clip_g, limit, tl.minimum(g, limit))
        u = tl.where(clip_u, tl.where(u > 0, limit, -limit), tl.minimum(tl.maximum(u, -limit), limit))
    s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    return (g * tl.sigmoid(g) * u * s[:, None]).to(tl.bfloat16)


@triton.jit
def _expert_item(wk, n_blocks, expert_row_ptr):
    """Work item -> (expert, column block, the expert's row range [r_lo, r_hi)): expert-major, the block fastest."""
    e = wk // n_blocks
    return e, wk % n_blocks, tl.load(expert_row_ptr + e), tl.load(expert_row_ptr + e + 1)


@triton.jit
def _live_rows(code_ptr, r0, r_hi, BR: tl.constexpr):
    rows = (r0 + tl.arange(0, BR)).to(tl.int64)
    inr = rows < r_hi
    return rows, inr, inr & (tl.load(code_ptr + rows, mask=inr, other=-1) >= 0)


@triton.jit
def _dgate_dw2_kernel(do_ptr, w2_ptr, dw2_ptr, h_ptr, clip_ptr, s_ptr, dh_ptr, ds_ptr, code_ptr, expert_row_ptr,
                      H, I, L, limit, BR: tl.constexpr, BH: tl.constexpr, BI: tl.constexpr, NUM_PROGS: tl.constexpr,
                      UPCAST: tl.constexpr, STAGES: tl.constexpr, HAS_LIMIT: tl.constexpr, WTMA: tl.constexpr,
                      TMA_STORE: tl.constexpr):
    n_h = H // BH
    n_i = I // BI
    for wk in range(tl.program_id(0), L * n_i, NUM_PROGS):
        e, i, r_lo, r_hi = _expert_item(wk, n_i, expert_row_ptr)
        icols = i * BI + tl.arange(0, BI)
        hh = tl.arange(0, BH)
        if r_hi - r_lo <= BR:
            rows, inr, live = _live_rows(code_ptr, r_lo, r_hi, BR)
            sa = _scaled_act(h_ptr, clip_ptr, s_ptr, rows, live, icols, I, limit, HAS_LIMIT)
            acc = tl.zeros((BR, BI), dtype=tl.float32)
            for hb in tl.range(0, n_h, num_stages=STAGES):
                a = tl.load(do_ptr + rows[:, None] * H + (hb * BH + hh)[None, :], mask=live[:, None], other=0.0)
                w = _load_w(w2_ptr, e, hb * BH, i * BI, H, I, BH, BI, WTMA)
                acc = _mma(a, w, acc, UPCAST)
                dw = _mma(a.T, sa, tl.zeros((BH, BI), dtype=tl.float32), UPCAST)
                _store_w(dw2_ptr, dw, e, hb * BH, i * BI, H, I, BH, BI, TMA_STORE)
            _bwd_rows_epilogue(acc, rows, inr, icols, i, n_i, dh_ptr, h_ptr, clip_ptr, s_ptr, dh_ptr, ds_ptr,
                               code_ptr, code_ptr, I, 1, limit, True, HAS_LIMIT, False, False, False)
        else:  # G over each row block, then each dW2 block over the row blocks (s A recomputed per block)
            for r0 in range(r_lo, r_hi, BR):
                rows, inr, live = _live_rows(code_ptr, r0, r_hi, BR)
                acc = tl.zeros((BR, BI), dtype=tl.float32)
                for hb in tl.range(0, n_h, num_stages=STAGES):
                    a = tl.load(do_ptr + rows[:, None] * H + (hb * BH + hh)[None, :], mask=live[:, None], other=0.0)
                    acc = _mma(a, _load_w(w2_ptr, e, hb * BH, i * BI, H, I, BH, BI, WTMA), acc, UPCAST)
                _bwd_rows_epilogue(acc, rows, inr, icols, i, n_i, dh_ptr, h_ptr, clip_ptr, s_ptr, dh_ptr, ds_ptr,
                                   code_ptr, code_ptr, I, 1, limit, True, HAS_LIMIT, False, False, False)
            for hb in range(0, n_h):
                dw = tl.zeros((BH, BI), dtype=tl.float32)
                for r0 in tl.range(r_lo, r_hi, BR, num_stages=STAGES):
                    rows, inr, live = _live_rows(code_ptr, r0, r_hi, BR)
                    a = tl.load(do_ptr + rows[:, None] * H + (hb * BH + hh)[None, :], mask=live[:, None], other=0.0)
                    sa = _scaled_act(h_ptr, clip_ptr, s_ptr, rows, live, icols, I, limit, HAS_LIMIT)
                    dw = _mma(a.T, sa, dw, UPCAST)
                _store_w(dw2_ptr, dw, e, hb * BH, i * BI, H, I, BH, BI, TMA_STORE)


@triton.jit
def _dx_dw13_kernel(dh_ptr, x_ptr, w13_ptr, dw13_ptr, out_ptr, code_ptr, delta_ptr, expert_row_ptr, H, N, L, TK,
                    BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGS: tl.constexpr,
                    UPCAST: tl.constexpr, STAGES: tl.constexpr, WTMA: tl.constexpr, TMA_STORE: tl.constexpr):
    n_n = N // BN
    n_k = H // BK
    for wk in range(tl.program_id(0), L * n_k, NUM_PROGS):
        e, k, r_lo, r_hi = _expert_item(wk, n_k, expert_row_ptr)
        kcols = k * BK + tl.arange(0, BK)
        nn = tl.arange(0, BN)
        if r_hi - r_lo <= BR:
            rows, inr, live = _live_rows(code_ptr, r_lo, r_hi, BR)
            q = tl.load(x_ptr + rows[:, None] * H + kcols[None, :], mask=live[:, None], other=0.0)  # [BR, BK]
            acc = tl.zeros((BR, BK), dtype=tl.float32)
            for n in tl.range(0, n_n, num_stages=STAGES):
                p = tl.load(dh_ptr + rows[:, None] * N + (n * BN + nn)[None, :], mask=live[:, None], other=0.0)
                w = _load_w(w13_ptr, e, n * BN, k * BK, N, H, BN, BK, WTMA)
                acc = _mma(p, w, acc, UPCAST)
                dw = _mma(p.T, q, tl.zeros((BN, BK), dtype=tl.float32), UPCAST)
                _store_w(dw13_ptr, dw, e, n * BN, k * BK, N, H, BN, BK, TMA_STORE)
            _bwd_rows_epilogue(acc, rows, inr, kcols, k, n_k, out_ptr, dh_ptr, dh_ptr, dh_ptr, dh_ptr, dh_ptr,
                               code_ptr, delta_ptr, H, TK, 0.0, False, False, False, True)
        else:  # dX over each row block, then each dW13 block over the row blocks
            for r0 in range(r_lo, r_hi, BR):
                rows, inr, live = _live_rows(code_ptr, r0, r_hi, BR)
                acc = tl.zeros((BR, BK), dtype=tl.float32)
                for n in tl.range(0, n_n, num_stages=STAGES):
                    p = tl.load(dh_ptr + rows[:, None] * N + (n * BN + nn)[None, :], mask=live[:, None], other=0.0)
                    acc = _mma(p, _load_w(w13_ptr, e, n * BN, k * BK, N, H, BN, BK, WTMA), acc, UPCAST)
                _bwd_rows_epilogue(acc, rows, inr, kcols, k, n_k, out_ptr, dh_ptr, dh_ptr, dh_ptr, dh_ptr, dh_ptr,
                                   code_ptr, delta_ptr, H, TK, 0.0, False, False, False, True)
            for n in range(0, n_n):
                dw = tl.zeros((BN, BK), dtype=tl.float32)
                for r0 in tl.range(r_lo, r_hi, BR, num_stages=STAGES):
                    rows, inr, live = _live_rows(code_ptr, r0, r_hi, BR)
                    p = tl.load(dh_ptr + rows[:, None] * N + (n * BN + nn)[None, :], mask=live[:, None], other=0.0)
                    q = tl.load(x_ptr + rows[:, None] * H + kcols[None, :], mask=live[:, None], other=0.0)
                    dw = _mma(p.T, q, dw, UPCAST)
                _store_w(dw13_ptr, dw, e, n * BN, k * BK, N, H, BN, BK, TMA_STORE)


def _descs(w: torch.Tensor, dw: torch.Tensor, block: list[int], tma_store: bool):
    """The weights' and gradients' [L NR, NC] TMA descriptors on CUDA (the weights by pointers elsewhere)."""
    NC = w.shape[-1]
    wd, dwd = w, dw
    if w.is_cuda:
        from triton.tools.tensor_descriptor import TensorDescriptor

        wd = TensorDescriptor.from_tensor(w.reshape(-1, NC), block)
        if tma_store:
            dwd = TensorDescriptor.from_tensor(dw.view(-1, NC), block)
    return wd, dwd, w.is_cuda, w.is_cuda and tma_store


def dgate_dw2(dO_RH: torch.Tensor, w2_LHI: torch.Tensor, dw2_LHI: torch.Tensor, h_R2I: torch.Tensor,
              clip_R2I: Optional[torch.Tensor], s_R: torch.Tensor, dH_R2I: torch.Tensor, ds_parts: torch.Tensor,
              row_code_R: torch.Tensor, expert_row_L1: torch.Tensor, *, programs: int, limit: Optional[float] = None,
              block_r: int = 64, block_h: int = 128, block_i: int = 64, stages: int = 3, num_warps: int = 8,
              tma_store: bool = True) -> None:
    """dgate and dW2 in one pass over W2 (contiguous [L, H, I]): dH (bf16 [R, 2I]), the router-weight gradient's
    partial sums ``ds_parts`` (fp32 [R, I / block_i]; :func:`~mok_kernels.mok_hopper.ops.bwd_gemm.router_grad` sums
    them) and dW2 (bf16 [L, H, I]), from the dO rows, the saved H (and clamp decisions, with ``limit``) and the router
    weights ``s_R``. Rows outside every expert's range are not written."""
    R, H = dO_RH.shape
    L, _, I = w2_LHI.shape
    assert w2_LHI.is_contiguous() and dw2_LHI.shape == w2_LHI.shape and dH_R2I.shape == (R, 2 * I)
    assert H % block_h == 0 and I % block_i == 0 and ds_parts.shape == (R, I // block_i)
    w, dw, wtma, tstore = _descs(w2_LHI, dw2_LHI, [block_h, block_i], tma_store)
    clip = clip_R2I if limit is not None else dH_R2I
    _dgate_dw2_kernel[(programs,)](
        dO_RH, w, dw, h_R2I, clip, s_R, dH_R2I, ds_parts, row_code_R, expert_row_L1, H, I, L,
        0.0 if limit is None else float(limit), BR=block_r, BH=block_h, BI=block_i, NUM_PROGS=programs,
        UPCAST=INTERPRET, STAGES=stages, HAS_LIMIT=limit is not None, WTMA=wtma, TMA_STORE=tstore,
        num_warps=num_warps)


def dx_dw13(dH_R2I: torch.Tensor, x_RH: torch.Tensor, w13_LNH: torch.Tensor, dw13_LNH: torch.Tensor,
            out: torch.Tensor, row_code_R: torch.Tensor, expert_row_L1: torch.Tensor, *, programs: int,
            push_delta: Optional[torch.Tensor] = None, slots_per_rank: Optional[int] = None, block_r: int = 64,
            block_n: int = 128, block_k: int = 128, stages: int = 3, num_warps: int = 8,
            tma_store: bool = True) -> None:
    """dX and dW13 in one pass over W13 (contiguous [L, 2I, H]): each row's dX (bf16 [H]) pushed to row
    ``row_code_R[r]`` of ``out`` (padding rows nowhere; with ``push_delta`` / ``slots_per_rank``, to slot
    code % TK of rank code // TK's copy, as :func:`~mok_kernels.mok_hopper.ops.bwd_gemm.bwd_rows` pushes, through its
    epilogue; the tests run this kernel on one rank only), and dW13 (bf16 [L, 2I, H]) = dH rows^T @ X rows per
    expert."""
    R, N = dH_R2I.shape
    L, _, H = w13_LNH.shape
    assert w13_LNH.is_contiguous() and dw13_LNH.shape == w13_LNH.shape and x_RH.shape == (R, H)
    assert N % block_n == 0 and H % block_k == 0 and w13_LNH.shape[1] == N
    if push_delta is None:  # one rank: slots of ``out`` itself
        delta, tk = torch.zeros(1, dtype=torch.int64, device=out.device), 1 << 30
    else:
        delta, tk = push_delta, slots_per_rank
    w, dw, wtma, tstore = _descs(w13_LNH, dw13_LNH, [block_n, block_k], tma_store)
    _dx_dw13_kernel[(programs,)](
        dH_R2I, x_RH, w, dw, out, row_code_R, delta, expert_row_L1, H, N, L, tk, BR=block_r, BN=block_n,
        BK=block_k, NUM_PROGS=programs, UPCAST=INTERPRET, STAGES=stages, WTMA=wtma, TMA_STORE=tstore,
        num_warps=num_warps)
