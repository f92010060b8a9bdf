"""HybridEP + PyTorch experts: NVIDIA's HybridEP (DeepEP ``hybrid-ep`` branch) dispatch-with-permute and
combine-with-unpermute around the same grouped PyTorch experts as the other baselines.

* ``dispatch_with_permute`` takes a [T, E] routing map and the router weights as dense probs, and returns the
  rows already grouped by local expert and padded per expert to ``pad_multiple`` (zero rows, zero probs), the
  per-row router weight, and the padded count per expert; the host waits for the counts (non-blocking mode is
  not used). The experts multiply their output rows by that weight; ``combine_with_unpermute`` sums the rows back
  to their tokens across ranks.
* Backward: dispatch's backward is combine-with-unpermute of the row gradients (the row-weight gradients ride
  along as its probs); combine's backward is a cached dispatch-with-permute. The published HybridEP + Megatron
  setup (Megatron's MoELayer, TE grouped MLP) is the separate ``hybridep_megatron`` backend.
* HybridEP compiles its kernels at run time (``CUDA_HOME`` must point at the CUDA toolkit); the first call of each
  process happens in ``setup`` / the correctness check, outside the timed region.
* fp8: HybridEP is used with bf16 on the wire, as in Megatron (which rejects FP8 dispatch there); the expert GEMMs
  run real fp8 (rowwise or DeepGEMM blockwise) or emulated fp8 by the ``fp8_gemm`` option, as in the nccl baseline
  (``scaling`` says which).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from contract import Case, LayerInputs
from baselines import fp8_gemm
from baselines.common import ExpertParams
from baselines.deepep import deepep_unsupported, import_deep_ep
from baselines.options import ExpertGemmOptions

PAD_MULTIPLE = 64  # Megatron's HYBRIDEP_TOKEN_ALIGNMENT


def hybridep_unsupported(case: Case, *, mxfp8: bool = False) -> Optional[str]:
    """Reasons shared by the HybridEP-based backends (None: can run)."""
    why = deepep_unsupported(case, mxfp8=mxfp8)
    if why:
        return why
    try:
        import_deep_ep().HybridEPBuffer  # noqa: B018
    except (ImportError, AttributeError) as e:
        return (f"this DeepEP build has no HybridEP ({e}); build DeepEP's hybrid-ep branch "
                "(docs/backends.md, 'DeepEP and HybridEP')")
    return None


def dense_routing(topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and weights as HybridEP (and Megatron's router) take them: dense fp32 probs [T, E] (differentiable
    in ``topk_w_TK``, zero off the top-k) and a bool routing map [T, E]."""
    T = topk_idx_TK.shape[0]
    routing_map = torch.zeros(T, num_experts, dtype=torch.bool, device=topk_idx_TK.device)
    routing_map.scatter_(1, topk_idx_TK, True)
    probs = torch.zeros(T, num_experts, dtype=torch.float32, device=topk_idx_TK.device)
    return probs.scatter(1, topk_idx_TK, topk_w_TK.float()), routing_map


def routing_map_traffic(map_TE: torch.Tensor, ep: int, local_experts: int, hidden: int, group) -> dict[str, Any]:
    """HybridEP moves one bf16 row per (token, destination rank), like DeepEP: counted from the [T, E] routing map
    (shared with the HybridEP + Megatron backend)."""
    to_rank = map_TE.view(map_TE.shape[0], ep, local_experts).any(-1).sum(0)
    from_rank = torch.empty_like(to_rank)
    dist.all_to_all_single(from_rank, to_rank, group=group)
    return {"dispatch_rows_to": to_rank.tolist(), "combine_rows_to": from_rank.tolist(),
            "dispatch_row_bytes": 2 * hidden, "combine_row_bytes": 2 * hidden}


