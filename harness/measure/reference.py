"""The ground truth: the simplest correct distributed BF16 MoE layer.

It shares no communication path with any backend: every rank all-gathers all tokens, top-k ids and router
weights, runs its own experts with a plain per-expert loop (bf16 GEMMs, fp32 router-weighted accumulation), and
the partial outputs are summed across ranks and scattered back (all-reduce, then each rank keeps its rows). Both
collectives are differentiable, so autograd gives the output and all 8 gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from contract import Case, LayerInputs, comm
from contract.weights import ExpertLeaves


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class _AllGather(torch.autograd.Function):
    """[T, ...] per rank -> [EP*T, ...]; backward sums every rank's gradient for this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        comm.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = grad.float().contiguous()
        comm.all_reduce(g, group=ctx.group)
        rank, n = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return g.chunk(n)[rank].to(grad.dtype), None


class _SumScatter(torch.autograd.Function):
    """[EP*T, ...] partial sums per rank -> this rank's [T, ...] rows of the sum; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        y = x.contiguous().clone()
        comm.all_reduce(y, group=group)
        return y.chunk(dist.get_world_size(group))[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        comm.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def _into_total(whole: torch.Tensor, j: int, part: torch.Tensor) -> None:
    """Expert ``j``'s gradient, just accumulated into ``part.grad``, added into ``whole.grad[j]`` (the [L, ...] total,
    zeros at first) and freed."""
    if whole.grad is None:
        whole.grad = torch.zeros_like(whole)
    whole.grad[j] += part.grad
    part.grad = None


class ReferenceBackend:
    name = "reference"
    directions = ("fwd", "bwd", "fwd_bwd")
    runs_shared_gpu = True  # its collectives go through contract.comm (host-staged on a gloo group)

    @classmethod
    def unsupported_reason(cls, case: Case) -> Optional[str]:
        return None  # bf16 on any device: it is the ground truth for every precision

    def __init__(self, case: Case, group: Any) -> None:
        self.case, self.group = case, group
        self.rank = dist.get_rank(group)

    def setup(self, inputs: LayerInputs) -> None:
        self.leaves = ExpertLeaves(self.case, inputs)  # weight bookkeeping only; the math below is its own
        self.shared = self.leaves.shared
        # One autograd leaf per expert (views of the same storage, no copy). Indexing one [L, ...] leaf per expert
        # would make autograd build each expert's gradient as a zero-filled [L, ...] tensor and add it to the
        # total: two weight-sized gradient buffers at once, which keep the largest shapes off an 80 GB card. Each
        # expert's gradient is added into the [L, ...] total as soon as autograd has it, and freed: the experts'
        # gradients never pile up beside the total (on kimi_k2_7 they and the total took 52.5 of an H100's 79 GiB).
        self.w13 = [w.detach().requires_grad_() for w in self.leaves.w13.detach().unbind(0)]
        self.w2 = [w.detach().requires_grad_() for w in self.leaves.w2.detach().unbind(0)]
        for whole, parts in ((self.leaves.w13, self.w13), (self.leaves.w2, self.w2)):
            for j, p in enumerate(parts):
                p.register_post_accumulate_grad_hook(functools.partial(_into_total, whole, j))

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        c, g = self.case, self.group
        I, L = c.ffn, c.local_experts
        x_all = _AllGather.apply(x_TH, g)
        idx_all = _AllGather.apply(topk_idx_TK, g)
        w_all = _AllGather.apply(topk_w_TK, g)
        acc = x_all.new_zeros(x_all.shape, dtype=torch.float32)
        # Every expert runs, on zero rows too: acc then always depends on x_all and w_all, so every rank's backward
        # runs the same collectives in the same order whatever the routing (a rank whose experts got no tokens
        # would otherwise skip them and leave the others waiting). Empty rows add nothing to any value.
        for j in range(L):
            tok, kk = torch.nonzero(idx_all == self.rank * L + j, as_tuple=True)
            xe = x_all[tok]
            h = _swiglu(xe @ self.w13[j][:I].t(), xe @ self.w13[j][I:].t(), c.swiglu_limit)
            ye = h @ self.w2[j].t()
            acc = acc.index_add(0, tok, w_all[tok, kk].unsqueeze(-1) * ye.float())
        out = _SumScatter.apply(acc, g)
        if self.shared is not None:
            sg, su, sd = self.shared
            out = out + (_swiglu(x_TH @ sg.t(), x_TH @ su.t(), c.swiglu_limit) @ sd.t()).float()
        return out.to(torch.bfloat16)

    def zero_grad(self) -> None:
        self.leaves.zero_grad()
        for p in [*self.w13, *self.w2]:
            p.grad = None

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return self.leaves.grads()

    def traffic(self) -> dict[str, Any]:
        return {}

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def info(self) -> dict[str, Any]:
        return {"scaling": "none", "compiled": False, "notes": "ground truth: all-gather, per-expert loop, all-reduce"}

    def teardown(self) -> None:
        pass
