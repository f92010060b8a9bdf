"""The trainable mok_hopper layer (mok_kernels/mok_hopper/module.py): ``MoKHopperMoE`` and its ``mokbench::`` custom
ops, under the Triton interpreter on the CPU (the training loop also on CUDA, marked ``gpu``): gradients against torch
autograd on a plain fp32 reference, accumulation over calls (``.grad``, fp32 ``main_grad``), varying token counts,
the state dict's plain layout in both parameter layouts, the weights adopted in place, the fake implementations
(opcheck, torch.compile), and a few SGD steps against a torch reference layer.

Legend: T tokens, K top-k, E experts, H hidden, I ffn.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton

from conftest import HAS_GPU  # noqa: E402

from mok_kernels.mok_hopper.twin import backward as twin_bwd  # noqa: E402

triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with torch on Linux; pip install "
                                              "-e '.[test]'): the interpreter kernel tests need it")

T, K, E, H, I = 24, 3, 8, 128, 64


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().sum() / b.abs().sum().clamp(min=1e-12))


def inputs(seed: int, tokens: int = T, masked: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    dO = (torch.randn(tokens, H, generator=g) * H ** -0.5).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    if masked:
        idx[::3, -1] = -1
    w = torch.softmax(torch.randn(tokens, K, generator=g), -1)
    return x, idx, w, dO


def weights(seed: int = 9):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    shared = ((torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
              (torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
              (torch.randn(H, I, generator=g) * I ** -0.5).bfloat16())
    return w13, w2, shared


def module(layout="plain", limit=None, **kw):
    from mok_kernels.mok_hopper.module import MoKHopperMoE

    w13, w2, shared = weights()
    return MoKHopperMoE.from_weights(w13, w2, shared, topk=K, max_tokens=T, swiglu_limit=limit, layout=layout, **kw)


def step(m, seed, tokens=T, masked=False):
    """One forward + backward with fresh inputs; returns (leaves x, w), the inputs, and the reference gradients."""
    x, idx, w, dO = inputs(seed, tokens, masked)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    m(xl, idx, wl).backward(dO)
    w13, w2, shared = weights()
    ref = twin_bwd.autograd_reference([x], [idx], [w], [dO], [w13], [w2], shared=shared,
                                      limit=m.layer.limit)[0]
    return xl, wl, idx, ref


# ---- layouts and weight adoption ----

def test_untile_inverts_tile_weights_and_tile_weights_gu():
    from mok_kernels.mok_hopper.ops.gemm_common import tile_weights, tile_weights_gu, untile_weights, untile_weights_gu

    w = torch.randn(3, 2 * 16, 24)
    for bn, bk in ((4, 3), (8, 24), (16, 8)):
        assert torch.equal(untile_weights(tile_weights(w, bn, bk)), w)
        assert torch.equal(untile_weights_gu(tile_weights_gu(w, bn, bk)), w)
    assert not torch.equal(untile_weights(tile_weights_gu(w, 4, 3)), w)  # the two layouts differ


def test_the_layer_adopts_weights_in_place_and_refuses_what_it_cannot_adopt():
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.tiles import default_tile

    w13, w2, (g, u, d) = weights()
    cpu = torch.device("cpu")
    plain = default_tile(device=cpu, hidden=H, ffn=I)
    tiled = replace(plain, tma=True, w_tiled=True, up_fused=True)
    sh13 = torch.cat([g, u])
    kw = dict(topk=K, tokens=T, rank=0, world=1, adopt_weights=True)
    layer = MoKHopperLayer(w13, w2, shared=(sh13[:I], sh13[I:], d), tile=plain, **kw)
    assert layer.w13.data_ptr() == w13.data_ptr() and layer.w2.data_ptr() == w2.data_ptr()
    assert layer.sh_w13.data_ptr() == sh13.data_ptr() and layer.sh_w2.data_ptr() == d.data_ptr()
    from mok_kernels.mok_hopper.ops.gemm_common import tile_weights, tile_weights_gu

    t13, t2 = tile_weights_gu(w13, tiled.up_n, tiled.up_k), tile_weights(w2, tiled.down_n, tiled.down_k)
    layer = MoKHopperLayer(t13, t2, tile=tiled, **kw)
    assert layer.w13.data_ptr() == t13.data_ptr() and (layer.L, layer.I, layer.H) == (E, I, H)
    bad = [(dict(w13=w13, w2=w2, tile=None), "pass the tile"),
           (dict(w13=w13, w2=w2, tile=tiled), "wants 5-D weights"),
           (dict(w13=tile_weights(w13, tiled.up_n, tiled.up_k), w2=t2, tile=tiled), "not the layout of the tile"),
           (dict(w13=w13.float(), w2=w2, tile=plain), "contiguous bf16"),
           (dict(w13=w13.transpose(1, 2), w2=w2, tile=plain), "contiguous bf16"),
           (dict(w13=w13, w2=w2, tile=plain, shared=(g, u, d)), "two halves of one contiguous"),
           (dict(w13=w13, w2=w2, tile=plain, precision="fp8"), "bf16 weights only")]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg) as e:
            MoKHopperLayer(args.pop("w13"), args.pop("w2"), **args, **kw)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout", ["plain", "tiled"])
def test_the_module_owns_its_weights_and_its_state_dict_is_plain(layout):
    from mok_kernels.mok_hopper.module import MoKHopperMoE

    m = module(layout)
    w13, w2, shared = weights()
    assert m.layer.w13.data_ptr() == m.w13.data_ptr() and m.layer.w2.data_ptr() == m.w2.data_ptr()
    assert (m.layer.sh_w13.data_ptr() == m.shared_gate.data_ptr()
            and m.layer.sh_w2.data_ptr() == m.shared_down.data_ptr())
    assert m.w13.dim() == (5 if layout == "tiled" else 3) and m.layer.cfg.w_tiled == (layout == "tiled")
    sd = m.state_dict()
    assert set(sd) == {"w13", "w2", "shared_gate", "shared_up", "shared_down"}
    for name, want in (("w13", w13), ("w2", w2), ("shared_gate", shared[0]), ("shared_up", shared[1]),
                       ("shared_down", shared[2])):
        assert torch.equal(sd[name], want), name
    x, idx, w, _ = inputs(3, masked=True)
    out = m(x, idx, w)
    for other in ("plain", "tiled"):  # into a fresh module of either layout: the same forward
        m2 = MoKHopperMoE(E, H, I, topk=K, max_tokens=T, layout=other)
        m2.load_state_dict(sd)
        assert torch.equal(m2(x, idx, w), out), other
        assert m2.layer.w13.data_ptr() == m2.w13.data_ptr()  # loaded in place
    bad = dict(sd, w2=sd["w2"][:, :, :32])
    with pytest.raises(RuntimeError, match=r"w2: the state dict holds \(8, 128, 32\), MoKHopperMoE wants"):
        m2.load_state_dict(bad)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["tiled", "tiled-gate-up-interleaved"])
def test_the_tiled_layout_trains_like_the_plain_one(fused):
    """Parameters in the kernels' TMA block order (tile_weights, or tile_weights_gu with the fused gate/up MMA):
    the backward reads them in place and returns the weight gradients in the same layout; untiled, every gradient
    matches autograd, and equals the plain-layout module's up to the order of the fp32 sums."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.ops.gemm_common import untile_weights, untile_weights_gu
    from mok_kernels.mok_hopper.module import MoKHopperMoE
    from mok_kernels.mok_hopper.tiles import default_tile

    tile = replace(default_tile(device=torch.device("cpu"), hidden=H, ffn=I), tma=True, w_tiled=True,
                   up_fused=fused)
    w13, w2, shared = weights()
    m = MoKHopperMoE.from_weights(w13, w2, shared, topk=K, max_tokens=T, layout="tiled", tile=tile)
    assert m.w13.dim() == 5 and m.layer.cfg.up_fused == fused
    xl, wl, idx, ref = step(m, 4, masked=True)
    g13 = (untile_weights_gu if fused else untile_weights)(m.w13.grad)
    g2 = untile_weights(m.w2.grad)
    assert m.w13.grad.shape == m.w13.shape and m.w2.grad.shape == m.w2.shape
    for name, got in (("x", xl.grad), ("topk_w", wl.grad), ("w13", g13), ("w2", g2)):
        assert rel_l1(got, ref[name]) < 1e-2, (name, rel_l1(got, ref[name]))
    plain = module("plain")
    pl, pw, _, _ = step(plain, 4, masked=True)
    assert rel_l1(g13, plain.w13.grad) < 1e-3 and rel_l1(g2, plain.w2.grad) < 1e-3
    assert rel_l1(xl.grad, pl.grad) < 1e-3


