"""The schedule on the device, in five small kernels (the twin of
:func:`mok_kernels.mok_hopper.schedule.build_schedule`, which takes ~20 torch launches): a counting sort of the P*T*K
routed slots by local expert, stable (ascending slot inside each expert), then the tile tables; and the index gather
that brings every rank's top-k table. Integers only, fixed order: deterministic. Legend: S = P*T*K slots, SB slots per
block, NB blocks, LP >= L+1 expert bins (bin L = "not mine"), M tile-table entries."""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from mok_kernels.mok_hopper.ops.interp import INTERPRET  # noqa: F401 (applies the interpreter fixes)

@triton.jit
def _gather_i32_kernel(ref_ptr, delta_table, out_ptr, N, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    d = tl.multiple_of(tl.load(delta_table + p), 16)
    v = tl.load(ref_ptr + d + offs, mask=m)
    tl.store(out_ptr + p.to(tl.int64) * N + offs, v, mask=m)


def gather_peer_i32(ref: torch.Tensor, delta_table_P: torch.Tensor, out_PN: torch.Tensor) -> None:
    """out[p] = rank p's copy of ``ref`` (int32, N elements each)."""
    P, N = out_PN.shape
    block = 1024
    _gather_i32_kernel[(P, triton.cdiv(N, block))](ref, delta_table_P, out_PN, N, BLOCK=block, num_warps=4)


@triton.jit
def _sched_hist_kernel(idx_ref, idx_delta, idx_all, hist_ptr, rank_ptr, S, TK, e_lo, L,
                       SB: tl.constexpr, LP: tl.constexpr):
    """Block b of slots: gather the ids from their ranks' buffers (into idx_all), histogram of local expert, and
    each slot's rank among the earlier slots of the block with the same expert."""
    b = tl.program_id(0)
    i = tl.arange(0, SB)
    p = b * SB + i
    m = p < S
    src = p // TK
    d = tl.load(idx_delta + src, mask=m, other=0)
    g = tl.load(idx_ref + d + (p % TK), mask=m, other=-1)
    tl.store(idx_all + p, g, mask=m)
    le = g - e_lo
    key = tl.where(m & (le >= 0) & (le < L), le, L)
    tl.store(hist_ptr + b * LP + tl.arange(0, LP), tl.histogram(key, LP))
    same_before = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None])
    tl.store(rank_ptr + p, tl.sum(same_before.to(tl.int32), axis=1), mask=m)


@triton.jit
def _sched_scan_kernel(hist_ptr, off_ptr, count_ptr, NB, NBP: tl.constexpr, LP: tl.constexpr, EB: tl.constexpr):
    """Per expert: exclusive prefix of the block histograms (where each block's slots start inside the expert's
    segment) and the total."""
    e = tl.program_id(0) * EB + tl.arange(0, EB)
    bb = tl.arange(0, NBP)
    at = bb[:, None] * LP + e[None, :]
    mask = (bb[:, None] < NB) & (e[None, :] < LP)
    h = tl.load(hist_ptr + at, mask=mask, other=0)
    tl.store(off_ptr + at, tl.cumsum(h, axis=0) - h, mask=mask)
    tl.store(count_ptr + e, tl.sum(h, axis=0), mask=e < LP)


