"""mok_hopper's fp8 backward: its twin (mok_kernels/mok_hopper/twin/backward.py, ``expert_backward_fp8``)
against torch autograd, and the kernels (mok_kernels/mok_hopper/ops/bwd_fp8.py, through train.py's three phases) against
the twin under the Triton interpreter, on 1, 2 and 4 simulated ranks (an idle rank, masked slots, a clamped SwiGLU, H
saved or recomputed), the weight gradients' 128-row token blocks over experts of several blocks, and a training step
through autograd at EP=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton (also run alone)

from mok_kernels.mok_hopper.twin import backward as twin_bwd  # noqa: E402
from test_mok_hopper_bwd import HAS_TRITON, make, rel_l1  # noqa: E402

NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip "
                                                         "install -e '.[test]'): the interpreter kernel tests need it")
# fp8's blocks: hidden and ffn multiples of 128
T, K, E, H, I = 24, 3, 8, 256, 128


def _interpreter_or_skip():
    from mok_kernels.mok_hopper.ops import interp

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")


@pytest.mark.parametrize("P", [1, 2])
def test_the_fp8_twin_quantises_and_stays_near_autograd(P):
    """The fp8 recipe's gradients are within the fp8 gate's 0.1 rel-L1 of an fp32 autograd reference on bf16 inputs
    (e4m3 blocks: 0.03-0.08 here), and are not the bf16 twin's (which is within 1%): the recipe does quantise."""
    xs, idx, ws, dOs, w13, w2, shared = make(P, 64, 4, 8, H, I, seed=3)
    ref = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared)
    fp8 = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, fp8=True, block_m=16)
    bf16 = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, block_m=16)
    for r in range(P):
        for name in ("x", "topk_w", "w13", "w2"):
            err = rel_l1(fp8[r][name], ref[r][name])
            assert 0.02 < err < 0.1, (r, name, err)
            assert rel_l1(bf16[r][name], ref[r][name]) < 1e-2
        for a, b in zip(fp8[r]["shared"], ref[r]["shared"]):  # the shared expert is bf16 in every precision
            assert rel_l1(a, b) < 1e-2


def test_token_quant_blocks_start_at_the_experts_first_row():
    """The weight gradients' operand rounding: one scale per column over each 128 rows (the last block short), so
    a column's large value in the first block does not coarsen the second block's values."""
    v = torch.randn(200, 4)
    v[0, 0] = 1e6  # the rest of its block falls under e4m3's smallest step at this scale
    got = twin_bwd.token_quant(v)
    assert rel_l1(got[128:], v[128:]) < 0.05  # the second block kept its own scale
    assert rel_l1(got[1:128, 0], v[1:128, 0]) > 0.5  # the first block's column 0 is dominated by its outlier
    assert torch.equal(twin_bwd.token_quant(v[:128]), got[:128])


def _layers(P, xs, idx, ws, w13, w2, shared, limit, save_h):
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    wss = link_local([Workspace(rank=r, world=P, device=torch.device("cpu"), tokens=T, hidden=H, topk=K, fp8=True,
                                symmetric=False) for r in range(P)])
    return [MoKHopperLayer(w13[r], w2[r], topk=K, tokens=T, shared=tuple(shared), swiglu_limit=limit, rank=r,
                           world=P, workspace=wss[r], save_h=save_h, precision="fp8", train=True) for r in range(P)]


@NEEDS_TRITON
@pytest.mark.slow
@pytest.mark.parametrize("P,limit,idle,masked,save_h", [
    (1, None, None, False, True), (2, None, 1, False, True), (2, None, None, True, False), (4, 0.5, None, True, True)],
    ids=["ep1", "ep2-idle-rank", "ep2-masked-recompute", "ep4-clamped-masked"])
