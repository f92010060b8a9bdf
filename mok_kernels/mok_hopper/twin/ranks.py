"""The twin on real ranks (gloo on the CPU): what the ``mok_hopper`` backend runs on a CPU, forward and backward,
with this rank's experts computed by :mod:`mok_kernels.mok_hopper.twin.forward` and
:mod:`mok_kernels.mok_hopper.twin.backward`."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from mok_kernels.mok_hopper.fp8 import quantize_expert_weights
from mok_kernels.mok_hopper.twin import backward
from mok_kernels.mok_hopper.twin.forward import epilogue, rank_rows, shared_rows


class DistributedTwin:
    """The twin on real ranks (gloo on the CPU): all-gather inputs, compute this rank's expert rows, deliver the
    combine rows to their source ranks with one all-reduce (each slot has one writer, so the sum is exact),
    fixed-order epilogue."""

    def __init__(self, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor, *, group: Any, topk: int,
                 shared: Optional[Sequence[torch.Tensor]], swiglu_limit: Optional[float], precision: str,
                 block_m: int = 128, capacity_multiplier: Optional[float] = 0.5,
                 router_weight_in: str = "expert") -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.w13, self.w2, self.shared = w13_LIH, w2_LHI, shared
        self.limit, self.fp8, self.K = swiglu_limit, precision == "fp8", topk
        self.block_m, self.cap_mult, self.rw_in = block_m, capacity_multiplier, router_weight_in
        self.w_quant = (*quantize_expert_weights(w13_LIH), *quantize_expert_weights(w2_LHI)) if self.fp8 else None
        self.idx_all: Optional[torch.Tensor] = None

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            T, K = topk_idx_TK.shape
            H = x_TH.shape[1]
            x_all = self._all_gather(x_TH.detach().float()).to(torch.bfloat16).reshape(-1, H)
            idx_all = self._all_gather(topk_idx_TK.to(torch.int64)).reshape(self.world, T * K)
            w_all = self._all_gather(topk_w_TK.detach().float()).reshape(-1)
            self.idx_all = idx_all
            rows = rank_rows(x_all, idx_all, w_all, self.w13, self.w2, rank=self.rank, limit=self.limit,
                             fp8=self.fp8, block_m=self.block_m, capacity_multiplier=self.cap_mult,
                             apply_w=self.rw_in == "expert", w_quant=self.w_quant)
            comb_all = torch.zeros(self.world * T * K, H, dtype=torch.float32)
            if rows:
                codes = torch.tensor([c for c, _ in rows])
                comb_all[codes] = torch.stack([y for _, y in rows]).float()
            self.dist.all_reduce(comb_all, group=self.group)
            comb = comb_all[self.rank * T * K : (self.rank + 1) * T * K].to(torch.bfloat16)
            sh = shared_rows(x_TH.detach(), self.shared, self.limit) if self.shared is not None else None
            rw = None if self.rw_in == "expert" else topk_w_TK.detach().float()
            return epilogue(comb, topk_idx_TK, rw, sh)

    def backward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                 dO_TH: torch.Tensor) -> dict[str, Any]:
        """This rank's gradients of the backward (:mod:`mok_kernels.mok_hopper.twin.backward`; fp8: its fp8 recipe) on
        real ranks: all-gather x, dO, ids and router weights; this rank's experts' rows (H recomputed); the dX rows and
        router-weight gradients delivered to their source ranks with one all-reduce each (one writer per slot, so
        the sums are exact); dx summed per token, k ascending. Keys as :func:`backward.simulate_backward`."""
        assert self.rw_in == "expert", "the backward twin covers the router weight applied in the expert"
        with torch.no_grad():
            T, K = topk_idx_TK.shape
            H = x_TH.shape[1]
            x_all = self._all_gather(x_TH.detach().float()).to(torch.bfloat16).reshape(-1, H)
            dO_all = self._all_gather(dO_TH.detach().float()).to(torch.bfloat16).reshape(-1, H)
            idx_all = self._all_gather(topk_idx_TK.to(torch.int64)).reshape(self.world, T * K)
            w_all = self._all_gather(topk_w_TK.detach().float()).reshape(-1)
            out = backward.rank_backward(x_all, dO_all, idx_all, w_all, self.w13, self.w2, rank=self.rank,
                                         limit=self.limit, block_m=self.block_m,
                                         capacity_multiplier=self.cap_mult, fp8=self.fp8, w_quant=self.w_quant)
            dx_all = torch.zeros(self.world * T * K, H, dtype=torch.float32)
            ds_all = torch.zeros(self.world * T * K, dtype=torch.float32)
            if out["rows"]:
                codes = torch.tensor([c for c, _, _ in out["rows"]])
                dx_all[codes] = torch.stack([d for _, d, _ in out["rows"]]).float()
                ds_all[codes] = torch.stack([d for _, _, d in out["rows"]])
            self.dist.all_reduce(dx_all, group=self.group)
            self.dist.all_reduce(ds_all, group=self.group)
            mine = slice(self.rank * T * K, (self.rank + 1) * T * K)
            live = topk_idx_TK >= 0
            g = {"w13": out["dW13"], "w2": out["dW2"],
                 "topk_w": torch.where(live, ds_all[mine].view(T, K), torch.zeros(()))}
            sh = None
            if self.shared is not None:
                sh = backward.shared_backward(x_TH.detach(), dO_TH.detach(), self.shared, self.limit)
                g["shared"] = (sh["gate"], sh["up"], sh["down"])
            g["x"] = epilogue(dx_all[mine].to(torch.bfloat16), topk_idx_TK, None, sh["dx"] if sh else None)
            return g

    def rows_per_peer(self) -> tuple[list[int], list[int]]:
        L = self.w13.shape[0]
        idx = self.idx_all
        owner = torch.where(idx >= 0, idx // L, torch.full_like(idx, self.world))
        mine = torch.bincount(owner[self.rank], minlength=self.world + 1)[: self.world]
        return mine.tolist(), (owner == self.rank).sum(dim=1).tolist()
