"""Device-side schedule: which (source rank, token, k) rows each local expert computes, padded to the GEMM tile.

Legend: P ranks, T tokens per rank, K top-k, S = P*T*K routed slots over all ranks, L local experts, BM rows per
GEMM tile, R capacity rows on this rank (a multiple of BM), M = R / BM tiles, C chunks.

With ``half_tiles`` an expert's last tile is BM/2 rows when its remaining rows fit in BM/2 (the GEMM kernels run
such a tile with a BM/2-row MMA, so an expert with 130 rows costs 192 rows of MMA work instead of 256). Tiles then
start on any multiple of BM/2; ``tile_row_M1`` says where. The pull marks rows as ready in granules of BM/2 rows.

With ``tail_rows`` (TL, a power of two below BM/2; needs ``half_tiles``) an expert's last tile may also carry TL
rows more: BM/2 + TL rows when the rest fits in them, and an expert's last full tile takes a rest of up to TL rows
as BM + TL rows instead of a half tile after it. The GEMM kernels run those TL rows as a second, swapped MMA with
the rows in the N dimension (which Hopper's MMA steps in 8s, where the M dimension steps in 64s), off the same
weight tile. Tiles then start on multiples of TL, and the ready granule is TL rows.

With ``packed`` (``TileConfig.packed_rows``; no tails) nothing is padded: expert e's rows start at the sum of the
earlier experts' routed rows, its tiles are BM rows each and its last one the rest (1 to BM rows), and
``tile_row_M1[m + 1]`` (the next tile's first row) is where tile m's rows end. A GEMM tile then loads BM (or, with
``half_tiles``, BM/2 where the rest fits) rows from its first: those past its end are the next expert's, computed
and not stored. The capacity is the routed rows (rounded up to BM), the tile tables have up to R/BM + L entries.

A slot is identified by its flat position ``p = (src * T + t) * K + k`` in the all-gathered top-k table
``idx_PS`` [P, T*K]; that integer (the "row code") is what the dispatch and combine kernels decode:
``src = p // (T*K)``, ``slot = p % (T*K)`` (the combine buffer row on the source rank), ``t = slot // K``.

Order is fixed, so the schedule (and everything downstream) is deterministic: experts in ascending local id, each
expert's rows in ascending ``p`` (source rank, then token, then k), each expert's segment padded with code -1 to a
multiple of BM (not with ``packed``). A slot whose id is negative (a masked top-k entry) or names another rank's
expert is skipped.

:func:`build_schedule` uses only fixed-size torch ops (stable sort, cumsum, scatter, searchsorted), so it stays on
the device with no host synchronisation. Rows that do not fit in R are dropped from the table and *counted* in
``overflow_rows`` (a device scalar the caller checks outside the timed path). :func:`reference_schedule` is the
plain-Python twin used by the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Schedule:
    row_code_R1: torch.Tensor  # int32 [R+1]: slot code p, or -1 for padding and unused rows; row R is scratch
    tile_expert_M: torch.Tensor  # int32 [M]: local expert of each tile; L for tiles past the end
    tile_row_M1: torch.Tensor  # int32 [M+1]: first row of each tile; tiles past the end start at the end of the last
    chunk_tiles_C1: torch.Tensor  # int32 [C+1]: tile boundaries of the C launch chunks (balanced by tile count)
    counts_L: torch.Tensor  # int32 [L]: routed rows per local expert (unpadded)
    num_tiles: torch.Tensor  # int32 [1]: tiles in use (<= M)
    overflow_rows: torch.Tensor  # int32 [1]: routed rows dropped because R was too small (0 when all fit)

    @property
    def row_code_R(self) -> torch.Tensor:
        return self.row_code_R1[:-1]


def capacity_rows(*, ep: int, tokens: int, topk: int, local_experts: int, block_m: int,
                  capacity_multiplier: Optional[float] = 0.5, half_tiles: bool = False,
                  packed: bool = False) -> int:
    """Rows to allocate on one rank: routed rows plus worst-case tile padding, rounded up to BM.

    Routed rows follow MoK's rule ``T*K*max(2, ceil(EP*multiplier))``, capped at the true worst case ``EP*T*K``
    (every token of every rank routed here), so EP <= 2 can never overflow. ``capacity_multiplier=None`` means
    the worst case at any EP.

    Padding: an expert with rows pads its last tile, at most BM - 1 rows; with ``half_tiles`` (the last tile BM/2
    rows when the rest fits, and with tails BM/2 + TL, or TL more rows on a full tile: :func:`padded_rows`) at most
    BM/2 - 1 (1 row, or BM/2 + 1, padded to BM/2, or BM). At most min(L, routed) experts have rows. Both bounds are
    reached by some routing, so nothing smaller is safe without reading the counts on the host. ``packed`` (no tile
    padding): the routed rows, rounded up to BM.
    """
    worst = ep * tokens * topk
    routed = (worst if capacity_multiplier is None
              else min(worst, tokens * topk * max(2, math.ceil(ep * capacity_multiplier))))
    pad = 0 if packed else block_m // 2 - 1 if half_tiles else block_m - 1
    padding = min(local_experts, routed) * pad
    return -(-(routed + padding) // block_m) * block_m


def padded_rows(count: torch.Tensor, block_m: int, half_tiles: bool = False,
                tail_rows: int = 0, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles, padded rows) of experts with ``count`` routed rows each (any integer tensor): full tiles of BM rows,
    then with ``half_tiles`` a last tile of BM/2 rows when the rest fits in it, with ``tail_rows`` (TL) BM/2 + TL
    rows when the rest fits in those, or TL more rows on the last full tile when the rest fits in TL; else BM.
    ``packed``: no padding (the tiles of BM rows, the last the rest; ``half_tiles`` adds no tile)."""
    BM, TL = block_m, tail_rows
    if packed:
        assert not TL, "packed rows take no tails"
        return (count + BM - 1) // BM, count
    assert not TL or (half_tiles and TL < BM // 2 and TL & (TL - 1) == 0), \
        "tail_rows needs half tiles and must be a power of two below block_m / 2"
    if not half_tiles:
        tiles = (count + BM - 1) // BM
        return tiles, tiles * BM
    full = count // BM
    rest = count - full * BM
    last = torch.where(rest > BM // 2 + TL, BM, torch.where(rest > BM // 2, BM // 2 + TL,
                                                            torch.where(rest > 0, BM // 2, 0)))
    if TL:
        absorbed = (rest > 0) & (rest <= TL) & (full > 0)
        last = torch.where(absorbed, TL, last)
        return full + ((rest > 0) & ~absorbed).to(full.dtype), full * BM + last
    return full + (rest > 0).to(full.dtype), full * BM + last


def max_tiles(capacity: int, block_m: int, half_tiles: bool = False, packed: bool = False,
              local_experts: int = 0) -> int:
    """Entries of the tile tables: every tile holds at least BM (BM/2 with half tiles) rows of the capacity;
    ``packed``: every tile but an expert's last holds BM rows, and at most min(L, R) experts have a last tile."""
    if packed:
        return capacity // block_m + min(local_experts, capacity)
    return capacity // (block_m // 2 if half_tiles else block_m)


def empty_schedule(*, capacity: int, block_m: int, local_experts: int, num_chunks: int,
                   device: torch.device, half_tiles: bool = False, packed: bool = False) -> Schedule:
    """Buffers for :func:`build_schedule` (``out=``), allocated once outside the timed path."""
    i32 = dict(dtype=torch.int32, device=device)
    M = max_tiles(capacity, block_m, half_tiles, packed, local_experts)
    return Schedule(row_code_R1=torch.full((capacity + 1,), -1, **i32),
                    tile_expert_M=torch.full((M,), local_experts, **i32),
                    tile_row_M1=torch.zeros(M + 1, **i32),
                    chunk_tiles_C1=torch.zeros(num_chunks + 1, **i32), counts_L=torch.zeros(local_experts, **i32),
                    num_tiles=torch.zeros(1, **i32), overflow_rows=torch.zeros(1, **i32))


def build_schedule(idx_PS: torch.Tensor, *, rank: int, local_experts: int, block_m: int, capacity: int,
                   num_chunks: int = 1, half_tiles: bool = False, tail_rows: int = 0, packed: bool = False,
                   out: Optional[Schedule] = None) -> Schedule:
    """The schedule of rank ``rank`` from every rank's top-k ids (``idx_PS`` [P, T*K], any integer dtype).

    Only device ops with static shapes; no host sync. ``out`` reuses the buffers of an earlier schedule."""
    assert capacity % block_m == 0, "capacity must be a multiple of block_m"
    assert not half_tiles or block_m % 2 == 0, "half tiles need an even block_m"
    dev = idx_PS.device
    L, BM, R = local_experts, block_m, capacity
    M = max_tiles(R, BM, half_tiles, packed, L)
    flat_S = idx_PS.reshape(-1).to(torch.int64)
    S = flat_S.numel()

    le_S = flat_S - rank * L
    local_S = (le_S >= 0) & (le_S < L)
    key_S = torch.where(local_S, le_S, torch.full_like(le_S, L))  # L = "not mine"
    counts_L1 = torch.zeros(L + 1, dtype=torch.int64, device=dev).scatter_add_(0, key_S, torch.ones_like(key_S))
    counts_L = counts_L1[:L]
    tiles_L, rows_L = padded_rows(counts_L, BM, half_tiles, tail_rows, packed)
    tile_end_L = torch.cumsum(tiles_L, 0)
    row_end_L = torch.cumsum(rows_L, 0)
    seg_start_L1 = torch.cat([row_end_L - rows_L, row_end_L.new_full((1,), R)])  # row where each expert starts
    start_unpadded_L1 = torch.cumsum(counts_L1, 0) - counts_L1

    sorted_key_S, order_S = torch.sort(key_S, stable=True)  # slots grouped by expert, ascending p inside
    within_S = torch.arange(S, device=dev) - start_unpadded_L1[sorted_key_S]
    dest_S = seg_start_L1[sorted_key_S] + within_S
    mine_S = sorted_key_S < L
    fits_S = mine_S & (dest_S < R)
    dest_S = torch.where(fits_S, dest_S, torch.full_like(dest_S, R))  # R = dump row, discarded

    sch = out if out is not None else empty_schedule(capacity=R, block_m=BM, local_experts=L, num_chunks=num_chunks,
                                                     device=dev, half_tiles=half_tiles, packed=packed)
    assert sch.chunk_tiles_C1.numel() == num_chunks + 1 and sch.row_code_R1.numel() == R + 1
    assert sch.tile_expert_M.numel() == M, "the schedule buffers were made for another tile layout"
    codes_R1 = sch.row_code_R1
    codes_R1.fill_(-1)
    codes_R1.scatter_(0, dest_S, order_S.to(torch.int32))
    codes_R1[R:].fill_(-1)  # a fill kernel: a Python-scalar setitem would copy from pageable host memory
    # tile -> expert: the first expert whose tile range ends after the tile (L past the last tile); tile -> row:
    # the expert's first row plus BM per earlier tile of the expert (only its last tile may differ)
    m_M = torch.arange(M, device=dev)
    e_M = torch.searchsorted(tile_end_L, m_M, right=True)
    e_c = e_M.clamp(max=max(L - 1, 0))
    used_rows = torch.clamp(row_end_L[-1:], max=R) if L > 0 else torch.zeros(1, dtype=torch.int64, device=dev)
    if L > 0:
        row_M = seg_start_L1[e_c] + (m_M - (tile_end_L[e_c] - tiles_L[e_c])) * BM
        in_use_M = (e_M < L) & (row_M < R)  # a tile starting past the capacity is dropped (its rows are counted)
    else:
        row_M = torch.zeros_like(m_M)
        in_use_M = torch.zeros_like(m_M, dtype=torch.bool)
    sch.tile_expert_M.copy_(torch.where(in_use_M, e_M, L))
    sch.tile_row_M1[:M].copy_(torch.where(in_use_M, row_M, used_rows))
    sch.tile_row_M1[M:].copy_(used_rows)
    num_tiles = in_use_M.sum().reshape(1)
    sch.num_tiles.copy_(num_tiles)
    c = torch.arange(num_chunks + 1, device=dev)
    sch.chunk_tiles_C1.copy_(num_tiles * c // num_chunks)
    sch.counts_L.copy_(counts_L)
    sch.overflow_rows.copy_((mine_S & ~fits_S).sum().reshape(1))
    return sch


def reference_schedule(idx_PS: torch.Tensor, *, rank: int, local_experts: int, block_m: int, capacity: int,
                       half_tiles: bool = False, tail_rows: int = 0,
                       packed: bool = False) -> tuple[list[int], list[int], int, list[int]]:
    """Plain-Python twin of :func:`build_schedule`: (row codes [R], tile experts [M], overflow rows,
    tile rows [M+1])."""
    flat = idx_PS.reshape(-1).tolist()
    L, BM, R = local_experts, block_m, capacity
    M = max_tiles(R, BM, half_tiles, packed, L)
    codes: list[int] = []
    tiles: list[int] = []
    starts: list[int] = []
    for e in range(L):
        mine = [p for p, g in enumerate(flat) if g == rank * L + e]
        sizes = [BM] * (len(mine) // BM)
        rest = len(mine) % BM
        if rest and packed:
            sizes.append(rest)  # no padding: the last tile is the rest
        elif rest and tail_rows and sizes and rest <= tail_rows:
            sizes[-1] += tail_rows  # the last full tile takes the rest as its tail
        elif rest and half_tiles and rest <= BM // 2:
            sizes.append(BM // 2)
        elif rest and tail_rows and rest <= BM // 2 + tail_rows:
            sizes.append(BM // 2 + tail_rows)
        elif rest:
            sizes.append(BM)
        for size in sizes:
            if len(codes) < R:  # a tile starting past the capacity is dropped
                starts.append(len(codes))
                tiles.append(e)
            codes += (mine[:size] + [-1] * size)[:size]
            mine = mine[size:]
    routed = sum(1 for g in flat if rank * L <= g < (rank + 1) * L)
    kept = sum(1 for c in codes[:R] if c >= 0)
    end = min(len(codes), R)
    codes = (codes + [-1] * R)[:R]
    tiles = tiles + [L] * (M - len(tiles))
    starts = starts + [end] * (M + 1 - len(starts))
    return codes, tiles, routed - kept, starts
