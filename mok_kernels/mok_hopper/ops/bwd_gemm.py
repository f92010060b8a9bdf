"""The bf16 backward's GEMMs (the stages of :mod:`mok_kernels.mok_hopper.twin.backward`; launched by
:mod:`mok_kernels.mok_hopper.train`; versions and measurements in the journal, lab/perf-notes.md: the bf16 backward).
Checked against the twin under the Triton interpreter, compiled for sm_90 without spills by ``aot_check``, and checked
against the harness's reference on an H200. Row-major weights: TMA descriptors where they are contiguous [L, K, N]
(dgate's W2, dX's W13), pointers through strides otherwise (W13 transposed, to recompute H).

* :func:`bwd_rows` - a grouped GEMM over the forward's row tiles, out[r] = A[r] @ W[e] with W[e] read [K, N]
  through strides, two epilogues:
  - ``dgate``: A = dO rows, W = W2 ([H, I]: K = H, N = I). From G = dO @ W2[e], the saved pre-SwiGLU H and clamp
    masks and the router weight s of each row: dH = [s G SwiGLU'_gate, s G SwiGLU'_up] (bf16 [R, 2I]), s*A (bf16
    [R, I], for dW2) and the router-weight gradient's partial sum over this column tile (fp32 [R, I / BN], summed
    over the tiles in a fixed order by :func:`router_grad`);
  - ``plain``: A = dH rows, W = W13 ([2I, H]: K = 2I, N = H): the dX rows (bf16 [R, H]), stored by row or pushed
    to the row's token slot (``push_code``); or, with ``save_clip``, H recomputed from the X rows.
* the weight gradients: :mod:`mok_kernels.mok_hopper.ops.bwd_wgrad`.

Legend: R routed rows, M row tiles (BM rows each, or BM/2 with half tiles), L local experts, H hidden, I ffn.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from contract.fp8 import FP8_MAX
from mok_kernels.mok_hopper.ops.gemm_common import _gather_rows, _mma, _quant_e4m3, _tiled_offset, _work_tile
from mok_kernels.mok_hopper.ops.interp import INTERPRET

FP8_MAX_C = tl.constexpr(FP8_MAX)  # (a global a jitted function reads must be a constexpr)


@triton.jit
def _bwd_rows_kernel(a_ptr, w_ptr, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, code_ptr, delta_ptr,
                     tile_expert_ptr, tile_row_ptr, chunk_ptr, n_rows, K, N, TK, stride_we, stride_wk, stride_wn, limit,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGS: tl.constexpr,
                     UPCAST: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, DGATE: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, SAVE_H: tl.constexpr = False, WTMA: tl.constexpr = False,
                     PUSH: tl.constexpr = False, TBN: tl.constexpr = 0, TBK: tl.constexpr = 0,
                     GU: tl.constexpr = False, RK: tl.constexpr = True, PAIR: tl.constexpr = False,
                     A_GATHER: tl.constexpr = 0):
    """Work items (row tile, column tile); a tile of any size (half tiles, tails) runs in BM-row blocks. PAIR: two
    BM-row blocks at a time where the tile has more than BM rows left, one weight block load for both (the
    weights are read once for a tile of up to 2 BM rows instead of once per block). A_GATHER (the top-k K, not
    with PUSH): ``a_ptr`` is per token, and row r's A row is token ``code[r] // K`` (``code_ptr``; rows with a
    negative code read zeros)."""
    m_lo = tl.load(chunk_ptr)
    m_hi = tl.load(chunk_ptr + 1)
    n_n = N // BN
    n_work = (m_hi - m_lo) * n_n
    for wk in range(tl.program_id(0), n_work, NUM_PROGS):
        m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
        for rb in range(row0, row1, 2 * BM if PAIR else BM):
            if PAIR and rb + BM < row1:
                _bwd_rows_block(a_ptr, w_ptr, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, code_ptr, delta_ptr,
                                rb, row1, n, n_n, e_tile, n_rows, K, N, TK, stride_we, stride_wk, stride_wn, limit,
                                BM, BN, BK, UPCAST, STAGES, DGATE, HAS_LIMIT, SAVE_H, WTMA, PUSH, TBN, TBK, GU, RK,
                                True, A_GATHER)
            else:
                _bwd_rows_block(a_ptr, w_ptr, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, code_ptr, delta_ptr,
                                rb, row1, n, n_n, e_tile, n_rows, K, N, TK, stride_we, stride_wk, stride_wn, limit,
                                BM, BN, BK, UPCAST, STAGES, DGATE, HAS_LIMIT, SAVE_H, WTMA, PUSH, TBN, TBK, GU, RK,
                                False, A_GATHER)


@triton.jit
def _bwd_rows_block(a_ptr, w_ptr, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, code_ptr, delta_ptr, row0, row1,
                    n, n_n, e_tile, n_rows, K, N, TK, stride_we, stride_wk, stride_wn, limit, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                    DGATE: tl.constexpr, HAS_LIMIT: tl.constexpr, SAVE_H: tl.constexpr, WTMA: tl.constexpr,
                    PUSH: tl.constexpr, TBN: tl.constexpr, TBK: tl.constexpr, GU: tl.constexpr, RK: tl.constexpr,
                    TWO: tl.constexpr, A_GATHER: tl.constexpr = 0):
    """Rows [row0, min(row0 + BM, row1)) x columns [n BN, (n + 1) BN) of expert ``e_tile``; TWO: and the next BM
    rows (up to row1), from the same weight block loads, each block's epilogue in turn. WTMA: ``w_ptr`` is a TMA
    descriptor over the weights' [L K, N] view (row-major [L, K, N]) with blocks [BK, BN]. A_GATHER: A's rows by
    token (:func:`_gather_rows`)."""
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    rmask = (rows < n_rows) & (rows < row1)
    a_rows, a_mask = _gather_rows(code_ptr, rows, rmask, A_GATHER)
    cols = n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    e = e_tile.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TWO:
        rows2 = rows + BM
        rmask2 = (rows2 < n_rows) & (rows2 < row1)
        a_rows2, a_mask2 = _gather_rows(code_ptr, rows2, rmask2, A_GATHER)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(a_ptr + a_rows[:, None] * K + (k0 + kk)[None, :], mask=a_mask[:, None], other=0.0)
        if TWO:
            a2 = tl.load(a_ptr + a_rows2[:, None] * K + (k0 + kk)[None, :], mask=a_mask2[:, None], other=0.0)
        if WTMA:
            b = w_ptr.load([e_tile * K + k0, n * BN])
        elif TBN > 0:  # weights in the forward's TMA block order: element (k, n) of W[e] by index arithmetic
            kv = (k0 + kk)[:, None].to(tl.int64)
            nv = cols[None, :].to(tl.int64)
            if RK:  # the forward's rows are this GEMM's K (dgate's W2, dX's W13)
                b = tl.load(w_ptr + _tiled_offset(e, kv, nv, K, N, TBN, TBK, GU))
            else:  # the forward's rows are N (W13 transposed, to recompute H)
                b = tl.load(w_ptr + _tiled_offset(e, nv, kv, N, K, TBN, TBK, GU))
        else:
            b = tl.load(w_ptr + e * stride_we + (k0 + kk)[:, None].to(tl.int64) * stride_wk
                        + cols[None, :].to(tl.int64) * stride_wn)
        acc = _mma(a, b, acc, UPCAST)
        if TWO:
            acc2 = _mma(a2, b, acc2, UPCAST)
    _bwd_rows_epilogue(acc, rows, rmask, cols, n, n_n, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, code_ptr,
                       delta_ptr, N, TK, limit, DGATE, HAS_LIMIT, SAVE_H, PUSH)
    if TWO:
        _bwd_rows_epilogue(acc2, rows2, rmask2, cols, n, n_n, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr,
                           code_ptr, delta_ptr, N, TK, limit, DGATE, HAS_LIMIT, SAVE_H, PUSH)


@triton.jit
def _bwd_rows_epilogue(acc, rows, rmask, cols, n, n_n, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, code_ptr,
                       delta_ptr, N, TK, limit, DGATE: tl.constexpr, HAS_LIMIT: tl.constexpr, SAVE_H: tl.constexpr,
                       PUSH: tl.constexpr, SA: tl.constexpr = True, dhq_ptr=None, dhs_ptr=None,
                       QUANT: tl.constexpr = False):
    """One [BM, BN] block of :func:`_bwd_rows_block`'s results: the dgate epilogue, the push, or a plain store.
    SA (dgate): store s*A too (the fused dgate of :mod:`mok_kernels.mok_hopper.ops.bwd_fused` uses it in place). QUANT
    (dgate, fp8: :mod:`mok_kernels.mok_hopper.ops.bwd_fp8`, BN = 128): dH also as e4m3 from its fp32 values, one scale
    per 1 x BN block of each row (``dhq_ptr`` [R, 2N], ``dhs_ptr`` [R, 2N / BN]: gate blocks, then up blocks)."""
    if DGATE:  # N = I: G = dO @ W2[e]; H and the masks are [R, 2I] (gate columns, then up columns)
        h_off = rows[:, None] * (2 * N) + cols[None, :]
        g = tl.load(h_ptr + h_off, mask=rmask[:, None], other=0.0).to(tl.float32)
        u = tl.load(h_ptr + h_off + N, mask=rmask[:, None], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
        if HAS_LIMIT:
            clip_g = tl.load(clip_ptr + h_off, mask=rmask[:, None], other=0) != 0
            clip_u = tl.load(clip_ptr + h_off + N, mask=rmask[:, None], other=0) != 0
            g = tl.where(clip_g, limit, tl.minimum(g, limit))
            u = tl.where(clip_u, tl.where(u > 0, limit, -limit), tl.minimum(tl.maximum(u, -limit), limit))
        sig = tl.sigmoid(g)
        silu = g * sig
        act = silu * u
        d_act = acc * s[:, None]
        dg = d_act * u * (sig * (1.0 + g * (1.0 - sig)))
        du = d_act * silu
        if HAS_LIMIT:
            dg = tl.where(clip_g, 0.0, dg)
            du = tl.where(clip_u, 0.0, du)
        tl.store(out_ptr + h_off, dg.to(tl.bfloat16), mask=rmask[:, None])
        tl.store(out_ptr + h_off + N, du.to(tl.bfloat16), mask=rmask[:, None])
        if QUANT:
            qg, sg = _quant_e4m3(dg, FP8_MAX_C)
            tl.store(dhq_ptr + h_off, qg, mask=rmask[:, None])
            tl.store(dhs_ptr + rows * (2 * n_n) + n, sg, mask=rmask)
            qu, su = _quant_e4m3(du, FP8_MAX_C)
            tl.store(dhq_ptr + h_off + N, qu, mask=rmask[:, None])
            tl.store(dhs_ptr + rows * (2 * n_n) + n_n + n, su, mask=rmask)
        if SA:
            tl.store(sa_ptr + rows[:, None] * N + cols[None, :], (act * s[:, None]).to(tl.bfloat16),
                     mask=rmask[:, None])
        tl.store(ds_ptr + rows * n_n + n, tl.sum(acc * act, axis=1), mask=rmask)
    elif PUSH:  # each row to its slot in its source rank's buffer (padding rows, code < 0, go nowhere)
        code = tl.load(code_ptr + rows, mask=rmask, other=-1)
        valid = code >= 0
        c = tl.where(valid, code, 0)
        d = tl.multiple_of(tl.load(delta_ptr + c // TK, mask=valid, other=0), 16)
        slot = (c % TK).to(tl.int64)
        tl.store(out_ptr + (d + slot * N)[:, None] + cols[None, :], acc.to(tl.bfloat16), mask=valid[:, None])
    else:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=rmask[:, None])
        if SAVE_H:  # N = 2I: the recomputed pre-SwiGLU H, and where the forward's clamp clipped it (fp32 decisions)
            up = cols >= N // 2
            clipped = tl.where(up[None, :], (acc > limit) | (acc < -limit), acc > limit)
            tl.store(clip_ptr + rows[:, None] * N + cols[None, :], clipped.to(tl.uint8), mask=rmask[:, None])


def bwd_rows(a_RK: torch.Tensor, w_LKN: torch.Tensor, out: torch.Tensor, tile_expert_M: torch.Tensor,
             tile_row_M1: torch.Tensor, chunk_2: torch.Tensor, *, block_m: int, programs: int,
             block_n: Optional[int] = None, block_k: int = 64, stages: int = 3, group_m: int = 4,
             dgate: Optional[dict] = None, limit: Optional[float] = None,
             save_clip: Optional[torch.Tensor] = None, push_code: Optional[torch.Tensor] = None,
             push_delta: Optional[torch.Tensor] = None, slots_per_rank: Optional[int] = None,
             num_warps: int = 8, w_tiles: Optional[tuple[int, int, bool, bool]] = None,
             w_dims: Optional[tuple[int, int]] = None, pair: bool = False,
             a_code: Optional[torch.Tensor] = None, a_gather_k: int = 0) -> None:
    """out[r] = a[r] @ w[e(r)] over the row tiles [chunk_2[0], chunk_2[1]) (``w`` [L, K, N], any strides: W2
    [L, H, I] as is, W13 [L, 2I, H] as is, W13.transpose(1, 2) to recompute H). ``dgate`` = dict(h=[R, 2I] bf16,
    clip=[R, 2I] uint8 or None, s=[R] fp32, sa=[R, N] bf16 out, ds=[R, N / block_n] fp32 out): the dgate epilogue,
    ``out`` [R, 2N] is dH. ``save_clip`` (uint8 [R, N], with ``limit``; N = 2I): out is the recomputed H and this
    gets the clamp's decisions, made on the fp32 accumulators as the forward makes them.
    ``push_code`` (int32 [R]): row r goes to row ``push_code[r]`` of ``out`` instead (rows with a negative code
    nowhere): the dX rows straight into their token slots; with ``push_delta`` (int64 [P], the element offsets
    from ``out`` to every rank's copy, as the forward's push takes them) and ``slots_per_rank`` (T K), into slot
    ``code % TK`` of rank ``code // TK``'s copy. Weights given as a contiguous [L, K, N] tensor are read
    through a TMA descriptor (blocks [block_k, block_n]) on CUDA; other strides (W13 transposed, to recompute H)
    by pointers. ``w_tiles`` (bn, bk, gate/up interleaved, the forward's rows are K): ``w_LKN`` is the forward's
    tiled weight tensor (``tile_weights`` / ``tile_weights_gu`` with blocks bn x bk), its plain shape [L, NF, KF]
    given by ``w_dims`` (NF, KF); read by pointers.
    ``block_n``: 32 for dgate (its epilogue holds eight [BM, BN] fp32 tiles: 64 wide spilled at BM 128, aot_check),
    else 64. ``pair``: where a tile has more than ``block_m`` rows left, two row blocks from one weight load (the
    same sums per row: each row's dot products are those of the single block). ``a_gather_k`` (the top-k K) with
    ``a_code`` (int32 [R], the rows' codes): ``a_RK`` is per token ([T, K]) and row r reads token
    ``a_code[r] // a_gather_k`` (the output gradient's rows gathered in the kernel; padding rows read zeros)."""
    K = a_RK.shape[1]
    R = a_RK.shape[0] if not a_gather_k else a_code.shape[0]
    assert not a_gather_k or push_code is None, "a gathered A takes the code pointer a push needs"
    if w_tiles is not None:
        NF, KF = w_dims
        N = KF if w_tiles[3] else NF
        assert (NF if w_tiles[3] else KF) == K, f"tiled w of forward dims {w_dims} does not take K = {K}"
    else:
        N = w_LKN.shape[2]
        assert w_LKN.shape[1] == K, "w must be [L, K, N]"
    block_n = block_n or (32 if dgate is not None else 64)
    assert save_clip is None or (dgate is None and limit is not None and save_clip.shape == (R, N))
    assert K % block_k == 0 and N % block_n == 0, f"K {K} / N {N} must be multiples of the tile ({block_k}, {block_n})"
    d = dgate or {}
    if dgate is not None:
        assert out.shape == (R, 2 * N) and d["ds"].shape == (R, N // block_n)
    clip = save_clip if save_clip is not None else (d.get("clip") if limit is not None else None)
    if push_delta is None:  # one rank: slots of ``out`` itself
        delta, tk = torch.zeros(1, dtype=torch.int64, device=out.device), 1 << 30
    else:
        delta, tk = push_delta, slots_per_rank
    wtma = w_LKN.is_cuda and w_LKN.is_contiguous() and w_tiles is None
    w = w_LKN
    if wtma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w = TensorDescriptor.from_tensor(w_LKN.reshape(-1, N), [block_k, block_n])
    _bwd_rows_kernel[(programs,)](
        a_RK, w, out, d.get("h", out), clip if clip is not None else out, d.get("s", out), d.get("sa", out),
        d.get("ds", out), push_code if push_code is not None else (a_code if a_gather_k else tile_row_M1), delta,
        tile_expert_M, tile_row_M1,
        chunk_2, R, K, N, tk, w_LKN.stride(0), w_LKN.stride(1) if w_tiles is None else 0,
        w_LKN.stride(2) if w_tiles is None else 0, 0.0 if limit is None else float(limit),
        BM=block_m, BN=block_n, BK=block_k, NUM_PROGS=programs, UPCAST=INTERPRET, GROUP_M=group_m, STAGES=stages,
        DGATE=dgate is not None, HAS_LIMIT=dgate is not None and limit is not None, SAVE_H=save_clip is not None,
        WTMA=wtma, PUSH=push_code is not None, TBN=w_tiles[0] if w_tiles else 0, TBK=w_tiles[1] if w_tiles else 0,
        GU=bool(w_tiles and w_tiles[2]), RK=bool(w_tiles[3]) if w_tiles else True, PAIR=pair,
        num_warps=num_warps, **(dict(A_GATHER=a_gather_k) if a_gather_k else {}))


@triton.jit
def _dgate_epilogue_kernel(g_ptr, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, end_ptr, R, N, limit,
                           BM: tl.constexpr, BN: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """dgate's epilogue (:func:`_bwd_rows_epilogue`) over a G = dO @ W2 computed elsewhere (bf16 [R, N]), rows
    below ``end`` (the last expert's end: G's rows past it were never written)."""
    m = tl.program_id(0)
    n = tl.program_id(1)
    end = tl.load(end_ptr)
    if m * BM < end:
        rows = (m * BM + tl.arange(0, BM)).to(tl.int64)
        rmask = (rows < R) & (rows < end)
        cols = n * BN + tl.arange(0, BN)
        acc = tl.load(g_ptr + rows[:, None] * N + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        _bwd_rows_epilogue(acc, rows, rmask, cols, n, N // BN, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr,
                           end_ptr, end_ptr, N, 1, limit, True, HAS_LIMIT, False, False)


def dgate_grouped_mm(dO_RH: torch.Tensor, w2_LHI: torch.Tensor, dH_R2I: torch.Tensor, expert_row_L1: torch.Tensor,
                     *, dgate: dict, limit: Optional[float], block_n: int, block_m: int = 32) -> None:
    """dgate as two steps (an option beside :func:`bwd_rows`' fused epilogue): G = dO rows @ W2[e] by
    ``torch._grouped_mm`` over the experts' row ranges (``expert_row_L1``, starting at row 0; bf16 G), then
    :func:`_dgate_epilogue_kernel` (``dgate`` as for :func:`bwd_rows`; ``ds`` [R, I / block_n]). G is rounded to
    bf16 once more than in the fused epilogue, which works on the fp32 accumulators."""
    R, I = dO_RH.shape[0], w2_LHI.shape[2]
    g = torch._grouped_mm(dO_RH, w2_LHI, offs=expert_row_L1[1:])
    clip = dgate.get("clip") if limit is not None else None
    assert I % block_n == 0 and dgate["ds"].shape == (R, I // block_n)
    _dgate_epilogue_kernel[(triton.cdiv(R, block_m), I // block_n)](
        g, dH_R2I, dgate["h"], clip if clip is not None else g, dgate["s"], dgate["sa"], dgate["ds"],
        expert_row_L1[-1:], R, I,
        0.0 if limit is None else float(limit), BM=block_m, BN=block_n, HAS_LIMIT=limit is not None, num_warps=8)


@triton.jit
def _push_scalars_kernel(code_ptr, v_ptr, out_ref, out_delta, R, TK, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    code = tl.load(code_ptr + rows, mask=rows < R, other=-1)
    valid = code >= 0
    c = tl.where(valid, code, 0)
    d = tl.load(out_delta + c // TK, mask=valid, other=0)
    tl.store(out_ref + d + (c % TK).to(tl.int64), tl.load(v_ptr + rows, mask=valid, other=0.0), mask=valid)


def push_scalars(code_R: torch.Tensor, v_R: torch.Tensor, out_ref: torch.Tensor, out_delta_P: torch.Tensor,
                 slots_per_rank: int) -> None:
    """out[rank code // TK][code % TK] = v[r] for every row with a code >= 0 (fp32; one writer per slot): the
    router-weight gradient of each row to its source rank."""
    R = code_R.numel()
    br = 256
    _push_scalars_kernel[(triton.cdiv(R, br),)](code_R, v_R, out_ref, out_delta_P, R, slots_per_rank, BR=br,
                                                 num_warps=4)


def router_grad(ds_parts_RN: torch.Tensor) -> torch.Tensor:
    """The router-weight gradient of every row: the dgate epilogue's partial sums over its column tiles, summed by
    torch (fp32; a fixed reduction tree for a given shape, no atomics: deterministic)."""
    return ds_parts_RN.sum(dim=1)
