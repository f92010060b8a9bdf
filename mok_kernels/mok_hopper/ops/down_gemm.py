"""The grouped down GEMM x router weight + push combine: each output row stored as bf16 into its source rank's
combine buffer (slot t*K + k)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mok_kernels.mok_hopper.ops.gemm_common import _ld_a, _ld_w, _mm, _mma, _operand, _tail_rows, _weights, _work_tile
from mok_kernels.mok_hopper.ops.interp import INTERPRET
from mok_kernels.mok_hopper.tiles import TileConfig

@triton.jit
def _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row_end, n, e_tile,
               n_rows, H, I, TK, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
               APPLY_W: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
               WB: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False, PAIR: tl.constexpr = False):
    """One work item: rows [row0, min(row0 + BM, row_end)) x output columns [n*BN, (n+1)*BN) of expert ``e_tile``,
    pushed (rows from row_end on belong to the next tile: computed, not stored). TAIL > 0 (bf16): also the TAIL
    rows after those, as W @ h^T with the rows in N, off the same weight tiles (see ``_up_item``). PAIR (fp8):
    each loop step runs two BK-deep blocks, each promoted by its own scales: the same products added in the same
    order as in BK-deep steps, in half as many loop steps (``TileConfig.fp8_down_pair``)."""
    e = e_tile.to(tl.int64)
    rows32 = row0 + tl.arange(0, BM)
    rows = rows32.to(tl.int64)
    rmask = (rows < n_rows) & (rows32 < row_end)
    cols = n * BN + tl.arange(0, BN)
    if WT:  # rows of the tiled weights (see _up_item)
        a_at = row0
        b_at = (e_tile * (H // BN) + n) * (I // BK) * BN
    elif TMA:  # block coordinates
        a_at = row0
        b_at = e_tile * H + n * BN
    else:  # pointers
        kk = tl.arange(0, BK)
        a_at = h_ptr + rows[:, None] * I + kk[None, :]
        b_at = w_ptr + e * H * I + cols[None, :].to(tl.int64) * I + kk[:, None]  # [BK, BN] view of W2^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TAIL > 0:  # bf16 only (TileConfig.for_fp8 turns tails off)
        rows_t32, rmask_t, t_at = _tail_rows(h_ptr, row0, row_end, n_rows, I, BM, BK, TAIL, TMA)
        acc_t = tl.zeros((BN, TAIL), dtype=tl.float32)
    for k0 in tl.range(0, I, 2 * BK if PAIR else BK, num_stages=STAGES):
        a = _ld_a(h_ptr, a_at, k0, rmask, TMA)
        if TAIL > 0:
            at = _ld_a(h_tail, t_at, k0, rmask_t, TMA).T  # [BK, TAIL]
        b = _ld_w(w_ptr, b_at, k0, TMA, WT)
        if FP8:
            acc += _fp8_block(a, b, hs_ptr, ws_ptr, rows, rmask, e, n, k0, H, I, BN, BK, WB, UPCAST)
            if PAIR:  # the second BK-deep block of this loop step (the loop steps 2 BK), promoted by its own scales
                acc += _fp8_block(_ld_a(h_ptr, a_at, k0 + BK, rmask, TMA), _ld_w(w_ptr, b_at, k0 + BK, TMA, WT),
                                  hs_ptr, ws_ptr, rows, rmask, e, n, k0 + BK, H, I, BN, BK, WB, UPCAST)
        else:
            acc = _mma(a, b, acc, UPCAST)
        if TAIL > 0:
            acc_t = _mma(b.T, at, acc_t, UPCAST)
    if TAIL > 0:
        _down_store(acc_t.T, rows_t32, rmask_t, cols, code_ptr, rw_ptr, out_ref, out_delta, H, TK, APPLY_W)
    _down_store(acc, rows32, rmask, cols, code_ptr, rw_ptr, out_ref, out_delta, H, TK, APPLY_W)


@triton.jit
def _fp8_block(a, b, hs_ptr, ws_ptr, rows, rmask, e, n, k0, H, I, BN: tl.constexpr, BK: tl.constexpr,
               WB: tl.constexpr, UPCAST: tl.constexpr):
    """The fp8 product of the BK-deep block at depth k0, promoted: h scales are 1 x BK (the up GEMM's column
    tile), weight scales 128 x 128."""
    sa = tl.load(hs_ptr + rows * (I // BK) + k0 // BK, mask=rmask, other=0.0)
    sb = tl.load(ws_ptr + e * (H // WB) * (I // WB) + ((n * BN) // WB) * (I // WB) + k0 // WB)
    return _mm(a, b, UPCAST) * (sa[:, None] * sb)


@triton.jit
def _down_store(acc, rows32, rmask, cols, code_ptr, rw_ptr, out_ref, out_delta, H, TK, APPLY_W: tl.constexpr):
    """Push rows ``rows32`` (x their router weight with APPLY_W) as bf16 into their source ranks' combine buffers."""
    code = tl.load(code_ptr + rows32, mask=rmask, other=-1)
    valid = code >= 0
    c = tl.where(valid, code, 0)
    if APPLY_W:
        acc = acc * tl.load(rw_ptr + rows32, mask=valid, other=0.0)[:, None]
    src = c // TK
    slot = (c % TK).to(tl.int64)
    d = tl.multiple_of(tl.load(out_delta + src, mask=valid, other=0), 16)
    tl.store(out_ref + (d + slot * H)[:, None] + cols[None, :], acc.to(tl.bfloat16), mask=valid[:, None])


