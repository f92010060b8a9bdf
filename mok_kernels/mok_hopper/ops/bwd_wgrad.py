"""The bf16 backward's weight gradients (beside :mod:`mok_kernels.mok_hopper.ops.bwd_gemm`'s other GEMMs; launched by
:mod:`mok_kernels.mok_hopper.train`; versions and measurements in the journal, lab/perf-notes.md: the bf16 backward).

* :func:`bwd_wgrad` - dW[e] = P_e^T @ Q_e, each expert's rows in schedule order (no split-K, no atomics: bitwise
  deterministic): dW13 (P = dH, Q = X rows) and dW2 (P = dO rows, or dO by token, Q = s*A); padding rows (code <
  0) add nothing. Optionally stored by TMA (asynchronous). With P resident (:func:`_bwd_wgrad_resident_kernel`),
  an expert's strips run over as few rows as the launch allows (``block_r_small`` / ``block_r_tail``), and a
  launch may take only the experts above or up to a row count (``rows_min`` / ``rows_max``: two launches with
  their own blocks).
* :func:`expert_rows` - each local expert's first row in the schedule, on the device.

Legend: R routed rows, M row tiles, L local experts, N and K the gradient's two dimensions.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mok_kernels.mok_hopper.ops.gemm_common import _gather_rows, _mma, _tiled_offset
from mok_kernels.mok_hopper.ops.interp import INTERPRET


@triton.jit
def _bwd_wgrad_kernel(p_ptr, q_ptr, dw_ptr, code_ptr, expert_row_ptr, N, K, L,
                      BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, NUM_PROGS: tl.constexpr,
                      UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA_STORE: tl.constexpr = False,
                      TBN: tl.constexpr = 0, TBK: tl.constexpr = 0, GU: tl.constexpr = False):
    """Work items (expert, column block of N, column block of K), expert-major, K fastest: programs running together
    share one expert's P and Q rows (from L2). The item loop is flattened with its row loop, so the next item's
    loads are issued during this item's store. TMA_STORE: ``dw_ptr`` is a TMA descriptor over dW's [L N, K] view
    (blocks [BN, BK]): the store is asynchronous."""
    n_n = N // BN
    n_k = K // BK
    n_work = L * n_n * n_k
    for wk in tl.range(tl.program_id(0), n_work, NUM_PROGS, flatten=True):
        e = wk // (n_n * n_k)
        n = (wk // n_k) % n_n
        k = wk % n_k
        r_lo = tl.load(expert_row_ptr + e)
        r_hi = tl.load(expert_row_ptr + e + 1)
        ncols = n * BN + tl.arange(0, BN)
        kcols = k * BK + tl.arange(0, BK)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for r0 in tl.range(r_lo, r_hi, BR, num_stages=STAGES):
            rows = (r0 + tl.arange(0, BR)).to(tl.int64)
            _, live = _gather_rows(code_ptr, rows, rows < r_hi, 0, True)  # padding rows: 0
            p = tl.load(p_ptr + rows[:, None] * N + ncols[None, :], mask=live[:, None], other=0.0)  # [BR, BN]
            q = tl.load(q_ptr + rows[:, None] * K + kcols[None, :], mask=live[:, None], other=0.0)  # [BR, BK]
            acc = _mma(p.T, q, acc, UPCAST)
        _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE, TBN, TBK, GU)


@triton.jit
def _store_dw(dw_ptr, acc, e, n, k, N, K, BN: tl.constexpr, BK: tl.constexpr, TMA_STORE: tl.constexpr,
              TBN: tl.constexpr = 0, TBK: tl.constexpr = 0, GU: tl.constexpr = False):
    """dW[e] block (n, k) = acc, by TMA (``dw_ptr`` a descriptor over [L N, K], blocks [BN, BK]) or pointers; TBN
    > 0: dW in the forward's TMA block order (:func:`_tiled_offset`), by pointers."""
    if TMA_STORE:
        dw_ptr.store([e * N + n * BN, k * BK], acc.to(dw_ptr.dtype))
    elif TBN > 0:
        ncols = (n * BN + tl.arange(0, BN)).to(tl.int64)
        kcols = (k * BK + tl.arange(0, BK)).to(tl.int64)
        off = _tiled_offset(e.to(tl.int64), ncols[:, None], kcols[None, :], N, K, TBN, TBK, GU)
        tl.store(dw_ptr + off, acc.to(dw_ptr.dtype.element_ty))
    else:
        ncols = n * BN + tl.arange(0, BN)
        kcols = k * BK + tl.arange(0, BK)
        tl.store(dw_ptr + e.to(tl.int64) * N * K + ncols[:, None].to(tl.int64) * K + kcols[None, :],
                 acc.to(dw_ptr.dtype.element_ty))