def test_the_fp8_kernels_backward_across_simulated_ranks_matches_its_twin(P, limit, idle, masked, save_h):
    """train.py's three phases in fp8 (stage dO quantised 1 x 128; pull the e4m3 dO rows; the fp8 dgate, dX and
    weight-gradient kernels; push the dX rows and router-weight gradients; sum), for P ranks simulated in one
    process under the interpreter, phase by phase: every rank's every gradient against the fp8 twin (the same
    recipe: within rounding order) and, unclamped, against torch autograd within the fp8 gate."""
    from mok_kernels.mok_hopper.train import backward_compute, backward_finish, backward_stage

    _interpreter_or_skip()
    xs, idx, ws, dOs, w13, w2, shared = make(P, T, K, E, H, I, seed=60 + P, idle_rank=idle, masked=masked)
    layers = _layers(P, xs, idx, ws, w13, w2, shared, limit, save_h)
    for r in range(P):
        layers[r].stage(xs[r], idx[r], ws[r])
    for r in range(P):
        layers[r].compute(xs[r])
    for r in range(P):
        layers[r].finish()
    for r in range(P):
        backward_stage(layers[r], dOs[r])
    parts = [backward_compute(layers[r], xs[r], w13[r], w2[r], shared, dO_TH=dOs[r]) for r in range(P)]
    got = [backward_finish(layers[r], idx[r], parts[r]) for r in range(P)]
    twin = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit,
                                      block_m=layers[0].cfg.block_m, fp8=True)
    ref = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit)
    for r in range(P):
        for name in ("x", "topk_w", "w13", "w2"):
            assert rel_l1(got[r][name], twin[r][name]) < 5e-3, (r, name, rel_l1(got[r][name], twin[r][name]))
            if limit is None:
                assert rel_l1(got[r][name], ref[r][name]) < 0.1, (r, name, rel_l1(got[r][name], ref[r][name]))
        for a, b in zip(got[r]["shared"], ref[r]["shared"]):
            assert rel_l1(a, b) < 1e-2
        assert not got[r]["topk_w"][idx[r] < 0].any()  # masked slots get no router-weight gradient
    if idle is not None:  # the idle rank's experts got no rows: zero weight gradients, written
        assert not got[idle]["w13"].any() and not got[idle]["w2"].any()


@NEEDS_TRITON
@pytest.mark.parametrize("resident", [False, True], ids=["blocks", "P-resident"])
@pytest.mark.parametrize("p8", [False, True], ids=["P-bf16-Q-e4m3", "P-e4m3-Q-bf16"])
def test_the_fp8_weight_gradient_over_several_token_blocks(p8, resident):
    """fp8_wgrad over experts of 0, 1, 100, 128, 129 and 300 rows (padding rows between them): each expert's rows
    in 128-row token blocks from its first row, both operands quantised per block and column (an e4m3 operand
    dequantised first), against the twin's ``token_quant``; ``resident``: an expert of one block loads its P block
    once a strip, a larger one sums its blocks, an empty one writes zeros. Padding rows add nothing even when they
    hold garbage."""
    from contract.fp8 import dequantize_blocks, quantize_blocks
    from mok_kernels.mok_hopper.ops.bwd_fp8 import fp8_wgrad

    _interpreter_or_skip()
    sizes = [0, 1, 100, 128, 129, 300]
    pad = 16
    starts, codes, r = [0], [], 0
    for n in sizes:
        codes += list(range(r, r + n)) + [-1] * pad
        r += n
        starts.append(len(codes))
    R, N, Kd = len(codes), 128, 256
    g = torch.Generator().manual_seed(7)
    p = torch.randn(R, N, generator=g).bfloat16()
    q = (torch.randn(R, Kd, generator=g) * 3).bfloat16()
    code = torch.tensor(codes, dtype=torch.int32)
    if p8:
        p8q, p8s = quantize_blocks(p, 1, 128)
        args, pv, qv = (p8q, p8s, q, None), dequantize_blocks(p8q, p8s, 1, 128), q.float()
    else:
        q8q, q8s = quantize_blocks(q, 1, 128)
        args, pv, qv = (p, None, q8q, q8s), p.float(), dequantize_blocks(q8q, q8s, 1, 128)
    live = code >= 0
    for t in (args[0], args[2]):  # garbage on the padding rows: the kernel must not read it into any sum
        t.view(torch.uint8)[~live] = 0x7E
    dw = torch.full((len(sizes), N, Kd), float("nan"), dtype=torch.bfloat16)
    fp8_wgrad(*args, dw, code, torch.tensor(starts, dtype=torch.int32), programs=3, block_n=64, block_k=128,
              resident=resident)
    for e, n in enumerate(sizes):
        rows = torch.arange(starts[e], starts[e] + n)
        want = (twin_bwd.token_quant(pv[rows]).t() @ twin_bwd.token_quant(qv[rows])).bfloat16()
        if n == 0:
            assert not dw[e].any()
            continue
        assert rel_l1(dw[e], want) < 1e-3, (e, n, rel_l1(dw[e], want))
        exact = (pv[rows].t() @ qv[rows]).bfloat16()
        if n > 1:  # (a one-row block quantises each value to +-448 x its own scale: exact)
            assert 1e-3 < rel_l1(dw[e], exact) < 0.1  # quantised along the tokens, not a bf16 GEMM


