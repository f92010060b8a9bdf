"""The grouped gate/up GEMM + SwiGLU (+ fp8 quantisation of the hidden activations): persistent programs over
(row tile, column tile) work items, each row tile's rows waited for on the pull's ready counters."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from contract.fp8 import FP8_MAX
from mok_kernels.mok_hopper.ops.gemm_common import (_ld_a, _ld_w, _mm, _mma, _operand, _quant_e4m3, _tail_rows,
                                                _wait_rows, _wait_rows_packed, _weights, _work_tile)
from mok_kernels.mok_hopper.ops.interp import INTERPRET
from mok_kernels.mok_hopper.tiles import TileConfig, h_save_by_tma, ready_granule

@triton.jit
def _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row_end, n, e_tile, n_rows, H, I, limit,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr, HAS_LIMIT: tl.constexpr,
             UPCAST: tl.constexpr, STAGES: tl.constexpr, FP8_MAX_: tl.constexpr, TMA: tl.constexpr,
             WB: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False, hsv_ptr=None, clip_ptr=None,
             SAVE_H: tl.constexpr = False, PAIR: tl.constexpr = False, HSV_TMA: tl.constexpr = False):
    """One work item: rows [row0, min(row0 + BM, row_end)) x hidden columns [n*BN, (n+1)*BN) of expert ``e_tile``
    (rows from row_end on belong to the next tile: computed, not stored). TAIL > 0 (bf16): also the TAIL rows
    after those (``a_tail``: their TMA descriptor), as W @ A^T with the rows in N, off the same weight tiles.
    WT: 0 row-major weights, 1 tiled (:func:`tile_weights`), 2 (bf16) tiled with gate and up rows interleaved
    (:func:`tile_weights_gu`): one [2BN, BK] block and one MMA of N = 2BN per K step, split into gate and up after
    the loop; 3 (bf16, TMA) row-major weights seen as [L, I, 2, H] (``TileConfig.up_stacked``): a [BN, 2, BK] box
    holds the gate and up blocks of a K step interleaved row by row, as one block of WT 2. SAVE_H: also the
    pre-SwiGLU H of every stored row (see ``_up_store``). PAIR (fp8): each loop step runs two BK-deep blocks, each
    promoted by its own scales: the same products added in the same order, in half as many loop steps
    (``TileConfig.fp8_up_pair``)."""
    e = e_tile.to(tl.int64)
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    rmask = (rows < n_rows) & (rows < row_end)
    cols = n * BN + tl.arange(0, BN)
    if WT == 2:  # rows of tile_weights_gu: H // BK blocks of 2BN rows per (expert, column tile)
        a_at = row0
        g_at = (e_tile * (I // BN) + n) * (H // BK) * (2 * BN)
    elif WT == 3:  # plain W13 seen as [L, I, 2, H] (gate row i, then up row i, at [e, i, 0 / 1, :])
        a_at = row0
        g_at = e_tile
    elif WT:  # rows of the tiled weights (tile_weights): H // BK blocks of BN rows per (expert, row tile)
        a_at = row0
        g_at = (e_tile * (2 * I // BN) + n) * (H // BK) * BN
        u_at = g_at + (I // BN) * (H // BK) * BN
    elif TMA:  # block coordinates
        a_at = row0
        g_at = e_tile * 2 * I + n * BN
        u_at = g_at + I
    else:  # pointers
        kk = tl.arange(0, BK)
        a_at = a_ptr + rows[:, None] * H + kk[None, :]
        g_at = w_ptr + e * 2 * I * H + cols[None, :].to(tl.int64) * H + kk[:, None]  # [BK, BN] view of W^T
        u_at = g_at + I * H
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if WT == 2 and FP8:  # one MMA of N = 2 BN for gate and up (columns g0 u0 g1 u1 ...), promoted per column
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        wsb = ws_ptr + e * (2 * I // WB) * (H // WB)
        is_up = (tl.arange(0, 2 * BN) % 2) == 1
        for k0 in tl.range(0, H, 2 * BK if PAIR else BK, num_stages=STAGES):
            acc += _fp8_gu_block(a_ptr, a_at, as_ptr, w_ptr, g_at, wsb, rows, rmask, is_up, n, k0, H, I, BN, BK, WB,
                                 TMA, WT, UPCAST)
            if PAIR:  # the second BK-deep block of this loop step, promoted by its own scales
                acc += _fp8_gu_block(a_ptr, a_at, as_ptr, w_ptr, g_at, wsb, rows, rmask, is_up, n, k0 + BK, H, I, BN,
                                     BK, WB, TMA, WT, UPCAST)
        acc_g, acc_u = tl.split(acc.reshape(BM, BN, 2))
    elif WT >= 2:  # (bf16: TileConfig) one MMA for gate and up, columns g0 u0 g1 u1 ...: the split costs no move
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        if TAIL > 0:
            rows_t32, rmask_t, t_at = _tail_rows(a_ptr, row0, row_end, n_rows, H, BM, BK, TAIL, TMA)
            acc_t = tl.zeros((2 * BN, TAIL), dtype=tl.float32)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            a = _ld_a(a_ptr, a_at, k0, rmask, TMA)
            if WT == 3:  # [1, BN, 2, BK] -> [BK, 2BN]: a view of the box in shared memory (no tails: TileConfig)
                w = w_ptr.load([g_at, n * BN, 0, k0]).reshape(2 * BN, BK).T
            else:
                w = _ld_w(w_ptr, g_at, k0, TMA, WT)  # [BK, 2BN]
            acc = _mma(a, w, acc, UPCAST)
            if TAIL > 0:
                acc_t = _mma(w.T, _ld_a(a_tail, t_at, k0, rmask_t, TMA).T, acc_t, UPCAST)
        if TAIL > 0:
            t_g, t_u = tl.split(acc_t.T.reshape(TAIL, BN, 2))
            _up_store(t_g, t_u, rows_t32.to(tl.int64), rmask_t, n, h_ptr, hs_ptr, I, limit, BN, FP8, HAS_LIMIT,
                      FP8_MAX_, hsv_ptr, clip_ptr, SAVE_H, row0 + BM)
        acc_g, acc_u = tl.split(acc.reshape(BM, BN, 2))
    elif FP8:  # two MMAs a block, gate and up (fp8_up_fused off)
        wsb = ws_ptr + e * (2 * I // WB) * (H // WB)
        for k0 in tl.range(0, H, 2 * BK if PAIR else BK, num_stages=STAGES):
            g, u = _fp8_g_u_blocks(a_ptr, a_at, as_ptr, w_ptr, g_at, u_at, wsb, rows, rmask, n, k0, H, I, BN, BK, WB,
                                   TMA, WT, UPCAST)
            acc_g += g
            acc_u += u
            if PAIR:  # the second BK-deep block of this loop step
                g, u = _fp8_g_u_blocks(a_ptr, a_at, as_ptr, w_ptr, g_at, u_at, wsb, rows, rmask, n, k0 + BK, H, I, BN,
                                       BK, WB, TMA, WT, UPCAST)
                acc_g += g
                acc_u += u
    else:
        if TAIL > 0:  # bf16 only (TileConfig.for_fp8 turns tails off)
            rows_t32, rmask_t, t_at = _tail_rows(a_ptr, row0, row_end, n_rows, H, BM, BK, TAIL, TMA)
            acc_tg = tl.zeros((BN, TAIL), dtype=tl.float32)
            acc_tu = tl.zeros((BN, TAIL), dtype=tl.float32)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            a = _ld_a(a_ptr, a_at, k0, rmask, TMA)
            if TAIL > 0:  # each weight tile feeds both MMAs
                at = _ld_a(a_tail, t_at, k0, rmask_t, TMA).T  # [BK, TAIL]
                wg = _ld_w(w_ptr, g_at, k0, TMA, WT)
                wu = _ld_w(w_ptr, u_at, k0, TMA, WT)
                acc_g = _mma(a, wg, acc_g, UPCAST)
                acc_u = _mma(a, wu, acc_u, UPCAST)
                acc_tg = _mma(wg.T, at, acc_tg, UPCAST)
                acc_tu = _mma(wu.T, at, acc_tu, UPCAST)
            else:
                acc_g = _mma(a, _ld_w(w_ptr, g_at, k0, TMA, WT), acc_g, UPCAST)
                acc_u = _mma(a, _ld_w(w_ptr, u_at, k0, TMA, WT), acc_u, UPCAST)
        if TAIL > 0:
            _up_store(acc_tg.T, acc_tu.T, rows_t32.to(tl.int64), rmask_t, n, h_ptr, hs_ptr, I, limit, BN, FP8,
                      HAS_LIMIT, FP8_MAX_, hsv_ptr, clip_ptr, SAVE_H, row0 + BM)
    _up_store(acc_g, acc_u, rows, rmask, n, h_ptr, hs_ptr, I, limit, BN, FP8, HAS_LIMIT, FP8_MAX_, hsv_ptr, clip_ptr,
              SAVE_H, row0, HSV_TMA)


@triton.jit
def _fp8_gu_block(a_ptr, a_at, as_ptr, w_ptr, g_at, wsb, rows, rmask, is_up, n, k0, H, I, BN: tl.constexpr,
                  BK: tl.constexpr, WB: tl.constexpr, TMA: tl.constexpr, WT: tl.constexpr, UPCAST: tl.constexpr):
    """The fused fp8 gate/up product of the BK-deep block at depth k0 (one MMA of N = 2 BN over interleaved gate
    and up rows), each column promoted by its own weight scale, each row by its x scale."""
    a = _ld_a(a_ptr, a_at, k0, rmask, TMA)
    sa = tl.load(as_ptr + rows * (H // BK) + k0 // BK, mask=rmask, other=0.0)
    sg = tl.load(wsb + ((n * BN) // WB) * (H // WB) + k0 // WB)
    su = tl.load(wsb + ((I + n * BN) // WB) * (H // WB) + k0 // WB)
    sc = tl.where(is_up, su, sg)  # [2BN]: each column's weight scale
    return _mm(a, _ld_w(w_ptr, g_at, k0, TMA, WT), UPCAST) * (sa[:, None] * sc[None, :])


@triton.jit
def _fp8_g_u_blocks(a_ptr, a_at, as_ptr, w_ptr, g_at, u_at, wsb, rows, rmask, n, k0, H, I, BN: tl.constexpr,
                    BK: tl.constexpr, WB: tl.constexpr, TMA: tl.constexpr, WT: tl.constexpr, UPCAST: tl.constexpr):
    """The fp8 gate and up products of the BK-deep block at depth k0 as two MMAs, promoted. Block scales change
    every K step, so each step's product is scaled before it is added ("promotion"): x scales are 1 x BK (BK =
    128), weight scales 128 x 128, one scalar per step for gate and for up."""
    a = _ld_a(a_ptr, a_at, k0, rmask, TMA)
    sa = tl.load(as_ptr + rows * (H // BK) + k0 // BK, mask=rmask, other=0.0)
    sg = tl.load(wsb + ((n * BN) // WB) * (H // WB) + k0 // WB)
    su = tl.load(wsb + ((I + n * BN) // WB) * (H // WB) + k0 // WB)
    return (_mm(a, _ld_w(w_ptr, g_at, k0, TMA, WT), UPCAST) * (sa[:, None] * sg),
            _mm(a, _ld_w(w_ptr, u_at, k0, TMA, WT), UPCAST) * (sa[:, None] * su))


@triton.jit
def _up_store(acc_g, acc_u, rows, rmask, n, h_ptr, hs_ptr, I, limit, BN: tl.constexpr, FP8: tl.constexpr,
              HAS_LIMIT: tl.constexpr, FP8_MAX_: tl.constexpr, hsv_ptr=None, clip_ptr=None,
              SAVE_H: tl.constexpr = False, srow0=0, HSV_TMA: tl.constexpr = False):
    """h[rows, column tile n] = SwiGLU(gate, up) (clamped with HAS_LIMIT), bf16 or e4m3 + its 1 x BN scale.
    SAVE_H (the training forward, bf16 and fp8): also the pre-SwiGLU gate and up columns into ``hsv_ptr`` (bf16
    [R, 2I], gate columns then up columns: the fp32 accumulators rounded once) and, with HAS_LIMIT, the clamp's
    decisions on the fp32 accumulators into ``clip_ptr`` (uint8 [R, 2I], 1 where clipped: gate > limit, |up| > limit).
    ``srow0``: the first of ``rows`` (offsets within the item in int32, from one base per item: fewer live
    pointers at the 255-register cap). The bf16 copies are made first and stored last, after the accumulators
    are consumed (the order with the least spill in ``aot_check``). HSV_TMA: ``hsv_ptr`` is a TMA descriptor with
    [rows, BN] blocks: every row of the item is the tile's own (its padding rows too), so each half of H goes out
    as one bulk store instead of scattered stores from the MMA layout (``TileConfig.save_h_tma``)."""
    if SAVE_H:
        g16 = acc_g.to(tl.bfloat16)
        u16 = acc_u.to(tl.bfloat16)
        s_at = srow0.to(tl.int64) * (2 * I) + n * BN
        s_off = (rows - srow0).to(tl.int32)[:, None] * (2 * I) + tl.arange(0, BN)[None, :]
        if HAS_LIMIT:
            tl.store(clip_ptr + s_at + s_off, (acc_g > limit).to(tl.uint8), mask=rmask[:, None])
            tl.store(clip_ptr + (s_at + I) + s_off, ((acc_u > limit) | (acc_u < -limit)).to(tl.uint8),
                     mask=rmask[:, None])
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    hv = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    cols = n * BN + tl.arange(0, BN)
    h_off = rows[:, None] * I + cols[None, :]
    if FP8:
        q, s = _quant_e4m3(hv, FP8_MAX_)
        tl.store(h_ptr + h_off, q, mask=rmask[:, None])
        tl.store(hs_ptr + rows * (I // BN) + n, s, mask=rmask)
    else:
        tl.store(h_ptr + h_off, hv.to(tl.bfloat16), mask=rmask[:, None])
    if SAVE_H:
        if HSV_TMA:
            hsv_ptr.store([srow0, n * BN], g16)
            hsv_ptr.store([srow0, I + n * BN], u16)
        else:
            tl.store(hsv_ptr + s_at + s_off, g16, mask=rmask[:, None])
            tl.store(hsv_ptr + (s_at + I) + s_off, u16, mask=rmask[:, None])


@triton.jit
def _up_tile(a_ptr, a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
             limit, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
             HAS_LIMIT: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr, FP8_MAX_: tl.constexpr,
             TMA: tl.constexpr, WB: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False,
             hsv_ptr=None, clip_ptr=None, SAVE_H: tl.constexpr = False, PAIR: tl.constexpr = False,
             SPLIT: tl.constexpr = False, hsv_half=None, HSV_TMA: tl.constexpr = False,
             PACKED: tl.constexpr = False):
    """The item of one row tile: a BM/2-row MMA for a half tile (HALF; PACKED: a tile of at most BM/2 rows), else BM
    rows; TAIL: a tile whose size is not a multiple of BM/2 (BM/2 + TAIL or BM + TAIL rows) adds the swapped TAIL-row
    MMA. SPLIT (HALF, no TAIL): every tile as BM/2-row items, a full tile as two (its weight blocks read twice), so
    the kernel holds BM/2-row accumulators only (``TileConfig.up_halves``). HSV_TMA (SAVE_H, no TAIL): ``hsv_ptr`` /
    ``hsv_half`` are TMA descriptors over the saved H with [BM, BN] / [BM/2, BN] blocks (``_up_store``)."""
    if HSV_TMA:
        hv_half = hsv_half
    else:
        hv_half = hsv_ptr
    if SPLIT:
        _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                 limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT, hv_half,
                 clip_ptr, SAVE_H, PAIR, HSV_TMA)
        if row1 - row0 > BM // 2:
            _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0 + BM // 2, row1, n, e_tile, n_rows,
                     H, I, limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT,
                     hv_half, clip_ptr, SAVE_H, PAIR, HSV_TMA)
    elif TAIL > 0:  # (HALF: TileConfig)
        size = row1 - row0
        if size % (BM // 2) != 0:
            if size < BM:
                _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                         limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, TAIL, WT, hv_half,
                         clip_ptr, SAVE_H, PAIR, HSV_TMA)
            else:
                _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                         limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, TAIL, WT, hsv_ptr,
                         clip_ptr, SAVE_H, PAIR, HSV_TMA)
        elif size < BM:
            _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT, hv_half,
                     clip_ptr, SAVE_H, PAIR, HSV_TMA)
        else:
            _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT, hsv_ptr,
                     clip_ptr, SAVE_H, PAIR, HSV_TMA)
    elif HALF:
        if (row1 - row0 <= BM // 2) if PACKED else (row1 - row0 < BM):
            _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT, hv_half,
                     clip_ptr, SAVE_H, PAIR, HSV_TMA)
        else:
            _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT, hsv_ptr,
                     clip_ptr, SAVE_H, PAIR, HSV_TMA)
    else:
        _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I, limit,
                 BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT, hsv_ptr, clip_ptr, SAVE_H, PAIR,
                 HSV_TMA)


@triton.jit
def _first_work(work_ptr, DYN: tl.constexpr):
    if DYN:
        wk = tl.atomic_add(work_ptr, 1, sem="relaxed", scope="gpu")
    else:
        wk = tl.program_id(0)
    return wk


@triton.jit
def _next_work(wk, work_ptr, NUM_PROGS: tl.constexpr, DYN: tl.constexpr):
    """Static round robin, or (DYN) the next item off a shared counter: then several launches (on different
    streams) can share one queue, and a launch that starts late takes what is left."""
    if DYN:
        wk = tl.atomic_add(work_ptr, 1, sem="relaxed", scope="gpu")
    else:
        wk += NUM_PROGS
    return wk


@triton.jit
def _up_swiglu_kernel(a_ptr, a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, tile_expert_ptr, tile_row_ptr,
                      chunk_ptr, ready_ptr, work_ptr, n_rows, H, I, limit, hsv_ptr, clip_ptr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
                      HAS_LIMIT: tl.constexpr, NUM_PROGS: tl.constexpr, UPCAST: tl.constexpr,
                      STAGES: tl.constexpr, FP8_MAX_: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr = False,
                      HALF: tl.constexpr = False, READY: tl.constexpr = False, GRAN: tl.constexpr = 64,
                      SPIN: tl.constexpr = True, DYN: tl.constexpr = False, WB: tl.constexpr = 128,
                      FLAT: tl.constexpr = False, TAIL: tl.constexpr = 0, WT: tl.constexpr = False,
                      SAVE_H: tl.constexpr = False, PAIR: tl.constexpr = False, SPLIT: tl.constexpr = False,
                      hsv_half=None, HSV_TMA: tl.constexpr = False, PACKED: tl.constexpr = False):
    """TMA: ``a_ptr`` / ``a_half`` / ``a_tail`` / ``w_ptr`` are TMA descriptors over A [R, H] (blocks [BM, BK],
    [BM/2, BK] and [TAIL, BK]) and W13 [L*2I, H] (blocks [BN, BK]; WT: W13 from :func:`tile_weights`, a
    [L*2I*H/BK, BK] view), read by Hopper's bulk copy engine; otherwise pointers. HALF: tiles of
    BM/2 rows (the schedule's half tiles) run a BM/2-row MMA. READY: wait for the pull per row granule. DYN: work
    items off the counter at ``work_ptr`` (zero before the first launch that shares it). FLAT (neither READY nor
    DYN): static round robin in one flattened loop nest, as in the down kernel. TAIL: see ``_up_tile``. SAVE_H
    (the training forward): also the pre-SwiGLU H into ``hsv_ptr`` and, with HAS_LIMIT, the clamp's decisions
    into ``clip_ptr`` (``_up_store``); off, both are None (constexprs: the kernel is the inference kernel, parameter
    for parameter). PAIR (fp8): two 128-deep blocks a loop step (``_up_item``). SPLIT, HSV_TMA (with ``hsv_half``):
    see ``_up_tile``. PACKED: tiles start on any row (``TileConfig.packed_rows``): the half-tile test and the wait on
    the ready counters follow (``_wait_rows_packed``)."""
    m_lo = tl.load(chunk_ptr)
    m_hi = tl.load(chunk_ptr + 1)
    n_n = I // BN
    n_work = (m_hi - m_lo) * n_n
    if FLAT:  # static round robin, one flattened loop nest; every tile runs BM rows (see _down_push_kernel)
        for wk in tl.range(tl.program_id(0), n_work, NUM_PROGS, flatten=True):
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT, hsv_ptr, clip_ptr,
                     SAVE_H, PAIR)
    else:
        wk = _first_work(work_ptr, DYN)
        while wk < n_work:
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            if READY:
                if PACKED:
                    _wait_rows_packed(ready_ptr, row0, row1, tl.load(tile_row_ptr + m_hi), GRAN, SPIN, TMA)
                else:
                    _wait_rows(ready_ptr, row0, row1, GRAN, SPIN, TMA)
            _up_tile(a_ptr, a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows,
                     H, I, limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, HALF, TAIL, WT,
                     hsv_ptr, clip_ptr, SAVE_H, PAIR, SPLIT, hsv_half, HSV_TMA, PACKED)
            wk = _next_work(wk, work_ptr, NUM_PROGS, DYN)


def weight_layout(cfg: TileConfig) -> int | bool:
    """The up GEMM's ``WT`` for ``cfg`` (see :func:`_up_item`): 3 stacked, 2 fused over the tiled copy, else
    ``w_tiled`` itself (the constexpr the launches have always passed)."""
    return 3 if cfg.up_stacked else 2 if cfg.up_fused else cfg.w_tiled


def up_swiglu(a_RH: torch.Tensor, a_scale: Optional[torch.Tensor], w13_LIH: torch.Tensor,
              w13_scale: Optional[torch.Tensor], h_RI: torch.Tensor, h_scale: Optional[torch.Tensor],
              tile_expert_M: torch.Tensor, tile_row_M1: torch.Tensor, chunk_2: torch.Tensor, *,
              limit: Optional[float], cfg: TileConfig, programs: int, n_rows: Optional[int] = None,
              ready: Optional[torch.Tensor] = None, work: Optional[torch.Tensor] = None,
              h_save: Optional[torch.Tensor] = None, clip_save: Optional[torch.Tensor] = None) -> None:
    """h = SwiGLU(a @ gate^T, a @ up^T) for tiles [chunk_2[0], chunk_2[1]); a tile's expert from tile_expert_M,
    its rows [tile_row_M1[m], tile_row_M1[m+1]) (BM, or BM/2 with ``cfg.half_tiles``). ``ready``: wait for the
    pull's per-granule counts (see :func:`pull_rows`) before reading a tile's rows. ``work``: an int32 counter,
    zero before the first launch over these tiles; launches given the same counter share the work items.
    ``h_save`` (bf16 [R, 2I], in bf16 and fp8): the epilogue also stores the pre-SwiGLU gate and up outputs (the fp32
    accumulators rounded once; gate columns then up columns) of every row it stores, and ``clip_save`` (uint8
    [R, 2I], given exactly when ``limit`` is) where the clamp clipped them, decided on the fp32 accumulators (1:
    gate > limit, |up| > limit): what the backward's dgate stage reads (``bwd_gemm.bwd_rows``, ``bwd_fp8.fp8_rows``)."""
    R, H = a_RH.shape
    I = h_RI.shape[1]
    fp8 = a_RH.dtype == torch.float8_e4m3fn
    bm, bn, bk = cfg.block_m, cfg.up_n, cfg.up_k
    assert I % bn == 0 and H % bk == 0, f"ffn {I} / hidden {H} must be multiples of the tile ({bn}, {bk})"
    if fp8:
        assert bk == 128 and 128 % bn == 0, "fp8 up: BK must be the 128 activation / weight block, BN divide 128"
        assert h_scale.shape[1] == I // bn, "fp8 hidden activations are quantised in 1 x up_n blocks"
        assert not cfg.fp8_up_pair or H % (2 * bk) == 0, f"fp8_up_pair: hidden {H} must be a multiple of 2 BK"
    flat = cfg.flat_up  # TileConfig refuses it with ready_flags, so the layer passes neither ready nor work
    assert not flat or (ready is None and work is None), "flat_up runs a static loop: no ready counters, no queue"
    tail = cfg.tail_rows
    assert not (tail and fp8), "tails are bf16 only (TileConfig.for_fp8 turns them off)"
    fused = cfg.up_fused
    wn = 2 * bn if fused else bn  # rows of a weight block
    assert _weights(w13_LIH, wn, bk, cfg.w_tiled) == (2 * I, H), "w13 must be [L, 2I, H] (or tiled)"
    stacked = cfg.up_stacked  # (TileConfig: TMA, plain weights, bf16)
    assert not (stacked and fp8), "up_stacked is bf16's (for_fp8 turns it off)"
    if stacked:  # W13 seen as [L, I, 2, H] (strides 2IH, H, IH, 1): a [BN, 2, BK] box interleaves gate and up rows
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_op = TensorDescriptor.from_tensor(w13_LIH.view(-1, 2, I, H).transpose(1, 2), [1, bn, 2, bk])
    else:
        w_op = _operand(w13_LIH, [wn, bk], cfg.tma)
    save = h_save is not None
    if save:
        assert h_save.shape == (R, 2 * I) and h_save.dtype == torch.bfloat16 and h_save.is_contiguous(), \
            f"h_save must be contiguous bf16 [{R}, {2 * I}]"
        assert (clip_save is not None) == (limit is not None), "clip_save goes with h_save exactly when limit is set"
        if clip_save is not None:
            assert clip_save.shape == (R, 2 * I) and clip_save.dtype == torch.uint8 and clip_save.is_contiguous(), \
                f"clip_save must be contiguous uint8 [{R}, {2 * I}]"
    else:
        assert clip_save is None, "clip_save needs h_save"
    hsv_tma = save and h_save_by_tma(cfg)
    _up_swiglu_kernel[(programs,)](
        _operand(a_RH, [bm, bk], cfg.tma), _operand(a_RH, [bm // 2, bk], cfg.tma and cfg.half_tiles),
        _operand(a_RH, [tail, bk], cfg.tma and tail > 0),
        a_scale if fp8 else a_RH, w_op,
        w13_scale if fp8 else w13_LIH, h_RI, h_scale if fp8 else h_RI,
        tile_expert_M, tile_row_M1, chunk_2, ready if ready is not None else tile_row_M1,
        work if work is not None else tile_row_M1, R if n_rows is None else n_rows, H, I,
        0.0 if limit is None else float(limit),
        _operand(h_save, [bm, bn], True) if hsv_tma else h_save, clip_save,
        BM=bm, BN=bn, BK=bk, FP8=fp8, HAS_LIMIT=limit is not None, NUM_PROGS=programs, UPCAST=INTERPRET,
        STAGES=cfg.up_stages, FP8_MAX_=FP8_MAX, GROUP_M=cfg.group_m, TMA=cfg.tma, HALF=cfg.half_tiles,
        READY=ready is not None, GRAN=ready_granule(cfg), SPIN=not INTERPRET, DYN=work is not None,
        FLAT=flat, TAIL=tail, WT=weight_layout(cfg), SAVE_H=save,
        PAIR=fp8 and cfg.fp8_up_pair,
        SPLIT=cfg.up_halves, hsv_half=_operand(h_save, [bm // 2, bn], True) if hsv_tma else None, HSV_TMA=hsv_tma,
        num_warps=cfg.up_warps, **({"PACKED": True} if cfg.packed_rows else {}))
