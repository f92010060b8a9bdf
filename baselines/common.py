"""PyTorch expert math and helpers shared by the baselines (no harness imports).

Legend: M routed rows on this rank, L local experts, H hidden, I expert ffn.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from baselines import fp8_gemm
from contract import comm
from contract.case import Case
# The harness's fp8 format (block-scaled e4m3) and the weights as autograd leaves: one definition each, in the contract.
from contract.fp8 import dequantize_blocks, quantize_blocks  # noqa: F401 (re-exported)
from contract.weights import ExpertLeaves  # noqa: F401 (re-exported)


def device_capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def cache_record(cache_env: str, name: str) -> Optional[dict]:
    """The JSON record ``name`` that an anchor's precompile tool left in the cache folder named by the environment
    variable ``cache_env`` (None where that is unset, or holds no readable record)."""
    import json
    import os
    from pathlib import Path

    cache = os.environ.get(cache_env)
    path = Path(cache) / name if cache else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def warm_forward_backward(routed: Callable[..., torch.Tensor], inputs, params: "ExpertParams") -> float:
    """One untimed forward and backward of ``routed(x, topk_idx, topk_w)`` on the point's inputs, so that a
    library's first-use autotuning and compiles land in setup; the gradients it leaves are cleared. Returns its
    seconds (the adapters report them in their notes)."""
    t0 = time.perf_counter()
    x = inputs.x_TH.detach().requires_grad_()
    w = inputs.topk_w_TK.detach().requires_grad_()
    routed(x, inputs.topk_idx_TK, w).backward(inputs.grad_out_TH)
    if x.is_cuda:
        torch.cuda.synchronize()
    params.zero_grad()
    return time.perf_counter() - t0


def package_version(dist_name: str) -> str:
    """The installed version of the distribution ``dist_name`` (what the rows' notes name), "?" where it is absent."""
    import importlib.metadata

    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def precision_unsupported(precision: str, device: torch.device) -> Optional[str]:
    """Why this device cannot run a precision at all (None if it can)."""
    cap = device_capability(device)
    if precision == "mxfp8" and cap < (10, 0):
        where = "the CPU" if device.type == "cpu" else f"SM{cap[0]}{cap[1]}"
        return f"mxfp8 needs a Blackwell GPU (SM100+), this is {where}; use precision=fp8 (Hopper block-scaled e4m3)"
    if precision == "fp8" and device.type == "cuda" and cap < (8, 9):
        return f"fp8 needs compute capability 8.9+ (Ada/Hopper), this is SM{cap[0]}{cap[1]}; use precision=bf16"
    return None


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float] = None) -> torch.Tensor:
    """silu(gate) * up; with ``limit`` the DeepSeek-V4 clamp (gate <= limit, |up| <= limit)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def use_grouped_mm(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0) and hasattr(torch, "_grouped_mm")


def grouped_mm_name(device: str) -> str:
    cuda = device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    return "torch._grouped_mm" if cuda and hasattr(torch, "_grouped_mm") else "per-expert loop"


def grouped_linear(
    x_MK: torch.Tensor, w_LNK: torch.Tensor, offs_L: torch.Tensor, counts: Sequence[int]
) -> torch.Tensor:
    """y[rows of group j] = x[rows of group j] @ w[j]^T. ``offs_L`` int32 cumulative row ends (device),
    ``counts`` the same sizes on the host (used by the portable fallback)."""
    if x_MK.shape[0] == 0:
        # No rows here (this rank's experts got no token): an empty GEMM that still depends on x and w, so backward
        # reaches the same collectives as on the other ranks and w gets a zero gradient. torch._grouped_mm is kept
        # out of it: its backward on zero rows failed under torch.compile(mode="default") on H200, torch 2.11
        # ("Invalid strides/sizes, got [0, 1] for strides and [256, 0] for sizes"; eager and max-autotune ran)
        return x_MK @ w_LNK[0].t()
    if use_grouped_mm(x_MK):
        return torch._grouped_mm(x_MK, w_LNK.transpose(-2, -1), offs=offs_L)
    outs, start = [], 0
    for j, n in enumerate(counts):
        outs.append(x_MK[start : start + n] @ w_LNK[j].t())
        start += n
    return torch.cat(outs) if outs else x_MK.new_empty(0, w_LNK.shape[1])


class _StraightThrough(torch.autograd.Function):
    """Forward: ``q`` itself (a view, no arithmetic on the weights); backward: the gradient goes to ``w`` as is."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 (w only takes the gradient)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The prequantized weight ``q`` in the forward, with a straight-through gradient to the master weight ``w``.
    Nothing is computed per call (``w + (q - w).detach()`` would read and write every weight each time; under
    torch.compile inductor also fused that add into a transposed grouped-GEMM operand, which its TMA template
    cannot load: 'Tensor descriptor last dim must be 1', 2xH200)."""
    return _StraightThrough.apply(w, q)


def expert_mlp(
    x_MH: torch.Tensor,
    w13_LIH: torch.Tensor,
    w2_LHI: torch.Tensor,
    offs_L: torch.Tensor,
    counts: Sequence[int],
    limit: Optional[float],
    quantized: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Grouped SwiGLU experts on rows already sorted by local expert. w13 holds gate rows then up rows.
    ``quantized``: the GEMMs use these values of (w13, w2) instead (fp8: the weights' dequantized e4m3 values),
    with a straight-through gradient to (w13, w2)."""
    if quantized is not None:
        w13_LIH, w2_LHI = straight_through(w13_LIH, quantized[0]), straight_through(w2_LHI, quantized[1])
    h13 = grouped_linear(x_MH, w13_LIH, offs_L, counts)
    gate, up = h13.chunk(2, dim=-1)
    return grouped_linear(swiglu(gate, up, limit), w2_LHI, offs_L, counts)


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i``: one scatter (a second argsort would sort again)."""
    return torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))


def dense_mlp(x_TH: torch.Tensor, g_IH: torch.Tensor, u_IH: torch.Tensor, d_HI: torch.Tensor,
              limit: Optional[float]) -> torch.Tensor:
    return swiglu(x_TH @ g_IH.t(), x_TH @ u_IH.t(), limit) @ d_HI.t()


# ---- fp8 block scaling (DeepSeek / TE Float8BlockScaling format) ------------------------------------------


def fake_quant(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Round-trip through block-scaled e4m3 with a straight-through gradient (value of the fp8 GEMM operand)."""
    q, s = quantize_blocks(x.detach(), block_rows, block_cols)
    dq = dequantize_blocks(q, s, block_rows, block_cols).to(x.dtype)
    return x + (dq - x).detach()