# ---- gradients ----

@pytest.mark.slow
@pytest.mark.parametrize("limit", [None, 0.5], ids=["plain", "clamped"])
def test_gradients_match_autograd_and_accumulate_over_calls(limit):
    m = module(limit=limit)
    xl, wl, idx, ref1 = step(m, 1, masked=True)
    for name, got in (("x", xl.grad), ("topk_w", wl.grad), ("w13", m.w13.grad), ("w2", m.w2.grad)):
        assert rel_l1(got, ref1[name]) < 1e-2, (name, rel_l1(got, ref1[name]))
    assert not wl.grad[idx < 0].any()  # masked slots: no gradient
    for p, r in zip((m.shared_gate, m.shared_up, m.shared_down), ref1["shared"]):
        assert rel_l1(p.grad, r) < 1e-2
    first = [p.grad.clone() for p in m.expert_parameters()]
    _, _, _, ref2 = step(m, 2)  # a second backward adds into .grad
    refs = [ref1["w13"] + ref2["w13"], ref1["w2"] + ref2["w2"],
            *[a + b for a, b in zip(ref1["shared"], ref2["shared"])]]
    for p, f, r in zip(m.expert_parameters(), first, refs):
        assert rel_l1(p.grad, r) < 1e-2 and not torch.equal(p.grad, f)