@triton.jit
def _bwd_wgrad_resident_kernel(p_ptr, q_ptr, dw_ptr, code_ptr, expert_row_ptr, N, K, L,
                               BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, NUM_PROGS: tl.constexpr,
                               UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA_STORE: tl.constexpr = False,
                               TBN: tl.constexpr = 0, TBK: tl.constexpr = 0, GU: tl.constexpr = False,
                               Q_RESIDENT: tl.constexpr = False, BR_SMALL: tl.constexpr = 0,
                               BR_TAIL: tl.constexpr = 0, P_GATHER: tl.constexpr = 0, ROWS_MIN: tl.constexpr = -1,
                               ROWS_MAX: tl.constexpr = -1):
    """The weight gradients with P resident: work items (expert, column block of N), each a strip of dW[e]
    [BN, K]. An expert of at most BR rows (every published shape at EP=1: 32-64 rows) loads its P block once and
    streams its Q blocks, one output block per K step (P read once per strip instead of once per output block);
    a larger expert reads P again for every K block (the rows loop inside). Same sums, same order, as
    :func:`_bwd_wgrad_kernel`: one row step, or the row steps ascending. ``Q_RESIDENT``: the other way round
    (:func:`_bwd_wgrad_q_resident`), the same sums. ``BR_SMALL``: an expert of at most BR_SMALL rows
    takes a strip over BR_SMALL rows instead (:func:`_resident_strip`): the rows past an expert's end are zeros in
    both operands, so its sums are those over BR rows, with half the MMA (or less) a stored block. ``BR_TAIL``: an
    expert of at most BR_SMALL + BR_TAIL rows takes strips over its first BR_SMALL rows and the BR_TAIL after them
    (two MMAs into one accumulator, in the rows' order: the sums of one MMA over BR rows). BR_SMALL may equal BR,
    and BR_SMALL + BR_TAIL exceed it: then the experts of BR to BR + BR_TAIL rows keep P resident too. P_GATHER
    (the top-k K; not with Q_RESIDENT): ``p_ptr`` is per token, row r's P row token ``code[r] // K``. ROWS_MIN
    (ROWS_MAX; at most one of them, not with Q_RESIDENT): the launch leaves out the experts of at most ROWS_MIN
    rows (of more than ROWS_MAX): two launches, one with each at the same bound, cover every expert once, each with
    its own blocks."""
    if Q_RESIDENT:
        _bwd_wgrad_q_resident(p_ptr, q_ptr, dw_ptr, code_ptr, expert_row_ptr, N, K, L, BN, BK, BR, NUM_PROGS, UPCAST,
                              STAGES, TMA_STORE, TBN, TBK, GU)
        return
    n_n = N // BN
    for wk in range(tl.program_id(0), L * n_n, NUM_PROGS):
        e = wk // n_n
        n = wk % n_n
        r_lo = tl.load(expert_row_ptr + e)
        r_hi = tl.load(expert_row_ptr + e + 1)
        if ROWS_MIN >= 0:
            if r_hi - r_lo > ROWS_MIN:
                _resident_item(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN, BK, BR, UPCAST, STAGES,
                               TMA_STORE, TBN, TBK, GU, BR_SMALL, BR_TAIL, P_GATHER)
        elif ROWS_MAX >= 0:
            if r_hi - r_lo <= ROWS_MAX:
                _resident_item(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN, BK, BR, UPCAST, STAGES,
                               TMA_STORE, TBN, TBK, GU, BR_SMALL, BR_TAIL, P_GATHER)
        else:
            _resident_item(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN, BK, BR, UPCAST, STAGES,
                           TMA_STORE, TBN, TBK, GU, BR_SMALL, BR_TAIL, P_GATHER)


