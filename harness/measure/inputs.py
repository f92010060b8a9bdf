"""Identical layer inputs for every backend.

Shape legend: T tokens on this rank, K top-k, H hidden, I expert ffn, E global experts, L local experts
(E / EP). Rank r owns the contiguous global experts [r*L, (r+1)*L).

* Tokens, routing (step 0 of the routing model: harness/config/routing.py) and the output gradient are drawn on the CPU
  from a generator seeded with ``seed + rank`` (the published per-rank seed), so they are identical on any device.
* Routed weights are drawn per global expert id from a generator seeded by (seed, expert), so expert e has the
  same weights at any EP size (on a given device type: CPU and CUDA generators differ).
* gate/up are scaled by H^-0.5, down by I^-0.5, and the output gradient by H^-0.5, as published. gate and up are
  stored fused as ``w13`` [L, 2I, H] (gate rows first) and exposed as views, so backends that fuse them need no
  copy.
"""

from __future__ import annotations

import torch

from contract.case import Case
from contract.inputs import LayerInputs, checksum
from harness.config.routing import make_routing

_WEIGHT_SEED_STRIDE = 1_000_003


def _randn(shape, scale: float, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(torch.bfloat16)


def make_inputs(case: Case, rank: int, device: torch.device) -> LayerInputs:
    t, h, i, l = case.tokens_per_gpu, case.hidden, case.ffn, case.local_experts
    g = torch.Generator().manual_seed(case.seed + rank)
    x = torch.randn(t, h, generator=g, dtype=torch.float32).to(torch.bfloat16)
    # the upstream gradient is scaled by H^-0.5, as published (MoK tests/utils.py::generate_inputs); the published
    # abs-max tolerances assume it (unscaled, weight gradients are sqrt(H) larger and so are their rounding errors)
    grad_out = (torch.randn(t, h, generator=g, dtype=torch.float32) * h**-0.5).to(torch.bfloat16)
    idx, w = make_routing(case, rank)

    base = (case.seed + 1) * _WEIGHT_SEED_STRIDE
    w13 = torch.empty(l, 2 * i, h, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(l, h, i, dtype=torch.bfloat16, device=device)
    for j in range(l):
        ge = rank * l + j  # global expert id
        s = base + 4 * ge
        w13[j, :i] = _randn((i, h), h**-0.5, s + 1, device)
        w13[j, i:] = _randn((i, h), h**-0.5, s + 2, device)
        w2[j] = _randn((h, i), i**-0.5, s + 3, device)
    shared = (None, None, None)
    if case.shared_expert:
        s = base - 4
        shared = (
            _randn((i, h), h**-0.5, s + 1, device),
            _randn((i, h), h**-0.5, s + 2, device),
            _randn((h, i), i**-0.5, s + 3, device),
        )
    return LayerInputs(
        x_TH=x.to(device),
        topk_idx_TK=idx.to(device),
        topk_w_TK=w.to(device),
        w13_LIH=w13,
        w2_LHI=w2,
        ws_gate_IH=shared[0],
        ws_up_IH=shared[1],
        ws_down_HI=shared[2],
        grad_out_TH=grad_out.to(device),
    )


def fingerprint(inputs: LayerInputs) -> dict[str, int]:
    """:func:`contract.inputs.checksum` of every tensor of the layer inputs, by field name: what the runner compares
    after each backend, so that a backend which leaves the point's shared inputs changed (written in place, a layout
    not restored) cannot spoil the rows of the backends after it."""
    import dataclasses

    return {f.name: checksum(v) for f in dataclasses.fields(inputs)
            if isinstance(v := getattr(inputs, f.name), torch.Tensor)}