@pytest.mark.slow
def test_main_grad_accumulates_in_fp32_and_leaves_grad_empty():
    plain, mg = module(), module(main_grad=True)
    for seed in (1, 2):
        step(plain, seed)
        if seed == 1:
            once = [p.grad.clone() for p in plain.expert_parameters()]
            for p in plain.expert_parameters():
                p.grad = None
        step(mg, seed)
    for p, a, b in zip(mg.expert_parameters(), once, [p.grad for p in plain.expert_parameters()]):
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert torch.equal(p.main_grad, a.float() + b.float())  # fp32 sum of the per-call gradients, in order


def test_fewer_tokens_than_max_tokens_pad_without_leaking():
    m = module()
    xl, wl, idx, ref = step(m, 5, tokens=17, masked=True)
    assert xl.grad.shape == (17, H) and wl.grad.shape == (17, K)
    for name, got in (("x", xl.grad), ("topk_w", wl.grad), ("w13", m.w13.grad), ("w2", m.w2.grad)):
        assert rel_l1(got, ref[name]) < 1e-2, (name, rel_l1(got, ref[name]))
    for p, r in zip((m.shared_gate, m.shared_up, m.shared_down), ref["shared"]):
        assert rel_l1(p.grad, r) < 1e-2
    x, idx, w, _ = inputs(6, tokens=T)
    full = m(x, idx, w)
    assert torch.equal(m(x[:10], idx[:10], w[:10]), full[:10])  # a token's output does not depend on the padding
    with pytest.raises(ValueError, match="more than max_tokens=24"):
        m(torch.zeros(T + 1, H, dtype=torch.bfloat16), torch.zeros(T + 1, K, dtype=torch.long), torch.zeros(T + 1, K))


def test_a_second_forward_before_the_backward_is_refused():
    m = module()
    x, idx, w, dO = inputs(1)
    out = m(x.requires_grad_(), idx, w)
    m(x, idx, w)
    with pytest.raises(RuntimeError, match="another forward of this module ran before this backward"):
        out.backward(dO)


def test_moving_the_module_is_refused():
    m = module()
    with pytest.raises(RuntimeError, match="reallocated its parameters"):
        m.float()


# ---- the custom op's fake implementations ----

