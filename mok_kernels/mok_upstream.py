"""The harness backend ``mok``: a thin adapter to the upstream ``mok`` package (cursor/mixture-of-kittens).

It runs only where upstream runs: the package installed, a Blackwell GPU (SM100 / SM103), NVLink multicast
(NVLS through torch symmetric memory), EP in {4, 8, 16, 32, 64}, T >= 512 and divisible by 256, H and I divisible
by 256. Anywhere else :meth:`MokBackend.unsupported_reason` says which of these is missing. The input preparation
(weight layouts, MXFP8 prequantisation through the package, the MoKConfig of a sweep point) is plain functions, so
it can be tested without the package.

Upstream API used (see docs/methodology.md section 12): ``MoKConfig``, ``get_workspace``, ``build_schedule``,
``forward``, ``backward``, ``ops.mxfp8_quantize``; ``clear_workspace_cache`` when present.

Legend: T tokens per rank, K top-k, H hidden, I ffn, L local experts.
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from contract import Case, LayerInputs

# Communication SMs of the published benchmark (bench_mok.py defaults), per precision and direction.
PUBLISHED_COMM_SMS: dict[tuple[str, str], int] = {("bf16", "fwd"): 24, ("bf16", "bwd"): 28,
                                                  ("mxfp8", "fwd"): 36, ("mxfp8", "bwd"): 36}
EP_SIZES = (4, 8, 16, 32, 64)
BLACKWELL = ((10, 0), (10, 3))


def import_mok() -> Any:
    """The upstream package (raises ImportError when it is not installed)."""
    mok = importlib.import_module("mok")
    if not hasattr(mok, "ops"):
        mok.ops = importlib.import_module("mok.ops")
    return mok


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _multicast_missing() -> Optional[str]:
    if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0") not in ("", "0"):
        return "NVLink multicast is disabled (TORCH_SYMM_MEM_DISABLE_MULTICAST=1); MoK's all-gather and barrier need it"
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        if not _SymmetricMemory.has_multicast_support(DeviceType.CUDA, torch.cuda.current_device()):
            return "this machine has no NVLink multicast (NVLS: an NVSwitch system such as NVL72); MoK needs it"
    except Exception:  # noqa: BLE001 - older torch: let the package's own check decide at setup
        return None
    return None


def case_constraints(case: Case) -> Optional[str]:
    """Upstream's limits on a sweep point (None when the point is within them)."""
    T, H, I, K, ep = case.tokens_per_gpu, case.hidden, case.ffn, case.topk, case.ep_size
    if ep not in EP_SIZES:
        return f"MoK runs at EP 4, 8, 16, 32 or 64 (this is EP={ep}); use mok_hopper or a baseline at this size"
    if T < 512 or T % 256:
        return f"MoK needs tokens_per_gpu >= 512 and divisible by 256 (got {T})"
    if H % 256 or I % 256:
        return f"MoK needs hidden and ffn divisible by 256 (got hidden={H}, ffn={I})"
    if not 1 <= K <= 255:
        return f"MoK needs 1 <= topk <= 255 (got {K})"
    if not case.shared_expert:
        return "MoK always computes a shared expert (with the routed ffn); this shape has none"
    return None


def unsupported_here(case: Case) -> Optional[str]:
    """Why this sweep point cannot run the upstream kernels on this machine (None when it can)."""
    if case.precision not in ("bf16", "mxfp8"):
        return (f"precision={case.precision} is not a MoK precision (bf16 or mxfp8); Hopper fp8 is the mok_hopper "
                f"backend's")
    if case.device != "cuda":
        return "MoK needs a Blackwell GPU (SM100/SM103) with NVLink multicast; this is the CPU (use mok_hopper)"
    cap = _capability()
    if cap not in BLACKWELL:
        return (f"MoK needs a Blackwell GPU (SM100 or SM103); this is SM{cap[0]}{cap[1]} (on Hopper use the "
                f"mok_hopper backend)")
    try:
        mok = import_mok()
    except ImportError as e:
        return (f"the upstream `mok` package is not installed ({e}); build cursor/mixture-of-kittens on this machine "
                f"(CUDA 13, `pip install . --no-build-isolation`)")
    why = _multicast_missing() or case_constraints(case)
    if why:
        return why
    if case.swiglu_limit is not None and "swiglu_limit" not in inspect.signature(mok.forward).parameters:
        return "this mok version has no clamped SwiGLU (swiglu_limit); it arrived with upstream PR #11 (6438bf4)"
    return None


def comm_sms(case: Case) -> tuple[int, int]:
    """(forward, backward) communication SMs: the published values per precision, or ``case.comm_sms`` for both."""
    if case.comm_sms is not None:
        return case.comm_sms, case.comm_sms
    return PUBLISHED_COMM_SMS[(case.precision, "fwd")], PUBLISHED_COMM_SMS[(case.precision, "bwd")]


def make_config(mok: Any, case: Case) -> Any:
    fwd, bwd = comm_sms(case)
    return mok.MoKConfig(fwd_num_comm_sms=fwd, bwd_num_comm_sms=bwd)