def emulated_fp8_weights(weights, block: int) -> list[torch.Tensor]:
    """Each weight's values after a round trip through ``block`` x ``block`` scaled e4m3, in its own dtype: the
    operands of the emulated fp8 GEMMs (computed once, used with a straight-through gradient)."""
    out = []
    for w in weights:
        q, s = quantize_blocks(w.detach(), block, block)
        out.append(dequantize_blocks(q, s, block, block).to(w.dtype))
    return out


# ---- differentiable collectives -----------------------------------------------------------------------------


class AllToAllSingle(torch.autograd.Function):
    """all_to_all_single with host split sizes; backward sends the gradient back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        gin = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all_single(gin, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gin, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return AllToAllSingle.apply(x, out_splits, in_splits, group)


# ---- expert parameters shared by the PyTorch-expert baselines ------------------------------------------------


PUBLISHED_COMPILE_MODE = "published"  # compile_mode value: each backend's own published torch.compile mode


class ExpertParams(ExpertLeaves):
    """The leaves plus the optional torch.compile of the expert math and fp8 weight prequantization
    (block-scaled e4m3, used with a straight-through gradient; done once, outside the timed region).

    ``published_mode``: the backend's torch.compile mode in the published scripts, used when the case asks for
    ``compile_mode=published`` (nccl: ``max-autotune``; DeepEP: ``max-autotune-no-cudagraphs``). ``group``: the
    backend's process group, over which ``fp8_gemm=auto`` agrees on one path (the slowest rank's times decide).
    ``fp8_option``: the backend's ``fp8_gemm`` option (baselines/options.py; backends without it: ``auto``)."""

    def __init__(self, case, inputs, published_mode: str = "max-autotune-no-cudagraphs", group=None,
                 fp8_option: str = "auto") -> None:
        super().__init__(case, inputs)
        self.mlp, self.dense = expert_mlp, dense_mlp
        self.compile_mode = published_mode if case.compile_mode == PUBLISHED_COMPILE_MODE else case.compile_mode
        self._quantized = None  # fp8 emulated: the weights' dequantized e4m3 values (bf16), computed once
        self._fp8 = None  # fp8 real paths: real fp8 GEMMs on weights quantized once (baselines/fp8_gemm.py)
        self.fp8_picked = ""  # fp8_gemm=auto: how it picked the path (for scaling)
        self.fp8_timing = ""  # fp8_gemm=auto with several real paths: each one's setup timing (for notes)
        self.fp8_path, why = fp8_gemm.resolve(case, fp8_option)
        if why:
            raise RuntimeError(why)
        if self.fp8_path == "auto":
            self._fp8, self.fp8_timing = fp8_gemm.fastest_experts(case, self.w13, self.w2, swiglu, group)
            self.fp8_path = self._fp8.path
            self.fp8_picked = "picked by fp8_gemm=auto: the fastest real path in a setup timing (times in notes)"
        elif self.fp8_path in fp8_gemm.FP8_GEMM_PATHS:
            self._fp8 = fp8_gemm.Fp8Experts(self.fp8_path, self.w13, self.w2)
            if fp8_option == "auto":
                self.fp8_picked = "picked by fp8_gemm=auto: the only real fp8 path installed here"
        if self._fp8 is not None:
            self.mlp = self._fp8_mlp
        if self._fp8 is None and case.precision == "fp8":
            self._quantized = emulated_fp8_weights((self.w13, self.w2), case.weight_block)
        self._eager = (self.mlp, self.dense)
        self.compile_note = ""  # the compile fallback's failures (warm_compiled), for notes
        if case.compile:
            # The weights are the same tensors every call, as a module's parameters would be: mark them static so
            # that CUDA graphs (max-autotune) use them in place instead of copying every weight into the graph's
            # input buffers on each call (on 2xH200 the compiled nccl forward took 11.47 ms on glm_5_2 unmarked,
            # 6.47 ms marked: runs recorded in lab/runs.md)
            for t in [self.w13, self.w2, *(self.shared or []), *(self._quantized or []),
                      *(self._fp8.tensors() if self._fp8 else [])]:
                torch._dynamo.mark_static_address(t)
            self.compile(self.compile_mode)

    def compile(self, mode: str) -> None:
        """The expert math and the shared expert under ``torch.compile(mode=mode)`` (``eager``: uncompiled). DeepGEMM's
        experts and the per-expert loop run eagerly (host-side group sizes; DeepGEMM's JIT kernels)."""
        from baselines.compile_modes import EAGER

        self.mlp, self.dense = self._eager
        if mode == EAGER:
            return
        if self.fp8_path not in ("blockwise", "blockwise_loop"):
            self.mlp = torch.compile(self.mlp, mode=mode, dynamic=False)
        self.dense = torch.compile(dense_mlp, mode=mode, dynamic=False)

    def warm_compiled(self, rows_M: int, counts_L: torch.Tensor, x_TH: torch.Tensor, agree=None) -> None:
        """Compile and autotune now, on this rank's shapes (``rows_M`` routed rows, grouped as ``counts_L``; the
        shared expert on ``x_TH``), with the fallback of ``baselines.compile_modes`` where a mode fails: the mode that
        compiled becomes ``compile_mode`` and the failures ``compile_note``. No collective runs inside a try, so a
        rank whose compile fails cannot leave the others waiting in one; ``agree`` makes them take the same branch."""
        from baselines.compile_modes import compile_with_fallback

        if not self.case.compile:
            return
        x = torch.randn(rows_M, self.case.hidden, device=x_TH.device, dtype=x_TH.dtype) * self.case.hidden**-0.5

        def warm(_):
            try:
                for _ in range(2):  # the second call: CUDA graph trees record on it
                    # no gradient left from the last call: under CUDA graphs it is an output of the last replay,
                    # which the next one overwrites, so accumulating into it fails (also in the next mode's try)
                    self.zero_grad()
                    self.step_begin()
                    xr, xt = x.detach().requires_grad_(), x_TH.detach().requires_grad_()
                    y = self.experts(xr, counts_L).float().sum() + (
                        self.dense(xt, *self.shared, self.case.swiglu_limit).float().sum() if self.shared else 0.0)
                    y.backward()
                if x.is_cuda:
                    torch.cuda.synchronize(x.device)
            finally:
                self.zero_grad()

        _, outcome = compile_with_fallback(self.compile_mode, self.compile, warm, agree)
        self.compile_mode, self.compile_note = outcome.mode, outcome.note

    def step_begin(self) -> None:
        """A new step of the compiled code's CUDA graphs (baselines.compile_modes.step_begin): once per layer call."""
        from baselines.compile_modes import step_begin

        if self.case.compile:
            step_begin(self.compile_mode, self.w13.is_cuda)

    def experts(self, x_MH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        """Grouped SwiGLU experts on rows sorted by local expert; ``counts_L`` rows per expert (device)."""
        c = self.case
        if self._fp8 is not None:
            return self.mlp(x_MH, self.w13, self.w2, counts_L, c.swiglu_limit)
        offs = torch.cumsum(counts_L, 0).to(torch.int32)
        counts = [] if use_grouped_mm(x_MH) else counts_L.tolist()
        if c.precision == "fp8":
            x_MH = fake_quant(x_MH, 1, c.act_block)
        quantized = tuple(self._quantized) if self._quantized is not None else None
        return self.mlp(x_MH, self.w13, self.w2, offs, counts, c.swiglu_limit, quantized)

    def _fp8_mlp(self, x_MH, w13_LIH, w2_LHI, counts_L, limit):
        return self._fp8(x_MH, w13_LIH, w2_LHI, counts_L, swiglu, limit)

    def add_shared(self, out_TH: torch.Tensor, x_TH: torch.Tensor) -> torch.Tensor:
        """fp32 out + the bf16 shared expert of x, cast to bf16."""
        if self.shared is not None:
            out_TH = out_TH + self.dense(x_TH, *self.shared, self.case.swiglu_limit).float()
        return out_TH.to(torch.bfloat16)

    def gemm_name(self) -> str:
        """The expert GEMMs that ran, for a row's notes."""
        name = {"rowwise": "torch._scaled_grouped_mm (fp8 rowwise)",
                "blockwise": f"{fp8_gemm.deep_gemm_version()} grouped fp8 (1x128/128x128)",
                "blockwise_loop": "torch scaled_mm v2 per expert (fp8 1x128/128x128)"}.get(
            self.fp8_path, grouped_mm_name(self.case.device) + (" (bf16, emulated fp8)" if self.fp8_path == "emulated"
                                                                 else ""))
        return f"{name} ({self.fp8_timing})" if self.fp8_timing else name

    def columns(self, dispatch: str = "bf16") -> dict[str, object]:
        """The row columns these experts decide: ``scaling``, ``compiled``, ``compile_mode``."""
        c = self.case
        scaling = (fp8_gemm.scaling_label(self.fp8_path, c, dispatch, self.fp8_picked) if c.precision == "fp8"
                   else "none")
        from baselines.compile_modes import EAGER

        compiled = bool(c.compile) and self.compile_mode != EAGER  # every compiled mode failed: eager ran
        return {"scaling": scaling, "compiled": compiled, "compile_mode": self.compile_mode if c.compile else ""}


# ---- anchors that run expert parallelism only when asked -----------------------------------------------------


def ep_opt_in(env: str) -> bool:
    """Whether the environment variable ``env`` (1 / true / yes) asks to run an anchor at EP >= 2, where this harness
    has not validated it."""
    return os.environ.get(env, "").strip().lower() in ("1", "true", "yes")


def ep_unsupported(what: str, case: Case, env: str) -> Optional[str]:
    """Why ``what`` does not run at this case's EP size (None: EP=1, or ``env`` asks for it)."""
    if case.ep_size == 1 or ep_opt_in(env):
        return None
    return (f"{what} runs at ep_size=1 unless {env}=1 (its expert parallelism is not validated by this harness yet): "
            f"run at ep_size=1, or set {env}=1 to run it at EP={case.ep_size} (the rows' notes then say so)")


def ep_note(case: Case, env: str) -> str:
    """The notes line of an anchor's EP: EP=1, or the opt-in it ran under."""
    return "EP=1" if case.ep_size == 1 else f"EP={case.ep_size} through {env}=1 (not validated by this harness)"