@triton.jit
def _resident_item(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN: tl.constexpr, BK: tl.constexpr,
                   BR: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA_STORE: tl.constexpr,
                   TBN: tl.constexpr, TBK: tl.constexpr, GU: tl.constexpr, BR_SMALL: tl.constexpr,
                   BR_TAIL: tl.constexpr, P_GATHER: tl.constexpr):
    """One work item of :func:`_bwd_wgrad_resident_kernel` (P resident): the strip dW[e][n BN : (n + 1) BN, :]."""
    n_k = K // BK
    ncols = n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    if BR_SMALL > 0 and r_hi - r_lo <= BR_SMALL:
        _resident_strip(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN, BK, BR_SMALL, 0, UPCAST,
                        STAGES, TMA_STORE, TBN, TBK, GU, P_GATHER)
    elif BR_TAIL > 0 and r_hi - r_lo <= BR_SMALL + BR_TAIL:
        _resident_strip(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN, BK, BR_SMALL, BR_TAIL, UPCAST,
                        STAGES, TMA_STORE, TBN, TBK, GU, P_GATHER)
    elif r_hi - r_lo <= BR:
        _resident_strip(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN, BK, BR, 0, UPCAST, STAGES,
                        TMA_STORE, TBN, TBK, GU, P_GATHER)
    else:
        for k in range(0, n_k):
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            for r0 in tl.range(r_lo, r_hi, BR, num_stages=STAGES):
                rows = (r0 + tl.arange(0, BR)).to(tl.int64)
                p_rows, live = _gather_rows(code_ptr, rows, rows < r_hi, P_GATHER, True)
                p = tl.load(p_ptr + p_rows[:, None] * N + ncols[None, :], mask=live[:, None], other=0.0)
                q = tl.load(q_ptr + rows[:, None] * K + (k * BK + kk)[None, :], mask=live[:, None], other=0.0)
                acc = _mma(p.T, q, acc, UPCAST)
            _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE, TBN, TBK, GU)


@triton.jit
def _resident_strip(p_ptr, q_ptr, dw_ptr, code_ptr, e, n, r_lo, r_hi, N, K, BN: tl.constexpr, BK: tl.constexpr,
                    RB: tl.constexpr, RB1: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                    TMA_STORE: tl.constexpr, TBN: tl.constexpr, TBK: tl.constexpr, GU: tl.constexpr,
                    P_GATHER: tl.constexpr = 0):
    """One strip dW[e][n BN : (n + 1) BN, :] of an expert of at most RB + RB1 rows: its P block [RB, BN] (and
    [RB1, BN] after it) loaded once, its Q blocks [RB, BK] (and [RB1, BK]) streamed, one MMA over RB rows (then
    one over RB1 into the same accumulator) and one stored block a K step. P_GATHER: P's rows by token
    (:func:`_gather_rows`)."""
    n_k = K // BK
    ncols = n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    rows = (r_lo + tl.arange(0, RB)).to(tl.int64)
    p_rows, live = _gather_rows(code_ptr, rows, rows < r_hi, P_GATHER, True)
    p = tl.load(p_ptr + p_rows[:, None] * N + ncols[None, :], mask=live[:, None], other=0.0)  # [RB, BN]
    if RB1 > 0:
        rows1 = (r_lo + RB + tl.arange(0, RB1)).to(tl.int64)
        p_rows1, live1 = _gather_rows(code_ptr, rows1, rows1 < r_hi, P_GATHER, True)
        p1 = tl.load(p_ptr + p_rows1[:, None] * N + ncols[None, :], mask=live1[:, None], other=0.0)  # [RB1, BN]
    for k in tl.range(0, n_k, num_stages=STAGES):
        q = tl.load(q_ptr + rows[:, None] * K + (k * BK + kk)[None, :], mask=live[:, None], other=0.0)
        acc = _mma(p.T, q, tl.zeros((BN, BK), dtype=tl.float32), UPCAST)
        if RB1 > 0:
            q1 = tl.load(q_ptr + rows1[:, None] * K + (k * BK + kk)[None, :], mask=live1[:, None], other=0.0)
            acc = _mma(p1.T, q1, acc, UPCAST)
        _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE, TBN, TBK, GU)