def split_gate_up(w13_LIH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, 2I, H] gate rows then up rows -> contiguous gate [L, I, H] and up [L, I, H]."""
    I = w13_LIH.shape[1] // 2
    return w13_LIH[:, :I].contiguous(), w13_LIH[:, I:].contiguous()


@dataclass
class RoutedWeights:
    """The routed weights as mok.forward / mok.backward take them (bf16 tensors, or MXFP8 tuples)."""

    fwd: tuple[Any, Any, Any]  # gate, up, down
    bwd: tuple[Any, Any, Any]


def prepare_weights(mok: Any, precision: str, gate_LIH: torch.Tensor, up_LIH: torch.Tensor,
                    down_LHI: torch.Tensor) -> RoutedWeights:
    """bf16: the tensors. mxfp8: ``ops.mxfp8_quantize(w, True, True)`` -> (data, scales, data_t, scales_t); the
    forward takes (data, scales) for all three, the backward gate/up as 4-tuples and down as (data_t, scales_t)."""
    if precision == "bf16":
        return RoutedWeights((gate_LIH, up_LIH, down_LHI), (gate_LIH, up_LIH, down_LHI))
    g, u, d = (tuple(mok.ops.mxfp8_quantize(w, True, True)) for w in (gate_LIH, up_LIH, down_LHI))
    return RoutedWeights((g[:2], u[:2], d[:2]), (g, u, d[2:]))


class _MoKLayer(torch.autograd.Function):
    """mok.forward / mok.backward as one autograd node. Inputs: x, router weights, shared gate/up/down, routed
    gate/up/down leaves (bf16; in mxfp8 mode their quantised copies are what the kernels read)."""

    @staticmethod
    def forward(ctx, x, w, sg, su, sd, g, u, d, runner):  # type: ignore[override]
        out, fctx = runner.call_forward(x, w, sg, su, sd)
        ctx.runner, ctx.fctx = runner, fctx
        ctx.save_for_backward(x, w, sg, su, sd)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w, sg, su, sd = ctx.saved_tensors
        d_x, d_w, d_g, d_u, d_d, d_sg, d_su, d_sd = ctx.runner.call_backward(ctx.fctx, grad, x, w, sg, su, sd)
        return d_x, d_w, d_sg, d_su, d_sd, d_g, d_u, d_d, None


class MokBackend:
    name = "mok"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case) -> Optional[str]:
        return unsupported_here(case)

    def __init__(self, case: Case, group: Any) -> None:
        self.case, self.group = case, group
        self.rank = dist.get_rank(group)
        self.ep = dist.get_world_size(group)
        self._last_idx: Optional[torch.Tensor] = None

    def setup(self, inputs: LayerInputs) -> None:
        c = self.case
        self.mok = import_mok()
        self.config = make_config(self.mok, c)
        g, u = split_gate_up(inputs.w13_LIH.detach())
        self.gate = g.requires_grad_()
        self.up = u.requires_grad_()
        self.down = inputs.w2_LHI.detach().requires_grad_()
        self.shared = [t.detach().requires_grad_() for t in (inputs.ws_gate_IH, inputs.ws_up_IH, inputs.ws_down_HI)]
        self.routed = prepare_weights(self.mok, c.precision, self.gate.detach(), self.up.detach(),
                                      self.down.detach())
        self.workspace = self.mok.get_workspace(self.config, self.group, device=inputs.x_TH.device,
                                                num_local_tokens=c.tokens_per_gpu, hidden_size=c.hidden, topk=c.topk)
        self._limit_kw = {} if c.swiglu_limit is None else {"swiglu_limit": c.swiglu_limit}

    # called by _MoKLayer
    def call_forward(self, x, w, sg, su, sd):  # type: ignore[no-untyped-def]
        return self.mok.forward(self.config, self.workspace, self._schedule, x.contiguous(), w.contiguous(), sg, su,
                                sd, *self.routed.fwd, **self._limit_kw)

    def call_backward(self, fctx, grad, x, w, sg, su, sd):  # type: ignore[no-untyped-def]
        return self.mok.backward(self.config, self.workspace, self._schedule, fctx, grad.contiguous(), x, w, sg, su,
                                 sd, *self.routed.bwd, **self._limit_kw)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        self._schedule = self.mok.build_schedule(self.workspace, self.config, topk_idx_TK.contiguous(),
                                                 num_local_experts=self.case.local_experts)
        self._last_idx = topk_idx_TK
        return _MoKLayer.apply(x_TH, topk_w_TK, *self.shared, self.gate, self.up, self.down, self)

    def zero_grad(self) -> None:
        for p in (self.gate, self.up, self.down, *self.shared):
            p.grad = None

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return {"w_gate": self.gate.grad, "w_up": self.up.grad, "w_down": self.down.grad,
                "ws_gate": self.shared[0].grad, "ws_up": self.shared[1].grad, "ws_down": self.shared[2].grad}

    def traffic(self) -> dict[str, Any]:
        """Rows per peer from the last routing (host sync, outside timing). MoK pulls bf16 rows in both
        precisions (mxfp8 quantises after the pull) and pushes bf16 rows back."""
        if self._last_idx is None:
            return {}
        parts = [torch.empty_like(self._last_idx) for _ in range(self.ep)]
        dist.all_gather(parts, self._last_idx.contiguous(), group=self.group)
        L = self.case.local_experts
        owner = torch.stack(parts) // L  # [P, T, K]
        d = torch.bincount(owner[self.rank].flatten(), minlength=self.ep).tolist()
        cmb = (owner == self.rank).flatten(1).sum(1).tolist()
        return {"dispatch_rows_to": d, "combine_rows_to": cmb, "dispatch_row_bytes": 2 * self.case.hidden,
                "combine_row_bytes": 2 * self.case.hidden}

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}  # one fused kernel: no separable phases

    def info(self) -> dict[str, Any]:
        fwd, bwd = comm_sms(self.case)
        version = getattr(self.mok, "__version__", "unknown")
        scaling = "mxfp8 1x32 e8m0 (upstream)" if self.case.precision == "mxfp8" else "none"
        return {"scaling": scaling, "compiled": True, "comm_sms": fwd,
                "notes": f"upstream mok {version}; comm SMs fwd {fwd} / bwd {bwd}; schedule built per forward"}

    def teardown(self) -> None:
        clear = getattr(self.mok, "clear_workspace_cache", None)
        if clear is not None:
            clear()