def test_opcheck_passes_on_the_custom_op():
    m = module()
    x, idx, w, _ = inputs(1, tokens=20)
    args = (m.handle, x.requires_grad_(), idx, w.requires_grad_(), m.w13, m.w2,
            [m.shared_gate, m.shared_up, m.shared_down])
    torch.library.opcheck(torch.ops.mokbench.mok_hopper_moe.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.slow
def test_torch_compile_traces_a_model_using_the_module():
    """aot_eager, fullgraph: the module's op and its backward op traced (fake implementations); the compiled
    model's output and gradients are the eager model's."""
    outs = []
    for compiled in (False, True):
        m = module()
        proj = torch.nn.Linear(H, H, dtype=torch.bfloat16)
        with torch.no_grad():
            proj.weight.copy_(torch.eye(H) * 0.5)
            proj.bias.zero_()

        def model(x, idx, w):
            return m(proj(x), idx, w).float().square().mean()

        fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        x, idx, w, _ = inputs(4)
        x.requires_grad_()
        loss = fn(x, idx, w)
        loss.backward()
        outs.append((loss.detach(), x.grad, m.w13.grad, proj.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ---- a toy regression trained with SGD, on the CPU (interpreter) and on CUDA ----

def _reference_forward(x, idx, w, w13, w2, shared, limit=None):
    """fp32 torch: a plain per-expert loop, then the shared expert."""
    In = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        t, k = (idx == e).nonzero(as_tuple=True)
        h = x[t] @ w13[e].t()
        out = out.index_add(0, t, w[t, k, None] * ((F.silu(h[:, :In]) * h[:, In:]) @ w2[e].t()))
    g, u, d = shared
    return out + (F.silu(x @ g.t()) * (x @ u.t())) @ d.t()


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU here")])])
def test_a_toy_regression_trains_like_the_torch_reference(device):
    """Five SGD steps on a fixed regression (router included: the top-k weights come from a trained router, so the
    router-weight gradient is trained too): the loss falls and follows the fp32 torch reference layer's."""
    from mok_kernels.mok_hopper.module import MoKHopperMoE

    dev = torch.device(device)
    Tn, Kn, En, Hn, In, steps, lr = 64, 2, 4, 256, 128, 5, 0.05
    g = torch.Generator().manual_seed(0)
    x = torch.randn(Tn, Hn, generator=g).bfloat16().to(dev)
    target = (torch.randn(Tn, Hn, generator=g) * 0.5).to(dev)
    router0 = torch.randn(En, Hn, generator=g) * Hn ** -0.5
    idx = (x.float() @ router0.to(dev).t()).topk(Kn, dim=-1).indices  # fixed routing; its weights are trained
    torch.manual_seed(0)  # reset_parameters
    m = MoKHopperMoE(En, Hn, In, topk=Kn, max_tokens=Tn, device=dev)
    ref = [p.detach().float().clone().requires_grad_() for p in m.expert_parameters()]
    router = router0.to(dev).clone().requires_grad_()
    router_ref = router0.to(dev).clone().requires_grad_()
    opt = torch.optim.SGD([*m.parameters(), router], lr=lr)
    opt_ref = torch.optim.SGD([*ref, router_ref], lr=lr)
    losses, ref_losses = [], []
    for _ in range(steps):
        for o in (opt, opt_ref):
            o.zero_grad()
        w = torch.softmax((x.float() @ router.t()).gather(1, idx), -1)
        loss = (m(x, idx, w).float() - target).square().sum(-1).mean()
        loss.backward()
        opt.step()
        w_ref = torch.softmax((x.float() @ router_ref.t()).gather(1, idx), -1)
        w13, w2, *sh = ref
        loss_ref = (_reference_forward(x.float(), idx, w_ref, w13, w2, sh) - target).square().sum(-1).mean()
        loss_ref.backward()
        opt_ref.step()
        losses.append(float(loss.detach()))
        ref_losses.append(float(loss_ref.detach()))
    assert m.layer.w13.data_ptr() == m.w13.data_ptr()  # the optimizer updated the layer's weights in place
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) < 0.01 * b, (losses, ref_losses)
