"""Moving rows, before and after the GEMMs: the stage's 1 x 128 fp8 quantisation of this rank's activations, the
pull dispatch (the expert owner reads routed rows straight from the source ranks' buffers and counts each granule
of rows ready for the up GEMM), the fixed-order epilogue (out[t] = sum_k combine[t*K + k] (x w[t, k]) + shared[t],
in fp32, k ascending) and the timeline stamps (the GPU's global timer, written on the stream that runs them)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from contract.fp8 import FP8_MAX
from mok_kernels.mok_hopper.ops.gemm_common import _quant_e4m3
from mok_kernels.mok_hopper.ops.interp import INTERPRET  # noqa: F401 (applies the interpreter fixes)
from mok_kernels.mok_hopper.tiles import TileConfig, ready_granule

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


@triton.jit
def _pull_rows_kernel(code_ptr, chunk_ptr, tile_row_ptr, ready_ptr, x_ref, x_delta, xs_ref, xs_delta, w_ref,
                      w_delta, x_out, xs_out, w_out, TK, K, H, HS,
                      BR: tl.constexpr, BH: tl.constexpr, HSP: tl.constexpr, FP8: tl.constexpr,
                      PULL_W: tl.constexpr, NUM_PROGS: tl.constexpr, READY: tl.constexpr, GRAN: tl.constexpr,
                      PACKED: tl.constexpr = False):
    """PACKED (tiles start on any row): the steps are BR-aligned in the buffer (so each lies in one granule), the
    chunk's first and last masked to its rows; each counts the rows it wrote."""
    r_lo = tl.load(tile_row_ptr + tl.load(chunk_ptr))
    r_hi = tl.load(tile_row_ptr + tl.load(chunk_ptr + 1))
    if PACKED:
        r_0 = (r_lo // BR) * BR
    else:
        r_0 = r_lo
    n_steps = tl.cdiv(r_hi - r_0, BR)
    cols = tl.arange(0, BH)  # a whole row per load: every byte of the step is in flight at once
    cmask = cols < H
    # programs take steps round-robin, so the rows finish roughly in ascending order (the GEMMs' order)
    for step in range(tl.program_id(0), n_steps, NUM_PROGS):
        row0 = r_0 + step * BR
        rows = row0 + tl.arange(0, BR)
        if PACKED:
            rmask = (rows >= r_lo) & (rows < r_hi)
        else:
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
            if PACKED:
                tl.atomic_add(ready_ptr + row0 // GRAN, tl.sum(rmask.to(tl.int32), axis=0), sem="release",
                              scope="gpu")
            else:
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
        PULL_W=pull_w, NUM_PROGS=programs, READY=ready is not None, GRAN=gran, num_warps=cfg.pull_warps,
        **({"PACKED": True} if cfg.packed_rows else {}))


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


@triton.jit
def _stamp_kernel(ptr, i):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(ptr + i, t)


def stamp(buf: torch.Tensor, i: int) -> None:
    """buf[i] = the GPU's global timer (ns) when the stream gets here (CUDA only; captured into graphs too)."""
    _stamp_kernel[(1,)](buf, i, num_warps=1)
