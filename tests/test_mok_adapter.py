"""The upstream-MoK adapter (backend ``mok``) without the package: its reasons for ``unsupported``, the MoKConfig of
a sweep point, the weight layouts and MXFP8 prequantisation, and the argument plumbing of forward / backward
through a fake ``mok`` module injected into ``sys.modules`` (its forward and backward are plain torch math).

Legend: T tokens, K top-k, H hidden, I ffn, L local experts.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
import pytest
import torch
import torch.nn.functional as F

import mok_kernels.mok_upstream as mu


def make_case(**kw):
    base = dict(shape="t", num_experts=32, local_experts=8, hidden=256, ffn=256, topk=2, shared_expert=True,
                swiglu_limit=None, tokens_per_gpu=512, precision="bf16", ep_size=4, device="cuda", comm_sms=None,
                act_block=128, weight_block=128)
    base.update(kw)
    return SimpleNamespace(**base)


# ---------------------------------------------------------------------------------------------------------------
# a fake `mok`


def _layer(x, w, sg, su, sd, g, u, d, idx, limit):
    """Single-rank MoE layer (all experts local): the fake kernels' math, differentiable."""
    def swiglu(a, b):
        if limit is not None:
            a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
        return F.silu(a) * b

    out = (swiglu(x @ sg.t(), x @ su.t()) @ sd.t()).float()
    for e in range(g.shape[0]):
        tok, kk = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel():
            xe = x[tok]
            y = swiglu(xe @ g[e].t(), xe @ u[e].t()) @ d[e].t()
            out = out.index_add(0, tok, w[tok, kk].unsqueeze(-1) * y.float())
    return out.to(torch.bfloat16)


def make_fake_mok(with_limit: bool = True) -> types.ModuleType:
    mok = types.ModuleType("mok")
    mok.__version__ = "0.0.fake"
    mok.calls = []

    @dataclass(frozen=True)
    class MoKConfig:
        fwd_num_comm_sms: int = 40
        bwd_num_comm_sms: int = 28
        minibatch_size: int = 4096
        macrobatch_size: int = 131072
        schedule_capacity_multiplier: float = 0.5
        all_gather_top_experts_chunk_bytes: int = 2048

    def get_workspace(config, group, *, device, num_local_tokens, hidden_size, topk):
        mok.calls.append(("get_workspace", config, num_local_tokens, hidden_size, topk))
        return SimpleNamespace(T=num_local_tokens, H=hidden_size, K=topk)

    def build_schedule(workspace, config, top_experts, *, num_local_experts):
        assert top_experts.dtype == torch.int64 and top_experts.is_contiguous()
        mok.calls.append(("build_schedule", num_local_experts))
        return SimpleNamespace(idx=top_experts.clone())

    def _dense(wt):  # a routed weight as the kernels read it: a tensor, or an MXFP8 tuple (fake: data only)
        return wt[0].to(torch.bfloat16) if isinstance(wt, tuple) else wt

    def forward(config, workspace, schedule, x, router_weights, sg, su, sd, g, u, d, swiglu_limit=None):
        mok.calls.append(("forward", type(g).__name__, swiglu_limit))
        out = _layer(x, router_weights, sg, su, sd, _dense(g), _dense(u), _dense(d), schedule.idx, swiglu_limit)
        return out, SimpleNamespace(tag="ctx")

    def backward(config, workspace, schedule, ctx, grad_output, x, router_weights, sg, su, sd, g, u, d,
                 swiglu_limit=None):
        assert ctx.tag == "ctx"
        if isinstance(g, tuple):  # mxfp8: gate/up as 4-tuples, down as the transposed pair
            assert len(g) == 4 and len(u) == 4 and len(d) == 2
            d = d[0].to(torch.bfloat16).transpose(-1, -2)
            g, u = g[0].to(torch.bfloat16), u[0].to(torch.bfloat16)
        leaves = [t.detach().float().requires_grad_() for t in (x, router_weights, g, u, d, sg, su, sd)]
        lx, lw, lg, lu, ld, lsg, lsu, lsd = leaves
        with torch.enable_grad():  # called from inside autograd's backward, where grad mode is off
            out = _layer(lx, lw, lsg, lsu, lsd, lg, lu, ld, schedule.idx, swiglu_limit)
            out.float().backward(grad_output.float())
        mok.calls.append(("backward", swiglu_limit))
        return tuple(t.grad.to(torch.float32 if i == 1 else torch.bfloat16) for i, t in enumerate(leaves))

    if not with_limit:
        def forward_no_limit(config, workspace, schedule, x, router_weights, sg, su, sd, g, u, d):
            return forward(config, workspace, schedule, x, router_weights, sg, su, sd, g, u, d)
        mok.forward = forward_no_limit
    else:
        mok.forward = forward

    def mxfp8_quantize(w, normal, transposed):
        mok.calls.append(("mxfp8_quantize", tuple(w.shape), normal, transposed))
        sc = torch.zeros(1, dtype=torch.uint8)
        return (w.to(torch.float8_e4m3fn), sc, w.transpose(-1, -2).contiguous().to(torch.float8_e4m3fn), sc)

    mok.MoKConfig = MoKConfig
    mok.get_workspace, mok.build_schedule, mok.backward = get_workspace, build_schedule, backward
    mok.ops = SimpleNamespace(mxfp8_quantize=mxfp8_quantize)
    mok.clear_workspace_cache = lambda: mok.calls.append(("clear",))
    return mok


