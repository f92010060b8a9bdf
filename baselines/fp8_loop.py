"""``fp8_gemm=blockwise_loop``: the harness's fp8 format through torch's block-scaled scaled_mm, one GEMM per expert.

The fallback for the blockwise format where DeepGEMM does not load (``sgl-deep-gemm`` 0.2.5 with torch 2.11, seen on
an H200): non-grouped ``torch.nn.functional.scaled_mm`` (``torch._scaled_mm_v2``) takes fp32 block scales on SM90
through cuBLASLt (CUDA 12.9+). Per expert e, on rows padded to 128 per expert (``GroupLayout`` with host sizes, as for
DeepGEMM):

* forward ``y_e [P_e, N] = x_e [P_e, K] @ W_e^T``: 1x128 x 128x128 (the weight's blocks, ``BlockwiseWeight.q / s``);
* dgrad ``dx_e [P_e, K] = dy_e [P_e, N] @ W_e``: 1x128 x 128x128, the same 128x128 blocks transposed
  (``BlockwiseWeight.q_t / s_t``: no second quantization of the weight);
* wgrad ``dW_e [N, K] = dy_e^T [N, P_e] @ x_e [P_e, K]``: 1x128 x 1x128 with the blocks along the tokens, the
  operands of ``fp8_gemm.k_grouped_operand`` (each expert's [C, P_e] block row-major, scales [P/128, C]).

The scale layouts are cuBLASLt's, and torch hands cuBLASLt only each scale's data pointer (``cublasCommonArgs``,
aten/src/ATen/native/cuda/cuBlasCommonArgs.h: ``scale_mata_ptr = ... scale_b->data_ptr()``), never its strides. For
``a`` [M, K] row-major, ``b`` [K, N] column-major, L = ceil(K/128), L4 = L rounded up to a multiple of 4:

* 1x128 of ``a``: [M, L], strides (1, M) ("outer-dim-major");
* 128x128 of ``b``: [L4, ceil(N/128)], strides (1, L4): each 128-column block's L scales contiguous, the next
  block L4 floats further on (the K blocks padded to a multiple of 4);
* 1x128 of ``b``: [N, L], strides (1, N).

These are what the v2 entry point checks (aten/src/ATen/native/cuda/ScaledBlas.cpp, ``_scaled_block1x128_block128x128``
and ``_scaled_block1x128_block1x128``; torch PR 166752 "Fix DeepSeek scaling tensor handling", citing the cuBLAS
docs' scaling-factor layouts; torch's own test pads them, test/test_scaled_matmul_cuda.py ``_pad_128x128_scales``).
The v1 ``torch._scaled_mm`` (``get_joint_scaling`` / ``is_blockwise_128x128_scaling`` in ScaledBlas.cpp, unchanged
on torch's main as of 2026) checks a 128x128 ``scale_b`` of strides (1, L) and passes the same pointer, so for
L % 4 != 0 and more than one 128-column block cuBLASLt reads the scales of column block j at j * L4, not j * L: a
silently wrong product from the second column block on (the symptom seen on an H200 with torch 2.11 at K = 256:
the first 128 columns exact, the later ones off). Hence v2, with the weight scales padded (``padded_scales``).

What torch checks on SM90: ``a`` row-major, ``b`` column-major; ``a``'s trailing dimension and both of ``b``'s
divisible by 16; e4m3 operands, fp32 scales of the layouts above. ``reference_scaled_mm`` checks the same, reads the
scales from their first element in cuBLASLt's layout (not through the tensor's strides) and computes the product in
fp32 on any device: the CPU tests run the whole path through it, the GPU tests compare the real GEMMs with it, and
``unavailable`` runs a layout probe (``probe``) on the GPU before the path is used.

Legend: P padded rows, G experts, N output features, K input features, B scale blocks along the last dim.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from baselines.fp8_groups import BLOCK, E4M3, GroupLayout, k_grouped_operand
from contract.fp8 import quantize_blocks

ALIGN = BLOCK  # rows per expert: the wgrad's 1x128 blocks run along the tokens and must not straddle two experts
FIX = ("needs a torch with torch.nn.functional.scaled_mm (scaled_mm v2) built with CUDA >= 12.9 (cuBLASLt block "
       "scales) on an SM90 GPU; or use fp8_gemm=rowwise")
PAIRS = (("1x128", "128x128"), ("1x128", "1x128"))  # the pairs used here (torch also has 128x128 x 1x128)


# ---- torch's block-scaled scaled_mm and its reference -------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round4(n: int) -> int:
    return _cdiv(n, 4) * 4


def scale_layout(kind: str, R: int, C: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(shape, strides) of the scales torch's v2 takes for an operand of ``R`` rows (M of ``a``, N of ``b``) and
    ``C`` = K, given as ``scale_a`` / ``scale_b``: exactly cuBLASLt's layout (see the module docstring)."""
    L = _cdiv(C, BLOCK)
    if kind == "1x128":
        return (R, L), (1, R)
    if kind == "128x128":
        return (_round4(L), _cdiv(R, BLOCK)), (1, _round4(L))
    raise ValueError(f"unknown scale kind {kind!r}")


