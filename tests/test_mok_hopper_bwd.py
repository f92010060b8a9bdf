"""The twin of mok_hopper's planned bf16 backward (mok_kernels/mok_hopper/twin/backward.py) against torch autograd:
every gradient (x, router weights, routed gate/up/down, shared gate/up/down) on small shapes, 1, 2 and 4 ranks, clamped
SwiGLU, masked top-k slots and a rank whose experts get no token. The kernels of issue 23 will be checked against
this twin stage by stage."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton (also run alone)

from mok_kernels.mok_hopper.twin import backward as twin_bwd  # noqa: E402


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().sum() / b.abs().sum().clamp(min=1e-12))


def make(P, T, K, E, H, I, seed, *, idle_rank=None, masked=False):
    g = torch.Generator().manual_seed(seed)
    L = E // P
    xs = [torch.randn(T, H, generator=g).bfloat16() for _ in range(P)]
    dOs = [(torch.randn(T, H, generator=g) * H ** -0.5).bfloat16() for _ in range(P)]
    experts = torch.arange(E)
    if idle_rank is not None:  # no token is routed to the idle rank's experts
        experts = experts[(experts // L) != idle_rank]
    idx = [torch.stack([experts[torch.randperm(experts.numel(), generator=g)[:K]] for _ in range(T)])
           for _ in range(P)]
    if masked:
        idx[0][::3, -1] = -1
    ws = [torch.softmax(torch.randn(T, K, generator=g), -1) for _ in range(P)]
    w13 = [(torch.randn(L, 2 * I, H, generator=g) * H ** -0.5).bfloat16() for _ in range(P)]
    w2 = [(torch.randn(L, H, I, generator=g) * I ** -0.5).bfloat16() for _ in range(P)]
    shared = [(torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
              (torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
              (torch.randn(H, I, generator=g) * I ** -0.5).bfloat16()]
    return xs, idx, ws, dOs, w13, w2, shared


@pytest.mark.parametrize("P,limit,idle,masked", [(1, None, None, False), (2, None, None, False),
                                                 (4, None, None, True), (2, 0.5, None, False),
                                                 (2, None, 1, False)],
                         ids=["ep1", "ep2", "ep4-masked", "ep2-clamped", "ep2-idle-rank"])
def test_backward_twin_matches_autograd(P, limit, idle, masked):
    xs, idx, ws, dOs, w13, w2, shared = make(P, 24, 3, 8, 128, 64, seed=P * 7 + 1, idle_rank=idle, masked=masked)
    got = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit, block_m=16)
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit)
    for r in range(P):
        for name in ("x", "topk_w", "w13", "w2"):
            g, w = got[r][name], want[r][name]
            if name == "topk_w":
                g = torch.where(idx[r] >= 0, g, 0.0)
                w = torch.where(idx[r] >= 0, w, 0.0)
            if float(w.abs().sum()) == 0:  # an idle rank's experts: zero gradients, and they must be exactly zero
                assert float(g.float().abs().sum()) == 0, (r, name)
                continue
            assert rel_l1(g, w) < 1e-2, (r, name, rel_l1(g, w))
        for i, (g, w) in enumerate(zip(got[r]["shared"], want[r]["shared"])):
            assert rel_l1(g, w) < 1e-2, (r, "shared", i, rel_l1(g, w))
    if idle is not None:
        assert float(got[idle]["w13"].float().abs().sum()) == 0 and float(got[idle]["w2"].float().abs().sum()) == 0


def test_swiglu_grads_match_autograd_with_and_without_the_clamp():
    g0 = torch.randn(64, 32) * 2
    u0 = torch.randn(64, 32) * 2
    dA = torch.randn(64, 32)
    for limit in (None, 0.7):
        g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
        gc, uc = (g, u) if limit is None else (g.clamp(max=limit), u.clamp(min=-limit, max=limit))
        A = torch.nn.functional.silu(gc) * uc
        A.backward(dA)
        A2, dg, du = twin_bwd.swiglu_grads(g0, u0, dA, limit)
        torch.testing.assert_close(A2, A.detach())
        torch.testing.assert_close(dg, g.grad)
        torch.testing.assert_close(du, u.grad)


def test_a_wrong_router_weight_gradient_is_caught():
    """The check can fail: the router-weight gradient taken against the scaled output (s * <G, A>) is wrong."""
    xs, idx, ws, dOs, w13, w2, shared = make(2, 24, 3, 8, 128, 64, seed=3)
    got = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, block_m=16)
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared)
    wrong = got[0]["topk_w"] * ws[0]
    assert rel_l1(wrong, want[0]["topk_w"]) > 0.1


def test_the_clamp_decisions_must_be_the_forwards():
    """With a clamped SwiGLU, deciding the clamp again from the saved bf16 H moves values across the limit: dx
    misses the bf16 gate (measured 2-4% rel-L1 at limits 0.5 and 2.0). The forward's masks fix it."""
    xs, idx, ws, dOs, w13, w2, shared = make(2, 24, 3, 8, 128, 64, seed=15)
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared, limit=0.5)
    got = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, limit=0.5, block_m=16)
    assert rel_l1(got[0]["x"], want[0]["x"]) < 1e-2
    saved = twin_bwd.saved
    try:  # the same backward without the masks
        twin_bwd.saved = lambda x, w, limit: (saved(x, w, limit)[0], None)
        unmasked = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, limit=0.5, block_m=16)
    finally:
        twin_bwd.saved = saved
    assert rel_l1(unmasked[0]["x"], want[0]["x"]) > 1e-2