@triton.jit
def _bwd_wgrad_q_resident(p_ptr, q_ptr, dw_ptr, code_ptr, expert_row_ptr, N, K, L, BN: tl.constexpr,
                          BK: tl.constexpr, BR: tl.constexpr, NUM_PROGS: tl.constexpr, UPCAST: tl.constexpr,
                          STAGES: tl.constexpr, TMA_STORE: tl.constexpr, TBN: tl.constexpr, TBK: tl.constexpr,
                          GU: tl.constexpr):
    """Q resident: work items (expert, column block of K), each a strip of dW[e] [N, BK], its Q block loaded once and
    its P blocks streamed, one output block per N step. Programs running together hold neighbouring K blocks of one
    expert, so at any moment they write neighbouring column blocks of the same rows (the store probe,
    lab/probes/wgrad_store_probe.py: the P-resident strips write one column band of many rows at a time,
    which HBM takes more slowly). Each output block is the same sum, in the same order, as the P-resident kernel's."""
    n_n = N // BN
    n_k = K // BK
    for wk in range(tl.program_id(0), L * n_k, NUM_PROGS):
        e = wk // n_k
        k = wk % n_k
        r_lo = tl.load(expert_row_ptr + e)
        r_hi = tl.load(expert_row_ptr + e + 1)
        kcols = k * BK + tl.arange(0, BK)
        nn = tl.arange(0, BN)
        if r_hi - r_lo <= BR:
            rows = (r_lo + tl.arange(0, BR)).to(tl.int64)
            _, live = _gather_rows(code_ptr, rows, rows < r_hi, 0, True)
            q = tl.load(q_ptr + rows[:, None] * K + kcols[None, :], mask=live[:, None], other=0.0)  # [BR, BK]
            for n in tl.range(0, n_n, num_stages=STAGES):
                p = tl.load(p_ptr + rows[:, None] * N + (n * BN + nn)[None, :], mask=live[:, None], other=0.0)
                acc = _mma(p.T, q, tl.zeros((BN, BK), dtype=tl.float32), UPCAST)
                _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE, TBN, TBK, GU)
        else:
            for n in range(0, n_n):
                acc = tl.zeros((BN, BK), dtype=tl.float32)
                for r0 in tl.range(r_lo, r_hi, BR, num_stages=STAGES):
                    rows = (r0 + tl.arange(0, BR)).to(tl.int64)
                    _, live = _gather_rows(code_ptr, rows, rows < r_hi, 0, True)
                    p = tl.load(p_ptr + rows[:, None] * N + (n * BN + nn)[None, :], mask=live[:, None], other=0.0)
                    q = tl.load(q_ptr + rows[:, None] * K + kcols[None, :], mask=live[:, None], other=0.0)
                    acc = _mma(p.T, q, acc, UPCAST)
                _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE, TBN, TBK, GU)


def expert_rows(tile_expert_M: torch.Tensor, tile_row_M1: torch.Tensor, local_experts: int) -> torch.Tensor:
    """int32 [L+1]: the first row of each local expert's tiles (and the end of the last), from the schedule's tile
    tables on the device (no host sync). An expert without rows gets an empty range."""
    first = torch.searchsorted(tile_expert_M.contiguous(),
                               torch.arange(local_experts + 1, device=tile_expert_M.device, dtype=torch.int32))
    return tile_row_M1.index_select(0, first.clamp(max=tile_row_M1.numel() - 1)).to(torch.int32)


