"""``fp8_gemm=blockwise_loop``: the harness's fp8 format through ``torch._scaled_mm``, one GEMM per expert.

The fallback for the blockwise format where DeepGEMM does not load (``sgl-deep-gemm`` 0.2.5 with torch 2.11, seen on
an H200): non-grouped ``torch._scaled_mm`` takes fp32 block scales on SM90 through cuBLASLt (CUDA 12.9+), in three
pairs (aten/src/ATen/native/cuda/ScaledBlas.cpp, ``get_joint_scaling``): 128x128 x 1x128, 1x128 x 128x128 and
1x128 x 1x128. Per expert e, on rows padded to 128 per expert (``GroupLayout`` with host sizes, as for DeepGEMM):

* forward ``y_e [P_e, N] = x_e [P_e, K] @ W_e^T``: 1x128 x 128x128 (the weight's blocks, ``BlockwiseWeight.q / s``);
* dgrad ``dx_e [P_e, K] = dy_e [P_e, N] @ W_e``: 1x128 x 128x128, the same 128x128 blocks transposed
  (``BlockwiseWeight.q_t / s_t``: no second quantization of the weight);
* wgrad ``dW_e [N, K] = dy_e^T [N, P_e] @ x_e [P_e, K]``: 1x128 x 1x128 with the blocks along the tokens, the
  operands of ``fp8_gemm.k_grouped_operand`` (each expert's [C, P_e] block row-major, scales [P/128, C]).

What torch checks on SM90 (``_scaled_mm_out_cuda``, torch 2.11-2.14): ``a`` row-major, ``b`` column-major; ``a``'s
trailing dimension and both of ``b``'s divisible by 16; ``use_fast_accum`` off. The scales of an operand ``t``
[R, C] (``a``, or ``b.t()``, whose scale is ``scale_b.t()``): 1x128 = [R, ceil(C/128)] with strides (1, R)
("outer-dim-major"); 128x128 = [ceil(R/128), ceil(C/128)] with strides (ceil(C/128), 1). So each expert's 1x128
activation scales are laid out expert by expert (``expert_major``), and each expert's weight scales start 16 bytes
aligned (``aligned_scales``). ``reference_scaled_mm`` checks the same and computes the product in fp32 on any device:
the CPU tests run the whole path through it, the GPU test compares the real GEMMs with it.

Legend: P padded rows, G experts, N output features, K input features, B scale blocks along the last dim.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from baselines.fp8_gemm import BLOCK, E4M3, GroupLayout, k_grouped_operand
from contract.fp8 import quantize_blocks

ALIGN = BLOCK  # rows per expert: the wgrad's 1x128 blocks run along the tokens and must not straddle two experts
FIX = ("needs torch >= 2.9 built with CUDA >= 12.9 (cuBLASLt block scales) on an SM90 GPU; or use fp8_gemm=rowwise")


# ---- torch._scaled_mm and its reference ---------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_scaling(t: torch.Tensor, scale: torch.Tensor, kind: str) -> bool:
    """torch's ``is_rowwise_scaling`` / ``is_blockwise_1x128_scaling`` / ``is_blockwise_128x128_scaling`` for an
    operand ``t`` [R, C] and its scale (a stride of a size-1 dimension is not checked, as in torch)."""
    if scale.dtype != torch.float32 or scale.dim() != 2:
        return False
    R, C = t.shape

    def ok(dim: int, size: int, stride: int) -> bool:
        return scale.size(dim) == size and (size <= 1 or scale.stride(dim) == stride)

    if kind == "rowwise":
        return scale.size(0) == R and scale.size(1) == 1 and scale.is_contiguous()
    if kind == "1x128":
        return ok(0, R, 1) and ok(1, _cdiv(C, BLOCK), R)
    return ok(0, _cdiv(R, BLOCK), _cdiv(C, BLOCK)) and ok(1, _cdiv(C, BLOCK), 1)


# the pairs torch tries, in its order (tensorwise first, unused here)
PAIRS = (("rowwise", "rowwise"), ("128x128", "1x128"), ("1x128", "128x128"), ("1x128", "1x128"))


def _dequantize(t: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    R, C = t.shape
    s = scale.float()
    if kind == "rowwise":
        return t.float() * s
    if kind == "1x128":
        return t.float() * s.repeat_interleave(BLOCK, 1)[:, :C]
    return t.float() * s.repeat_interleave(BLOCK, 0)[:R].repeat_interleave(BLOCK, 1)[:, :C]


def _aligned16(t: torch.Tensor) -> bool:
    return (t.storage_offset() * t.element_size()) % 16 == 0


def reference_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out.dtype, out=out)`` in plain torch (fp32 math), with
    the checks torch makes on SM90 for the block-scaled pairs (and rowwise x rowwise, which torch picks when a
    1x128 operand has a single block). Also requires 16-byte aligned operands and scales (cuBLASLt's pointers)."""
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise RuntimeError("Expected mat1 and mat2 to be float8_e4m3fn (the reference checks the fp8 inputs)")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({tuple(a.shape)} and {tuple(b.shape)})")
    if not (a.stride(1) == 1 or a.shape[1] <= 1) or not (b.stride(0) == 1 or b.shape[0] <= 1):
        raise RuntimeError("Only multiplication of row-major and column-major matrices is supported by cuBLASLt")
    if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
        raise RuntimeError(f"mat1's trailing dimension and mat2's dimensions must be divisible by 16, got "
                           f"{tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("mat1", a), ("mat2", b), ("scale_a", scale_a), ("scale_b", scale_b), ("out", out)):
        if not _aligned16(t):
            raise RuntimeError(f"{name} does not start 16-byte aligned (the reference checks cuBLASLt's pointers)")
    if out.shape != (a.shape[0], b.shape[1]) or not out.is_contiguous():
        raise RuntimeError(f"out must be a contiguous [{a.shape[0]}, {b.shape[1]}] tensor, got {tuple(out.shape)}")
    for ka, kb in PAIRS:
        if _is_scaling(a, scale_a, ka) and _is_scaling(b.t(), scale_b.t(), kb):
            A = _dequantize(a, scale_a, ka)
            B = _dequantize(b.t(), scale_b.t(), kb).t()
            return out.copy_(A @ B)
    raise RuntimeError(f"Invalid scaling configuration: scale_a {tuple(scale_a.shape)} strides {scale_a.stride()}, "
                       f"scale_b {tuple(scale_b.shape)} strides {scale_b.stride()} for mat1 {tuple(a.shape)}, "
                       f"mat2 {tuple(b.shape)} (the reference checks what torch._scaled_mm checks)")


def scaled_mm(a, b, scale_a, scale_b, out) -> torch.Tensor:
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out.dtype, out=out)
    return reference_scaled_mm(a, b, scale_a, scale_b, out)


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """Why this torch cannot run the blockwise ``torch._scaled_mm`` pairs used here (None: it can). Run once on the
    current GPU (SM90 checked by the caller): a 128 x 256 x 128 product in each pair."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm; fp8_gemm=blockwise_loop {FIX}"
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        a = torch.ones(128, 256, device=dev).to(E4M3)
        bt = torch.ones(128, 256, device=dev).to(E4M3)  # b = bt.t(): column-major [256, 128]
        out = torch.empty(128, 128, dtype=torch.bfloat16, device=dev)
        sa = torch.ones(2, 128, device=dev).t()  # 1x128 of a: [128, 2], strides (1, 128)
        torch._scaled_mm(a, bt.t(), sa, torch.ones(1, 2, device=dev).t(), out_dtype=torch.bfloat16, out=out)
        torch._scaled_mm(a, bt.t(), sa, torch.ones(2, 128, device=dev), out_dtype=torch.bfloat16, out=out)
        torch.cuda.synchronize(dev)
    except Exception as e:  # noqa: BLE001 (torch raises RuntimeError / NotImplementedError by version)
        first = str(e).splitlines()[0] if str(e) else ""
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) does not run blockwise torch._scaled_mm here "
                f"({type(e).__name__}: {first}); fp8_gemm=blockwise_loop {FIX}")
    if float(out.float().sum()) != 128 * 128 * 256:
        return f"torch._scaled_mm's blockwise product is wrong here (all-ones check); fp8_gemm=blockwise_loop {FIX}"
    return None


# ---- operand bookkeeping ------------------------------------------------------------------------------------------


def expert_major(s_PB: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """1x128 scales [P, B] of rows grouped by expert (exact layout, each expert's rows a multiple of 128) as one flat
    tensor in which expert e's scales are a [B, P_e] row-major block at offset start_e * B: ``expert_scales`` reads
    them back as [P_e, B] with strides (1, P_e), the outer-dim-major layout torch wants for a 1x128 operand."""
    P, B = s_PB.shape
    start, length = (t.repeat_interleave(BLOCK) for t in layout.block_tables())  # per row: its expert's start, rows
    rows = torch.arange(P, device=s_PB.device)
    pos = (start * B + rows - start)[:, None] + torch.arange(B, device=s_PB.device)[None, :] * length[:, None]
    return s_PB.new_empty(P * B).index_copy_(0, pos.reshape(-1), s_PB.reshape(-1))


def expert_scales(flat: torch.Tensor, start: int, rows: int, blocks: int) -> torch.Tensor:
    return flat[start * blocks:(start + rows) * blocks].view(blocks, rows).t()


def aligned_scales(s_GAB: torch.Tensor) -> torch.Tensor:
    """The weight scales [G, A, B] with each expert's [A, B] block contiguous and 16-byte aligned (a copy only when
    A * B is not a multiple of 4)."""
    G, A, B = s_GAB.shape
    n = A * B
    if n % 4 == 0:
        return s_GAB
    buf = s_GAB.new_zeros(G, -(-n // 4) * 4)
    buf[:, :n] = s_GAB.reshape(G, n)
    return buf[:, :n].view(G, A, B)


class LoopWeight:
    """A ``BlockwiseWeight`` (shared with DeepGEMM's path: the same blocks) plus its scales laid out for
    ``torch._scaled_mm``: 16-byte aligned per expert."""

    def __init__(self, w) -> None:
        self.q, self.q_t = w.q, w.q_t
        self.s, self.s_t = aligned_scales(w.s), aligned_scales(w.s_t)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.s, self.q_t, self.s_t]


def _starts(layout: GroupLayout) -> list[int]:
    out, s = [], 0
    for n in layout.padded_host:
        out.append(s)
        s += n
    return out


def _act_times_weight(aq: torch.Tensor, a_em: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                      layout: GroupLayout) -> torch.Tensor:
    """out [P, C] with rows of expert e = A_e (1x128) @ wq[e].t() (128x128 blocks ``ws[e]``): the forward with
    (q, s), the dgrad with (q_t, s_t)."""
    out = torch.empty(aq.shape[0], wq.shape[1], dtype=torch.bfloat16, device=aq.device)
    B = aq.shape[1] // BLOCK
    for e, (s, n) in enumerate(zip(_starts(layout), layout.padded_host)):
        if n:
            scaled_mm(aq[s:s + n], wq[e].t(), expert_scales(a_em, s, n, B), ws[e].t(), out[s:s + n])
    return out


class LoopLinear(torch.autograd.Function):
    """y [P, N] = x [P, K] @ w[g]^T per expert, every GEMM a block-scaled fp8 ``torch._scaled_mm``."""

    @staticmethod
    def forward(ctx, x_PK, w_GNK, q, s, q_t, s_t, layout):  # type: ignore[override]
        xq, xs = quantize_blocks(x_PK, 1, BLOCK)
        y = _act_times_weight(xq, expert_major(xs, layout), q, s, layout)
        ctx.save_for_backward(x_PK, q_t, s_t)
        ctx.layout = layout
        return y

    @staticmethod
    def backward(ctx, dy_PN):  # type: ignore[override]
        x_PK, q_t, s_t = ctx.saved_tensors
        layout = ctx.layout
        dy_PN = dy_PN.contiguous()
        dyq, dys = quantize_blocks(dy_PN, 1, BLOCK)
        dx = _act_times_weight(dyq, expert_major(dys, layout), q_t, s_t, layout)
        (ga, gsf), (xa, xsf) = k_grouped_operand(dy_PN, layout), k_grouped_operand(x_PK, layout)
        N, K = dy_PN.shape[1], x_PK.shape[1]
        dw = torch.empty(layout.G, N, K, dtype=torch.bfloat16, device=dy_PN.device)
        for e, (s, n) in enumerate(zip(_starts(layout), layout.padded_host)):
            if not n:
                dw[e].zero_()
                continue
            b0, b1 = s // BLOCK, (s + n) // BLOCK
            # dy_e^T [N, n] row-major, scales [N, n/128] strides (1, N); x_e [n, K] column-major (x_e^T [K, n]
            # row-major), scale_b [n/128, K] row-major, i.e. scale_b.t() [K, n/128] with strides (1, K)
            scaled_mm(ga[s * N:(s + n) * N].view(N, n), xa[s * K:(s + n) * K].view(K, n).t(),
                      gsf[b0:b1].t(), xsf[b0:b1], dw[e])
        return dx, dw, None, None, None, None, None