try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def _stage_toy(limit):
    """The backward stages' toy (several row tiles per expert, an expert with no row, padding rows): the schedule,
    the rows, and the twin's stage results expert by expert."""
    from mok_kernels.mok_hopper.schedule import build_schedule

    T, K, E, H, I, BM = 40, 3, 8, 128, 64, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).bfloat16()
    dO = (torch.randn(T, H, generator=g) * H ** -0.5).bfloat16()
    load = torch.tensor([6.0, 1.0, 0.0, 3.0, 2.0, 4.0, 1.0, 5.0])  # expert 2 gets no row
    idx = torch.stack([torch.multinomial(load, K, generator=g) for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    R = 256
    sch = build_schedule(idx.reshape(1, -1), rank=0, local_experts=E, block_m=BM, capacity=R)
    codes = sch.row_code_R.long()
    valid = codes >= 0
    c = torch.where(valid, codes, 0)
    tok = c // K
    x_rows = torch.where(valid[:, None], x[tok], 0).bfloat16()
    dO_rows = torch.where(valid[:, None], dO[tok], 0).bfloat16()
    s_rows = torch.where(valid, w.reshape(-1)[c], 0.0)
    expert = sch.tile_expert_M.long().repeat_interleave(BM)[:R]
    h_rows = torch.zeros(R, 2 * I, dtype=torch.bfloat16)
    clip_rows = torch.zeros(R, 2 * I, dtype=torch.uint8)
    want = {}
    for e in range(E):
        r = (valid & (expert == e)).nonzero().flatten()
        if r.numel() == 0:
            continue
        h, clip = twin_bwd.saved(x_rows[r], w13[e], limit)
        h_rows[r] = h
        if clip is not None:
            clip_rows[r] = clip.to(torch.uint8)
        want[e] = (r, twin_bwd.expert_backward(x_rows[r], h, dO_rows[r], s_rows[r], w13[e], w2[e], limit=limit,
                                               clip_r2I=clip))
    assert 2 not in want and any(r.numel() > BM for r, _ in want.values())  # an idle expert; multi-tile experts
    return dict(sch=sch, x_rows=x_rows, dO_rows=dO_rows, s_rows=s_rows, h_rows=h_rows, clip_rows=clip_rows,
                w13=w13, w2=w2, want=want, valid=valid, dims=(T, K, E, H, I, BM, R))


def _interpreted(monkeypatch, *modules):
    """Reload the kernel modules under TRITON_INTERPRET=1 (they read it at import), or skip."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import importlib

    from mok_kernels.mok_hopper.ops import interp

    if not interp.INTERPRET:
        pytest.skip("run with TRITON_INTERPRET=1 from the start (tests/conftest.py sets it on CPU machines)")
    for m in modules:
        importlib.reload(m)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("limit", [None, 0.5], ids=["plain", "clamped"])
def test_backward_gemms_match_the_twin_under_the_interpreter(limit, monkeypatch):
    """The v0 backward GEMMs (mok_kernels/mok_hopper/ops/bwd_gemm.py) against the twin's stages, expert by expert: dH,
    s*A, the router-weight gradient, dX rows, dW13 and dW2 (several row tiles per expert, an expert with no row,
    padding rows, several column tiles and K steps)."""
    from mok_kernels.mok_hopper.ops import bwd_gemm, bwd_wgrad

    _interpreted(monkeypatch, bwd_gemm, bwd_wgrad)
    d = _stage_toy(limit)
    sch, x_rows, dO_rows, s_rows, h_rows, clip_rows, w13, w2, want, valid = (
        d[k] for k in ("sch", "x_rows", "dO_rows", "s_rows", "h_rows", "clip_rows", "w13", "w2", "want", "valid"))
    T, K, E, H, I, BM, R = d["dims"]
    chunk = torch.tensor([0, int(sch.num_tiles)], dtype=torch.int32)
    # H recomputed from the X rows (the recompute path), in 8-row blocks of the 16-row tiles, clamp decisions included
    h_re = torch.zeros(R, 2 * I, dtype=torch.bfloat16)
    clip_re = torch.zeros(R, 2 * I, dtype=torch.uint8)
    bwd_gemm.bwd_rows(x_rows, w13.transpose(1, 2), h_re, sch.tile_expert_M, sch.tile_row_M1, chunk, block_m=BM // 2,
                      programs=3, block_n=32, block_k=32, limit=limit if limit is not None else 1e30,
                      save_clip=clip_re)
    assert rel_l1(h_re[valid], h_rows[valid]) < 1e-3
    if limit is not None:
        assert torch.equal(clip_re[valid], clip_rows[valid]) and clip_rows[valid].any()
    dH = torch.zeros(R, 2 * I, dtype=torch.bfloat16)
    sA = torch.zeros(R, I, dtype=torch.bfloat16)
    ds_parts = torch.zeros(R, I // 32, dtype=torch.float32)
    bwd_gemm.bwd_rows(dO_rows, w2, dH, sch.tile_expert_M, sch.tile_row_M1, chunk, block_m=BM, programs=3,
                      block_n=32, block_k=32, dgate=dict(h=h_rows, clip=clip_rows, s=s_rows, sa=sA, ds=ds_parts),
                      limit=limit)
    dX = torch.zeros(R, H, dtype=torch.bfloat16)
    bwd_gemm.bwd_rows(dH, w13, dX, sch.tile_expert_M, sch.tile_row_M1, chunk, block_m=BM, programs=3, block_n=32,
                      block_k=32)
    starts = bwd_wgrad.expert_rows(sch.tile_expert_M, sch.tile_row_M1, E)
    dW13 = torch.zeros_like(w13)
    dW2 = torch.zeros_like(w2)
    bwd_wgrad.bwd_wgrad(dH, x_rows, dW13, sch.row_code_R, starts, programs=5, block_n=32, block_k=32, block_r=32)
    bwd_wgrad.bwd_wgrad(dO_rows, sA, dW2, sch.row_code_R, starts, programs=5, block_n=32, block_k=32, block_r=32)
    ds = bwd_gemm.router_grad(ds_parts)
    for e, (r, out) in want.items():
        assert rel_l1(dX[r], out["dX"]) < 2e-3, (e, "dX")
        assert rel_l1(ds[r], out["ds"]) < 1e-4, (e, "ds")
        assert rel_l1(dW13[e], out["dW13"]) < 2e-3, (e, "dW13")
        assert rel_l1(dW2[e], out["dW2"]) < 2e-3, (e, "dW2")
    assert not dW13[2].any() and not dW2[2].any()  # the idle expert: zero gradients, written
    assert not dH[~valid].any() and not dX[~valid].any()  # padding rows stay zero


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("limit", [None, 0.5], ids=["plain", "clamped"])
@pytest.mark.parametrize("block_r", [64, 16], ids=["one-row-block", "row-blocks"])
def test_fused_weight_streaming_stages_match_the_twin_under_the_interpreter(limit, block_r, monkeypatch):
    """mok_kernels/mok_hopper/ops/bwd_fused.py: dgate + dW2 and dX + dW13, each in one pass over its weights, against
    the twin's stages expert by expert; with every expert in one row block (the fast path) and with experts over
    several row blocks (the GEMM over row blocks, then each gradient block over them)."""
    from mok_kernels.mok_hopper.ops import bwd_fused, bwd_gemm, bwd_wgrad

    _interpreted(monkeypatch, bwd_gemm, bwd_wgrad, bwd_fused)
    d = _stage_toy(limit)
    sch, x_rows, dO_rows, s_rows, h_rows, clip_rows, w13, w2, want, valid = (
        d[k] for k in ("sch", "x_rows", "dO_rows", "s_rows", "h_rows", "clip_rows", "w13", "w2", "want", "valid"))
    T, K, E, H, I, BM, R = d["dims"]
    starts = bwd_wgrad.expert_rows(sch.tile_expert_M, sch.tile_row_M1, E)
    spans = (starts[1:] - starts[:-1]).tolist()
    assert (max(spans) <= block_r) == (block_r == 64) and min(spans) == 0  # the path under test; the idle expert
    dH = torch.zeros(R, 2 * I, dtype=torch.bfloat16)
    ds_parts = torch.zeros(R, I // 32, dtype=torch.float32)
    dW13 = torch.full_like(w13, float("nan"))  # every block must be written, the idle expert's too
    dW2 = torch.full_like(w2, float("nan"))
    dX = torch.zeros(R, H, dtype=torch.bfloat16)
    bwd_fused.dgate_dw2(dO_rows, w2, dW2, h_rows, clip_rows, s_rows, dH, ds_parts, sch.row_code_R, starts,
                        programs=3, limit=limit, block_r=block_r, block_h=32, block_i=32)
    bwd_fused.dx_dw13(dH, x_rows, w13, dW13, dX, sch.row_code_R, starts, programs=5, block_r=block_r, block_n=32,
                      block_k=32)
    ds = bwd_gemm.router_grad(ds_parts)
    code = sch.row_code_R.long()
    for e, (r, out) in want.items():
        assert rel_l1(dX[code[r]], out["dX"]) < 2e-3, (e, "dX")  # pushed to row code (one rank: its own slots)
        assert rel_l1(ds[r], out["ds"]) < 1e-4, (e, "ds")
        assert rel_l1(dW13[e], out["dW13"]) < 2e-3, (e, "dW13")
        assert rel_l1(dW2[e], out["dW2"]) < 2e-3, (e, "dW2")
    assert not dW13[2].any() and not dW2[2].any()  # the idle expert: zero gradients, written
    assert not dH[~valid].any()  # padding rows: dH 0


TOY = (24, 3, 8, 128, 64)  # T, K, E, H, I of the one-rank training-step tests
GROUPED_MM = {"dw13": {"grouped_mm": True}, "dw2": {"grouped_mm": True}}  # the weight gradients by torch


def _toy_layer(**kw):
    """A one-rank MoKHopperLayer on the CPU over TOY's seed-9 weights (``kw``: the layer's options), with them."""
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    T, K, E, H, I = TOY
    (ws_,) = link_local([Workspace(rank=0, world=1, device=torch.device("cpu"), tokens=T, hidden=H, topk=K, fp8=False,
                                   symmetric=False)])
    _, _, _, _, w13, w2, shared = make(1, T, K, E, H, I, seed=9)
    layer = MoKHopperLayer(w13[0], w2[0], topk=K, tokens=T, shared=tuple(shared), rank=0, world=1, workspace=ws_, **kw)
    return layer, w13, w2, shared


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("limit", [None, 0.5], ids=["plain", "clamped"])
def test_a_training_step_through_the_kernels_matches_autograd(limit):
    """mok_kernels/mok_hopper/train.py at EP=1: the fused forward, then the v0 backward GEMMs (H recomputed), against
    torch autograd over a plain per-expert loop: every gradient, the shared expert's too; twice (the layer's
    buffers reused, the forward's SwiGLU rows as the backward's s * SwiGLU(H) scratch), with different inputs."""
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import mok_hopper_train

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    layer, w13, w2, shared = _toy_layer(swiglu_limit=limit)
    for seed in (1, 2):
        xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=seed)
        leaves = [t.detach().clone().requires_grad_() for t in (xs[0], ws[0], w13[0], w2[0], *shared)]
        x, w, a13, a2, sg, su, sd = leaves
        out = mok_hopper_train(layer, x, idx[0], w, a13, a2, (sg, su, sd))
        h_fwd = layer.h_rows.clone()
        out.backward(dOs[0])
        assert not torch.equal(layer.h_rows, h_fwd)  # dgate's s * SwiGLU(H) went into the forward's SwiGLU rows
        want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit)[0]
        for name, got in (("x", x.grad), ("topk_w", w.grad), ("w13", a13.grad), ("w2", a2.grad)):
            assert rel_l1(got, want[name]) < 1e-2, (seed, name, rel_l1(got, want[name]))
        for i, (got, ref) in enumerate(zip((sg.grad, su.grad, sd.grad), want["shared"])):
            assert rel_l1(got, ref) < 1e-2, (seed, "shared", i)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.slow
@pytest.mark.parametrize("P,limit,idle,masked,save_h,tiles", [
    (2, None, 1, False, True, None), (4, 0.5, None, True, True, None), (2, None, None, False, False, None),
    (2, None, 1, True, True, GROUPED_MM)], ids=["ep2-idle-rank", "ep4-clamped-masked", "ep2-recompute",
                                                 "ep2-idle-rank-masked-grouped-mm"])
def test_the_kernels_backward_across_simulated_ranks_matches_autograd(P, limit, idle, masked, save_h, tiles):
    """The backward across ranks (train.py's three phases: stage dO, pull the dO rows / run the stages / push the dX
    rows and router-weight gradients to their source ranks, sum), for P ranks simulated in one process under the
    interpreter, phase by phase in lockstep as the barriers would order them: every rank's every gradient against
    torch autograd, and against the twin's backward. ``tiles``: launch overrides (the weight gradients by
    torch._grouped_mm: an idle rank's groups all empty, masked slots' padding rows summed as zeros)."""
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.train import backward_compute, backward_finish, backward_stage
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = 24, 3, 8, 128, 64
    xs, idx, ws, dOs, w13, w2, shared = make(P, T, K, E, H, I, seed=50 + P, idle_rank=idle, masked=masked)
    wss = link_local([Workspace(rank=r, world=P, device=torch.device("cpu"), tokens=T, hidden=H, topk=K, fp8=False,
                                symmetric=False) for r in range(P)])
    layers = [MoKHopperLayer(w13[r], w2[r], topk=K, tokens=T, shared=tuple(shared), swiglu_limit=limit, rank=r,
                             world=P, workspace=wss[r], save_h=save_h) for r in range(P)]
    for r in range(P):  # the forward, phase by phase
        layers[r].stage(xs[r], idx[r], ws[r])
    for r in range(P):
        layers[r].compute(xs[r])
    outs = [layers[r].finish() for r in range(P)]
    for r in range(P):  # the backward, phase by phase
        backward_stage(layers[r], dOs[r])
    parts = [backward_compute(layers[r], xs[r], w13[r], w2[r], shared, tiles=tiles) for r in range(P)]
    got = [backward_finish(layers[r], idx[r], parts[r]) for r in range(P)]
    ref = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit)
    twin = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit,
                                      block_m=layers[0].cfg.block_m)
    for r in range(P):
        assert outs[r].isfinite().all()
        for name in ("x", "topk_w", "w13", "w2"):
            assert rel_l1(got[r][name], ref[r][name]) < 1e-2, (r, name, rel_l1(got[r][name], ref[r][name]))
            assert rel_l1(got[r][name], twin[r][name]) < 5e-3, (r, name, "twin")
        for i, (a, b) in enumerate(zip(got[r]["shared"], ref[r]["shared"])):
            assert rel_l1(a, b) < 1e-2, (r, "shared", i)
        live = idx[r] >= 0
        assert not got[r]["topk_w"][~live].any()  # masked slots get no router-weight gradient
    if idle is not None:  # the idle rank's experts got no rows: zero weight gradients, written
        assert not got[idle]["w13"].any() and not got[idle]["w2"].any()


def _gloo_rank(rank, world, store_path, out_path, limit):
    import torch.distributed as dist

    from mok_kernels.mok_hopper.twin.ranks import DistributedTwin

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        xs, idx, ws, dOs, w13, w2, shared = make(world, 24, 3, 8, 128, 64, seed=40 + world,
                                                 idle_rank=1 if world == 2 else None)
        twin = DistributedTwin(w13[rank], w2[rank], group=dist.group.WORLD, topk=3, shared=shared,
                               swiglu_limit=limit, precision="bf16", block_m=16)
        torch.save(twin.backward(xs[rank], idx[rank], ws[rank], dOs[rank]), f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world,limit", [(2, None), (4, 0.5)], ids=["ep2-idle-rank", "ep4-clamped"])
def test_the_backward_twin_on_gloo_ranks_is_the_simulated_one(tmp_path, world, limit):
    """The distributed twin of the backward (real gloo ranks: all-gathers, one all-reduce per delivered tensor) gives
    the in-process simulation's gradients exactly, at EP=2 with an idle rank and EP=4 with a clamped SwiGLU."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_rank, args=(world, str(tmp_path / "store"), str(tmp_path / "grads"), limit), nprocs=world)
    xs, idx, ws, dOs, w13, w2, shared = make(world, 24, 3, 8, 128, 64, seed=40 + world,
                                             idle_rank=1 if world == 2 else None)
    want = twin_bwd.simulate_backward(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit, block_m=16)
    ref = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit)
    for r in range(world):
        got = torch.load(tmp_path / f"grads.{r}")
        for name in ("x", "topk_w", "w13", "w2"):
            assert torch.equal(got[name], want[r][name]), (r, name)
        assert all(torch.equal(a, b) for a, b in zip(got["shared"], want[r]["shared"]))
        assert rel_l1(got["x"], ref[r]["x"]) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_bwd_check_runs_on_the_cpu(tmp_path, precision):
    """mok_tools/mok_hopper/bwd_check.py end to end on one CPU rank (the backend's CPU twin, tiny shape): every
    gradient checked against the reference in the precision's gate, the repeat check, the CSV. Measures nothing;
    guards the script the GPU runs use."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m", "mok_tools.mok_hopper.bwd_check",
           "--smoke", "--out", str(tmp_path), "--precision", precision]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "mok_hopper_bwd_check.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["section"] == "backward"]
    assert [r["mode"] for r in rows] == ["save_h", "recompute"]
    lo, hi = (0.01, 0.1) if precision == "fp8" else (0, 0.01)  # fp8: quantised, within its gate
    for r in rows:
        assert r["ok"] == "True" and r["identical"] == "2/2" and lo < float(r["rel_err"]) < hi
        assert r["precision"] == precision and float(r["d_w_gate_rel"]) < hi and float(r["d_topk_w_rel"]) < hi


@pytest.mark.slow
def test_bwd_check_refuses_a_bad_mode_or_tile_in_one_line(tmp_path):
    """bwd_check: a bad mode or tile field is one line and exit 2, before anything is written."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-m", "mok_tools.mok_hopper.bwd_check", "--out", str(tmp_path / "x"),
                        "--modes", "fast"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "unknown mode" in p.stderr and not (tmp_path / "x").exists()
    p = subprocess.run([sys.executable, "-m", "mok_tools.mok_hopper.bwd_check", "--out", str(tmp_path / "x"),
                        "--tile", "ready_flag=0"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "not a TileConfig field" in p.stderr
    assert not (tmp_path / "x").exists()


def _wgrad_problem(seed, sizes, padding):
    """A weight-gradient problem of experts with ``sizes`` rows: their row ``starts``, bf16 P [R, 128] and Q [R, 256],
    and each row's ``code`` (its index; -1 for the ``padding`` rows)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    R = int(starts[-1])
    p = torch.randn(R, 128, generator=g).bfloat16()
    q = torch.randn(R, 256, generator=g).bfloat16()
    code = torch.arange(R, dtype=torch.int32)
    code[padding] = -1
    return starts, p, q, code


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("tma_store", [False, True], ids=["pointer-store", "tma-store"])
def test_weight_gradient_with_p_resident_is_the_default_one(tma_store):
    """bwd_wgrad(resident=True) (P loaded once per strip where an expert fits one row step) and
    bwd_wgrad(q_resident=True) (the Q block loaded once instead) against the default kernel, bit for bit, and
    against torch: experts of 0, 40, 64 and 130 rows (130 > the 64-row step: the other branch), padding rows (code
    -1) inside an expert. Session 29: with ``block_r_small`` 16 and ``block_r_tail`` 32 (64-row steps), the expert
    of 12 rows takes 16-row strips, those of 20, 32 and 40 rows two row blocks (16 + 32), the 64-row one the 64-row
    strips; with ``block_r_small`` 32 alone, the 20- and 32-row experts 32-row strips; with ``block_r_small`` 64
    (the launch's own row block) and ``block_r_tail`` 32, the 80-row expert, which the default runs by reloading
    P at 64-row steps, takes two resident row blocks (64 + 32). Every block is the same
    bits, except with the tail block: the interpreter's dot is numpy's, which rounds a 64-row sum taken as 16 + 32
    rows differently (on the GPU both are the same chain of 16-row MMA steps: bwd_check's sweep says whether the
    bits are the default's), so there to an fp32 rounding, at most one unit in the last place of the bf16 result."""
    from mok_kernels.mok_hopper.ops import bwd_wgrad, interp

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    sizes = [0, 40, 64, 130, 20, 32, 12, 80]
    starts, p, q, code = _wgrad_problem(3, sizes, [5, 70, 150, 240, 260, 330])
    N, K = p.shape[1], q.shape[1]
    out = {}
    small = {"p small": (32, 0), "p small + tail": (16, 32), "p block + tail": (64, 32)}
    for mode in ("default", "p", "q", *small):
        dw = torch.full((len(sizes), N, K), float("nan"), dtype=torch.bfloat16)
        r_small, r_tail = small.get(mode, (0, 0))
        bwd_wgrad.bwd_wgrad(p, q, dw, code, starts, programs=3, block_n=64, block_k=64, block_r=64,
                           tma_store=tma_store, resident=mode.startswith("p"), q_resident=mode == "q",
                           block_r_small=r_small, block_r_tail=r_tail)
        out[mode] = dw
    for mode in ("p", "q", "p small"):
        assert torch.equal(out[mode], out["default"]), mode
    for mode in ("p small + tail", "p block + tail"):
        assert torch.allclose(out[mode].float(), out["default"].float(), rtol=2 ** -7, atol=1e-6), mode
    # (the split sums are numpy's here, so a two-block expert differs from the default somewhere: the path ran)
    assert any(not torch.equal(out["p small + tail"][sizes.index(n)], out["default"][sizes.index(n)])
               for n in (20, 32, 40))
    # (the default reloads the 80-row expert's P in 64-row steps: the same split as 64 + 32, so the same bits)
    assert torch.equal(out["p block + tail"], out["default"])
    live = (code >= 0).float()[:, None]
    for e in range(len(sizes)):
        a, b = int(starts[e]), int(starts[e + 1])
        want = (p[a:b].float() * live[a:b]).t() @ q[a:b].float()
        for mode in ("p", "p small + tail", "p block + tail"):
            assert torch.allclose(out[mode][e].float(), want, rtol=1e-2, atol=0.1), (mode, e)
    assert not out["p"][0].any()  # the expert without rows: zeros, written


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("first_n", [64, 128], ids=["strips-as-default", "strips-twice-as-wide"])
def test_weight_gradient_split_launches_cover_every_expert_once(first_n):
    """Session 30's option: the experts of at most ``rows`` rows in a launch of their own blocks (``rows_max``),
    the others in a second launch (``rows_min``). Each launch alone writes exactly its experts' blocks (the rest
    stay NaN: the expert without rows belongs to the first); both together are the default kernel's values, the
    second launch's experts bit for bit (its launch is the default's), the first's to an fp32 rounding (other
    blocks: numpy's dot may sum in another order). Through ``train._wgrad``'s ``split`` too. Session 32: the first
    launch's strips twice as wide as the default's (``block_n``; bwd_check's 256 x 64 candidate), here all of N."""
    from mok_kernels.mok_hopper import train
    from mok_kernels.mok_hopper.ops import bwd_wgrad, interp

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    sizes = [0, 40, 64, 130, 20, 41, 12, 80]
    starts, p, q, code = _wgrad_problem(5, sizes, [5, 70, 150, 240, 300])
    N, K = p.shape[1], q.shape[1]
    base = dict(programs=3, block_n=64, block_k=64, block_r=64, resident=True, block_r_small=64, block_r_tail=32)

    def run(*launches):
        dw = torch.full((len(sizes), N, K), float("nan"), dtype=torch.bfloat16)
        for kw in launches:
            bwd_wgrad.bwd_wgrad(p, q, dw, code, starts, **kw)
        return dw

    small = {**base, "block_n": first_n, "block_k": 128, "block_r_small": 0, "block_r_tail": 0, "rows_max": 40}
    large = {**base, "rows_min": 40}
    default, lo, hi, both = run(base), run(small), run(large), run(small, large)
    for e, n in enumerate(sizes):
        assert not lo[e].isnan().any() if n <= 40 else lo[e].isnan().all(), (e, n)
        assert not hi[e].isnan().any() if n > 40 else hi[e].isnan().all(), (e, n)
        if n > 40:
            assert torch.equal(both[e], default[e]), (e, n)
    assert torch.allclose(both.float(), default.float(), rtol=2 ** -7, atol=1e-6) and not both[0].any()
    t = dict(base, grouped_mm=False, split=dict(rows=40, programs=2, block_n=first_n, block_k=128))
    t.pop("programs")
    via = train._wgrad(p, q, torch.empty(len(sizes), N, K, dtype=torch.bfloat16), code, starts, 3, t, {})
    assert torch.equal(via, both)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
def test_the_weight_gradient_launch_follows_the_routed_rows_not_the_capacity(monkeypatch):
    """The weight-gradient launches are chosen by the rows an expert gets on average (T K / L), not by the layer's
    row capacity over L, which counts tile padding: at EP=1 on glm_5_2 the capacity is 191 rows an expert against
    64 routed, and dividing it turned the resident launch off on every published shape. Here the capacity is 256
    rows an expert and the experts get 9: the routed experts' weight gradients are P-resident; the fused stages
    (options) take 64-row blocks, dX + dW13 alone or with dgate + dW2; the step is right every way."""
    from mok_kernels.mok_hopper.ops import bwd_fused, bwd_wgrad, interp
    from mok_kernels.mok_hopper.schedule import capacity_rows
    from mok_kernels.mok_hopper.train import layer_backward

    # the published case the rule is for: glm_5_2 at EP=1 (T 2048, K 8, 256 experts, BM 128)
    assert capacity_rows(ep=1, tokens=2048, topk=8, local_experts=256, block_m=128) / 256 > 64
    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    layer, w13, w2, shared = _toy_layer(capacity=E * 256)
    assert layer.R / E > 128 and layer.rows_per_expert == T * K / E
    launches = []

    def spy(name, real):
        def call(*args, **kw):
            launches.append((name, kw.get("block_r"), kw.get("resident", False)))
            return real(*args, **kw)
        return call

    for mod, name in ((bwd_wgrad, "bwd_wgrad"), (bwd_fused, "dgate_dw2"), (bwd_fused, "dx_dw13")):
        monkeypatch.setattr(mod, name, spy(name, getattr(mod, name)))
    xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=4)
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared)[0]
    fused_dx, fused = {"dx_dw13": {"on": True}}, {"dgate_dw2": {"on": True}, "dx_dw13": {"on": True}}
    for tiles, launched in ((None, [("bwd_wgrad", 64, True), ("bwd_wgrad", 64, True)]),
                            (fused_dx, [("dx_dw13", 64, False), ("bwd_wgrad", 64, True)]),
                            (fused, [("dgate_dw2", 64, False), ("dx_dw13", 64, False)])):
        launches.clear()
        with torch.no_grad():
            layer(xs[0], idx[0], ws[0])
        g = layer_backward(layer, dOs[0], xs[0], idx[0], ws[0], w13[0], w2[0], shared, tiles=tiles)
        assert launches == launched, launches  # (the shared expert's backward: torch GEMMs)
        for name in ("x", "topk_w", "w13", "w2"):
            assert rel_l1(g[name], want[name]) < 1e-2, (tiles, name, rel_l1(g[name], want[name]))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
def test_paired_row_blocks_give_the_single_blocks_gradients_bit_for_bit():
    """``bwd_rows(pair=True)``: where a tile has more than BM rows left, two BM-row blocks share one weight block
    load. Every token's first choice is expert 0 (24 rows) and the row blocks are 16 rows, so expert 0's tile runs
    paired (16 rows, then 8 of a masked second block) and the other experts' (at most 16 rows) singly; dgate and dX
    both. Each row's dot products are the single blocks', so every gradient is bitwise the unpaired one's, and
    right against autograd."""
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import layer_backward

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    layer, w13, w2, shared = _toy_layer()
    xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=6)
    gen = torch.Generator().manual_seed(7)
    idx[0] = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                     1 + torch.randperm(E - 1, generator=gen)[:K - 1]])
                          for _ in range(T)])
    assert (idx[0] == 0).sum() == T and all(len(set(r.tolist())) == K for r in idx[0])
    grads = []
    for pair in (False, True):
        tiles = {"dgate": dict(block_m=16, pair=pair), "dx": dict(block_m=16, pair=pair)}
        with torch.no_grad():
            layer(xs[0], idx[0], ws[0])
            g = layer_backward(layer, dOs[0], xs[0], idx[0], ws[0], w13[0], w2[0], shared, tiles=tiles)
        grads.append([g["x"], g["topk_w"], g["w13"], g["w2"], *g["shared"]])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared)[0]
    for name, got in zip(("x", "topk_w", "w13", "w2"), grads[1]):
        assert rel_l1(got, want[name]) < 1e-2, (name, rel_l1(got, want[name]))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