@triton.jit
def _down_tile(h_ptr, h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
               e_tile, n_rows, H, I, TK, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
               APPLY_W: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
               WB: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False,
               PAIR: tl.constexpr = False, SPLIT: tl.constexpr = False, PACKED: tl.constexpr = False):
    """The item of one row tile: a BM/2-row MMA for a half tile (HALF; PACKED: a tile of at most BM/2 rows), else BM
    rows; TAIL: as in ``_up_tile``. SPLIT (HALF, no TAIL): every tile as BM/2-row items, a full tile as two (its
    weight blocks read twice), so the kernel holds a BM/2-row accumulator only (``TileConfig.down_halves``)."""
    if SPLIT:
        _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                   e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT, PAIR)
        if row1 - row0 > BM // 2:
            _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0 + BM // 2,
                       row1, n, e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0,
                       WT, PAIR)
    elif TAIL > 0:
        size = row1 - row0
        if size % (BM // 2) != 0:
            if size < BM:
                _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1,
                           n, e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES,
                           TMA, WB, TAIL, WT, PAIR)
            else:
                _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1,
                           n, e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES,
                           TMA, WB, TAIL, WT, PAIR)
        elif size < BM:
            _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT, PAIR)
        else:
            _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT, PAIR)
    elif HALF:
        if (row1 - row0 <= BM // 2) if PACKED else (row1 - row0 < BM):
            _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT, PAIR)
        else:
            _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT, PAIR)
    else:
        _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                   e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT, PAIR)


@triton.jit
def _down_push_kernel(h_ptr, h_half, h_tail, hs_ptr, w_ptr, ws_ptr, tile_expert_ptr, tile_row_ptr, chunk_ptr, code_ptr,
                      rw_ptr, out_ref, out_delta, n_rows, H, I, TK,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
                      APPLY_W: tl.constexpr, NUM_PROGS: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                      GROUP_M: tl.constexpr, TMA: tl.constexpr = False, HALF: tl.constexpr = False,
                      WB: tl.constexpr = 128, FLAT: tl.constexpr = False, TAIL: tl.constexpr = 0,
                      WT: tl.constexpr = False, PAIR: tl.constexpr = False, SPLIT: tl.constexpr = False,
                      PACKED: tl.constexpr = False):
    """TMA: ``h_ptr`` / ``h_half`` / ``h_tail`` / ``w_ptr`` are TMA descriptors over h [R, I] (blocks [BM, BK],
    [BM/2, BK] and [TAIL, BK]) and W2 [L*H, I] (blocks [BN, BK]; WT: W2 from :func:`tile_weights`, a
    [L*H*I/BK, BK] view); otherwise pointers. HALF, TAIL: as in the up kernel. FLAT: one flattened loop nest
    (items x K steps, pipelined across items); every tile runs BM rows, a half tile's rows past its end are
    computed and not stored. Otherwise static round robin over the items; SPLIT, PACKED: see ``_down_tile``."""
    m_lo = tl.load(chunk_ptr)
    m_hi = tl.load(chunk_ptr + 1)
    n_n = H // BN
    n_work = (m_hi - m_lo) * n_n
    if FLAT:
        for wk in tl.range(tl.program_id(0), n_work, NUM_PROGS, flatten=True):
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT, PAIR)
    else:
        for wk in range(tl.program_id(0), n_work, NUM_PROGS):
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            _down_tile(h_ptr, h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1,
                       n, e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES,
                       TMA, WB, HALF, TAIL, WT, PAIR, SPLIT, PACKED)


