"""mok_hopper's torch twin (``mok_kernels/mok_hopper/twin/``: the CPU path's math, and the expected values of the
kernels) against a plain reference.

Legend: P ranks, T tokens per rank, K top-k, E experts, L = E / P local experts, H hidden, I ffn.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton

from mok_hopper_layers import make_layer_inputs, plain_reference, rel_l1  # noqa: E402
from mok_kernels.mok_hopper.twin import forward as twin  # noqa: E402
from mok_kernels.mok_hopper.fp8 import quantize_blocks  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# the torch twin (the CPU path's math, and the expected values of the kernels)


@pytest.mark.parametrize("mode,limit,rw_in", [("uniform", None, "expert"), ("uniform", 0.5, "epilogue"),
                                              ("masked", None, "expert"), ("one_rank", None, "expert")])
def test_twin_matches_the_plain_reference(mode, limit, rw_in):
    xs, idx, ws, w13, w2, sh = make_layer_inputs(2, 16, 2, 8, 128, 128, mode=mode)
    want = plain_reference(xs, idx, ws, w13, w2, sh, limit)
    got = twin.simulate(xs, idx, ws, w13, w2, shared=sh, limit=limit, block_m=8, router_weight_in=rw_in)
    for g, w in zip(got, want):
        assert rel_l1(g, w) < 0.01 and (g.float() - w.float()).abs().max() < 0.5  # the published bf16 gate


def test_fp8_twin_is_close_to_bf16_and_uses_the_harness_format():
    from baselines.common import quantize_blocks as harness_quantize

    x = torch.randn(4, 256, 256)
    q, s = quantize_blocks(x, 128, 128)
    hq, hs = harness_quantize(x, 128, 128)
    assert torch.equal(q.view(torch.uint8), hq.view(torch.uint8)) and torch.equal(s, hs)
    xs, idx, ws, w13, w2, sh = make_layer_inputs(2, 16, 2, 8, 256, 128)
    want = plain_reference(xs, idx, ws, w13, w2, sh)
    got = twin.simulate(xs, idx, ws, w13, w2, shared=sh, fp8=True, block_m=8)
    for g, w in zip(got, want):
        err = rel_l1(g, w)
        assert 0.005 < err < 0.1  # e4m3 rounding is visible, and within the fp8 gate


def test_epilogue_sums_in_a_fixed_order():
    T, K, H = 8, 6, 64
    g = torch.Generator().manual_seed(5)
    comb = (torch.randn(T * K, H, generator=g) * torch.logspace(-3, 3, K).repeat(T)[:, None]).bfloat16()
    idx = torch.zeros(T, K, dtype=torch.int64)
    shared = torch.randn(T, H, generator=g).bfloat16()
    out = twin.epilogue(comb, idx, None, shared)
    acc = torch.zeros(T, H)
    for k in range(K):  # left to right in k, then the shared expert, all fp32
        acc = acc + comb.view(T, K, H)[:, k].float()
    assert torch.equal(out, (acc + shared.float()).bfloat16())