def _layout_ok(scale: torch.Tensor, kind: str, R: int, C: int) -> bool:
    """torch's check (a stride of a size-1 dimension is not checked, as in torch)."""
    (s0, s1), (t0, t1) = scale_layout(kind, R, C)
    return (scale.dtype == torch.float32 and scale.dim() == 2 and tuple(scale.shape) == (s0, s1)
            and (s0 <= 1 or scale.stride(0) == t0) and (s1 <= 1 or scale.stride(1) == t1))


def cublas_scales(scale: torch.Tensor, kind: str, R: int, C: int) -> torch.Tensor:
    """The scales cuBLASLt reads for an operand [R, C] (C the reduced dim), one per block: [R, L] (1x128) or
    [R/128, L] (128x128), read from ``scale``'s first element in cuBLASLt's layout whatever the tensor's strides (a
    read past the storage's end raises)."""
    (s0, s1), (t0, t1) = scale_layout(kind, R, C)
    if kind == "1x128":
        return scale.as_strided((s0, s1), (t0, t1), scale.storage_offset())
    return scale.as_strided((s1, _cdiv(C, BLOCK)), (t1, t0), scale.storage_offset())


def _dequantize(t: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` [R, C] times its block scales ``s`` ([R, L] or [R/128, L])."""
    R, C = t.shape
    s = s.float().repeat_interleave(BLOCK, 1)[:, :C]
    if kind == "128x128":
        s = s.repeat_interleave(BLOCK, 0)[:R]
    return t.float() * s


def _aligned16(t: torch.Tensor) -> bool:
    return (t.storage_offset() * t.element_size()) % 16 == 0


def reference_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, kind_a: str, scale_b: torch.Tensor,
                        kind_b: str, out: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm(a, b, scale_a, kind_a, scale_b, kind_b)`` written into ``out``, in plain torch
    (fp32 math), with the checks torch makes on SM90 for the pairs in ``PAIRS``. Also requires 16-byte aligned
    operands and scales (cuBLASLt's pointers)."""
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise RuntimeError("Expected mat_a and mat_b to be float8_e4m3fn (the reference checks the fp8 inputs)")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat_a and mat_b shapes cannot be multiplied ({tuple(a.shape)} and {tuple(b.shape)})")
    if not (a.stride(1) == 1 or a.shape[1] <= 1) or not (b.stride(0) == 1 or b.shape[0] <= 1):
        raise RuntimeError("Only multiplication of row-major and column-major matrices is supported by cuBLASLt")
    if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
        raise RuntimeError(f"mat_a's trailing dimension and mat_b's dimensions must be divisible by 16, got "
                           f"{tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("mat_a", a), ("mat_b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("out", out)):
        if not _aligned16(t):
            raise RuntimeError(f"{name} does not start 16-byte aligned (the reference checks cuBLASLt's pointers)")
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    if out.shape != (M, N) or not out.is_contiguous():
        raise RuntimeError(f"out must be a contiguous [{M}, {N}] tensor, got {tuple(out.shape)}")
    if (kind_a, kind_b) not in PAIRS or not _layout_ok(scale_a, kind_a, M, K) or not _layout_ok(scale_b, kind_b, N, K):
        want = [scale_layout(k, r, K) for k, r in ((kind_a, M), (kind_b, N))] if (kind_a, kind_b) in PAIRS else None
        raise RuntimeError(f"Invalid scaling configuration: {kind_a} x {kind_b}, scale_a {tuple(scale_a.shape)} "
                           f"strides {scale_a.stride()}, scale_b {tuple(scale_b.shape)} strides {scale_b.stride()} "
                           f"for mat_a {tuple(a.shape)}, mat_b {tuple(b.shape)}; (shape, strides) wanted: {want} "
                           "(the reference checks what torch's scaled_mm v2 checks)")
    A = _dequantize(a, cublas_scales(scale_a, kind_a, M, K), kind_a)
    B = _dequantize(b.t(), cublas_scales(scale_b, kind_b, N, K), kind_b)
    return out.copy_(A @ B.t())


@functools.lru_cache(maxsize=None)
def _v2_out() -> bool:
    op = getattr(torch.ops.aten, "_scaled_mm_v2", None)
    return op is not None and "out" in op.overloads()


def scaled_mm(a, b, scale_a, kind_a, scale_b, kind_b, out) -> torch.Tensor:
    """``out = a @ b`` block-scaled (``kind_*``: "1x128" / "128x128", scales laid out by ``scale_layout``): torch's
    v2 on a GPU (into ``out`` where torch has the out overload), the reference elsewhere."""
    if not a.is_cuda:
        return reference_scaled_mm(a, b, scale_a, kind_a, scale_b, kind_b, out)
    F = torch.nn.functional
    recipe = {"1x128": F.ScalingType.BlockWise1x128, "128x128": F.ScalingType.BlockWise128x128}
    if _v2_out():
        return torch.ops.aten._scaled_mm_v2.out(a, b, [scale_a], [recipe[kind_a].value], [], [scale_b],
                                                [recipe[kind_b].value], [], None, out.dtype, out=out)
    return out.copy_(F.scaled_mm(a, b, scale_a, recipe[kind_a], scale_b, recipe[kind_b], output_dtype=out.dtype))


def probe(kind_b: str, device, layout: str = "cublas") -> tuple[torch.Tensor, torch.Tensor]:
    """One product a [128, 256] @ b [256, 256] in the pair 1x128 x ``kind_b``: (what ``scaled_mm`` gives on
    ``device``, the reference on the CPU). Ones as data and a distinct power of two per scale block, so every output
    block is exact in bf16 and a scale read from the wrong place gives a visibly wrong block; two K blocks (L = 2,
    L4 = 4) and two 128-column blocks, where cuBLASLt's padded 128x128 layout and an unpadded one differ.
    ``layout="v1"`` (diagnostics only) runs the old ``torch._scaled_mm`` call instead, its 128x128 ``scale_b``
    unpadded [L, N/128] with strides (1, L) (the rest of its buffer zeros)."""
    M, K, N = 128, 256, 256
    L = K // BLOCK
    rows = torch.arange(M)
    kb = torch.arange(L)
    sa = (2.0 ** ((rows % 2)[:, None] + kb[None, :])).float()  # [M, L]
    if kind_b == "128x128":
        sb = 2.0 ** (2 * kb[None, :] + torch.arange(N // BLOCK)[:, None]).float()  # [N/128, L]
    else:
        sb = 2.0 ** (2 * kb[None, :] + (torch.arange(N) % 3)[:, None]).float()  # [N, L]

    def operands(dev):
        a = torch.ones(M, K, device=dev).to(E4M3)
        b = torch.ones(N, K, device=dev).to(E4M3).t()
        scale_a = sa.t().contiguous().to(dev).t()
        if kind_b == "1x128":
            scale_b = sb.t().contiguous().to(dev).t()
        else:
            scale_b = torch.zeros(N // BLOCK, _round4(L), device=dev)
            scale_b[:, :L] = sb.to(dev)
            scale_b = scale_b.t()
        return a, b, scale_a, scale_b

    want = reference_scaled_mm(*_pair(operands("cpu"), kind_b), torch.empty(M, N, dtype=torch.bfloat16))
    a, b, scale_a, scale_b = operands(device)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    if layout == "v1":  # torch._scaled_mm: 128x128 scale_b [L, N/128] strides (1, L); 1x128 scale_b [L, N]
        buf = torch.zeros(256, device=device)
        v1_b = buf[:sb.numel()].view(sb.shape).copy_(sb.to(device)).t() if kind_b == "128x128" else scale_b.t()
        got = torch._scaled_mm(a, b, scale_a, v1_b, out_dtype=torch.bfloat16, out=out)
    else:
        got = scaled_mm(*_pair((a, b, scale_a, scale_b), kind_b), out)
    return got, want


def _pair(ops, kind_b):
    a, b, scale_a, scale_b = ops
    return a, b, scale_a, "1x128", scale_b, kind_b


def block_report(got: torch.Tensor, want: torch.Tensor) -> str:
    """Per 128-column block: the distinct values got and wanted (a layout error shows as a wrong block)."""
    parts = []
    for j in range(0, want.shape[1], BLOCK):
        g, w = got[:, j:j + BLOCK].float().cpu(), want[:, j:j + BLOCK].float()
        ok = "ok" if torch.equal(g, w) else "WRONG"
        parts.append(f"cols {j}-{j + BLOCK - 1} {ok}: got {g.unique().tolist()[:4]} want {w.unique().tolist()[:4]}")
    return "; ".join(parts)


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """Why this torch cannot run the block-scaled pairs used here (None: it can). Run once on the current GPU (SM90
    checked by the caller): ``probe`` in each pair, which must match the reference exactly."""
    if not hasattr(torch.nn.functional, "scaled_mm") or not hasattr(torch.nn.functional, "ScalingType"):
        return (f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (its v1 torch._scaled_mm misreads "
                f"128x128 scales when K/128 is not a multiple of 4); fp8_gemm=blockwise_loop {FIX}")
    dev = torch.device("cuda", torch.cuda.current_device())
    for kind_b in ("128x128", "1x128"):
        try:
            got, want = probe(kind_b, dev)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 (torch raises RuntimeError / NotImplementedError / ValueError by version)
            first = str(e).splitlines()[0] if str(e) else ""
            return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) does not run block-scaled scaled_mm "
                    f"1x128 x {kind_b} here ({type(e).__name__}: {first}); fp8_gemm=blockwise_loop {FIX}")
        if not torch.equal(got.cpu(), want):
            return (f"torch {torch.__version__}'s block-scaled scaled_mm 1x128 x {kind_b} reads its scales from "
                    f"elsewhere than cuBLASLt's documented layout ({block_report(got, want)}); fp8_gemm=blockwise_loop "
                    "is off until baselines/fp8_loop.py lays them out as this torch reads them")
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


def padded_scales(s_GAB: torch.Tensor) -> torch.Tensor:
    """The weight scales [G, A, B] (A blocks of output rows, B blocks along the reduced dim) as cuBLASLt reads a
    128x128 ``scale_b``: [G, A, B4] with B4 = B rounded up to a multiple of 4, zeros past B (a copy only when B is
    not a multiple of 4). ``weight_scales`` views expert e's as torch's [B4, A] with strides (1, B4); every
    expert's block (A * B4 floats) starts 16-byte aligned."""
    G, A, B = s_GAB.shape
    if B % 4 == 0:
        return s_GAB.contiguous()
    buf = s_GAB.new_zeros(G, A, _round4(B))
    buf[:, :, :B] = s_GAB
    return buf


def weight_scales(s_pad: torch.Tensor, e: int) -> torch.Tensor:
    return s_pad[e].t()


class LoopWeight:
    """A ``BlockwiseWeight`` (shared with DeepGEMM's path: the same blocks) plus its scales laid out for torch's
    block-scaled ``scaled_mm``: padded to cuBLASLt's 128x128 layout (``padded_scales``)."""

    def __init__(self, w) -> None:
        self.q, self.q_t = w.q, w.q_t
        self.s, self.s_t = padded_scales(w.s), padded_scales(w.s_t)

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
    """out [P, C] with rows of expert e = A_e (1x128) @ wq[e].t() (128x128 blocks, ``ws`` from ``padded_scales``):
    the forward with (q, s), the dgrad with (q_t, s_t)."""
    out = torch.empty(aq.shape[0], wq.shape[1], dtype=torch.bfloat16, device=aq.device)
    B = aq.shape[1] // BLOCK
    for e, (s, n) in enumerate(zip(_starts(layout), layout.padded_host)):
        if n:
            scaled_mm(aq[s:s + n], wq[e].t(), expert_scales(a_em, s, n, B), "1x128", weight_scales(ws, e), "128x128",
                      out[s:s + n])
    return out


class LoopLinear(torch.autograd.Function):
    """y [P, N] = x [P, K] @ w[g]^T per expert, every GEMM a block-scaled fp8 ``scaled_mm``."""

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
            # dy_e^T [N, n] row-major, scale_a [N, n/128] strides (1, N); x_e [n, K] column-major (x_e^T [K, n]
            # row-major), scale_b [K, n/128] strides (1, K): both the transposes of row-major [n/128, C] slices
            scaled_mm(ga[s * N:(s + n) * N].view(N, n), xa[s * K:(s + n) * K].view(K, n).t(),
                      gsf[b0:b1].t(), "1x128", xsf[b0:b1].t(), "1x128", dw[e])
        return dx, dw, None, None, None, None, None