def test_dgate_and_dw2_gather_the_output_gradient_rows_themselves():
    """v12 (lab/perf-notes.md, "Session 29"): at EP=1 dgate and dW2 read each schedule row's output gradient from its
    token (``code // K``) instead of a gathered copy of dO's T K rows. With paired dgate blocks (a second block's
    rows gathered too) and the P-resident weight gradients, every gradient is bitwise the copy's, and right against
    autograd; the launches that cannot gather (here the fused dgate + dW2) get the copy made for them."""
    from mok_kernels.mok_hopper import train
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import layer_backward

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    layer, w13, w2, shared = _toy_layer()
    xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=8)
    assert train._tiles(H, I, False, rows_per_expert=layer.rows_per_expert)["dw2"]["resident"]
    grads = {}
    for label, tiles in (("copy", {"gather_dO": {"in_kernels": False}}), ("kernels", {}),
                         ("fused", {"dgate_dw2": {"on": True}})):
        tiles = {**tiles, "dgate": dict(block_m=16, pair=True)}
        with torch.no_grad():
            layer(xs[0], idx[0], ws[0])
            g = layer_backward(layer, dOs[0], xs[0], idx[0], ws[0], w13[0], w2[0], shared, tiles=tiles)
        grads[label] = [g["x"], g["topk_w"], g["w13"], g["w2"]]
    for a, b in zip(grads["copy"], grads["kernels"]):
        assert torch.equal(a, b)
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared)[0]
    for label in ("kernels", "fused"):
        for name, got in zip(("x", "topk_w", "w13", "w2"), grads[label]):
            assert rel_l1(got, want[name]) < 1e-2, (label, name, rel_l1(got, want[name]))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("limit", [None, 0.5], ids=["plain", "clamped"])