class _DispatchPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, probs_TE, be, routing_map_TE):  # type: ignore[override]
        ctx.be = be
        rows, row_w, _, padded_counts, handle = be.buffer.dispatch_with_permute(
            hidden=x_TH, routing_map=routing_map_TE, probs=probs_TE, num_of_experts_per_rank=be.case.local_experts,
            pad_multiple=PAD_MULTIPLE)
        be.handle, be.padded_counts = handle, padded_counts
        be.num_rows = rows.shape[0]
        be.last_x = x_TH.detach()
        be.last_map, be.last_probs = routing_map_TE, probs_TE.detach()
        return rows, row_w

    @staticmethod
    def backward(ctx, g_rows, g_row_w):  # type: ignore[override]
        be = ctx.be
        if g_row_w is None:
            g_row_w = torch.zeros(be.num_rows, dtype=torch.float32, device=g_rows.device)
        gx, gp = be.buffer.combine_with_unpermute(hidden=g_rows.to(torch.bfloat16).contiguous(),
                                                  probs=g_row_w.float().contiguous(), handle=be.handle,
                                                  pad_multiple=PAD_MULTIPLE)
        return gx, gp, None, None


class _CombineUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MH, be):  # type: ignore[override]
        ctx.be = be
        out, _ = be.buffer.combine_with_unpermute(hidden=y_MH, handle=be.handle, pad_multiple=PAD_MULTIPLE)
        be.last_y = y_MH.detach()
        return out

    @staticmethod
    def backward(ctx, g_out):  # type: ignore[override]
        be = ctx.be
        g, _, _, _, _ = be.buffer.dispatch_with_permute(hidden=g_out.contiguous(), handle=be.handle,
                                                        num_permuted_tokens=be.num_rows, pad_multiple=PAD_MULTIPLE)
        return g, None


class HybridEPBackend:
    name = "hybridep"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case, options: Optional[ExpertGemmOptions] = None) -> Optional[str]:
        return hybridep_unsupported(case) or fp8_gemm.resolve(case, (options or ExpertGemmOptions()).fp8_gemm)[1]

    def __init__(self, case: Case, group: Any, options: Optional[ExpertGemmOptions] = None) -> None:
        self.case, self.group = case, group
        self.options = options or ExpertGemmOptions()
        self.rank, self.ep = dist.get_rank(group), dist.get_world_size(group)
        self.num_sms = case.comm_sms or 24  # HybridEP's single-node default

    def setup(self, inputs: LayerInputs) -> None:
        HybridEPBuffer = import_deep_ep().HybridEPBuffer
        c = self.case
        self.buffer = HybridEPBuffer(group=self.group, hidden_dim=c.hidden, max_num_of_tokens_per_rank=c.tokens_per_gpu,
                                     num_local_experts=c.local_experts, use_fp8=False,
                                     num_sms_dispatch_api=self.num_sms, num_sms_combine_api=self.num_sms)
        self.params = ExpertParams(c, inputs, group=self.group, fp8_option=self.options.fp8_gemm)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        c = self.case
        probs, routing_map = dense_routing(topk_idx_TK, topk_w_TK, c.num_experts)
        rows, row_w = _DispatchPermute.apply(x_TH, probs, self, routing_map)
        counts = torch.as_tensor(self.padded_counts, device=rows.device).to(torch.int64)
        y = self.params.experts(rows, counts).float() * row_w.unsqueeze(-1)
        out = _CombineUnpermute.apply(y.to(torch.bfloat16), self)
        return self.params.add_shared(out.float(), x_TH)

    def zero_grad(self) -> None:
        self.params.zero_grad()

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return self.params.grads()

    def traffic(self) -> dict[str, Any]:
        return routing_map_traffic(self.last_map, self.ep, self.case.local_experts, self.case.hidden, self.group)

    def phases(self) -> dict[str, Callable[[], Any]]:
        """Cached dispatch-with-permute and combine-with-unpermute on the last forward's tensors."""
        x, y, n = self.last_x, self.last_y, self.num_rows
        return {
            "dispatch": lambda: self.buffer.dispatch_with_permute(hidden=x, handle=self.handle, num_permuted_tokens=n,
                                                                  pad_multiple=PAD_MULTIPLE),
            "combine": lambda: self.buffer.combine_with_unpermute(hidden=y, handle=self.handle,
                                                                  pad_multiple=PAD_MULTIPLE),
        }

    def info(self) -> dict[str, Any]:
        return {**self.params.columns("bf16"), "comm_sms": self.num_sms,
                "notes": f"HybridEP dispatch_with_permute / combine_with_unpermute, pad {PAD_MULTIPLE}, "
                         f"{self.num_sms} SMs; grouped GEMM: {self.params.gemm_name()}"}

    def teardown(self) -> None:
        self.buffer = None
