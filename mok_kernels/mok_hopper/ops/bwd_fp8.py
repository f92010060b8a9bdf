"""The fp8 backward's GEMMs, the recipe of :func:`mok_kernels.mok_hopper.twin.backward.expert_backward_fp8`:
e4m3 operands, fp32 accumulation, every block's product promoted by its scales. Launched by
:func:`expert_backward` (the four stages of one rank's routed rows; :mod:`mok_kernels.mok_hopper.train` calls it).

* :func:`fp8_rows` - the dgrad GEMMs over the forward's row tiles, out[r] = A[r] @ W[e] with A in 1 x 128 blocks
  (e4m3 rows + fp32 scales [R, K / 128]) and W given as W^T, the forward's e4m3 values transposed [L, N, K], with W's
  128 x 128 block scales [L, K / 128, N / 128] (128 x 128 blocks are those of W^T too: no second quantisation).
  Epilogues of :func:`mok_kernels.mok_hopper.ops.bwd_gemm._bwd_rows_epilogue`:
  - ``dgate``: A = dO rows (quantised at their source rank by the stage kernel, pulled as e4m3), W = W2 [H, I];
    dH (bf16, for dW13), dH again as e4m3 1 x 128 along 2I from its fp32 values (for dX: the quantisation fused into
    the epilogue that produces dH, no pass over it), s*A (bf16) and the router-weight gradient's partial sums;
  - ``push``: A = dH (e4m3), W = W13 [2I, H]: the dX rows (bf16) pushed to their token slots / source ranks.
* :func:`fp8_wgrad` - dW[e] = P_e^T Q_e over each expert's rows, both operands quantised along the tokens in 128-row
  blocks from the expert's first row (one scale per block and column): from bf16 rows (dH, s*A) or from 1 x 128
  e4m3 rows, dequantised first (X, dO: the forward keeps X only in fp8, and dO arrives quantised). One pass over each
  operand quantises it and writes it transposed (:func:`token_quantise_t`: the tokens contiguous, K-major, as
  Hopper's e4m3 MMA needs), then the e4m3 GEMM. No split-K, no atomics: bitwise deterministic.

Hopper's e4m3 MMA (QGMMA) takes both operands K-major only. The dgrad GEMMs reduce over W's rows, so a training layer
keeps W^T in e4m3 (the same values; 1 byte a parameter); v0 read W row-major, and Triton's transposes in the loop ran
dgate and dX at 7-10x their floors (the journal, lab/perf-notes.md: the fp8 backward v0). The wgrad quantised its
operands inside the GEMM in v0 (no pass over memory) and ran at 6x its store floor; v1 quantises them in a pass of their
own.

The passes over memory that remain outside the GEMMs: the stage's quantisation of dO (one read of [T, H] bf16, as the
forward's x), the four token-axis quantisations of the wgrad operands (dH and s*A bf16, X and dO e4m3: about
0.6 GB on glm_5_2 at EP=1, against the 19 GB of weight gradients written) and the router-weight gradient's sum over
the column tiles (:func:`~mok_kernels.mok_hopper.ops.bwd_gemm.router_grad`). The shared expert stays bf16, as in the
forward.

Legend: R routed rows, L local experts, H hidden, I ffn, N / K a GEMM's output / reduction dims.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl

from mok_kernels.mok_hopper.ops.bwd_gemm import FP8_MAX_C, _bwd_rows_epilogue, router_grad
from mok_kernels.mok_hopper.ops.bwd_wgrad import _store_dw
from mok_kernels.mok_hopper.ops.gemm_common import _gather_rows, _mm, _quant_e4m3, _work_tile
from mok_kernels.mok_hopper.ops.interp import INTERPRET

BLOCK = 128  # the format's block: 1 x 128 activations, 128 x 128 weights, 128-row token blocks for the wgrad
E4M3 = torch.float8_e4m3fn


@triton.jit
def _fp8_rows_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr, dhq_ptr,
                     dhs_ptr, code_ptr, delta_ptr, tile_expert_ptr, tile_row_ptr, chunk_ptr, n_rows, K, N, TK, limit,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGS: tl.constexpr,
                     UPCAST: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, DGATE: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, WTMA: tl.constexpr, PUSH: tl.constexpr):
    """Work items (row tile, column tile), each tile in BM-row blocks; K steps of BK = 128 (one scale block of A and
    of W). The weights come transposed, W^T contiguous [L, N, K] (K-major, as Hopper's e4m3 MMA needs): WTMA:
    ``w_ptr`` is a TMA descriptor over its [L N, K] view, blocks [BN, BK]. Each column's weight scale is that of its
    128-column block (BN may span several); the scales are W's, [L, K / 128, N / 128]."""
    m_lo = tl.load(chunk_ptr)
    m_hi = tl.load(chunk_ptr + 1)
    n_n = N // BN
    n_work = (m_hi - m_lo) * n_n
    KB = K // BK
    NB = N // 128
    kk = tl.arange(0, BK)
    for wk in range(tl.program_id(0), n_work, NUM_PROGS):
        m, n, e_tile, row0, row1 = _work_tile(wk, tile_expert_ptr, tile_row_ptr, m_lo, m_hi, n_n, GROUP_M)
        e = e_tile.to(tl.int64)
        cols = n * BN + tl.arange(0, BN)
        wsc = ws_ptr + e * KB * NB + cols // 128  # [BN]: each column's weight-scale block, at K block 0
        for rb in range(row0, row1, BM):
            rows = (rb + tl.arange(0, BM)).to(tl.int64)
            rmask = (rows < n_rows) & (rows < row1)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in tl.range(0, K, BK, num_stages=STAGES):
                a = tl.load(a_ptr + rows[:, None] * K + (k0 + kk)[None, :], mask=rmask[:, None], other=0.0)
                sa = tl.load(as_ptr + rows * KB + k0 // BK, mask=rmask, other=0.0)
                if WTMA:  # W^T's [BN, BK] block, K contiguous: Hopper's e4m3 MMA takes K-major operands only
                    b = w_ptr.load([e_tile * N + n * BN, k0]).T
                else:
                    b = tl.load(w_ptr + e * N * K + cols[None, :].to(tl.int64) * K + (k0 + kk)[:, None])
                sw = tl.load(wsc + (k0 // BK) * NB)
                acc += _mm(a, b, UPCAST) * (sa[:, None] * sw[None, :])
            _bwd_rows_epilogue(acc, rows, rmask, cols, n, n_n, out_ptr, h_ptr, clip_ptr, s_ptr, sa_ptr, ds_ptr,
                               code_ptr, delta_ptr, N, TK, limit, DGATE, HAS_LIMIT, False, PUSH, True, dhq_ptr,
                               dhs_ptr, DGATE)


def fp8_rows(a_RK: torch.Tensor, a_scale: torch.Tensor, wt_LNK: torch.Tensor, w_scale: torch.Tensor,
             out: torch.Tensor, tile_expert_M: torch.Tensor, tile_row_M1: torch.Tensor, chunk_2: torch.Tensor, *,
             block_m: int, programs: int, block_n: int = 128, stages: int = 3, group_m: int = 4,
             dgate: Optional[dict] = None, limit: Optional[float] = None, push_code: Optional[torch.Tensor] = None,
             push_delta: Optional[torch.Tensor] = None, slots_per_rank: Optional[int] = None,
             num_warps: int = 8) -> None:
    """out[r] = a[r] @ w[e(r)] in fp8 over the row tiles [chunk_2[0], chunk_2[1]): ``a`` e4m3 [R, K] with
    ``a_scale`` fp32 [R, K / 128]; the weights given transposed, ``wt`` contiguous e4m3 [L, N, K] (W2^T [L, I, H] for
    dgate, W13^T [L, H, 2I] for dX: the layer's ``w2_bwd`` / ``w13_bwd``), with W's scales ``w_scale`` fp32
    [L, K / 128, N / 128] (the 128 x 128 blocks of W^T are W's, transposed).
    ``dgate`` = dict(h, clip, s, sa, ds, dhq, dhs): the dgate epilogue (as :func:`~mok_kernels.mok_hopper.ops.bwd_gemm.
    bwd_rows`; ``out`` is dH bf16 [R, 2N]; ``dhq`` e4m3 [R, 2N] and ``dhs`` fp32 [R, 2N / 128] get dH in 1 x 128
    blocks; ``block_n`` must be 128). ``push_code`` / ``push_delta`` / ``slots_per_rank``: the dX rows to their
    token slots, as :func:`~mok_kernels.mok_hopper.ops.bwd_gemm.bwd_rows`."""
    R, K = a_RK.shape
    L, N, Kw = wt_LNK.shape
    assert a_RK.dtype == E4M3 and wt_LNK.dtype == E4M3 and wt_LNK.is_contiguous() and Kw == K, \
        "fp8_rows: e4m3 rows [R, K] and contiguous transposed e4m3 weights [L, N, K]"
    assert K % BLOCK == 0 and N % BLOCK == 0 and (BLOCK % block_n == 0 or block_n % BLOCK == 0), \
        f"K {K} / N {N} must be multiples of {BLOCK}, block_n ({block_n}) divide or be a multiple of it"
    assert a_scale.shape == (R, K // BLOCK) and w_scale.shape == (L, K // BLOCK, N // BLOCK)
    d = dgate or {}
    if dgate is not None:
        assert block_n == BLOCK, "the dgate epilogue quantises dH in 1 x 128 blocks: block_n must be 128"
        assert out.shape == (R, 2 * N) and d["ds"].shape == (R, N // block_n)
        assert d["dhq"].shape == (R, 2 * N) and d["dhs"].shape == (R, 2 * N // BLOCK)
    if push_delta is None:
        delta, tk = torch.zeros(1, dtype=torch.int64, device=out.device), 1 << 30
    else:
        delta, tk = push_delta, slots_per_rank
    wtma = wt_LNK.is_cuda
    w = wt_LNK
    if wtma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w = TensorDescriptor.from_tensor(wt_LNK.reshape(-1, K), [block_n, BLOCK])
    clip = d.get("clip") if limit is not None else None
    _fp8_rows_kernel[(programs,)](
        a_RK, a_scale, w, w_scale, out, d.get("h", out), clip if clip is not None else out, d.get("s", out),
        d.get("sa", out), d.get("ds", out), d.get("dhq", out), d.get("dhs", out),
        push_code if push_code is not None else tile_row_M1, delta, tile_expert_M, tile_row_M1, chunk_2, R, K, N, tk,
        0.0 if limit is None else float(limit), BM=block_m, BN=block_n, BK=BLOCK, NUM_PROGS=programs,
        UPCAST=INTERPRET, GROUP_M=group_m, STAGES=stages, DGATE=dgate is not None,
        HAS_LIMIT=dgate is not None and limit is not None, WTMA=wtma, PUSH=push_code is not None,
        num_warps=num_warps)


@triton.jit
def _tok_quant_t_kernel(src_ptr, srcs_ptr, dst_ptr, dsts_ptr, code_ptr, expert_row_ptr, block_base_ptr, C, RP, L,
                        BR: tl.constexpr, BC: tl.constexpr, FP8: tl.constexpr, NUM_PROGS: tl.constexpr):
    """Work items (expert, column block): the expert's j-th 128-row token block of ``src`` [R, C] (``src`` e4m3 with
    1 x 128 scales if FP8, dequantised first) quantised to e4m3 with one scale per column, written transposed into
    slot ``block_base[e] + j`` of ``dst`` [C, RP] (columns [slot 128, slot 128 + 128): the tokens contiguous,
    K-major for the GEMM; rows past the expert's end and padding rows as zeros) and its scales into row ``slot`` of
    ``dsts`` [blocks, C]. Offsets in int32 (the launcher checks the sizes)."""
    n_c = C // BC
    r_off = tl.arange(0, BR)
    for wk in range(tl.program_id(0), L * n_c, NUM_PROGS):
        e = wk // n_c
        c = wk % n_c
        r_lo = tl.load(expert_row_ptr + e)
        r_hi = tl.load(expert_row_ptr + e + 1)
        b0 = tl.load(block_base_ptr + e)
        cols = c * BC + tl.arange(0, BC)
        for r0 in range(r_lo, r_hi, BR):
            rows = r0 + r_off
            _, live = _gather_rows(code_ptr, rows, rows < r_hi, 0, True)  # padding rows: 0
            v = tl.load(src_ptr + rows[:, None] * C + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            if FP8:
                v = v * tl.load(srcs_ptr + rows * (C // 128) + (c * BC) // 128, mask=live, other=0.0)[:, None]
            q, scale = _quant_e4m3(v, FP8_MAX_C, 0)
            slot = b0 + (r0 - r_lo) // BR
            tl.store(dst_ptr + cols[None, :] * RP + (slot * BR + r_off)[:, None], q)
            tl.store(dsts_ptr + slot * C + cols, scale)


@triton.jit
def _fp8_wgrad_kernel(pt_ptr, ps_ptr, qt_ptr, qs_ptr, dw_ptr, expert_row_ptr, block_base_ptr, RP, N, K, L,
                      BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, NUM_PROGS: tl.constexpr,
                      UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr, TMA_STORE: tl.constexpr,
                      RESIDENT: tl.constexpr = False):
    """Work items (expert, column block of N, column block of K), expert-major, K fastest (programs running
    together share one expert's P^T block from L2): dW[e] block = sum over the expert's token blocks, ascending, of
    P^T block @ Q^T block^T (e4m3, K = the block's 128 tokens, both K-major; :func:`token_quantise_t`'s slots),
    promoted by the block's P and Q column scales. The item loop is flattened with the token loop (the next item's
    loads are issued during this item's store). TMA: ``pt_ptr`` / ``qt_ptr`` are descriptors over [N, RP] / [K, RP]
    with blocks [BN, BR] / [BK, BR]."""
    n_n = N // BN
    n_k = K // BK
    if RESIDENT:
        _fp8_wgrad_resident(pt_ptr, ps_ptr, qt_ptr, qs_ptr, dw_ptr, expert_row_ptr, block_base_ptr, RP, N, K, L, BN,
                            BK, BR, NUM_PROGS, UPCAST, STAGES, TMA, TMA_STORE)
        return
    for wk in tl.range(tl.program_id(0), L * n_n * n_k, NUM_PROGS, flatten=True):
        e = wk // (n_n * n_k)
        n = (wk // n_k) % n_n
        k = wk % n_k
        r_lo = tl.load(expert_row_ptr + e)
        n_blk = tl.cdiv(tl.load(expert_row_ptr + e + 1) - r_lo, BR)
        b0 = tl.load(block_base_ptr + e)
        ncols = n * BN + tl.arange(0, BN)
        kcols = k * BK + tl.arange(0, BK)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for j in tl.range(0, n_blk, num_stages=STAGES):
            slot = b0 + j
            a = _tok_block_ld(pt_ptr, n * BN, ncols, slot, RP, BR, TMA)
            b = _tok_block_ld(qt_ptr, k * BK, kcols, slot, RP, BR, TMA)
            sp = tl.load(ps_ptr + slot * N + ncols)
            sq = tl.load(qs_ptr + slot * K + kcols)
            acc += _mm(a, b.T, UPCAST) * (sp[:, None] * sq[None, :])
        _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE)


@triton.jit
def _tok_block_ld(t_ptr, c0, cols, slot, RP, BR: tl.constexpr, TMA: tl.constexpr):
    """The block of columns ``cols`` (from ``c0``) of token-block slot ``slot`` of a K-major [C, RP] operand, [BC, BR]
    (TMA: ``t_ptr`` a descriptor with that block)."""
    if TMA:
        blk = t_ptr.load([c0, slot * BR])
    else:
        blk = tl.load(t_ptr + cols[:, None] * RP + (slot * BR + tl.arange(0, BR))[None, :])
    return blk


@triton.jit
def _fp8_wgrad_resident(pt_ptr, ps_ptr, qt_ptr, qs_ptr, dw_ptr, expert_row_ptr, block_base_ptr, RP, N, K, L,
                        BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, NUM_PROGS: tl.constexpr,
                        UPCAST: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr, TMA_STORE: tl.constexpr):
    """P resident: work items (expert, column block of N), each a strip of dW[e] [BN, K]. An expert of one token
    block (the published shapes at EP=1) loads its P^T block once and streams its Q^T blocks, one output block per K
    step; an expert of none writes zeros; a larger one sums its token blocks for each output block. The same sums,
    in the same order, as :func:`_fp8_wgrad_kernel`."""
    n_n = N // BN
    n_k = K // BK
    for wk in range(tl.program_id(0), L * n_n, NUM_PROGS):
        e = wk // n_n
        n = wk % n_n
        r_lo = tl.load(expert_row_ptr + e)
        n_blk = tl.cdiv(tl.load(expert_row_ptr + e + 1) - r_lo, BR)
        b0 = tl.load(block_base_ptr + e)
        ncols = n * BN + tl.arange(0, BN)
        if n_blk == 1:
            a = _tok_block_ld(pt_ptr, n * BN, ncols, b0, RP, BR, TMA)
            sp = tl.load(ps_ptr + b0 * N + ncols)
            for k in tl.range(0, n_k, num_stages=STAGES):
                kcols = k * BK + tl.arange(0, BK)
                b = _tok_block_ld(qt_ptr, k * BK, kcols, b0, RP, BR, TMA)
                sq = tl.load(qs_ptr + b0 * K + kcols)
                acc = _mm(a, b.T, UPCAST) * (sp[:, None] * sq[None, :])
                _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE)
        else:
            for k in range(0, n_k):
                kcols = k * BK + tl.arange(0, BK)
                acc = tl.zeros((BN, BK), dtype=tl.float32)
                for j in tl.range(0, n_blk, num_stages=STAGES):
                    a = _tok_block_ld(pt_ptr, n * BN, ncols, b0 + j, RP, BR, TMA)
                    b = _tok_block_ld(qt_ptr, k * BK, kcols, b0 + j, RP, BR, TMA)
                    sp = tl.load(ps_ptr + (b0 + j) * N + ncols)
                    sq = tl.load(qs_ptr + (b0 + j) * K + kcols)
                    acc += _mm(a, b.T, UPCAST) * (sp[:, None] * sq[None, :])
                _store_dw(dw_ptr, acc, e, n, k, N, K, BN, BK, TMA_STORE)


def token_blocks(expert_row_L1: torch.Tensor, R: int) -> tuple[torch.Tensor, int]:
    """(each expert's first token-block slot, int32 [L], on the device: no host sync; the number of slots, a bound:
    every 128 rows of R plus one partial block an expert)."""
    counts = (expert_row_L1[1:] - expert_row_L1[:-1]).clamp(min=0)
    blocks = (counts + BLOCK - 1) // BLOCK
    return (torch.cumsum(blocks, 0) - blocks).to(torch.int32), -(-R // BLOCK) + blocks.numel()


def token_quantise_t(x_RC: torch.Tensor, x_scale: Optional[torch.Tensor], row_code_R: torch.Tensor,
                     expert_row_L1: torch.Tensor, block_base_L: torch.Tensor, n_blocks: int, *, programs: int,
                     block_c: int = 64, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight gradients' operand, quantised along the tokens (each expert's rows in 128-row blocks from its first
    row, one scale per block and column; padding rows zero) and transposed into token-block slots: (e4m3
    [C, n_blocks 128], fp32 [n_blocks, C]). ``x`` bf16, or e4m3 with 1 x 128 ``x_scale`` (dequantised first)."""
    R, C = x_RC.shape
    assert (x_scale is not None) == (x_RC.dtype == E4M3), "an e4m3 operand comes with its 1 x 128 scales, bf16 without"
    assert C % block_c == 0 and BLOCK % block_c == 0 and (x_scale is None or x_scale.shape == (R, C // BLOCK))
    RP = n_blocks * BLOCK
    assert max(R, RP) * C < 2**31, "token_quantise_t indexes in int32"
    qt = torch.empty(C, RP, dtype=E4M3, device=x_RC.device)  # slots no expert uses stay unwritten, and unread
    qs = torch.empty(n_blocks, C, dtype=torch.float32, device=x_RC.device)
    L = expert_row_L1.numel() - 1
    _tok_quant_t_kernel[(programs,)](x_RC, x_scale if x_scale is not None else x_RC, qt, qs, row_code_R,
                                     expert_row_L1, block_base_L, C, RP, L, BR=BLOCK, BC=block_c,
                                     FP8=x_scale is not None, NUM_PROGS=programs, num_warps=num_warps)
    return qt, qs


def fp8_wgrad(p_RN: torch.Tensor, p_scale: Optional[torch.Tensor], q_RK: torch.Tensor,
              q_scale: Optional[torch.Tensor], dw_LNK: torch.Tensor, row_code_R: torch.Tensor,
              expert_row_L1: torch.Tensor, *, programs: int, block_n: int = 128, block_k: int = 128, stages: int = 3,
              num_warps: int = 8, programs_per_sm: int = 1, tma_store: bool = False, resident: bool = False,
              blocks: Optional[tuple[torch.Tensor, int]] = None) -> None:
    """dw[e] = p[rows of e]^T @ q[rows of e] in fp8: both operands quantised along the tokens in 128-row blocks from
    the expert's first row (``expert_row_L1``), one scale per block and column (:func:`token_quantise_t`, one pass
    over each operand into K-major e4m3 token-block slots), then the e4m3 GEMM with fp32 accumulation, the blocks
    in schedule order (padding rows, code < 0, add nothing). An operand is bf16 rows, or e4m3 rows with 1 x 128
    scales (``*_scale`` given: dequantised, then quantised along the tokens). ``dw`` bf16 [L, N, K]. ``resident``:
    one work item a strip (expert, N block), P^T loaded once where the expert has one token block
    (:func:`_fp8_wgrad_resident`); the same sums in the same order. ``blocks``: :func:`token_blocks` of these
    experts, where the caller has it already."""
    R, N = p_RN.shape
    K = q_RK.shape[1]
    L = dw_LNK.shape[0]
    assert dw_LNK.shape == (L, N, K) and q_RK.shape[0] == R
    assert N % block_n == 0 and K % block_k == 0, f"N {N} / K {K} must be multiples of ({block_n}, {block_k})"
    base, n_blocks = blocks if blocks is not None else token_blocks(expert_row_L1, R)
    bc = 64 if (N % 64 == 0 and K % 64 == 0) else 32
    pt, ps = token_quantise_t(p_RN, p_scale, row_code_R, expert_row_L1, base, n_blocks, programs=programs,
                              block_c=bc)
    qt, qs = token_quantise_t(q_RK, q_scale, row_code_R, expert_row_L1, base, n_blocks, programs=programs,
                              block_c=bc)
    cuda = dw_LNK.is_cuda
    dw = dw_LNK
    if cuda:
        from triton.tools.tensor_descriptor import TensorDescriptor

        pt = TensorDescriptor.from_tensor(pt, [block_n, BLOCK])
        qt = TensorDescriptor.from_tensor(qt, [block_k, BLOCK])
        if tma_store:
            dw = TensorDescriptor.from_tensor(dw_LNK.view(-1, K), [block_n, block_k])
    progs = programs * programs_per_sm
    _fp8_wgrad_kernel[(progs,)](pt, ps, qt, qs, dw, expert_row_L1, base, n_blocks * BLOCK, N, K, L, BN=block_n,
                                BK=block_k, BR=BLOCK, NUM_PROGS=progs, UPCAST=INTERPRET, STAGES=stages, TMA=cuda,
                                TMA_STORE=tma_store and cuda, RESIDENT=resident, num_warps=num_warps)


def _tiles(H: int, I: int, cuda: bool, rows_per_expert: float = 0.0) -> dict[str, dict[str, Any]]:
    """Launch parameters of the fp8 backward's GEMMs, by stage: dgate 64 x 128 blocks (its epilogue quantises dH in
    1 x 128 blocks), dX 128-row blocks (32 on the CPU), both over W^T (K-major) at 3 stages; the weight gradients in
    128 x 128 blocks (64 x 64 where ``H`` or ``I`` is no multiple of 128) over 128-row token blocks, by TMA stores on
    CUDA, with P resident where the experts average at most 128 rows (one token block), else the flattened item loop.
    The measurements behind each choice: the journal, lab/2026-12-07-kernel-changelog.md."""
    bn = 128 if (H % 128 == 0 and I % 128 == 0) else 64
    res = 0 < rows_per_expert <= BLOCK
    return {"dgate": dict(block_m=64, block_n=BLOCK, stages=3),
            "dx": dict(block_m=128 if cuda else 32, block_n=bn, stages=3),
            "dw13": dict(block_n=bn, block_k=bn, tma_store=cuda, resident=res),
            "dw2": dict(block_n=bn, block_k=bn, tma_store=cuda, resident=res)}


def expert_backward(x_rows: torch.Tensor, xs_rows: torch.Tensor, dO_rows: torch.Tensor, dOs_rows: torch.Tensor,
                    s_rows: torch.Tensor, h: torch.Tensor, clip: Optional[torch.Tensor], w13_t: torch.Tensor,
                    w13_scale: torch.Tensor, w2_t: torch.Tensor, w2_scale: torch.Tensor, code_R: torch.Tensor,
                    tile_expert: torch.Tensor, tile_row: torch.Tensor, chunk: torch.Tensor, starts: torch.Tensor,
                    dx_slots: torch.Tensor, *, limit: Optional[float], programs: int,
                    mark: Callable[[str], None], push: Optional[tuple[torch.Tensor, int]] = None,
                    tiles: Optional[dict[str, dict[str, Any]]] = None, rows_per_expert: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four fp8 stages over this rank's routed rows (the fp8 counterpart of ``train._expert_backward``): the
    dX rows pushed into ``dx_slots`` by their code (``push``: every rank's offset from ``dx_slots``, T K), and
    (dW13 bf16 [L, 2I, H], dW2 bf16 [L, H, I], the router-weight gradient of every row, fp32 [R]). X rows and dO
    rows are e4m3 with 1 x 128 scales, ``h`` the forward's pre-SwiGLU H (bf16 [R, 2I]) with its clamp masks, the
    weights the forward's e4m3 values transposed (W13^T [L, H, 2I], W2^T [L, I, H]) with W's 128 x 128 scales.
    ``rows_per_expert``: the rows an expert gets on average (picks the weight-gradient kernel). ``tiles``: launch
    overrides per stage (:func:`_tiles`' keys)."""
    R, H = x_rows.shape
    L, I = w2_t.shape[0], w2_t.shape[1]
    dev = x_rows.device
    t = _tiles(H, I, dev.type == "cuda", rows_per_expert)
    for stage, over in (tiles or {}).items():
        if stage in t:
            t[stage] = {**t[stage], **over}
    dH = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=dev)
    dHq = torch.empty(R, 2 * I, dtype=E4M3, device=dev)
    dHs = torch.empty(R, 2 * I // BLOCK, dtype=torch.float32, device=dev)
    sA = torch.empty(R, I, dtype=torch.bfloat16, device=dev)
    ds_parts = torch.empty(R, I // BLOCK, dtype=torch.float32, device=dev)
    fp8_rows(dO_rows, dOs_rows, w2_t, w2_scale, dH, tile_expert, tile_row, chunk, programs=programs, limit=limit,
             dgate=dict(h=h, clip=clip, s=s_rows, sa=sA, ds=ds_parts, dhq=dHq, dhs=dHs), **t["dgate"])
    mark("dgate")
    fp8_rows(dHq, dHs, w13_t, w13_scale, dx_slots, tile_expert, tile_row, chunk, programs=programs, push_code=code_R,
             push_delta=push[0] if push else None, slots_per_rank=push[1] if push else None, **t["dx"])
    mark("dx")
    ds = router_grad(ds_parts)
    blocks = token_blocks(starts, R)  # (both weight gradients' token-block slots)
    dW13 = torch.empty(L, 2 * I, H, dtype=torch.bfloat16, device=dev)
    fp8_wgrad(dH, None, x_rows, xs_rows, dW13, code_R, starts, programs=programs, blocks=blocks, **t["dw13"])
    mark("dw13")
    dW2 = torch.empty(L, H, I, dtype=torch.bfloat16, device=dev)
    fp8_wgrad(dO_rows, dOs_rows, sA, None, dW2, code_R, starts, programs=programs, blocks=blocks, **t["dw2"])
    mark("dw2")
    return dW13, dW2, ds
