"""PyTorch + NCCL baseline, as published (mixture-of-kittens ``benchmarks/bench_nccl_torch.py``).

Forward: per-expert counts exchanged with ``all_to_all_single``; one host sync for the split sizes; token rows
sorted by expert and sent with ``all_to_all_single`` (one row per (token, k), no de-duplication); received rows
regrouped by local expert; grouped SwiGLU GEMMs (gate+up fused into one [L, 2I, H] weight; ``torch._grouped_mm``
on SM90+, a per-expert loop elsewhere); rows sent back; router-weighted sum in fp32 plus the shared expert.
Backward is autograd through the same graph (the all-to-alls reverse).

fp8 (option ``fp8_gemm``, ``baselines/fp8_gemm.py``; ``scaling`` records the path): real fp8 grouped GEMMs in the
forward and backward, ``rowwise`` (``torch._scaled_grouped_mm``) or ``blockwise`` (DeepGEMM, the harness's 1x128 /
128x128 format); weights are quantized once in ``setup``, activations and gradients inside the timed call.
``emulated`` (operands round-trip through e4m3, GEMMs in bf16) measures accuracy only; ``auto`` takes the fastest
real path installed, and on a CPU the emulated one, labelled so. Known gap against the published script: the
shared expert is not overlapped with the dispatch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from contract import Case, LayerInputs, comm
from baselines import fp8_gemm
from baselines.common import ExpertParams, all_to_all, inverse_permutation, precision_unsupported
from baselines.compile_modes import group_agree
from baselines.options import ExpertGemmOptions


def inductor_note(compiled: bool) -> str:
    """How inductor autotuned a compiled row, for its notes: in subprocesses where inductor's ``autotune_in_subproc``
    is on (``TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1``; at EP=1 the published ``max-autotune`` hit an illegal memory access
    autotuning in the process, on H200), else nothing to add."""
    if not compiled:
        return ""
    from torch._inductor import config

    return "inductor autotuning in subprocesses (TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1)" if config.autotune_in_subproc \
        else ""


class NcclBackend:
    name = "nccl"
    directions = ("fwd", "bwd", "fwd_bwd")
    # several ranks on one GPU (ranks_per_gpu > 1): its all-to-alls go through contract.comm, host-staged on gloo
    runs_shared_gpu = True

    @classmethod
    def unsupported_reason(cls, case: Case, options: Optional[ExpertGemmOptions] = None) -> Optional[str]:
        why = precision_unsupported(case.precision, torch.device(case.device))
        if why:
            return why
        if case.precision == "mxfp8":
            return "the nccl baseline's mxfp8 path (TorchAO scaled_grouped_mm) is not implemented; use precision=bf16"
        return fp8_gemm.resolve(case, (options or ExpertGemmOptions()).fp8_gemm)[1]

    def __init__(self, case: Case, group: Any, options: Optional[ExpertGemmOptions] = None) -> None:
        self.case, self.group = case, group
        self.options = options or ExpertGemmOptions()
        self.rank = dist.get_rank(group)
        self.ep = dist.get_world_size(group)
        self._last: dict[str, Any] = {}

    def setup(self, inputs: LayerInputs) -> None:
        self.params = ExpertParams(self.case, inputs, published_mode="max-autotune",  # bench_nccl_torch.py
                                   group=self.group, fp8_option=self.options.fp8_gemm)
        if self.case.compile:
            self.warm_compile(inputs)

    def warm_compile(self, inputs: LayerInputs) -> None:
        """Compile and autotune in setup, on this rank's row count (the count exchange, then the expert math on that
        many rows, locally), falling back where a mode fails (baselines/compile_modes.py)."""
        counts_E = torch.bincount(inputs.topk_idx_TK.reshape(-1), minlength=self.case.num_experts)
        recv_counts = torch.empty_like(counts_E)
        comm.all_to_all_single(recv_counts, counts_E, group=self.group)
        recv_L = recv_counts.view(self.ep, self.case.local_experts).sum(0)
        self.params.warm_compiled(int(recv_L.sum()), recv_L, inputs.x_TH, group_agree(self.group, inputs.x_TH.device))

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        c, ep, L, g = self.case, self.ep, self.case.local_experts, self.group
        self.params.step_begin()
        T, K = topk_idx_TK.shape
        flat = topk_idx_TK.reshape(-1)
        counts_E = torch.bincount(flat, minlength=c.num_experts)
        recv_counts = torch.empty_like(counts_E)  # [src, local expert] flattened
        comm.all_to_all_single(recv_counts, counts_E, group=g)
        both = torch.stack([counts_E, recv_counts]).cpu()  # the one host sync, for the split sizes
        in_splits = both[0].view(ep, L).sum(1).tolist()
        out_splits = both[1].view(ep, L).sum(1).tolist()
        recv_EP_L = both[1].view(ep, L)

        order = torch.argsort(flat, stable=True)  # (t, k) slots grouped by destination rank, then expert
        x_sorted = x_TH.index_select(0, order // K)
        x_recv = all_to_all(x_sorted, out_splits, in_splits, g)  # rows ordered (src rank, local expert)

        n_recv = sum(out_splits)
        local_ids = torch.arange(L, device=x_TH.device).repeat(ep)
        expert_of_row = torch.repeat_interleave(local_ids, recv_counts, output_size=n_recv)
        perm = torch.argsort(expert_of_row, stable=True)  # -> ordered (local expert, src rank)
        x_e = x_recv.index_select(0, perm)
        y_e = self.params.experts(x_e, recv_EP_L.sum(0).to(x_TH.device))

        y_recv = y_e.index_select(0, inverse_permutation(perm))
        y_sorted = all_to_all(y_recv, in_splits, out_splits, g)
        y_slots = y_sorted.index_select(0, inverse_permutation(order))  # back to (t, k) order
        # the router-weighted sum of each token's K rows: one bmm (bf16 operands, fp32 accumulation)
        out = torch.bmm(topk_w_TK.unsqueeze(1).to(y_slots.dtype), y_slots.view(T, K, -1)).squeeze(1).float()
        self._last = {"x_sorted": x_sorted.detach(), "y_recv": y_recv.detach(),
                      "in_splits": in_splits, "out_splits": out_splits}
        return self.params.add_shared(out, x_TH)

    def zero_grad(self) -> None:
        self.params.zero_grad()

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return self.params.grads()

    def traffic(self) -> dict[str, Any]:
        """Rows sent per destination rank in dispatch (combine returns the same rows). bf16 on the wire."""
        row_bytes = self.case.hidden * 2
        return {"dispatch_rows_to": self._last["in_splits"], "combine_rows_to": self._last["out_splits"],
                "dispatch_row_bytes": row_bytes, "combine_row_bytes": row_bytes}

    def phases(self) -> dict[str, Callable[[], Any]]:
        """Communication-only closures on the last forward's rows (layout and host sync excluded)."""
        last, g = self._last, self.group
        x_sorted, y_recv = last["x_sorted"], last["y_recv"]
        ins, outs = last["in_splits"], last["out_splits"]
        recv_buf = x_sorted.new_empty((sum(outs), x_sorted.shape[1]))
        back_buf = y_recv.new_empty((sum(ins), y_recv.shape[1]))
        return {
            "dispatch": lambda: comm.all_to_all_single(recv_buf, x_sorted, outs, ins, group=g),
            "combine": lambda: comm.all_to_all_single(back_buf, y_recv, ins, outs, group=g),
        }

    def info(self) -> dict[str, Any]:
        cols = self.params.columns("bf16")
        notes = [f"grouped GEMM: {self.params.gemm_name()}", "shared expert not overlapped with dispatch",
                 inductor_note(bool(cols.get("compiled"))), self.params.compile_note]
        return {**cols, "notes": "; ".join(filter(None, notes))}

    def teardown(self) -> None:
        self._last = {}
