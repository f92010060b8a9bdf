"""Triton kernels of the MoK-style forward: stage, index gather, pull dispatch, grouped SwiGLU GEMM, down GEMM with
router weight and push combine, fixed-order epilogue.

Legend: P ranks, T tokens per rank, K top-k, H hidden, I expert ffn, L local experts, R capacity rows, BM/BN/BK
GEMM tile, M = R / BM tiles. Row codes and tiles come from :mod:`kernels.mok_hopper.schedule`.

Peer memory is reached through raw addresses: a small int64 table per buffer holds, for every rank, the element
offset from this rank's copy to that rank's copy (the peers' symmetric-memory buffers, or ordinary tensors for
EP=1 and the CPU interpreter). Kernels add it to the local pointer argument and declare it a multiple of 16
elements (``tl.multiple_of``), so the peer loads and stores stay 16-byte vectorised. No multicast anywhere.

Every launcher takes device-side bounds (a chunk's first and last tile), so no launch needs a host sync; grids
are fixed ("persistent" programs loop over the work they find).

Under ``TRITON_INTERPRET=1`` (CPU tests) two interpreter gaps are worked around: bf16 ``tl.dot`` is done on fp32
copies (``UPCAST``), and a numpy>=2.4 incompatibility in the interpreter's scalar ``__index__`` is patched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FP8_MAX = 448.0


def _interpreter_compat() -> None:
    """Two fixes to Triton 3.6's CPU interpreter, so that it computes what the GPU computes:

    * scalars are converted with ``int(array)``, an error since numpy 2.4;
    * fp32 -> bf16 and fp32 -> e4m3 conversions truncate (the GPU rounds to nearest even, as torch does).
    """
    import numpy as np
    import triton.runtime.interpreter as ti

    if getattr(ti, "_mok_patched", False) or not hasattr(ti, "_patch_lang_tensor") or not hasattr(ti, "_convert_float"):
        return
    orig_patch, orig_convert = ti._patch_lang_tensor, ti._convert_float

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    targets = {tl.bfloat16: (torch.bfloat16, torch.uint16), tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8)}

    def convert(data, src_ty, dst_ty, rounding_mode):  # type: ignore[no-untyped-def]
        if src_ty == tl.float32 and dst_ty in targets:
            to, bits = targets[dst_ty]
            src = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return src.to(to).view(bits).numpy().reshape(np.shape(data))
        return orig_convert(data, src_ty, dst_ty, rounding_mode)

    ti._patch_lang_tensor = patched
    ti._convert_float = convert
    ti._mok_patched = True


if INTERPRET:
    _interpreter_compat()


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------------------------
# tile configuration


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters. ``gemm_programs``/``pull_programs`` 0 = derived from the SM count."""

    block_m: int = 128  # rows per tile; the schedule pads every expert to a multiple of it
    up_n: int = 128  # gate and up columns per tile (two accumulators of block_m x up_n)
    up_k: int = 64
    up_stages: int = 4  # 4 x 48 KB in flight per SM (3 streamed weights 5% slower on 2xH200, PERF_NOTES v5)
    up_warps: int = 8
    down_n: int = 128
    down_k: int = 64
    down_stages: int = 6
    down_warps: int = 8
    pull_rows: int = 4  # rows per pull step (each step loads whole rows)
    pull_warps: int = 16
    comm_sms: int = 24  # SMs left to the pull kernel while GEMMs run (GEMM grid = SMs - comm_sms)
    pull_programs: int = 0  # 0: comm_sms
    gemm_programs: int = 0  # 0: SMs - comm_sms
    num_chunks: int = 1  # pull / GEMM pipeline chunks (1: the pulls overlap the shared expert only; measured best)
    group_m: int = 4  # row tiles per work group (see _tile_order)
    tma: bool = True  # GEMM operands through TMA tensor descriptors (Hopper's bulk copy engine) instead of pointers
    half_tiles: bool = True  # an expert's last tile is block_m / 2 rows when its rest fits (less MMA on padding)
    ready_flags: bool = True  # the up GEMM waits per row granule for the pull (no stream-level wait)
    shared_last: bool = False  # the shared expert after the routed GEMMs (every SM) instead of beside the pull
    shared_sms: int = 0  # > 0 (CUDA, ready flags, 1 chunk): the shared expert on this many SMs of its own stream,
    # beside the routed up GEMM instead of before it, then one more up launch on those SMs (PERF_NOTES v8; 0: before
    # the up GEMM, beside the pull; default_tile sets api.SHARED_SMS)
    flat_down: bool = False  # down GEMM: one flattened, software-pipelined loop over (item, K step) (half tiles
    # then run at block_m rows): the next item's loads overlap this item's epilogue (Triton's ``flatten``)
    flat_up: bool = False  # the same for the up GEMM; needs ready_flags off (a spin wait cannot be flattened)
    tail_rows: int = 0  # bf16, half tiles: an expert's last tile may carry this many rows more (BM/2 + TL, or BM
    # + TL instead of a full tile and a half tile), run as a second MMA with the rows in N ("swap AB") off the same
    # weight tiles: with 32, an expert of 70 rows costs 96 rows of MMA work instead of 128 (schedule.padded_rows)
    w_tiled: bool = False  # TMA: the expert weights in the tiled layout of tile_weights (each TMA block one
    # contiguous run of memory instead of BN rows of BK elements a row length apart); the layer tiles them once
    up_fused: bool = False  # bf16, w_tiled: the up GEMM's gate and up weight rows interleaved (tile_weights_gu), one
    # [2 up_n, up_k] block and one MMA of N = 2 up_n per K step instead of two of up_n (A read once per step)
    fp8: bool = False  # set by for_fp8 (the fp8 GEMM steps and pipeline depths)

    def __post_init__(self) -> None:
        if self.shared_sms < 0 or (self.shared_sms and self.shared_last):
            raise ValueError("shared_sms (the shared expert beside the up GEMM) must be >= 0 and cannot be combined "
                             "with shared_last (the shared expert after the routed GEMMs)")
        if self.w_tiled and not self.tma:
            raise ValueError("w_tiled (weights in TMA block order) needs tma=True")
        if self.up_fused and not self.w_tiled:
            raise ValueError("up_fused (one gate/up MMA over interleaved weight rows) needs w_tiled=True")
        if self.flat_up and self.ready_flags:
            raise ValueError("flat_up needs ready_flags=False: the up GEMM's spin wait for the pull cannot be "
                             "flattened")
        if self.tail_rows and (not self.half_tiles or self.flat_up or self.flat_down
                               or self.tail_rows & (self.tail_rows - 1) or not 16 <= self.tail_rows < self.block_m // 2):
            raise ValueError(f"tail_rows={self.tail_rows} needs half_tiles=True, no flattened loop (its items have "
                             "one row count), and a power of two from 16 to below block_m / 2")

    def for_fp8(self) -> "TileConfig":
        """fp8 tiles: one weight scale per step (BK <= 128, BN <= 128 inside one 128 x 128 block). The up GEMM
        steps over whole 1 x 128 x blocks (BK = 128) and is 64 columns wide, which keeps its two accumulators and
        their promotion temporaries in registers; the hidden activations are quantised in its 1 x 64 column
        tiles, so the down GEMM steps 64 deep. The flattened down loop is off (it ran 0-5% slower in fp8,
        PERF_NOTES v6); tails are bf16 only."""
        from dataclasses import replace

        if self.fp8:  # idempotent: callers may apply it to a tile that already is one
            return self
        down_stages = 6 if self.down_n > 128 else self.down_stages  # (the bf16 tile's 4 stages are 256 wide)
        return replace(self, up_n=64, up_k=128, up_stages=self.up_stages + 2, down_n=128, down_k=64,
                       down_stages=down_stages + 2, flat_down=False, tail_rows=0, up_fused=False,
                       fp8=True)

    @property
    def h_block(self) -> int:
        """fp8: columns per scale of the hidden activations (the up GEMM's column tile)."""
        return self.up_n


# ---------------------------------------------------------------------------------------------------------------
# small helpers


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b (fp32 accumulate). UPCAST: the interpreter's bf16 dot is broken, multiply fp32 copies."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _mm(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _tile_order(wk, m_lo, m_hi, n_n, GROUP_M: tl.constexpr):
    """Work item -> (row tile, column tile), in groups of GROUP_M row tiles: inside a group the row tile varies
    fastest. Programs running together then share both the A rows of the group and, for an expert with several
    row tiles in the group, each weight tile (the second read comes from L2)."""
    per_group = GROUP_M * n_n
    first = m_lo + (wk // per_group) * GROUP_M
    size = tl.minimum(m_hi - first, GROUP_M)
    r = wk % per_group
    return first + r % size, r // size


@triton.jit
def _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M: tl.constexpr):
    """Work item -> (row tile, column tile, the tile's expert, its first row, the next tile's first row)."""
    m, n = _tile_order(wk, m_lo, m_hi, n_n, GROUP_M)
    return m, n, tl.load(tile_expert_ptr + m), tl.load(tile_row_ptr + m), tl.load(tile_row_ptr + m + 1)


@triton.jit
def _quant_e4m3(v, FP8_MAX_: tl.constexpr):
    """Row-wise 1xN block quantisation of an fp32 block [R, N]: (e4m3 values, fp32 scale [R])."""
    amax = tl.max(tl.abs(v), axis=1)
    scale = tl.maximum(amax, 1e-12) / FP8_MAX_
    q = v / scale[:, None]
    q = tl.minimum(tl.maximum(q, -FP8_MAX_), FP8_MAX_)
    return q.to(tl.float8e4nv), scale


# ---------------------------------------------------------------------------------------------------------------
# stage: this rank's activations into its (symmetric) buffer; fp8 quantises on the way (1 x 128 blocks)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, H, ROWS: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + rows[:, None] * H + cols[None, :]).to(tl.float32)
    q, s = _quant_e4m3(v, FP8_MAX_)
    tl.store(q_ptr + rows[:, None] * H + cols[None, :], q)
    tl.store(s_ptr + rows * (H // BLOCK) + b, s)


def quantize_rows(x_TH: torch.Tensor, q_TH: torch.Tensor, s_TB: torch.Tensor, block: int = 128) -> None:
    """e4m3 data and fp32 scales, one scale per 1 x ``block`` of each row (written into q_TH / s_TB)."""
    T, H = x_TH.shape
    rows = 1
    for r in (8, 4, 2):
        if T % r == 0:
            rows = r
            break
    _quant_rows_kernel[(T // rows, H // block)](x_TH, q_TH, s_TB, H, ROWS=rows, BLOCK=block, FP8_MAX_=FP8_MAX,
                                                 num_warps=4)


# ---------------------------------------------------------------------------------------------------------------
# index gather: every rank's top-k table (int32) from the peers' buffers


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


# ---------------------------------------------------------------------------------------------------------------
# the schedule in five small kernels (the twin of schedule.build_schedule, which takes ~20 torch launches): a
# counting sort of the P*T*K routed slots by local expert, stable (ascending slot inside each expert), then the tile
# tables. Integers only, fixed order: deterministic. Legend: S = P*T*K slots, SB slots per block, NB blocks,
# LP >= L+1 expert bins (bin L = "not mine"), M tile-table entries.


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
                         TAIL: tl.constexpr = 0):
    """One program: per expert its padded rows and tiles, segment start, tile range (lay_ptr rows 0-2, row 3 slot 0:
    rows in use); tiles in use, chunk bounds; zeroes the overflow count and (ZERO) the ready / work counters."""
    e = tl.arange(0, LP)
    live = e < L
    c = tl.where(live, tl.load(count_ptr + e), 0)
    if HALF:  # full tiles, then a last tile of BM/2 rows if the rest fits in it, else of BM rows
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
                 half_tiles: bool, num_chunks: int, device: torch.device, tail_rows: int = 0) -> None:
        self.TK, self.L, self.BM, self.R = tokens * topk, local_experts, block_m, capacity
        self.half, self.C, self.tail = half_tiles, num_chunks, tail_rows
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
                                   RP=1024, ZERO=zero, TAIL=self.tail, num_warps=4)
        M = out.tile_expert_M.numel()
        mb = max(1, min(64, 16384 // LP))
        grid = triton.cdiv(M + 1, mb)
        cb = triton.next_power_of_2(triton.cdiv(R + 1, grid))
        _sched_tiles_kernel[(grid,)](self.lay, out.tile_expert_M, out.tile_row_M1, out.row_code_R1, M, L, R,
                                     BM=BM, LP=LP, MB=mb, CB=cb, num_warps=4)
        _sched_place_kernel[(NB,)](idx_all, self.rank, self.off, self.lay, out.row_code_R1, out.overflow_rows,
                                   overflow_total, self.S, e_lo, L, R, SB=SB, LP=LP, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------
# pull dispatch: the expert owner reads routed rows straight from the source ranks' buffers


@triton.jit
def _pull_rows_kernel(code_ptr, chunk_ptr, tile_row_ptr, ready_ptr, x_ref, x_delta, xs_ref, xs_delta, w_ref,
                      w_delta, x_out, xs_out, w_out, TK, K, H, HS,
                      BR: tl.constexpr, BH: tl.constexpr, HSP: tl.constexpr, FP8: tl.constexpr,
                      PULL_W: tl.constexpr, NUM_PROGS: tl.constexpr, READY: tl.constexpr, GRAN: tl.constexpr):
    r_lo = tl.load(tile_row_ptr + tl.load(chunk_ptr))
    r_hi = tl.load(tile_row_ptr + tl.load(chunk_ptr + 1))
    n_steps = tl.cdiv(r_hi - r_lo, BR)
    cols = tl.arange(0, BH)  # a whole row per load: every byte of the step is in flight at once
    cmask = cols < H
    # programs take steps round-robin, so the rows finish roughly in ascending order (the GEMMs' order)
    for step in range(tl.program_id(0), n_steps, NUM_PROGS):
        row0 = r_lo + step * BR
        rows = row0 + tl.arange(0, BR)
        rmask = rows < r_hi
        rows64 = rows.to(tl.int64)
        code = tl.load(code_ptr + rows, mask=rmask, other=-1)
        valid = code >= 0
        c = tl.where(valid, code, 0)
        src = c // TK
        slot = c % TK
        tok = (slot // K).to(tl.int64)
        d = tl.multiple_of(tl.load(x_delta + src, mask=valid, other=0), 16)
        v = tl.load(x_ref + (d + tok * H)[:, None] + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
        tl.store(x_out + rows64[:, None] * H + cols[None, :], v, mask=rmask[:, None] & cmask[None, :])
        if FP8:
            ds = tl.load(xs_delta + src, mask=valid, other=0)
            sc = tl.arange(0, HSP)
            smask = sc[None, :] < HS
            s = tl.load(xs_ref + (ds + tok * HS)[:, None] + sc[None, :], mask=valid[:, None] & smask, other=0.0)
            tl.store(xs_out + rows64[:, None] * HS + sc[None, :], s, mask=rmask[:, None] & smask)
        if PULL_W:
            dw = tl.load(w_delta + src, mask=valid, other=0)
            wv = tl.load(w_ref + dw + slot, mask=valid, other=0.0)
            tl.store(w_out + rows, wv, mask=rmask)
        if READY:
            # every thread's stores of this step, then one release: the granule counts BR more rows
            tl.debug_barrier()
            tl.atomic_add(ready_ptr + row0 // GRAN, BR, sem="release", scope="gpu")


def pull_rows(code_R: torch.Tensor, chunk_2: torch.Tensor, tile_row_M1: torch.Tensor, x_ref: torch.Tensor,
              x_delta: torch.Tensor, xs_ref: Optional[torch.Tensor], xs_delta: Optional[torch.Tensor],
              w_ref: Optional[torch.Tensor], w_delta: Optional[torch.Tensor], x_out_RH: torch.Tensor,
              xs_out: Optional[torch.Tensor], w_out_R: Optional[torch.Tensor], *, tokens: int, topk: int,
              cfg: TileConfig, programs: int, ready: Optional[torch.Tensor] = None) -> None:
    """Copy the rows of tiles [chunk_2[0], chunk_2[1]) from their source ranks' ``x`` (``*_ref`` is this rank's
    copy, ``*_delta`` the offsets to every rank's); padding rows become zeros. ``w_ref``: also pull each row's
    router weight. fp8: e4m3 rows plus their 1x128 scales. ``ready``: int32 per ``ready_granule(cfg)`` rows,
    zero before the call; each granule reaches its row count once its rows are written (release, GPU scope)."""
    H = x_out_RH.shape[1]
    fp8 = x_out_RH.dtype == torch.float8_e4m3fn
    hs = H // 128 if fp8 else 1
    pull_w = w_ref is not None
    gran = ready_granule(cfg)
    assert gran % cfg.pull_rows == 0, f"pull_rows={cfg.pull_rows} must divide the ready granule of {gran} rows"
    _pull_rows_kernel[(programs,)](
        code_R, chunk_2, tile_row_M1, ready if ready is not None else code_R, x_ref, x_delta,
        xs_ref if fp8 else x_ref, xs_delta if fp8 else x_delta,
        w_ref if pull_w else x_ref, w_delta if pull_w else x_delta,
        x_out_RH, xs_out if fp8 else x_out_RH, w_out_R if pull_w else x_out_RH,
        tokens * topk, topk, H, hs,
        BR=cfg.pull_rows, BH=triton.next_power_of_2(H), HSP=triton.next_power_of_2(hs), FP8=fp8,
        PULL_W=pull_w, NUM_PROGS=programs, READY=ready is not None, GRAN=gran, num_warps=cfg.pull_warps)


def ready_granule(cfg: TileConfig) -> int:
    """Rows per ready flag: every tile starts on a multiple of it (the tail, the half tile, or the tile)."""
    return cfg.tail_rows or (cfg.block_m // 2 if cfg.half_tiles else cfg.block_m)


@triton.jit
def _wait_counts(count_ptr, g0, g1, NEED, SPIN: tl.constexpr, TMA: tl.constexpr):
    """Wait until counters [g0, g1) each reach ``NEED`` (acquire, GPU scope). The interpreter runs the producer to
    completion first, so it does not spin (``SPIN`` off). TMA reads through the async proxy: fence it after the
    acquire."""
    if SPIN:
        for g in range(g0, g1):
            n = tl.atomic_add(count_ptr + g, 0, sem="acquire", scope="gpu")
            while n < NEED:
                n = tl.atomic_add(count_ptr + g, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        if TMA:
            tl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)


@triton.jit
def _wait_rows(ready_ptr, row0, row1, GRAN: tl.constexpr, SPIN: tl.constexpr, TMA: tl.constexpr):
    """Wait until the pull has written rows [row0, row1) (its per-granule counters)."""
    _wait_counts(ready_ptr, row0 // GRAN, row1 // GRAN, GRAN, SPIN, TMA)


# ---------------------------------------------------------------------------------------------------------------
# grouped gate/up GEMM + SwiGLU (+ fp8 quantisation of the hidden activations)


@triton.jit
def _ld_a(a_ptr, a_at, k0, rmask, TMA: tl.constexpr):
    """The [BM, BK] activation tile at depth k0: a TMA load at row ``a_at``, or a masked load from the pointers
    ``a_at`` (rows past the end are zeros either way)."""
    if TMA:
        tile = a_ptr.load([a_at, k0])
    else:
        tile = tl.load(a_at + k0, mask=rmask[:, None], other=0.0)
    return tile


@triton.jit
def _ld_w(w_ptr, w_at, k0, TMA: tl.constexpr, WT: tl.constexpr = False):
    """The [BK, BN] view of W^T at depth k0 (W row-major [N, K]): a TMA load of the [BN, BK] block at row ``w_at``,
    transposed, or a load from the pointers ``w_at``. WT (TMA): W in tiles (:func:`tile_weights`): the block of
    K step k0 is the contiguous [BN, BK] block ``k0 // BK`` after row ``w_at`` of the [*, BK] view."""
    if WT:
        BN: tl.constexpr = w_ptr.block_shape[0]
        BK: tl.constexpr = w_ptr.block_shape[1]
        tile = w_ptr.load([w_at + (k0 // BK) * BN, 0]).T
    elif TMA:
        tile = w_ptr.load([w_at, k0]).T
    else:
        tile = tl.load(w_at + k0)
    return tile


@triton.jit
def _tail_rows(ptr, row0, row_end, n_rows, K, BM: tl.constexpr, BK: tl.constexpr, TAIL: tl.constexpr,
               TMA: tl.constexpr):
    """The TAIL rows after a tile's first BM: their indices (int32), which of them to store (inside the tile and
    the capacity), and where their [TAIL, BK] operand tiles load from (a TMA row, or pointers into ``ptr``, a
    row-major [R, K] matrix)."""
    rows32 = row0 + BM + tl.arange(0, TAIL)
    rows = rows32.to(tl.int64)
    rmask = (rows < n_rows) & (rows32 < row_end)
    if TMA:
        at = row0 + BM
    else:
        at = ptr + rows[:, None] * K + tl.arange(0, BK)[None, :]
    return rows32, rmask, at


@triton.jit
def _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row_end, n, e_tile, n_rows, H, I, limit,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr, HAS_LIMIT: tl.constexpr,
             UPCAST: tl.constexpr, STAGES: tl.constexpr, FP8_MAX_: tl.constexpr, TMA: tl.constexpr,
             WB: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False):
    """One work item: rows [row0, min(row0 + BM, row_end)) x hidden columns [n*BN, (n+1)*BN) of expert ``e_tile``
    (rows from row_end on belong to the next tile: computed, not stored). TAIL > 0 (bf16): also the TAIL rows
    after those (``a_tail``: their TMA descriptor), as W @ A^T with the rows in N, off the same weight tiles.
    WT: 0 row-major weights, 1 tiled (:func:`tile_weights`), 2 (bf16) tiled with gate and up rows interleaved
    (:func:`tile_weights_gu`): one [2BN, BK] block and one MMA of N = 2BN per K step, split into gate and up after
    the loop."""
    e = e_tile.to(tl.int64)
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    rmask = (rows < n_rows) & (rows < row_end)
    cols = n * BN + tl.arange(0, BN)
    if WT == 2:  # rows of tile_weights_gu: H // BK blocks of 2BN rows per (expert, column tile)
        a_at = row0
        g_at = (e_tile * (I // BN) + n) * (H // BK) * (2 * BN)
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
    if WT == 2:  # (bf16: TileConfig) one MMA for gate and up, columns g0 u0 g1 u1 ...: the split costs no move
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        if TAIL > 0:
            rows_t32, rmask_t, t_at = _tail_rows(a_ptr, row0, row_end, n_rows, H, BM, BK, TAIL, TMA)
            acc_t = tl.zeros((2 * BN, TAIL), dtype=tl.float32)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            a = _ld_a(a_ptr, a_at, k0, rmask, TMA)
            w = _ld_w(w_ptr, g_at, k0, TMA, WT)  # [BK, 2BN]
            acc = _mma(a, w, acc, UPCAST)
            if TAIL > 0:
                acc_t = _mma(w.T, _ld_a(a_tail, t_at, k0, rmask_t, TMA).T, acc_t, UPCAST)
        if TAIL > 0:
            t_g, t_u = tl.split(acc_t.T.reshape(TAIL, BN, 2))
            _up_store(t_g, t_u, rows_t32.to(tl.int64), rmask_t, n, h_ptr, hs_ptr, I, limit, BN, FP8, HAS_LIMIT,
                      FP8_MAX_)
        acc_g, acc_u = tl.split(acc.reshape(BM, BN, 2))
    elif FP8:
        # Block scales change every K step, so each step's product is scaled before it is added ("promotion").
        # x scales are 1 x BK (BK = 128), weight scales 128 x 128: one scalar per step for gate and for up.
        wsb = ws_ptr + e * (2 * I // WB) * (H // WB)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            a = _ld_a(a_ptr, a_at, k0, rmask, TMA)
            sa = tl.load(as_ptr + rows * (H // BK) + k0 // BK, mask=rmask, other=0.0)
            sg = tl.load(wsb + ((n * BN) // WB) * (H // WB) + k0 // WB)
            su = tl.load(wsb + ((I + n * BN) // WB) * (H // WB) + k0 // WB)
            acc_g += _mm(a, _ld_w(w_ptr, g_at, k0, TMA, WT), UPCAST) * (sa[:, None] * sg)
            acc_u += _mm(a, _ld_w(w_ptr, u_at, k0, TMA, WT), UPCAST) * (sa[:, None] * su)
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
                      HAS_LIMIT, FP8_MAX_)
    _up_store(acc_g, acc_u, rows, rmask, n, h_ptr, hs_ptr, I, limit, BN, FP8, HAS_LIMIT, FP8_MAX_)


@triton.jit
def _up_store(acc_g, acc_u, rows, rmask, n, h_ptr, hs_ptr, I, limit, BN: tl.constexpr, FP8: tl.constexpr,
              HAS_LIMIT: tl.constexpr, FP8_MAX_: tl.constexpr):
    """h[rows, column tile n] = SwiGLU(gate, up) (clamped with HAS_LIMIT), bf16 or e4m3 + its 1 x BN scale."""
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


@triton.jit
def _up_tile(a_ptr, a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
             limit, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
             HAS_LIMIT: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr, FP8_MAX_: tl.constexpr,
             TMA: tl.constexpr, WB: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False):
    """The item of one row tile: a BM/2-row MMA for a half tile (HALF), else BM rows; TAIL: a tile whose size is
    not a multiple of BM/2 (BM/2 + TAIL or BM + TAIL rows) adds the swapped TAIL-row MMA."""
    if TAIL > 0:  # (HALF: TileConfig)
        size = row1 - row0
        if size % (BM // 2) != 0:
            if size < BM:
                _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                         limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, TAIL, WT)
            else:
                _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                         limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, TAIL, WT)
        elif size < BM:
            _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT)
        else:
            _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT)
    elif HALF:
        if row1 - row0 < BM:
            _up_item(a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM // 2, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT)
        else:
            _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT)
    else:
        _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I, limit,
                 BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT)


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
                      chunk_ptr, ready_ptr, work_ptr, n_rows, H, I, limit,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
                      HAS_LIMIT: tl.constexpr, NUM_PROGS: tl.constexpr, UPCAST: tl.constexpr,
                      STAGES: tl.constexpr, FP8_MAX_: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr = False,
                      HALF: tl.constexpr = False, READY: tl.constexpr = False, GRAN: tl.constexpr = 64,
                      SPIN: tl.constexpr = True, DYN: tl.constexpr = False, WB: tl.constexpr = 128,
                      FLAT: tl.constexpr = False, TAIL: tl.constexpr = 0, WT: tl.constexpr = False):
    """TMA: ``a_ptr`` / ``a_half`` / ``a_tail`` / ``w_ptr`` are TMA descriptors over A [R, H] (blocks [BM, BK],
    [BM/2, BK] and [TAIL, BK]) and W13 [L*2I, H] (blocks [BN, BK]; WT: W13 from :func:`tile_weights`, a
    [L*2I*H/BK, BK] view), read by Hopper's bulk copy engine; otherwise pointers. HALF: tiles of
    BM/2 rows (the schedule's half tiles) run a BM/2-row MMA. READY: wait for the pull per row granule. DYN: work
    items off the counter at ``work_ptr`` (zero before the first launch that shares it). FLAT (neither READY nor
    DYN): static round robin in one flattened loop nest, as in the down kernel. TAIL: see ``_up_tile``."""
    m_lo = tl.load(chunk_ptr)
    m_hi = tl.load(chunk_ptr + 1)
    n_n = I // BN
    n_work = (m_hi - m_lo) * n_n
    if FLAT:  # static round robin, one flattened loop nest; every tile runs BM rows (see _down_push_kernel)
        for wk in tl.range(tl.program_id(0), n_work, NUM_PROGS, flatten=True):
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            _up_item(a_ptr, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows, H, I,
                     limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, 0, WT)
    else:
        wk = _first_work(work_ptr, DYN)
        while wk < n_work:
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            if READY:
                _wait_rows(ready_ptr, row0, row1, GRAN, SPIN, TMA)
            _up_tile(a_ptr, a_half, a_tail, as_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, row0, row1, n, e_tile, n_rows,
                     H, I, limit, BM, BN, BK, FP8, HAS_LIMIT, UPCAST, STAGES, FP8_MAX_, TMA, WB, HALF, TAIL, WT)
            wk = _next_work(wk, work_ptr, NUM_PROGS, DYN)


def tile_weights(w_LNK: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """W [L, N, K] in the GEMM kernels' block order (``TileConfig.w_tiled``): [L, N/bn, K/bk, bn, bk], so that the
    [bn, bk] block a K step loads is one contiguous run of memory (a copy)."""
    L, N, K = w_LNK.shape
    assert N % bn == 0 and K % bk == 0, f"weights [{N}, {K}] must be multiples of the tile ({bn}, {bk})"
    return w_LNK.reshape(L, N // bn, bn, K // bk, bk).permute(0, 1, 3, 2, 4).contiguous()


def tile_weights_gu(w13_LNK: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """W13 [L, 2I, H] (gate rows, then up rows) for the fused gate/up MMA (``TileConfig.up_fused``):
    [L, I/bn, H/bk, 2bn, bk], each [2bn, bk] block one contiguous run holding the gate and up rows of column tile
    n interleaved (gate row j at 2j, up row j at 2j + 1), so that one MMA's output columns alternate gate, up."""
    L, N, K = w13_LNK.shape
    assert N % (2 * bn) == 0 and K % bk == 0, f"w13 [{N}, {K}] must be multiples of the tile (2 x {bn}, {bk})"
    w = w13_LNK.reshape(L, 2, N // (2 * bn), bn, K // bk, bk)  # [L, gate/up, n, row, k, col]
    return w.permute(0, 2, 4, 3, 1, 5).reshape(L, N // (2 * bn), K // bk, 2 * bn, bk).contiguous()


def _weights(w: torch.Tensor, bn: int, bk: int, tiled: bool) -> tuple[int, int]:
    """(N, K) of expert weights given as [L, N, K], or tiled ([L, N/bn, K/bk, bn, bk], see :func:`tile_weights`)."""
    if not tiled:
        return w.shape[1], w.shape[2]
    assert w.dim() == 5 and tuple(w.shape[3:]) == (bn, bk), \
        f"w_tiled: weights must come from tile_weights(w, {bn}, {bk}), got shape {tuple(w.shape)}"
    return w.shape[1] * bn, w.shape[2] * bk


def _operand(t: torch.Tensor, block: list[int], tma: bool):
    """A GEMM operand as the kernels take it: the tensor, or a TMA descriptor over its 2-D view (leading dims
    flattened) with the given block shape."""
    if not tma:
        return t
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), block)


def up_swiglu(a_RH: torch.Tensor, a_scale: Optional[torch.Tensor], w13_LIH: torch.Tensor,
              w13_scale: Optional[torch.Tensor], h_RI: torch.Tensor, h_scale: Optional[torch.Tensor],
              tile_expert_M: torch.Tensor, tile_row_M1: torch.Tensor, chunk_2: torch.Tensor, *,
              limit: Optional[float], cfg: TileConfig, programs: int, n_rows: Optional[int] = None,
              ready: Optional[torch.Tensor] = None, work: Optional[torch.Tensor] = None) -> None:
    """h = SwiGLU(a @ gate^T, a @ up^T) for tiles [chunk_2[0], chunk_2[1]); a tile's expert from tile_expert_M,
    its rows [tile_row_M1[m], tile_row_M1[m+1]) (BM, or BM/2 with ``cfg.half_tiles``). ``ready``: wait for the
    pull's per-granule counts (see :func:`pull_rows`) before reading a tile's rows. ``work``: an int32 counter,
    zero before the first launch over these tiles; launches given the same counter share the work items."""
    R, H = a_RH.shape
    I = h_RI.shape[1]
    fp8 = a_RH.dtype == torch.float8_e4m3fn
    bm, bn, bk = cfg.block_m, cfg.up_n, cfg.up_k
    assert I % bn == 0 and H % bk == 0, f"ffn {I} / hidden {H} must be multiples of the tile ({bn}, {bk})"
    if fp8:
        assert bk == 128 and 128 % bn == 0, "fp8 up: BK must be the 128 activation / weight block, BN divide 128"
        assert h_scale.shape[1] == I // bn, "fp8 hidden activations are quantised in 1 x up_n blocks"
    flat = cfg.flat_up  # TileConfig refuses it with ready_flags, so the layer passes neither ready nor work
    assert not flat or (ready is None and work is None), "flat_up runs a static loop: no ready counters, no queue"
    tail = cfg.tail_rows
    assert not (tail and fp8), "tails are bf16 only (TileConfig.for_fp8 turns them off)"
    fused = cfg.up_fused and not fp8
    wn = 2 * bn if fused else bn  # rows of a weight block
    assert _weights(w13_LIH, wn, bk, cfg.w_tiled) == (2 * I, H), "w13 must be [L, 2I, H] (or tiled)"
    _up_swiglu_kernel[(programs,)](
        _operand(a_RH, [bm, bk], cfg.tma), _operand(a_RH, [bm // 2, bk], cfg.tma and cfg.half_tiles),
        _operand(a_RH, [tail, bk], cfg.tma and tail > 0),
        a_scale if fp8 else a_RH, _operand(w13_LIH, [wn, bk], cfg.tma),
        w13_scale if fp8 else w13_LIH, h_RI, h_scale if fp8 else h_RI,
        tile_expert_M, tile_row_M1, chunk_2, ready if ready is not None else tile_row_M1,
        work if work is not None else tile_row_M1, R if n_rows is None else n_rows, H, I, 0.0 if limit is None else float(limit),
        BM=bm, BN=bn, BK=bk, FP8=fp8, HAS_LIMIT=limit is not None, NUM_PROGS=programs, UPCAST=INTERPRET,
        STAGES=cfg.up_stages, FP8_MAX_=FP8_MAX, GROUP_M=cfg.group_m, TMA=cfg.tma, HALF=cfg.half_tiles,
        READY=ready is not None, GRAN=ready_granule(cfg), SPIN=not INTERPRET, DYN=work is not None,
        FLAT=flat, TAIL=tail, WT=2 if fused else cfg.w_tiled, num_warps=cfg.up_warps)


# ---------------------------------------------------------------------------------------------------------------
# grouped down GEMM + router weight + push combine (each row stored into its source rank's combine buffer)


@triton.jit
def _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row_end, n, e_tile,
               n_rows, H, I, TK, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
               APPLY_W: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
               WB: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False):
    """One work item: rows [row0, min(row0 + BM, row_end)) x output columns [n*BN, (n+1)*BN) of expert ``e_tile``,
    pushed (rows from row_end on belong to the next tile: computed, not stored). TAIL > 0 (bf16): also the TAIL
    rows after those, as W @ h^T with the rows in N, off the same weight tiles (see ``_up_item``)."""
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
    for k0 in tl.range(0, I, BK, num_stages=STAGES):
        a = _ld_a(h_ptr, a_at, k0, rmask, TMA)
        if TAIL > 0:
            at = _ld_a(h_tail, t_at, k0, rmask_t, TMA).T  # [BK, TAIL]
        b = _ld_w(w_ptr, b_at, k0, TMA, WT)
        if FP8:  # h scales are 1 x BK (the up GEMM's column tile), weight scales 128 x 128
            sa = tl.load(hs_ptr + rows * (I // BK) + k0 // BK, mask=rmask, other=0.0)
            sb = tl.load(ws_ptr + e * (H // WB) * (I // WB) + ((n * BN) // WB) * (I // WB) + k0 // WB)
            acc += _mm(a, b, UPCAST) * (sa[:, None] * sb)
        else:
            acc = _mma(a, b, acc, UPCAST)
        if TAIL > 0:
            acc_t = _mma(b.T, at, acc_t, UPCAST)
    if TAIL > 0:
        _down_store(acc_t.T, rows_t32, rmask_t, cols, code_ptr, rw_ptr, out_ref, out_delta, H, TK, APPLY_W)
    _down_store(acc, rows32, rmask, cols, code_ptr, rw_ptr, out_ref, out_delta, H, TK, APPLY_W)


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
               WB: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, WT: tl.constexpr = False):
    """The item of one row tile: a BM/2-row MMA for a half tile (HALF), else BM rows; TAIL: as in ``_up_tile``."""
    if TAIL > 0:
        size = row1 - row0
        if size % (BM // 2) != 0:
            if size < BM:
                _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1,
                           n, e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, TAIL, WT)
            else:
                _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1,
                           n, e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, TAIL, WT)
        elif size < BM:
            _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT)
        else:
            _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT)
    elif HALF:
        if row1 - row0 < BM:
            _down_item(h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM // 2, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT)
        else:
            _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT)
    else:
        _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                   e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT)


@triton.jit
def _down_push_kernel(h_ptr, h_half, h_tail, hs_ptr, w_ptr, ws_ptr, tile_expert_ptr, tile_row_ptr, chunk_ptr, code_ptr,
                      rw_ptr, out_ref, out_delta, n_rows, H, I, TK,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
                      APPLY_W: tl.constexpr, NUM_PROGS: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                      GROUP_M: tl.constexpr, TMA: tl.constexpr = False, HALF: tl.constexpr = False,
                      WB: tl.constexpr = 128, FLAT: tl.constexpr = False, TAIL: tl.constexpr = 0,
                      WT: tl.constexpr = False):
    """TMA: ``h_ptr`` / ``h_half`` / ``h_tail`` / ``w_ptr`` are TMA descriptors over h [R, I] (blocks [BM, BK],
    [BM/2, BK] and [TAIL, BK]) and W2 [L*H, I] (blocks [BN, BK]; WT: W2 from :func:`tile_weights`, a
    [L*H*I/BK, BK] view); otherwise pointers. HALF, TAIL: as in the up kernel. FLAT: one flattened loop nest
    (items x K steps, pipelined across items); every tile runs BM rows, a half tile's rows past its end are
    computed and not stored. Otherwise static round robin over the items."""
    m_lo = tl.load(chunk_ptr)
    m_hi = tl.load(chunk_ptr + 1)
    n_n = H // BN
    n_work = (m_hi - m_lo) * n_n
    if FLAT:
        for wk in tl.range(tl.program_id(0), n_work, NUM_PROGS, flatten=True):
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            _down_item(h_ptr, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1, n,
                       e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, 0, WT)
    else:
        for wk in range(tl.program_id(0), n_work, NUM_PROGS):
            m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
            _down_tile(h_ptr, h_half, h_tail, hs_ptr, w_ptr, ws_ptr, code_ptr, rw_ptr, out_ref, out_delta, row0, row1,
                       n, e_tile, n_rows, H, I, TK, BM, BN, BK, FP8, APPLY_W, UPCAST, STAGES, TMA, WB, HALF, TAIL, WT)


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
        TAIL=tail, WT=cfg.w_tiled, num_warps=cfg.down_warps)


# ---------------------------------------------------------------------------------------------------------------
# fixed-order epilogue: out[t] = sum_k combine[t*K + k] (x w[t, k]) + shared[t], in fp32, k ascending


@triton.jit
def _epilogue_kernel(comb_ptr, idx_ptr, rw_ptr, shared_ptr, out_ptr, T, H, K,
                     BT: tl.constexpr, BH: tl.constexpr, APPLY_W: tl.constexpr, HAS_SHARED: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = t < T
    mask = tmask[:, None] & (cols[None, :] < H)
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for k in range(0, K):
        live = tl.load(idx_ptr + t * K + k, mask=tmask, other=-1) >= 0  # masked top-k slots (id < 0) add nothing
        v = tl.load(comb_ptr + (t[:, None] * K + k) * H + cols[None, :], mask=mask & live[:, None], other=0.0)
        v = v.to(tl.float32)
        if APPLY_W:
            v = v * tl.load(rw_ptr + t * K + k, mask=tmask, other=0.0)[:, None]
        acc += v
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * H + cols[None, :], acc.to(tl.bfloat16), mask=mask)


def combine_epilogue(comb_SH: torch.Tensor, idx_TK: torch.Tensor, rw_TK: Optional[torch.Tensor],
                     shared_TH: Optional[torch.Tensor], out_TH: torch.Tensor) -> None:
    """out[t] = sum_k comb[t*K + k] (x w[t, k]) + shared[t] in fp32, k ascending, then bf16."""
    T, H = out_TH.shape
    K = idx_TK.shape[1]
    bh = min(1024, triton.next_power_of_2(H))
    bt = 2 if out_TH.is_cuda else min(64, triton.next_power_of_2(T))
    _epilogue_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bh))](
        comb_SH, idx_TK, rw_TK if rw_TK is not None else comb_SH, shared_TH if shared_TH is not None else comb_SH,
        out_TH, T, H, K, BT=bt, BH=bh, APPLY_W=rw_TK is not None, HAS_SHARED=shared_TH is not None, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------
# timeline stamps (diagnostics): the GPU's global timer, written by a one-thread kernel on the stream that runs it


@triton.jit
def _stamp_kernel(ptr, i):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(ptr + i, t)


def stamp(buf: torch.Tensor, i: int) -> None:
    """buf[i] = the GPU's global timer (ns) when the stream gets here (CUDA only; captured into graphs too)."""
    _stamp_kernel[(1,)](buf, i, num_warps=1)