def test_the_shared_experts_backward_by_torch_gemms(limit):
    """``tiles["shared_bwd"] = {"torch": True}`` (the default): the shared expert's gradients by torch GEMMs, right
    against autograd; the routed gradients untouched (bitwise the run with ``{"torch": False}``, the shared expert
    through the routed kernels). With a clamp the kernels keep it (the clamp is decided on fp32 accumulators): every
    gradient bitwise the kernels' run."""
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import layer_backward

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    layer, w13, w2, shared = _toy_layer(swiglu_limit=limit)
    xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=8)
    got = []
    for tiles in ({"shared_bwd": {"torch": False}}, None):
        with torch.no_grad():
            layer(xs[0], idx[0], ws[0])
            got.append(layer_backward(layer, dOs[0], xs[0], idx[0], ws[0], w13[0], w2[0], shared, tiles=tiles))
    kern, tor = got
    for k in ("topk_w", "w13", "w2"):
        assert torch.equal(kern[k], tor[k]), k
    same = [torch.equal(a, b) for a, b in zip(kern["shared"], tor["shared"])] + [torch.equal(kern["x"], tor["x"])]
    assert all(same) if limit is not None else not all(same)  # the torch path ran where it may, and only there
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared, limit=limit)[0]
    assert rel_l1(tor["x"], want["x"]) < 1e-2
    for got_, ref in zip(tor["shared"], want["shared"]):
        assert rel_l1(got_, ref) < 1e-2


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("save_h,dgate", [(True, False), (False, False), (True, True)],
                         ids=["save-h", "recompute", "save-h-dgate-too"])