@triton.jit
def _sched_layout_kernel(count_ptr, lay_ptr, counts_out, num_tiles_ptr, chunk_ptr, overflow_ptr, ready_ptr, work_ptr,
                         L, R, n_ready, n_work, BM: tl.constexpr, HALF: tl.constexpr, LP: tl.constexpr,
                         CP: tl.constexpr, NC: tl.constexpr, RP: tl.constexpr, ZERO: tl.constexpr,
                         TAIL: tl.constexpr = 0, PACKED: tl.constexpr = False):
    """One program: per expert its padded rows (PACKED: its routed rows, no padding) and tiles, segment start, tile
    range (lay_ptr rows 0-2, row 3 slot 0: rows in use); tiles in use, chunk bounds; zeroes the overflow count and
    (ZERO) the ready / work counters."""
    e = tl.arange(0, LP)
    live = e < L
    c = tl.where(live, tl.load(count_ptr + e), 0)
    if PACKED:  # tiles of BM rows, the last the rest (schedule.padded_rows)
        tiles = (c + BM - 1) // BM
        rows = c
    elif HALF:  # full tiles, then a last tile of BM/2 rows if the rest fits in it, else of BM rows
        full = c // BM  # (TAIL: also BM/2 + TAIL rows, or TAIL more on the last full tile; schedule.padded_rows)
        rest = c - full * BM
        last = tl.where(rest > BM // 2 + TAIL, BM,
                        tl.where(rest > BM // 2, BM // 2 + TAIL, tl.where(rest > 0, BM // 2, 0)))
        if TAIL > 0:
            absorbed = (rest > 0) & (rest <= TAIL) & (full > 0)
            last = tl.where(absorbed, TAIL, last)
            tiles = full + ((rest > 0) & (~absorbed)).to(tl.int32)
        else:
            tiles = full + (rest > 0).to(tl.int32)
        rows = full * BM + last
    else:
        tiles = (c + BM - 1) // BM
        rows = tiles * BM
    seg = tl.cumsum(rows, axis=0) - rows
    tile_end = tl.cumsum(tiles, axis=0)
    tl.store(lay_ptr + e, seg)
    tl.store(lay_ptr + LP + e, tile_end)
    tl.store(lay_ptr + 2 * LP + e, tiles)
    tl.store(counts_out + e, c, mask=live)
    used = tl.minimum(tl.sum(rows, axis=0), R)
    tl.store(lay_ptr + 3 * LP, used)
    # tiles in use: those starting below the capacity (a prefix of the tile order)
    n_in = tl.where(seg < R, tl.minimum(tiles, (R - seg + BM - 1) // BM), 0)
    nt = tl.sum(n_in, axis=0)
    tl.store(num_tiles_ptr, nt)
    cc = tl.arange(0, CP)
    tl.store(chunk_ptr + cc, nt * cc // NC, mask=cc <= NC)
    tl.store(overflow_ptr, 0)
    if ZERO:
        for r0 in range(0, n_ready, RP):
            rr = r0 + tl.arange(0, RP)
            tl.store(ready_ptr + rr, tl.zeros((RP,), dtype=tl.int32), mask=rr < n_ready)
        cw = tl.arange(0, CP)
        tl.store(work_ptr + cw, tl.zeros((CP,), dtype=tl.int32), mask=cw < n_work)


@triton.jit
def _sched_tiles_kernel(lay_ptr, tile_expert_ptr, tile_row_ptr, codes_ptr, M, L, R, BM: tl.constexpr,
                        LP: tl.constexpr, MB: tl.constexpr, CB: tl.constexpr):
    """Tile tables for tiles [pid*MB, (pid+1)*MB): expert (L past the end) and first row (the rows in use past the
    end); also resets row codes [pid*CB, (pid+1)*CB) (and the scratch row R) to -1."""
    pid = tl.program_id(0)
    m = pid * MB + tl.arange(0, MB)
    e = tl.arange(0, LP)
    tile_end = tl.load(lay_ptr + LP + e)
    ex = tl.sum(((tile_end[None, :] <= m[:, None]) & (e[None, :] < L)).to(tl.int32), axis=1)
    ec = tl.minimum(ex, L - 1)
    seg = tl.load(lay_ptr + ec)
    first = tl.load(lay_ptr + LP + ec) - tl.load(lay_ptr + 2 * LP + ec)
    row = seg + (m - first) * BM
    in_use = (ex < L) & (row < R)
    used = tl.load(lay_ptr + 3 * LP)
    tl.store(tile_expert_ptr + m, tl.where(in_use, ex, L), mask=m < M)
    tl.store(tile_row_ptr + m, tl.where(in_use, row, used), mask=m <= M)
    r = pid * CB + tl.arange(0, CB)
    tl.store(codes_ptr + r, tl.full((CB,), -1, tl.int32), mask=r <= R)


@triton.jit
def _sched_place_kernel(idx_all, rank_ptr, off_ptr, lay_ptr, codes_ptr, overflow_ptr, overflow_total_ptr, S, e_lo, L,
                        R, SB: tl.constexpr, LP: tl.constexpr):
    """Every local slot to its row: expert segment start + the block's offset inside it + rank inside the block.
    Slots that do not fit in R are counted (an integer sum: order-independent)."""
    b = tl.program_id(0)
    p = b * SB + tl.arange(0, SB)
    m = p < S
    le = tl.load(idx_all + p, mask=m, other=-1) - e_lo
    mine = m & (le >= 0) & (le < L)
    key = tl.where(mine, le, 0)
    dest = tl.load(lay_ptr + key, mask=mine, other=0) + tl.load(off_ptr + b * LP + key, mask=mine, other=0) + \
        tl.load(rank_ptr + p, mask=mine, other=0)
    fits = mine & (dest < R)
    tl.store(codes_ptr + dest, p, mask=fits)
    lost = tl.sum((mine & (dest >= R)).to(tl.int32), axis=0)
    tl.atomic_add(overflow_ptr, lost)
    tl.atomic_add(overflow_total_ptr, lost)


class DeviceScheduler:
    """Scratch buffers and launches of the Triton schedule for one layer (sizes fixed at construction)."""

    SB = 128  # slots per block

    def __init__(self, *, world: int, tokens: int, topk: int, local_experts: int, block_m: int, capacity: int,
                 half_tiles: bool, num_chunks: int, device: torch.device, tail_rows: int = 0,
                 packed: bool = False) -> None:
        self.TK, self.L, self.BM, self.R = tokens * topk, local_experts, block_m, capacity
        self.half, self.C, self.tail, self.packed = half_tiles, num_chunks, tail_rows, packed
        assert not (packed and tail_rows), "packed rows take no tails"
        self.S = world * tokens * topk
        self.NB = triton.cdiv(self.S, self.SB)
        self.LP = triton.next_power_of_2(local_experts + 1)
        i32 = dict(dtype=torch.int32, device=device)
        self.hist = torch.zeros(self.NB, self.LP, **i32)
        self.off = torch.zeros(self.NB, self.LP, **i32)
        self.rank = torch.zeros(self.S, **i32)
        self.count = torch.zeros(self.LP, **i32)
        self.lay = torch.zeros(3 * self.LP + 1, **i32)

    def __call__(self, idx_ref: torch.Tensor, idx_delta: torch.Tensor, idx_all: torch.Tensor, *, rank: int,
                 out: Any, overflow_total: torch.Tensor, ready: Optional[torch.Tensor] = None,
                 work: Optional[torch.Tensor] = None) -> None:
        """``out``: a schedule.Schedule (its buffers are written); idx_all [P, T*K] int32 gets every rank's ids."""
        L, LP, NB, SB, R, BM = self.L, self.LP, self.NB, self.SB, self.R, self.BM
        e_lo = rank * L
        _sched_hist_kernel[(NB,)](idx_ref, idx_delta, idx_all, self.hist, self.rank, self.S, self.TK, e_lo, L,
                                  SB=SB, LP=LP, num_warps=4)
        nbp = triton.next_power_of_2(NB)
        eb = max(1, min(LP, 4096 // nbp))
        _sched_scan_kernel[(triton.cdiv(LP, eb),)](self.hist, self.off, self.count, NB, NBP=nbp, LP=LP, EB=eb,
                                                   num_warps=8)
        zero = ready is not None
        _sched_layout_kernel[(1,)](self.count, self.lay, out.counts_L, out.num_tiles, out.chunk_tiles_C1,
                                   out.overflow_rows, ready if zero else self.count, work if zero else self.count,
                                   L, R, ready.numel() if zero else 0, work.numel() if zero else 0,
                                   BM=BM, HALF=self.half, LP=LP, CP=triton.next_power_of_2(self.C + 1), NC=self.C,
                                   RP=1024, ZERO=zero, TAIL=self.tail, num_warps=4,
                                   **({"PACKED": True} if self.packed else {}))
        M = out.tile_expert_M.numel()
        mb = max(1, min(64, 16384 // LP))
        grid = triton.cdiv(M + 1, mb)
        cb = triton.next_power_of_2(triton.cdiv(R + 1, grid))
        _sched_tiles_kernel[(grid,)](self.lay, out.tile_expert_M, out.tile_row_M1, out.row_code_R1, M, L, R,
                                     BM=BM, LP=LP, MB=mb, CB=cb, num_warps=4)
        _sched_place_kernel[(NB,)](idx_all, self.rank, self.off, self.lay, out.row_code_R1, out.overflow_rows,
                                   overflow_total, self.S, e_lo, L, R, SB=SB, LP=LP, num_warps=4)