def down_push(h_RI: torch.Tensor, h_scale: Optional[torch.Tensor], w2_LHI: torch.Tensor,
              w2_scale: Optional[torch.Tensor], tile_expert_M: torch.Tensor, tile_row_M1: torch.Tensor,
              chunk_2: torch.Tensor, code_R: torch.Tensor, rw_R: Optional[torch.Tensor], out_ref: torch.Tensor,
              out_delta_P: torch.Tensor, *, slots_per_rank: int, cfg: TileConfig, programs: int,
              n_rows: Optional[int] = None) -> None:
    """y = h @ down^T (x router weight) stored as bf16 at row ``slot`` of rank ``src``'s copy of ``out_ref``
    (row code = src * slots_per_rank + slot; ``out_delta_P`` locates every rank's copy). Tiles as in
    :func:`up_swiglu`."""
    R, I = h_RI.shape
    fp8 = h_RI.dtype == torch.float8_e4m3fn
    bm, bn, bk = cfg.block_m, cfg.down_n, cfg.down_k
    H, I_w = _weights(w2_LHI, bn, bk, cfg.w_tiled)
    assert I_w == I, "w2 must be [L, H, I] (or tiled)"
    assert H % bn == 0 and I % bk == 0, f"hidden {H} / ffn {I} must be multiples of the tile ({bn}, {bk})"
    if fp8:
        assert 128 % bn == 0 and h_scale.shape[1] == I // bk, "fp8 down: BK must be the hidden-activation block, " \
                                                             "BN divide 128"
        assert not cfg.fp8_down_pair or I % (2 * bk) == 0, f"fp8_down_pair: ffn {I} must be a multiple of 2 BK"
    tail = cfg.tail_rows
    assert not (tail and fp8), "tails are bf16 only (TileConfig.for_fp8 turns them off)"
    _down_push_kernel[(programs,)](
        _operand(h_RI, [bm, bk], cfg.tma), _operand(h_RI, [bm // 2, bk], cfg.tma and cfg.half_tiles),
        _operand(h_RI, [tail, bk], cfg.tma and tail > 0),
        h_scale if fp8 else h_RI, _operand(w2_LHI, [bn, bk], cfg.tma),
        w2_scale if fp8 else w2_LHI, tile_expert_M, tile_row_M1, chunk_2, code_R,
        rw_R if rw_R is not None else h_RI, out_ref, out_delta_P, R if n_rows is None else n_rows, H, I,
        slots_per_rank,
        BM=bm, BN=bn, BK=bk, FP8=fp8, APPLY_W=rw_R is not None, NUM_PROGS=programs, UPCAST=INTERPRET,
        STAGES=cfg.down_stages, GROUP_M=cfg.group_m, TMA=cfg.tma, HALF=cfg.half_tiles, FLAT=cfg.flat_down,
        TAIL=tail, WT=cfg.w_tiled, PAIR=fp8 and cfg.fp8_down_pair, SPLIT=cfg.down_halves, num_warps=cfg.down_warps,
        **({"PACKED": True} if cfg.packed_rows else {}),
        **({"maxnreg": cfg.down_maxnreg} if cfg.down_maxnreg and not INTERPRET else {}))