def test_the_weight_gradients_by_grouped_mm(save_h, dgate, monkeypatch):
    """``tiles`` GROUPED_MM: dW13 and dW2 by torch._grouped_mm over the experts' row ranges (padding rows summed as
    zeros instead of skipped); ``dgate``: and dgate's G = dO @ W2 too, its epilogue after it. An expert with no row
    (expert 2) and masked slots: its gradients zero, the others right against autograd and within bf16 rounding of
    the kernels'; with the kernels' dgate every other gradient bitwise the kernels' (only the weight-gradient
    stages changed); twice the same bits."""
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import layer_backward

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    layer, w13, w2, shared = _toy_layer(save_h=save_h)
    xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=12, masked=True)
    gen = torch.Generator().manual_seed(13)
    busy = torch.tensor([e for e in range(E) if e != 2])
    idx[0] = torch.stack([busy[torch.randperm(E - 1, generator=gen)[:K]] for _ in range(T)])
    idx[0][::4, -1] = -1
    got = []
    over = {**GROUPED_MM, "dgate": {"grouped_mm": True}} if dgate else GROUPED_MM
    calls = []
    real = torch._grouped_mm

    def counted(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    for tiles in (None, over, over):
        with torch.no_grad():
            layer(xs[0], idx[0], ws[0])
            got.append(layer_backward(layer, dOs[0], xs[0], idx[0], ws[0], w13[0], w2[0], shared, tiles=tiles))
    assert len(calls) == 2 * (3 if dgate else 2)  # the grouped GEMMs ran, where asked, and only there
    kern, mm, again = got
    assert not (idx[0] == 2).any() and not mm["w13"][2].any() and not mm["w2"][2].any()
    for a, b in zip(kern["shared"], mm["shared"]):
        assert torch.equal(a, b)
    want = twin_bwd.autograd_reference(xs, idx, ws, dOs, w13, w2, shared=shared)[0]
    for k in ("x", "topk_w", "w13", "w2"):
        assert torch.equal(mm[k], again[k]), k
        if k in ("x", "topk_w") and not dgate:
            assert torch.equal(kern[k], mm[k]), k
        assert rel_l1(mm[k], kern[k]) < (5e-3 if dgate else 2e-3), (k, rel_l1(mm[k], kern[k]))
        assert rel_l1(mm[k], want[k]) < 1e-2, (k, rel_l1(mm[k], want[k]))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("fused", [False, True], ids=["tiled", "tiled-gate-up-interleaved"])
def test_bwd_checks_tiled_layout_variant_runs_the_tiled_backward(fused, monkeypatch):
    """bwd_check's ``tiled layout`` sweep variant: the backward on the layer's own weights in TMA block order, its
    weight gradients untiled, agrees with the plain-layout run (``rel_l1_to_default``); untiled wrongly (rows in the
    wrong order), the comparison fails; on a layer whose weights are plain the variant refuses to run."""
    from dataclasses import replace
    from types import SimpleNamespace

    from mok_tools.mok_hopper import bwd_check
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.tiles import default_tile

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    tile = replace(default_tile(device=torch.device("cpu"), hidden=H, ffn=I), tma=True, w_tiled=True, up_fused=fused)
    layer, w13, w2, shared = _toy_layer(tile=tile)
    xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=8)
    backend = SimpleNamespace(impl=layer, params=SimpleNamespace(w13=w13[0], w2=w2[0], shared=tuple(shared)))
    inp = SimpleNamespace(x_TH=xs[0], topk_idx_TK=idx[0], topk_w_TK=ws[0], grad_out_TH=dOs[0])
    over = bwd_check.SWEEP["tiled layout"]
    w13_t, w2_t, rest = bwd_check._weights(backend, over)
    assert w13_t is layer.w13 and w13_t.dim() == 5 and w2_t is layer.w2 and rest == {}
    g = bwd_check._backward(backend, inp, over)
    assert g["w13"].shape == w13[0].shape and g["w2"].shape == w2[0].shape
    assert bwd_check.rel_l1_to_default(backend, inp, over) < 1e-3
    untile = bwd_check._plain
    monkeypatch.setattr(bwd_check, "_plain", lambda b, g: {**untile(b, g), "w13": untile(b, g)["w13"].flip(1)})
    assert bwd_check.rel_l1_to_default(backend, inp, over) > 0.1
    plain_layer, _, _, _ = _toy_layer()
    with pytest.raises(ValueError, match="plain here"):
        bwd_check._weights(SimpleNamespace(impl=plain_layer, params=backend.params), over)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