@pytest.fixture
def fake_mok(monkeypatch):
    mok = make_fake_mok()
    monkeypatch.setitem(sys.modules, "mok", mok)
    return mok


@pytest.fixture
def blackwell(monkeypatch, fake_mok):
    """Pretend to be a Blackwell node with multicast, with the fake package installed."""
    monkeypatch.setattr(mu, "_capability", lambda: (10, 0))
    monkeypatch.setattr(mu, "_multicast_missing", lambda: None)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    return fake_mok


# ---------------------------------------------------------------------------------------------------------------
# unsupported reasons


def test_unsupported_without_blackwell_or_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "mok", None)  # import mok -> ImportError
    assert "Blackwell" in mu.MokBackend.unsupported_reason(make_case(device="cpu"))
    monkeypatch.setattr(mu, "_capability", lambda: (9, 0))
    why = mu.MokBackend.unsupported_reason(make_case())
    assert "SM90" in why and "mok_hopper" in why
    monkeypatch.setattr(mu, "_capability", lambda: (10, 3))
    assert "not installed" in mu.MokBackend.unsupported_reason(make_case())
    assert "not a MoK precision" in mu.MokBackend.unsupported_reason(make_case(precision="fp8"))


def test_multicast_is_required(monkeypatch, fake_mok):
    monkeypatch.setattr(mu, "_capability", lambda: (10, 0))
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert "multicast" in mu.MokBackend.unsupported_reason(make_case())


@pytest.mark.parametrize("change,message", [
    (dict(ep_size=2), "EP 4, 8, 16, 32 or 64"),
    (dict(ep_size=128), "EP 4, 8, 16, 32 or 64"),
    (dict(tokens_per_gpu=256), ">= 512"),
    (dict(tokens_per_gpu=640), "divisible by 256"),
    (dict(hidden=384), "hidden and ffn divisible by 256"),
    (dict(ffn=128), "hidden and ffn divisible by 256"),
    (dict(shared_expert=False), "shared expert"),
])
def test_sweep_points_outside_upstreams_limits_are_unsupported(blackwell, change, message):
    assert message in mu.MokBackend.unsupported_reason(make_case(**change))


def test_supported_points(blackwell):
    for kw in (dict(), dict(ep_size=64, tokens_per_gpu=2048, hidden=7168, ffn=2048, topk=8),
               dict(precision="mxfp8"), dict(swiglu_limit=7.0)):
        assert mu.MokBackend.unsupported_reason(make_case(**kw)) is None, kw


def test_clamped_swiglu_needs_a_recent_mok(monkeypatch, blackwell):
    monkeypatch.setitem(sys.modules, "mok", make_fake_mok(with_limit=False))
    assert "swiglu_limit" in mu.MokBackend.unsupported_reason(make_case(swiglu_limit=7.0))
    assert mu.MokBackend.unsupported_reason(make_case()) is None


# ---------------------------------------------------------------------------------------------------------------
# input preparation


def test_config_uses_the_published_comm_sms_unless_overridden(fake_mok):
    assert mu.comm_sms(make_case()) == (24, 28)
    assert mu.comm_sms(make_case(precision="mxfp8")) == (36, 36)
    assert mu.comm_sms(make_case(comm_sms=16)) == (16, 16)
    cfg = mu.make_config(fake_mok, make_case(precision="mxfp8"))
    assert (cfg.fwd_num_comm_sms, cfg.bwd_num_comm_sms) == (36, 36)
    assert cfg.minibatch_size == 4096 and cfg.schedule_capacity_multiplier == 0.5  # upstream defaults kept


def test_gate_up_split_and_mxfp8_prequantisation(fake_mok):
    L, I, H = 3, 256, 512
    w13 = torch.randn(L, 2 * I, H).bfloat16()
    w2 = torch.randn(L, H, I).bfloat16()
    g, u = mu.split_gate_up(w13)
    assert g.shape == u.shape == (L, I, H) and g.is_contiguous() and u.is_contiguous()
    assert torch.equal(g, w13[:, :I]) and torch.equal(u, w13[:, I:])
    bf = mu.prepare_weights(fake_mok, "bf16", g, u, w2)
    assert bf.fwd[0] is g and bf.bwd[2] is w2 and not fake_mok.calls
    mx = mu.prepare_weights(fake_mok, "mxfp8", g, u, w2)
    assert [c[1:] for c in fake_mok.calls] == [((L, I, H), True, True), ((L, I, H), True, True),
                                               ((L, H, I), True, True)]
    assert all(len(t) == 2 for t in mx.fwd) and len(mx.bwd[0]) == len(mx.bwd[1]) == 4 and len(mx.bwd[2]) == 2
    assert mx.fwd[2][0].shape == (L, H, I) and mx.bwd[2][0].shape == (L, I, H)  # down: normal fwd, transposed bwd


