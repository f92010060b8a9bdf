"""What the two grouped GEMMs share: the MMA steps, the work-item order over (row tile, column tile), operand
loads (pointers or TMA descriptors, row-major or tiled weights), the tails' extra rows, the wait on the pull's
ready counters, the 1 x N e4m3 quantisation of an output block, and the weights' TMA block order
(:func:`tile_weights`, inverted by :func:`untile_weights`; :func:`adopted_dims` checks weights a layer adopts in
place)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mok_kernels.mok_hopper.tiles import TileConfig


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
def _quant_e4m3(v, FP8_MAX_: tl.constexpr, AXIS: tl.constexpr = 1):
    """Row-wise 1xN block quantisation of an fp32 block [R, N]: (e4m3 values, fp32 scale [R]). AXIS 0: column-wise,
    one scale per column over the R rows (fp32 scale [N]; the fp8 weight gradients' token blocks)."""
    amax = tl.max(tl.abs(v), axis=AXIS)
    scale = tl.maximum(amax, 1e-12) / FP8_MAX_
    if AXIS == 1:
        q = v / scale[:, None]
    else:
        q = v / scale[None, :]
    q = tl.minimum(tl.maximum(q, -FP8_MAX_), FP8_MAX_)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _wait_counts(count_ptr, g0, g1, NEED, SPIN: tl.constexpr, TMA: tl.constexpr, end=None):
    """Wait until counters [g0, g1) each reach ``NEED`` (acquire, GPU scope); with ``end``, counter g only its
    granule's rows below ``end``: min(end - g * NEED, NEED). The interpreter runs the producer to completion first, so
    it does not spin (``SPIN`` off). TMA reads through the async proxy: fence it after the acquire."""
    if SPIN:
        for g in range(g0, g1):
            if end is None:
                need = NEED
            else:
                need = tl.minimum(end - g * NEED, NEED)
            n = tl.atomic_add(count_ptr + g, 0, sem="acquire", scope="gpu")
            while n < need:
                n = tl.atomic_add(count_ptr + g, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        if TMA:
            tl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)


@triton.jit
def _wait_rows(ready_ptr, row0, row1, GRAN: tl.constexpr, SPIN: tl.constexpr, TMA: tl.constexpr):
    """Wait until the pull has written rows [row0, row1) (its per-granule counters)."""
    _wait_counts(ready_ptr, row0 // GRAN, row1 // GRAN, GRAN, SPIN, TMA)


@triton.jit
def _wait_rows_packed(ready_ptr, row0, row1, r_end, GRAN: tl.constexpr, SPIN: tl.constexpr, TMA: tl.constexpr):
    """Packed rows (``TileConfig.packed_rows``; tiles start on any row): wait until the pull has written rows
    [row0, row1), i.e. until every granule they touch counts its rows below ``r_end`` (the chunk's last row; rows
    of a granule before ``row0`` are earlier tiles', pulled by this chunk's pull or an earlier one, which finished
    before this chunk's began)."""
    _wait_counts(ready_ptr, row0 // GRAN, (row1 + GRAN - 1) // GRAN, GRAN, SPIN, TMA, r_end)


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


def untile_weights(w_tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`tile_weights`: [L, N/bn, K/bk, bn, bk] -> W [L, N, K] (a copy; bn, bk from the shape)."""
    assert w_tiled.dim() == 5, f"tiled weights are [L, N/bn, K/bk, bn, bk], got shape {tuple(w_tiled.shape)}"
    L, nn_, nk, bn, bk = w_tiled.shape
    return w_tiled.permute(0, 1, 3, 2, 4).reshape(L, nn_ * bn, nk * bk)


def untile_weights_gu(w_tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`tile_weights_gu`: [L, I/bn, H/bk, 2bn, bk] -> W13 [L, 2I, H] (gate rows, then up rows;
    a copy)."""
    assert w_tiled.dim() == 5 and w_tiled.shape[3] % 2 == 0, \
        f"gate/up tiled weights are [L, I/bn, H/bk, 2bn, bk], got shape {tuple(w_tiled.shape)}"
    L, nn_, nk, bn2, bk = w_tiled.shape
    w = w_tiled.reshape(L, nn_, nk, bn2 // 2, 2, bk)  # [L, n, k, row, gate/up, col]
    return w.permute(0, 4, 1, 3, 2, 5).reshape(L, nn_ * bn2, nk * bk)


def layout_shapes(L: int, I: int, H: int, cfg: TileConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of (w13, w2) in the layout the layer's GEMMs read with ``cfg``: plain [L, 2I, H] / [L, H, I], or
    the TMA block order of ``tile_weights`` (``w_tiled``; w13 by ``tile_weights_gu`` with ``up_fused``)."""
    if not cfg.w_tiled:
        return (L, 2 * I, H), (L, H, I)
    bn, bk, dn, dk = cfg.up_n, cfg.up_k, cfg.down_n, cfg.down_k
    w13 = (L, I // bn, H // bk, 2 * bn, bk) if cfg.up_fused else (L, 2 * I // bn, H // bk, bn, bk)
    return w13, (L, H // dn, I // dk, dn, dk)


def adopted_dims(w13: torch.Tensor, w2: torch.Tensor, tile: Optional[TileConfig], precision: str) -> tuple[int, ...]:
    """(L, I, H) of weights a layer adopts without a copy; a one-line ValueError where they cannot be adopted."""
    if tile is None:
        raise ValueError("adopt_weights: pass the tile the weights are laid out for (tile=...)")
    if precision != "bf16":
        raise ValueError(f"adopt_weights: bf16 weights only (got precision={precision!r}: fp8 weights are "
                         f"quantised copies)")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != torch.bfloat16 or not w.is_contiguous() or w.device != w13.device:
            raise ValueError(f"adopt_weights: {name} must be contiguous bf16 on {w13.device}, got {w.dtype} "
                             f"contiguous={w.is_contiguous()} on {w.device}")
    dims = 5 if tile.w_tiled else 3
    if w13.dim() != dims or w2.dim() != dims:
        raise ValueError(f"adopt_weights: the tile (w_tiled={tile.w_tiled}) wants {dims}-D weights, got w13 "
                         f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    L = w13.shape[0]
    H = w13.shape[2] * (tile.up_k if tile.w_tiled else 1)
    I = w2.shape[2] * (tile.down_k if tile.w_tiled else 1)
    want = layout_shapes(L, I, H, tile)
    if (tuple(w13.shape), tuple(w2.shape)) != want:
        raise ValueError(f"adopt_weights: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} are not the layout of the "
                         f"tile (w_tiled={tile.w_tiled}, up_fused={tile.up_fused}): want {want[0]} / {want[1]}")
    return L, I, H


def adjacent_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[1, 2I, H] over gate [I, H] and up [I, H] when they are the two halves of one contiguous tensor (no copy)."""
    I, H = gate.shape
    if (tuple(up.shape) != (I, H) or not gate.is_contiguous() or not up.is_contiguous() or up.dtype != gate.dtype
            or up.untyped_storage().data_ptr() != gate.untyped_storage().data_ptr()
            or up.storage_offset() != gate.storage_offset() + I * H):
        raise ValueError("adopt_weights: the shared gate and up weights must be the two halves of one contiguous "
                         "[2I, H] tensor (the shared expert's up GEMM reads them as one)")
    return gate.detach().new_empty(0).set_(gate.untyped_storage(), gate.storage_offset(), (1, 2 * I, H))


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


@triton.jit
def _gather_rows(code_ptr, rows, rmask, GATHER: tl.constexpr, LIVE: tl.constexpr = False):
    """(source rows, mask) of schedule rows ``rows``: themselves (masked by ``rmask``, and with LIVE where the
    code is negative too), or with GATHER (the top-k K) the token of each row's code (``code // K``), masked where
    the code is negative (padding rows: their values are zeros, where a gathered copy held token 0's row; either
    way the sums skip them or weigh them by 0)."""
    if GATHER > 0:
        code = tl.load(code_ptr + rows, mask=rmask, other=-1)
        valid = rmask & (code >= 0)
        return (tl.where(valid, code, 0) // GATHER).to(tl.int64), valid
    elif LIVE:
        return rows, rmask & (tl.load(code_ptr + rows, mask=rmask, other=-1) >= 0)
    else:
        return rows, rmask


@triton.jit
def _tiled_offset(e, r, c, NF, KF, TBN: tl.constexpr, TBK: tl.constexpr, GU: tl.constexpr):
    """Element offset of W[e, r, c] (W [L, NF, KF] as the forward reads it: NF output rows, KF input columns) in
    the forward's TMA block order: :func:`~mok_kernels.mok_hopper.ops.gemm_common.tile_weights` ([L, NF/TBN, KF/TBK,
    TBN, TBK]) or, GU, ``tile_weights_gu`` (gate row j and up row j of block j // TBN at rows 2 (j % TBN) and
    2 (j % TBN) + 1 of a [2 TBN, TBK] block)."""
    base = e * NF * KF + (c // TBK) * (TBK * (2 * TBN if GU else TBN)) + c % TBK
    if GU:
        half = NF // 2
        up = (r >= half).to(tl.int64)
        j = r - up * half
        return base + (j // TBN) * (2 * TBN * KF) + (2 * (j % TBN) + up) * TBK
    return base + (r // TBN) * (TBN * KF) + (r % TBN) * TBK
