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


CHECKSUM_CHUNK = 1 << 22  # elements of one run of rows in checksum (its int64 temporaries: 32 MB)


def checksum(t: "torch.Tensor", chunk_elems: int = CHECKSUM_CHUNK) -> int:
    """An order-sensitive checksum of a tensor's bits, modulo 2^64: its bytes read as int16, cut along dim 0 into
    runs of whole rows of at most ``chunk_elems`` elements (one row where a row is larger: ``chunk_elems=1`` takes
    one expert of a weight tensor at a time); each element times a fixed pseudo-random weight of its position in
    the run, run i's sum times 2i + 1, the element count folded in. A permutation (a layout left tiled), a changed
    value or a changed size changes it (up to collisions). Its int64 temporaries hold one run."""
    import torch

    flat = t.detach().reshape(t.shape[0] if t.dim() else 1, -1)
    flat = flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.to(torch.int16)
    rows, row = flat.shape
    step = max(1, chunk_elems // max(1, row))
    g = torch.Generator(device=flat.device).manual_seed(1234)
    weights = torch.randint(1, 1 << 16, (min(step, rows) * row,), generator=g, dtype=torch.int64, device=flat.device)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for i, start in enumerate(range(0, rows, step)):
        run = flat[start:start + step].reshape(-1)
        total += (run.to(torch.int64) * weights[:run.numel()]).sum() * (2 * i + 1)
    return int(total.item()) ^ flat.numel()