# ---------------------------------------------------------------------------------------------------------------
# forward / backward plumbing (one gloo rank; the fake computes all experts locally)


def _inputs(T=16, K=2, L=4, H=256, I=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        x_TH=torch.randn(T, H, generator=g).bfloat16(),
        topk_idx_TK=torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(T)]),
        topk_w_TK=torch.softmax(torch.randn(T, K, generator=g), -1),
        w13_LIH=(torch.randn(L, 2 * I, H, generator=g) * H ** -0.5).bfloat16(),
        w2_LHI=(torch.randn(L, H, I, generator=g) * I ** -0.5).bfloat16(),
        ws_gate_IH=(torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
        ws_up_IH=(torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
        ws_down_HI=(torch.randn(H, I, generator=g) * I ** -0.5).bfloat16(),
        grad_out_TH=torch.randn(T, H, generator=g).bfloat16())


@pytest.mark.parametrize("precision,limit", [("bf16", None), ("bf16", 0.5), ("mxfp8", None)])
def test_forward_and_backward_reach_the_package_in_its_argument_order(fake_mok, one_rank, precision, limit):
    inp = _inputs()
    L, I = inp.w13_LIH.shape[0], inp.w2_LHI.shape[2]
    case = make_case(precision=precision, swiglu_limit=limit, tokens_per_gpu=16, local_experts=L, num_experts=L,
                     ep_size=1, device="cpu")
    b = mu.MokBackend(case, one_rank)
    b.setup(inp)
    assert fake_mok.calls[-1][0] == "get_workspace" and fake_mok.calls[-1][2:] == (16, 256, 2)
    x = inp.x_TH.clone().requires_grad_()
    w = inp.topk_w_TK.clone().requires_grad_()
    out = b.forward(x, inp.topk_idx_TK, w)
    assert ("build_schedule", L) in fake_mok.calls and ("forward", "tuple" if precision == "mxfp8" else "Tensor",
                                                        limit) in fake_mok.calls

    # the same layer straight from the harness-layout inputs, through torch autograd
    wq = (lambda t: t.to(torch.float8_e4m3fn).to(torch.bfloat16)) if precision == "mxfp8" else (lambda t: t)
    leaves = [t.detach().clone().requires_grad_() for t in
              (inp.x_TH, inp.topk_w_TK, inp.ws_gate_IH, inp.ws_up_IH, inp.ws_down_HI, inp.w13_LIH, inp.w2_LHI)]
    rx, rw, rsg, rsu, rsd, r13, r2 = leaves
    want = _layer(rx, rw, rsg, rsu, rsd, wq(r13[:, :I]), wq(r13[:, I:]), wq(r2), inp.topk_idx_TK, limit)
    assert torch.equal(out, want)

    out.backward(inp.grad_out_TH)
    want.backward(inp.grad_out_TH)
    grads = b.weight_grads()
    assert set(grads) == {"w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"}
    def close(a, b):  # relative L1; fp32 (fake) vs bf16 (here) autograd differ by a few %, a swapped argument by O(1)
        assert a.shape == b.shape
        assert float((a.float() - b.float()).abs().sum() / b.float().abs().sum()) < 0.1

    close(x.grad, rx.grad)
    close(w.grad, rw.grad)
    close(grads["w_gate"], r13.grad[:, :I])
    close(grads["w_up"], r13.grad[:, I:])
    close(grads["w_down"], r2.grad)
    close(grads["ws_gate"], rsg.grad)
    close(grads["ws_up"], rsu.grad)
    close(grads["ws_down"], rsd.grad)
    tr = b.traffic()
    assert tr["dispatch_rows_to"] == [16 * 2] and tr["combine_rows_to"] == [16 * 2]
    assert b.info()["comm_sms"] == (36 if precision == "mxfp8" else 24)
    b.zero_grad()
    assert all(v is None for v in b.weight_grads().values())
    b.teardown()
    assert fake_mok.calls[-1] == ("clear",)


def test_registered_in_the_harness():
    from harness.core.backends import BACKENDS, load_backend

    assert load_backend("mok") is mu.MokBackend
    assert BACKENDS["mok_hopper"] == "mok_kernels.mok_hopper.backend:MokHopperBackend"