def bwd_wgrad(p_RN: torch.Tensor, q_RK: torch.Tensor, dw_LNK: torch.Tensor, row_code_R: torch.Tensor,
              expert_row_L1: torch.Tensor, *, programs: int, block_n: int = 128, block_k: int = 128,
              block_r: int = 64, stages: int = 3, num_warps: int = 8, tma_store: bool = False,
              resident: bool = False, q_resident: bool = False, block_r_small: int = 0, block_r_tail: int = 0,
              dw_tiles: Optional[tuple[int, int, bool]] = None, p_gather_k: int = 0, rows_min: int = -1,
              rows_max: int = -1) -> None:
    """dw[e] = p[rows of e]^T @ q[rows of e] (fp32 accumulation, the rows in schedule order; rows whose code is
    negative are padding and add nothing). ``dw`` [L, N, K] (bf16, or fp32 for a main-grad accumulator).
    ``resident``: one work item per (expert, N block), P loaded once for the strip where the expert has at most
    ``block_r`` rows (:func:`_bwd_wgrad_resident_kernel`); the same sums in the same order; with ``q_resident``
    the Q block is the one loaded once, per (expert, K block); with ``block_r_small`` (P resident) an expert of at
    most that many rows runs its strips over ``block_r_small`` rows, and with ``block_r_tail`` one of at most
    ``block_r_small + block_r_tail`` rows over two row blocks of those sizes (the same sums). ``block_r_small`` over
    ``block_r`` turns both off; equal to it, only the two-block path is on (experts of ``block_r`` to
    ``block_r + block_r_tail`` rows, which would otherwise reload P at every K block). ``dw_tiles`` (bn, bk,
    gate/up interleaved): ``dw`` is in the forward's TMA block order (the layout of tiled parameters), stored by
    pointers. ``p_gather_k`` (the top-k K; P resident, not ``q_resident``): ``p`` is per token ([T, N]) and row r
    reads token ``row_code[r] // p_gather_k`` (the output gradient's rows gathered in the kernel). ``rows_min``
    (``rows_max``; P resident, not ``q_resident``, one of the two): only the experts of more than ``rows_min`` rows
    (of at most ``rows_max``); the others' blocks of ``dw`` are left as they are, for a second launch."""
    N = p_RN.shape[1]
    R = q_RK.shape[0]
    K = q_RK.shape[1]
    assert not p_gather_k or (resident and not q_resident), "P is gathered by the P-resident kernel only"
    L = dw_LNK.shape[0]
    assert dw_LNK.numel() == L * N * K and (p_gather_k or p_RN.shape[0] == R)
    assert dw_tiles is not None or dw_LNK.shape == (L, N, K)
    tma_store = tma_store and dw_tiles is None
    assert N % block_n == 0 and K % block_k == 0, f"N {N} / K {K} must be multiples of ({block_n}, {block_k})"
    dw = dw_LNK
    if tma_store:
        from triton.tools.tensor_descriptor import TensorDescriptor

        dw = TensorDescriptor.from_tensor(dw_LNK.view(-1, K), [block_n, block_k])
    kernel = _bwd_wgrad_resident_kernel if resident or q_resident else _bwd_wgrad_kernel
    extra = dict(Q_RESIDENT=True) if q_resident else {}
    if p_gather_k:
        extra["P_GATHER"] = p_gather_k
    if rows_min >= 0 or rows_max >= 0:
        assert resident and not q_resident and (rows_min < 0 or rows_max < 0), "one row bound, P resident"
        extra["ROWS_MIN" if rows_min >= 0 else "ROWS_MAX"] = max(rows_min, rows_max)
    if 0 < block_r_small <= block_r and resident and not q_resident:
        if block_r_small < block_r:
            extra["BR_SMALL"] = block_r_small
        if 0 < block_r_tail and block_r_small + block_r_tail != block_r:
            extra.update(BR_SMALL=block_r_small, BR_TAIL=block_r_tail)
    kernel[(programs,)](p_RN, q_RK, dw, row_code_R, expert_row_L1, N, K, L, BN=block_n, BK=block_k, BR=block_r,
                        NUM_PROGS=programs, UPCAST=INTERPRET, STAGES=stages, TMA_STORE=tma_store,
                        TBN=dw_tiles[0] if dw_tiles else 0, TBK=dw_tiles[1] if dw_tiles else 0,
                        GU=bool(dw_tiles and dw_tiles[2]), num_warps=num_warps, **extra)
