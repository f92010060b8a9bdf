"""The inputs of one layer call on one rank, identical for every backend (:class:`LayerInputs`). The harness
makes them (:mod:`harness.measure.inputs`).

Shape legend: T tokens on this rank, K top-k, H hidden, I expert ffn, L local experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: the registry and reports load the contract without torch
    import torch


@dataclass
class LayerInputs:
    x_TH: torch.Tensor  # bf16
    topk_idx_TK: torch.Tensor  # int64, global expert ids
    topk_w_TK: torch.Tensor  # fp32, softmax over the top-k logits
    w13_LIH: torch.Tensor  # bf16 [L, 2I, H]: gate rows [:I], up rows [I:]
    w2_LHI: torch.Tensor  # bf16 [L, H, I]
    ws_gate_IH: Optional[torch.Tensor]  # shared expert (None when the shape has none)
    ws_up_IH: Optional[torch.Tensor]
    ws_down_HI: Optional[torch.Tensor]
    grad_out_TH: torch.Tensor  # bf16, the upstream gradient used for backward

    @property
    def w_gate_LIH(self) -> torch.Tensor:
        return self.w13_LIH[:, : self.w13_LIH.shape[1] // 2]

    @property
    def w_up_LIH(self) -> torch.Tensor:
        return self.w13_LIH[:, self.w13_LIH.shape[1] // 2 :]
