"""mok_hopper.weights=owned: the harness's routed weights re-laid in place into the kernels' TMA block order for the
layer's lifetime (mok_kernels/mok_hopper/owned.py): one expert's temporary at a time, restored bit for bit (checked),
undone when a rewrite fails half way, and a training step over them bitwise the tiled default's."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton (also run alone)

from test_check import NewStorages  # noqa: E402
from test_mok_hopper_bwd import HAS_TRITON, make  # noqa: E402

from mok_kernels.mok_hopper.ops.gemm_common import tile_weights, tile_weights_gu, untile_weights  # noqa: E402
from contract.inputs import checksum  # noqa: E402
from mok_kernels.mok_hopper.owned import OwnedWeights, relayout_  # noqa: E402
from mok_kernels.mok_hopper.tiles import TileConfig  # noqa: E402

T, K, E, H, I = 24, 3, 8, 256, 128
BASE = TileConfig(block_m=64, up_n=32, up_k=32, down_n=64, down_k=32, num_chunks=1, gemm_programs=3,
                  pull_programs=5, pull_rows=4, group_m=2, tma=True, w_tiled=True, tail_rows=16)


def _weights(seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g).bfloat16(), torch.randn(E, H, I, generator=g).bfloat16())


@pytest.mark.parametrize("fused", [False, True], ids=["tiled", "tiled-gate-up-interleaved"])
def test_owned_weights_are_the_tiled_copy_in_place_and_come_back_bit_for_bit(fused):
    tile = TileConfig(**{**BASE.__dict__, "up_fused": fused})
    w13, w2 = _weights()
    plain13, plain2 = w13.clone(), w2.clone()
    ptr13, ptr2 = w13.data_ptr(), w2.data_ptr()
    with NewStorages() as m:
        owned = OwnedWeights(w13, w2, tile)
    assert max(m.sizes) <= 8 * plain13[0].numel()  # one expert's temporaries (the checksum's int64), never all
    v13, v2 = owned.views()
    assert v13.data_ptr() == ptr13 and v2.data_ptr() == ptr2  # no copy: the harness's storage
    want13 = (tile_weights_gu if fused else tile_weights)(plain13, tile.up_n, tile.up_k)
    assert torch.equal(v13, want13) and torch.equal(v2, tile_weights(plain2, tile.down_n, tile.down_k))
    g13, g2 = want13.clone().view(w13.shape), tile_weights(plain2, tile.down_n, tile.down_k).view(w2.shape)
    owned.plain_grad_(g13, g2)  # gradients written in the tiled order come back plain, in place
    assert torch.equal(g13, plain13) and torch.equal(g2, plain2)
    owned.restore()
    assert torch.equal(w13, plain13) and torch.equal(w2, plain2) and w13.data_ptr() == ptr13
    owned.restore()  # (twice: nothing more)
    assert torch.equal(w13, plain13)


def test_a_restore_that_does_not_give_the_plain_weights_back_is_loud():
    w13, w2 = _weights()
    owned = OwnedWeights(w13, w2, BASE)
    w2.view(E, -1)[3, :2] = w2.view(E, -1)[3, :2].flip(0)  # two elements swapped: the same sum, another order
    with pytest.raises(RuntimeError, match="differ from the harness's"):
        owned.restore()
    assert checksum(w2, 1) != checksum(w2.flip(2), 1)


def test_a_rewrite_that_fails_half_way_is_undone(monkeypatch):
    w13, w2 = _weights()
    plain13, plain2 = w13.clone(), w2.clone()
    calls = {"n": 0}
    real = tile_weights

    def failing(w, bn, bk):
        calls["n"] += 1
        if calls["n"] == E + 3:  # w13 done, three experts of w2 done
            raise torch.cuda.OutOfMemoryError("planted")
        return real(w, bn, bk)

    monkeypatch.setattr("mok_kernels.mok_hopper.owned.tile_weights", failing)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        OwnedWeights(w13, w2, BASE)
    assert torch.equal(w13, plain13) and torch.equal(w2, plain2)


def test_relayout_round_trip_one_expert_at_a_time():
    _, w2 = _weights()
    plain = w2.clone()
    relayout_(w2, (1, H, I), lambda w: tile_weights(w, 64, 32))
    assert torch.equal(w2.view(E, H // 64, I // 32, 64, 32), tile_weights(plain, 64, 32))
    relayout_(w2, (1, H // 64, I // 32, 64, 32), untile_weights, range(2, 3))  # one expert back
    assert torch.equal(w2[2], plain[2]) and not torch.equal(w2[1], plain[1])


def _within_one_block_order(u: torch.Tensor, v: torch.Tensor, what) -> None:
    """``u`` and ``v`` equal but for the order of fp32 sums inside a block: the tiled-parameter backward runs other
    block shapes than the default's, and under the interpreter a block's dot is numpy's matmul, whose summation order
    follows the CPU's BLAS kernel for that shape (equal bits on some CPUs, a bf16 step apart on others). At most one
    bf16 step anywhere, in at most 1% of the elements; a wrong layout (a swapped row, a transposed block) is far
    outside. fp32 tensors (the router-weight gradient) within the same bf16 step, element by element."""
    assert u.shape == v.shape and u.dtype == v.dtype, what
    a, b = u.float(), v.float()
    step = torch.ldexp(torch.ones_like(a), torch.frexp(torch.maximum(a.abs(), b.abs()))[1] - 8)  # bf16's spacing
    off = (a - b).abs()
    assert bool((off <= step).all()), (what, float((off / step).max()))
    if u.dtype == torch.bfloat16:
        assert float((off > 0).float().mean()) <= 0.01, (what, float((off > 0).float().mean()))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("forward", ["save_h", "recompute"])
def test_a_training_step_over_owned_weights_is_the_tiled_defaults(forward):
    """What the adapter does with weights=owned (backend.py): the layer adopts the tiled views of the harness's
    storage, the autograd leaves are the harness's [L, 2I, H] / [L, H, I] tensors seen as tiled, the gradients come
    back in the tiled order and are put into the plain order in place; the output bitwise that of the default layer
    (its own tiled copy, the leaves plain), every gradient equal to its but for the order of a block's sums
    (:func:`_within_one_block_order`), and the weights restored after."""
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import mok_hopper_train
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    tile = TileConfig(**{**BASE.__dict__, "up_fused": True})
    _, _, _, _, w13s, w2s, shared = make(1, T, K, E, H, I, seed=71)
    plain13, plain2 = w13s[0].clone(), w2s[0].clone()
    runs = []
    for own in (False, True):
        w13, w2 = w13s[0].clone(), w2s[0].clone()  # the harness's tensors
        owned = OwnedWeights(w13, w2, tile) if own else None
        (ws_,) = link_local([Workspace(rank=0, world=1, device=torch.device("cpu"), tokens=T, hidden=H, topk=K,
                                       fp8=False, symmetric=False)])
        lw13, lw2 = owned.views() if own else (w13, w2)
        layer = MoKHopperLayer(lw13, lw2, topk=K, tokens=T, shared=tuple(shared), rank=0, world=1, workspace=ws_,
                               tile=tile, save_h=forward == "save_h", train=True, adopt_routed=own, swiglu_limit=0.5)
        assert (layer.w13.data_ptr() == w13.data_ptr()) == own
        steps = []
        for seed in (1, 2):
            xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=seed, masked=seed == 2)
            x, w = (t.detach().clone().requires_grad_() for t in (xs[0], ws[0]))
            p13, p2 = w13.detach().requires_grad_(), w2.detach().requires_grad_()  # ExpertLeaves' aliases
            a13, a2 = (p13.view(owned.shape13), p2.view(owned.shape2)) if own else (p13, p2)
            out = mok_hopper_train(layer, x, idx[0], w, a13, a2, tuple(shared))
            out.backward(dOs[0])
            assert p13.grad.shape == p13.shape
            if own:
                owned.plain_grad_(p13.grad, p2.grad)
            steps.append([out.detach(), x.grad, w.grad, p13.grad, p2.grad])
        runs.append(steps)
        if own:
            owned.restore()
        assert torch.equal(w13, plain13) and torch.equal(w2, plain2)
    for a, b in zip(*runs):
        assert torch.equal(a[0], b[0])  # the forward: the same kernels over the same bytes
        for i, (u, v) in enumerate(zip(a[1:], b[1:]), 1):
            _within_one_block_order(u, v, i)


def test_the_adapter_hands_out_plain_gradients_once_and_restores_at_teardown():
    """backend.py with weights=owned (its CUDA state set by hand): weight_grads puts the gradients the backward
    wrote in the tiled order into the plain order once (a second call changes nothing), and teardown gives the
    harness its plain weights back."""
    from types import SimpleNamespace

    from contract import ExpertLeaves
    from mok_kernels.mok_hopper.backend import MokHopperBackend
    from mok_kernels.mok_hopper.options import MokHopperOptions

    w13, w2 = _weights()
    plain13, plain2 = w13.clone(), w2.clone()
    case = SimpleNamespace(ffn=I, shared_expert=False, device="cpu")
    b = MokHopperBackend.__new__(MokHopperBackend)
    b.case, b.impl, b.weights, b._plain_grads = case, None, MokHopperOptions(weights="owned").weights, None
    b.params = ExpertLeaves(case, SimpleNamespace(w13_LIH=w13, w2_LHI=w2))
    b.owned = OwnedWeights(w13, w2, BASE)
    b.params.w13.grad = tile_weights(plain13, BASE.up_n, BASE.up_k).view(w13.shape)
    b.params.w2.grad = tile_weights(plain2, BASE.down_n, BASE.down_k).view(w2.shape)
    for _ in range(2):
        g = b.weight_grads()
        assert torch.equal(g["w_gate"], plain13[:, :I]) and torch.equal(g["w_up"], plain13[:, I:])
        assert torch.equal(g["w_down"], plain2)
    assert b._grads_plain()
    b.teardown()
    assert b.owned is None and torch.equal(w13, plain13) and torch.equal(w2, plain2)