def test_split_weight_gradients_through_the_layer_backward(monkeypatch):
    """``split`` as bwd_check's sweep passes it (train.py's tiles, its own programs an SM): two launches for each
    weight gradient, the experts of at most ``rows`` rows first, and the layer's gradients those of the default
    launch (the weight gradients to an fp32 rounding: other blocks, numpy's dot; the rest bit for bit)."""
    from types import SimpleNamespace

    from mok_tools.mok_hopper import bwd_check
    from mok_kernels.mok_hopper.ops import bwd_wgrad, interp

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    layer, w13, w2, shared = _toy_layer()
    xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=8)
    backend = SimpleNamespace(impl=layer, params=SimpleNamespace(w13=w13[0], w2=w2[0], shared=tuple(shared)))
    inp = SimpleNamespace(x_TH=xs[0], topk_idx_TK=idx[0], topk_w_TK=ws[0], grad_out_TH=dOs[0])
    default = bwd_check._backward(backend, inp, None)
    calls = []
    launch = bwd_wgrad.bwd_wgrad
    monkeypatch.setattr(bwd_wgrad, "bwd_wgrad", lambda *a, **kw: calls.append(kw) or launch(*a, **kw))
    sp = dict(rows=K * T // E, block_k=64, block_r=32, programs_per_sm=3)
    got = bwd_check._backward(backend, inp, {"dw13": dict(split=sp), "dw2": dict(split=sp)})
    assert [(c.get("rows_max", -1), c.get("rows_min", -1), c["block_r"]) for c in calls] == [(9, -1, 32),
                                                                                        (-1, 9, 64)] * 2
    assert calls[0]["programs"] == 3 * calls[1]["programs"] // 2  # split's 3 an SM against the default's 2
    for k in default:
        a, b = default[k], got[k]
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            if k in ("w13", "w2"):
                assert torch.allclose(x.float(), y.float(), rtol=2 ** -7, atol=1e-6), k
            else:
                assert torch.equal(x, y), k


def test_bwd_check_interleaved_rounds_cancel_a_linear_drift():
    """bwd_check's ``--sweep-rounds``: rounds of D V1 D V2 D, each variant's ratio to the mean of the two default
    timings around it. Under a drift of 1% a call, linear in time, an A/A variant reads x1 exactly and a variant
    whose dW13 is 14% slower x1.1 on the total, in every round; timed one after another (as the one-shot sweep
    does) the A/A would read x1.01, and against the round's first default timing alone x1.01-x1.03."""
    from mok_tools.mok_hopper.bwd_check import interleaved_rounds, ratios_to_default

    calls = []
    cost = {None: {"dgate": 2.0, "dw13": 5.0}, "A/A": {"dgate": 2.0, "dw13": 5.0},
            "dW13 slower": {"dgate": 2.0, "dw13": 5.7}}

    def measure(label):
        drift = 1 + 0.01 * len(calls)
        calls.append(label)
        return {k: v * drift for k, v in cost[label].items()}

    samples = interleaved_rounds(measure, ["A/A", "dW13 slower"], 3)
    assert calls[:5] == [None, "A/A", None, "dW13 slower", None]
    assert all(a != b for a, b in zip(calls, calls[1:]))  # no label twice in a row, across rounds too
    assert len(samples[None]) == 7 and len(samples["A/A"]) == len(samples["dW13 slower"]) == 3
    r = ratios_to_default(samples)
    assert set(r) == {"A/A", "dW13 slower"}
    for label, want, dw13 in (("A/A", 1.0, 1.0), ("dW13 slower", round(7.7 / 7.0, 4), 1.14)):
        assert r[label]["total_ratio"] == r[label]["round_ratio_min"] == r[label]["round_ratio_max"] == want
        assert r[label]["stage_dw13_ratio"] == dw13 and r[label]["stage_dgate_ratio"] == 1.0


def test_backward_launch_defaults_store_dw13_by_pointers_on_the_resident_path():
    """v10 (lab/perf-notes.md, "Session 28"): on CUDA the resident weight gradients (experts of at most 128 rows on
    average: every published shape at EP=1) store dW13 by pointers and dW2 by TMA; above 128 rows (the
    compute-bound point) the weight gradients are torch._grouped_mm's and the kernels' launch keeps TMA stores;
    the interpreter (CPU) stores by pointers everywhere. v11 (session 29): where the experts average 48-128 rows
    (glm_5_2), the 128-row launches run the strips of an expert of at most 64 / 96 rows over 64 / 64 + 32 rows,
    and store dW2 by pointers too (not with the tiled layout, whose launch keeps v10's)."""
    from mok_kernels.mok_hopper.train import _tiles

    for rows, resident in ((40.0, True), (64.0, True), (1024.0, False)):
        t = _tiles(4096, 1024, True, rows_per_expert=rows)
        assert t["dw13"]["resident"] is resident and t["dw13"]["tma_store"] is not resident, rows
        assert t["dw2"]["tma_store"] is (rows != 64.0) and t["dw13"]["grouped_mm"] is (rows > 128), rows
        for stage in ("dw13", "dw2"):
            small = (t[stage].get("block_r_small"), t[stage].get("block_r_tail"))
            assert small == ((64, 32) if rows == 64.0 else (None, None)), (rows, stage)
            assert t[stage]["block_r"] == (128 if rows == 64.0 else 64), (rows, stage)
    tiled = _tiles(4096, 1024, True, rows_per_expert=64.0, tiled=True)
    assert "block_r_small" not in tiled["dw13"] and tiled["dw2"]["tma_store"] is True
    t = _tiles(4096, 1024, False, rows_per_expert=40.0)
    assert t["dw13"]["tma_store"] is False and t["dw2"]["tma_store"] is False


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("precision,forward", [("bf16", "save_h"), ("bf16", "recompute"), ("fp8", "save_h"),
                                               ("fp8", "recompute")])
def test_plain_weights_train_bit_for_bit_like_the_tiled_default(precision, forward):
    """mok_hopper.weights=plain (``tiles.plain_weights``: the caller's [L, 2I, H] / [L, H, I] through strided TMA
    descriptors, no copy in TMA block order, no fused gate/up MMA) against the default's tiled weights with the
    fused gate/up MMA (and bf16's tails): a training step through autograd at EP=1, the output and every gradient
    bitwise equal, twice (the layers' buffers reused). The plain bf16 layer keeps no weights of its own: its w13 and
    w2 are the caller's tensors. In bf16 also the plain weights with the fused gate/up MMA kept, its interleaved
    block read as a [up_n, 2, up_k] box of them (``plain_weights(..., stacked=True)``)."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.tiles import TileConfig, plain_weights
    from mok_kernels.mok_hopper.train import mok_hopper_train
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = 24, 3, 8, 256, 128
    fp8 = precision == "fp8"
    base = TileConfig(block_m=32, up_n=32, up_k=32, down_n=64, down_k=32, num_chunks=1, gemm_programs=3,
                      pull_programs=5, pull_rows=4, group_m=2, tma=True, w_tiled=True, fp8_up_fused=True)
    tiled = base.for_fp8() if fp8 else replace(base, block_m=64, tail_rows=16, up_fused=True)
    plain = plain_weights(tiled)
    assert tiled.up_fused and not plain.w_tiled and not plain.up_fused and plain.tma and not plain.up_stacked
    stacked = plain_weights(tiled, stacked=True)  # bf16: the fused MMA over a box of the plain weights
    assert stacked.up_stacked == (not fp8) and not stacked.w_tiled
    _, _, _, _, w13, w2, shared = make(1, T, K, E, H, I, seed=71)
    runs = []
    for tile in (tiled, plain) + (() if fp8 else (stacked,)):
        (ws_,) = link_local([Workspace(rank=0, world=1, device=torch.device("cpu"), tokens=T, hidden=H, topk=K,
                                       fp8=fp8, symmetric=False)])
        layer = MoKHopperLayer(w13[0], w2[0], topk=K, tokens=T, shared=tuple(shared), rank=0, world=1,
                               workspace=ws_, precision=precision, tile=tile, save_h=forward == "save_h",
                               train=True, swiglu_limit=0.5)
        assert (layer.w13.dim(), layer.w2.dim()) == ((5, 5) if tile.w_tiled else (3, 3))
        if not fp8 and not tile.w_tiled:
            assert layer.w13.data_ptr() == w13[0].data_ptr() and layer.w2.data_ptr() == w2[0].data_ptr()
        steps = []
        for seed in (1, 2):
            xs, idx, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=seed, masked=seed == 2)
            leaves = [t.detach().clone().requires_grad_() for t in (xs[0], ws[0], w13[0], w2[0], *shared)]
            out = mok_hopper_train(layer, leaves[0], idx[0], leaves[1], leaves[2], leaves[3], tuple(leaves[4:]))
            out.backward(dOs[0])
            steps.append([out.detach(), *(t.grad for t in leaves)])
        runs.append(steps)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            for i, (u, v) in enumerate(zip(a, b)):
                assert torch.equal(u, v), i


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
@pytest.mark.parametrize("save_h,limit,tiles", [(True, None, None), (False, 0.5, None), (True, None, "grouped_mm"),
                                                (True, 0.5, "fused")],
                         ids=["save-h", "recompute-clamped", "save-h-grouped-mm", "save-h-clamped-fused"])
def test_packed_rows_backward_is_the_padded_backward(save_h, limit, tiles):
    """bf16, EP=1, packed rows (no tile padding): every gradient the padded layout's, bit for bit: dX and the
    router-weight gradient (each row's depends on that row only), and dW13 / dW2, whose sums over an expert's rows
    run in row blocks from the expert's first row in both layouts (the padded layout's extra blocks hold padding
    rows only, which add nothing). Experts of 0 to 2 tiles of rows, masked slots; ``grouped_mm``: dgate and the
    weight gradients by torch._grouped_mm over the experts' row ranges; ``fused``: the fused weight-streaming stages
    (dgate + dW2, dX + dW13; options), whose row blocks also start at each expert's first row."""
    from dataclasses import replace

    from mok_hopper_layers import skewed_routing
    from mok_kernels.mok_hopper.api import default_tile
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import layer_backward

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    T, K, E, H, I = TOY
    padded_tile = replace(default_tile(device=torch.device("cpu"), hidden=H, ffn=I), block_m=16, pull_rows=4)
    xs, _, ws, dOs, _, _, _ = make(1, T, K, E, H, I, seed=21)
    idx = skewed_routing(T, K, E, seed=21)
    idx[::5, -1] = -1
    over = {None: None, "grouped_mm": {**GROUPED_MM, "dgate": {"grouped_mm": True}},
            "fused": {"dgate_dw2": {"on": True, "block_r": 16}, "dx_dw13": {"on": True, "block_r": 16}}}[tiles]
    got = []
    for tile in (padded_tile, replace(padded_tile, packed_rows=True)):
        layer, w13, w2, shared = _toy_layer(save_h=save_h, swiglu_limit=limit, tile=tile)
        with torch.no_grad():
            layer(xs[0], idx, ws[0])
            got.append(layer_backward(layer, dOs[0], xs[0], idx, ws[0], w13[0], w2[0], shared, tiles=over))
        counts = layer.sched.counts_L
        assert layer.overflow_rows() == 0
    assert layer.R == -(-int(counts.sum()) // padded_tile.block_m) * padded_tile.block_m  # the packed layer's R
    assert (counts == 0).any() and (counts > padded_tile.block_m).any()
    padded, packed = got
    for k in ("x", "topk_w", "w13", "w2"):
        assert torch.equal(packed[k], padded[k]), k
    want = twin_bwd.autograd_reference(xs, [idx], ws, dOs, w13, w2, shared=shared, limit=limit)[0]
    for k in ("x", "topk_w", "w13", "w2"):
        assert rel_l1(packed[k], want[k]) < 1e-2, (k, rel_l1(packed[k], want[k]))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; pip install -e "
                                           "'.[test]'): the interpreter kernel tests need it")
def test_packed_rows_at_ep2_are_the_padded_layout_bit_for_bit():
    """bf16, two simulated ranks in lockstep (train.py's three backward phases between the barriers): with packed
    rows each rank's forward output and every gradient are the padded layout's, bit for bit; rank 1's experts get
    no row (its weight gradients zero), masked slots; the capacity is the EP=2 worst case, with no padding."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile
    from mok_kernels.mok_hopper.ops import interp
    from mok_kernels.mok_hopper.train import backward_compute, backward_finish, backward_stage
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    if not interp.INTERPRET:
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1 (set at the top of this file without a GPU)")
    P, (T, K, E, H, I) = 2, TOY
    xs, idx, ws, dOs, w13, w2, shared = make(P, T, K, E, H, I, seed=33, idle_rank=1, masked=True)
    padded_tile = replace(default_tile(device=torch.device("cpu"), hidden=H, ffn=I), block_m=16, pull_rows=4)
    runs = []
    for tile in (padded_tile, replace(padded_tile, packed_rows=True)):
        wss = link_local([Workspace(rank=r, world=P, device=torch.device("cpu"), tokens=T, hidden=H, topk=K,
                                    fp8=False, symmetric=False) for r in range(P)])
        layers = [MoKHopperLayer(w13[r], w2[r], topk=K, tokens=T, shared=tuple(shared), rank=r, world=P,
                                 workspace=wss[r], save_h=True, tile=tile) for r in range(P)]
        for r in range(P):
            layers[r].stage(xs[r], idx[r], ws[r])
        for r in range(P):
            layers[r].compute(xs[r])
        outs = [layers[r].finish() for r in range(P)]
        for r in range(P):
            backward_stage(layers[r], dOs[r])
        parts = [backward_compute(layers[r], xs[r], w13[r], w2[r], shared) for r in range(P)]
        runs.append((outs, [backward_finish(layers[r], idx[r], parts[r]) for r in range(P)]))
        assert all(layer.overflow_rows() == 0 for layer in layers)
    assert layers[0].R == P * T * K and int(layers[0].sched.counts_L.sum()) == int((idx[0] >= 0).sum() + idx[1].numel())
    (out_a, g_a), (out_b, g_b) = runs
    for r in range(P):
        assert torch.equal(out_a[r], out_b[r])
        for k in ("x", "topk_w", "w13", "w2"):
            assert torch.equal(g_a[r][k], g_b[r][k]), (r, k)
    assert not g_b[1]["w13"].any() and not g_b[1]["w2"].any()