@pytest.mark.slow
@NEEDS_TRITON
def test_an_fp8_training_step_through_autograd():
    """mok_hopper_train with an fp8 layer at EP=1 (train=True, H saved): out.backward() reaches every leaf, the
    gradients are the fp8 twin's, twice with different inputs (the layer's buffers reused)."""
    from mok_kernels.mok_hopper.train import mok_hopper_train

    _interpreter_or_skip()
    xs0, idx0, ws0, dOs0, w13, w2, shared = make(1, T, K, E, H, I, seed=70)
    layer = _layers(1, xs0, idx0, ws0, w13, w2, shared, None, True)[0]
    for seed in (71, 72):
        xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=seed)
        leaves = [t.detach().clone().requires_grad_() for t in (xs[0], ws[0], w13[0], w2[0], *shared)]
        x, w, a13, a2, sg, su, sd = leaves
        mok_hopper_train(layer, x, idx[0], w, a13, a2, (sg, su, sd)).backward(dOs[0])
        want = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, block_m=layer.cfg.block_m,
                                          fp8=True)[0]
        for name, got in (("x", x.grad), ("topk_w", w.grad), ("w13", a13.grad), ("w2", a2.grad)):
            assert rel_l1(got, want[name]) < 5e-3, (seed, name, rel_l1(got, want[name]))
        for got, ref in zip((sg.grad, su.grad, sd.grad), want["shared"]):
            assert rel_l1(got, ref) < 1e-2


def test_the_fp8_backward_needs_a_training_layer():
    """A layer built without train=True keeps no plain e4m3 weights: the backward's stage says so."""
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.train import backward_stage

    xs, idx, ws, dOs, w13, w2, shared = make(1, T, K, E, H, I, seed=80)
    layer = MoKHopperLayer(w13[0], w2[0], topk=K, tokens=T, precision="fp8", cuda_graph=False)
    with pytest.raises(AssertionError, match="train=True"):
        backward_stage(layer, dOs[0])


@NEEDS_TRITON
@pytest.mark.parametrize("save_h,halves", [(True, False), (False, True)], ids=["save-h", "recompute-halves"])
def test_packed_rows_fp8_forward_and_backward_are_the_padded_ones(save_h, halves):
    """fp8, EP=1, packed rows (no tile padding): the forward's output, then every gradient, the padded layout's bit
    for bit (the e4m3 rows and their 1 x 128 scales are per row; the weight gradients' 128-row token blocks start
    at each expert's first row in both layouts). ``halves``: the up and down GEMMs in BM/2-row items
    (``fp8_up_halves`` / ``fp8_down_halves``), and H recomputed by the forward's up GEMM."""
    from dataclasses import replace

    from mok_hopper_layers import skewed_routing
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.tiles import TileConfig
    from mok_kernels.mok_hopper.train import layer_backward
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    _interpreter_or_skip()
    xs, _, ws, dOs, w13, w2, shared = make(1, T, K, E, H, I, seed=90)
    idx = skewed_routing(T, K, E, seed=90)
    base = TileConfig(block_m=16, num_chunks=2, gemm_programs=3, pull_programs=3, pull_rows=4,
                      fp8_down_halves=halves, fp8_up_halves=halves)
    outs, grads = [], []
    for packed in (False, True):
        (wsp,) = link_local([Workspace(rank=0, world=1, device=torch.device("cpu"), tokens=T, hidden=H, topk=K,
                                       fp8=True, symmetric=False)])
        layer = MoKHopperLayer(w13[0], w2[0], topk=K, tokens=T, shared=tuple(shared), rank=0, world=1,
                               workspace=wsp, save_h=save_h, precision="fp8", train=True,
                               tile=replace(base, packed_rows=packed).for_fp8())
        assert layer.cfg.packed_rows == packed and layer.cfg.up_halves == halves == layer.cfg.down_halves
        with torch.no_grad():
            outs.append(layer(xs[0], idx, ws[0]))
            grads.append(layer_backward(layer, dOs[0], xs[0], idx, ws[0], w13[0], w2[0], shared))
        assert layer.overflow_rows() == 0
    counts = layer.sched.counts_L
    assert layer.R == -(-T * K // 16) * 16 and (counts == 0).any() and (counts > 16).any()
    assert torch.equal(outs[0], outs[1])
    for k in ("x", "topk_w", "w13", "w2"):
        assert torch.equal(grads[0][k], grads[1][k]), k
