"""The grouped layout of the fp8 baselines' expert GEMMs, shared by every fp8 path (``baselines.fp8_gemm`` and
the per-expert loop ``baselines.fp8_loop``): rows sorted by expert and padded (:class:`GroupLayout`), and the
k-grouped weight-gradient operand (each expert's block row-major, one scale per 128 tokens and channel), in one
Triton kernel on CUDA and in plain torch as its reference."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from contract.fp8 import FP8_MAX

E4M3 = torch.float8_e4m3fn
BLOCK = 128  # DeepGEMM's block (1x128 / 128x128) on SM90


# ---- grouped layout (padding) -------------------------------------------------------------------------------------


class GroupLayout:
    """Rows sorted by expert, each expert's rows padded to ``align`` (zero rows), on the device.

    ``dest`` [M]: each row's place in the padded buffer; ``offs`` [G] int32 padded cumulative ends; ``group`` [P]:
    the expert of each padded row (G for slack rows past the last expert); ``rows``: P. ``host_counts`` given: P is
    exact (DeepGEMM's k-grouped GEMM needs the sizes on the host); otherwise P = M + (align - 1) * G rounded up to
    align, a static bound (no host sync; the GEMMs only read up to ``offs[-1]``)."""

    def __init__(self, counts_G: torch.Tensor, M: int, align: int,
                 host_counts: Optional[Sequence[int]] = None) -> None:
        dev, G = counts_G.device, counts_G.numel()
        counts = counts_G.to(torch.int64)
        padded = (counts + align - 1) // align * align
        ends = torch.cumsum(padded, 0)
        pstart = ends - padded
        start = torch.cumsum(counts, 0) - counts
        if host_counts is not None:
            self.padded_host = [-(-int(n) // align) * align for n in host_counts]
            self.rows = sum(self.padded_host)
        else:
            self.padded_host = None
            # a static bound, rounded up to ``align`` rows: torch._scaled_grouped_mm needs every non-unit stride to be
            # a multiple of 16 bytes, and the wgrad's operands are [P, C] read column-major (stride P)
            self.rows = -(-(M + (align - 1) * G) // align) * align
        ids = torch.arange(G, device=dev)
        e_M = torch.repeat_interleave(ids, counts, output_size=M)
        self.dest = pstart.index_select(0, e_M) + torch.arange(M, device=dev) - start.index_select(0, e_M)
        slack = torch.clamp(self.rows - ends[-1:], min=0) if G else torch.tensor([self.rows], device=dev)
        self.group = torch.repeat_interleave(torch.cat([ids, ids.new_full((1,), G)]), torch.cat([padded, slack]),
                                             output_size=self.rows)
        self.offs = ends.to(torch.int32)
        self.G = G
        # DeepGEMM's m-grouped layout: the expert of each padded row, -1 on padding rows
        pos = torch.arange(self.rows, device=dev) - torch.cat([pstart, ends[-1:]]).index_select(0, self.group)
        real = pos < torch.cat([counts, counts.new_zeros(1)]).index_select(0, self.group)
        self.m_indices = torch.where(real, self.group, torch.full_like(self.group, -1)).to(torch.int32)

    def pad(self, x_MC: torch.Tensor) -> torch.Tensor:
        return x_MC.new_zeros(self.rows, x_MC.shape[1]).index_copy(0, self.dest, x_MC)

    def unpad(self, y_PC: torch.Tensor) -> torch.Tensor:
        return y_PC.index_select(0, self.dest)


def reference_k_grouped_operand(z_PC: torch.Tensor, ks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-grouped GEMM operand of ``z`` (rows = tokens, grouped by expert in ``ks``-row blocks, each a multiple
    of 128): flat e4m3 data with each group's [C, k_g] block row-major, and fp32 scales [P/128, C], one per 128
    tokens and channel."""
    P, C = z_PC.shape
    zb = z_PC.float().view(P // BLOCK, BLOCK, C)
    scale = zb.abs().amax(1).clamp(min=1e-12) / FP8_MAX  # [P/128, C]
    q = (zb / scale[:, None, :]).to(E4M3).view(P, C)
    flat = torch.empty(P * C, dtype=E4M3, device=z_PC.device)
    k0 = 0
    for k in ks:
        flat[k0 * C:(k0 + k) * C] = q[k0:k0 + k].t().reshape(-1)
        k0 += k
    return flat, scale


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _k_grouped_operand_kernel(z_ptr, out_ptr, sf_ptr, blk_start_ptr, blk_len_ptr, C,
                                  BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        c0 = tl.program_id(1) * BLOCK_C
        start = tl.load(blk_start_ptr + b).to(tl.int64)
        length = tl.load(blk_len_ptr + b).to(tl.int64)
        t = b.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < C
        z = tl.load(z_ptr + t[:, None] * C + c[None, :], mask=cm[None, :], other=0.0).to(tl.float32)
        # IEEE divisions (div_rn), as torch divides: Triton's `/` on a GPU is approximate (or a reciprocal multiply
        # for a constant), and its scales then differ from the reference's by an ulp (tests/test_fp8_gemm.py on one
        # H200: lab/diagnostics/2026-12-03-s22/)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(z), axis=0), 1e-12), 448.0)
        q = tl.math.div_rn(z, scale[None, :]).to(out_ptr.dtype.element_ty)
        dst = start * C + c[None, :].to(tl.int64) * length + (t[:, None] - start)
        tl.store(out_ptr + dst, q, mask=cm[None, :])
        tl.store(sf_ptr + b.to(tl.int64) * C + c, scale, mask=cm)
except ImportError:  # pragma: no cover (Triton ships with torch on Linux)
    triton = None


def k_grouped_operand(z_PC: torch.Tensor, layout: GroupLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_k_grouped_operand`` in one Triton kernel (CUDA), or the reference (CPU)."""
    if not z_PC.is_cuda or triton is None:
        return reference_k_grouped_operand(z_PC, layout.padded_host)
    P, C = z_PC.shape
    out = torch.empty(P * C, dtype=E4M3, device=z_PC.device)
    sf = torch.empty(P // BLOCK, C, dtype=torch.float32, device=z_PC.device)
    blk_start, blk_len = layout.block_tables()
    grid = (P // BLOCK, triton.cdiv(C, 64))
    _k_grouped_operand_kernel[grid](z_PC.contiguous(), out, sf, blk_start, blk_len, C, BLOCK_T=BLOCK, BLOCK_C=64)
    return out, sf


def _block_tables(self: GroupLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128-row block: the start row and padded length of its expert (exact layouts only)."""
    if not hasattr(self, "_blocks"):
        dev = self.offs.device
        padded = torch.tensor(self.padded_host, dtype=torch.int64, device=dev)
        starts = torch.cumsum(padded, 0) - padded
        nblk = padded // BLOCK
        self._blocks = (torch.repeat_interleave(starts, nblk, output_size=self.rows // BLOCK),
                        torch.repeat_interleave(padded, nblk, output_size=self.rows // BLOCK))
    return self._blocks


GroupLayout.block_tables = _block_tables  # type: ignore[attr-defined]
