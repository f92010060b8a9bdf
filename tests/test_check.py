"""The correctness check's memory: the comparison with the reference in slices (no full-size temporary, the same
verdicts wherever an error sits) and the reference's own gradients without a second weight-sized buffer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from harness.measure.correctness import compare, errors, leaves, run_once, slices
from harness.measure.runner import _gate
from tests.conftest import compose_cfg


class NewStorages(TorchDispatchMode):
    """Every tensor an op returns in storage of its own (views and in-place results excluded): the bytes of each,
    so a test can bound the largest temporary."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("shape", [(8, 6, 5), (3, 40), (50,), (2, 3, 7, 9), ()])
@pytest.mark.parametrize("chunk", [1, 7, 30, 10_000])
def test_slices_cover_every_element_once_within_the_chunk(shape, chunk):
    t = torch.zeros(shape)
    for idx in slices(t, chunk):
        piece = t[idx]
        assert piece.numel() <= max(chunk, 1) or piece.numel() == 1
        piece += 1
    assert bool((t == 1).all())


def _pair(seed=0):
    """A weight-gradient-like pair: got is a strided half of a [L, 2I, H] tensor (as the harness's w_gate is), ref a
    contiguous host tensor."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(6, 2 * 10, 12, generator=g).bfloat16()
    got = whole[:, :10]
    return whole, got, got.clone()


def test_the_comparison_makes_no_full_size_temporary():
    whole, got, ref = _pair()
    chunk = 2 * 10 * 12  # two experts' rows
    with NewStorages() as m:
        errors(got, ref, chunk)
    assert max(m.sizes) <= 4 * chunk < got.numel() * 2  # one fp32 slice at most, below the tensor's own bytes
    # transposed (no row run of any length is contiguous) and a single row longer than a chunk
    ref_t, row = ref.transpose(1, 2).contiguous(), whole[0].flatten().clone()
    with NewStorages() as m:
        errors(got.transpose(1, 2), ref_t, 7)
        errors(whole[0].flatten(), row, 7)
    assert max(m.sizes) <= 4 * 7
    with NewStorages() as m:  # the probe itself: one slice of everything is a full-size fp32 copy
        errors(got, ref, got.numel())
    assert max(m.sizes) >= 4 * got.numel()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_planted_errors_give_the_same_verdict_in_any_chunk(where):
    _, got, ref = _pair()
    flat = [0, got.numel() // 2, got.numel() - 1][["first", "middle", "last"].index(where)]
    bad = got.clone()
    bad.view(-1)[flat] += 4.0
    for chunk in (1, 7, 240, 1 << 26):  # every slicing, the single slice included
        a, rel = errors(bad, ref, chunk)
        assert a == pytest.approx(float((bad.float() - ref.float()).abs().max()))
        whole = float((bad.double() - ref.double()).abs().sum() / ref.double().abs().sum())
        assert rel == pytest.approx(whole, rel=1e-9)
        assert errors(got, ref, chunk) == (0.0, 0.0)


@pytest.mark.parametrize("where", ["first", "last"])
def test_compare_verdicts_on_planted_errors(one_rank, where):
    """ok on equal tensors; a mismatch on one wrong element of the last tensor's last slice as on its first; NaN
    never passes; a missing tensor is said."""
    _, got, ref = _pair()
    case = SimpleNamespace(atol=1.0, rtol=0.5)
    refs = {"out": ref[0].clone(), "d_w_gate": ref}
    assert _gate(compare({"out": ref[0].clone(), "d_w_gate": got}, refs, one_rank), case)[0] == "ok"
    for planted in (4.0, float("nan")):
        bad = got.clone()
        bad.view(-1)[0 if where == "first" else -1] = planted
        status, err, cols = _gate(compare({"out": ref[0].clone(), "d_w_gate": bad}, refs, one_rank), case)
        assert status == "mismatch" and "d_w_gate" in err and cols["worst_tensor"] == "d_w_gate"
    status, err, _ = _gate(compare({"out": ref[0].clone()}, refs, one_rank), case)
    assert status == "mismatch" and "tensors missing: d_w_gate" in err


def _case():
    from harness.config.point import make_case

    cfg = compose_cfg("device=cpu", "shape=tiny", "workload.tokens_per_gpu=64")
    return make_case(cfg, ep_size=1, device="cpu")


def _single_leaf_reference(case, inp, group):
    """The reference's math with one [L, ...] autograd leaf per weight (the way whose backward builds a zero-filled
    weight-sized gradient per expert): the values the reference must reproduce bit for bit."""
    from harness.measure.reference import _AllGather, _SumScatter

    I = case.ffn
    x = inp.x_TH.detach().requires_grad_()
    w = inp.topk_w_TK.detach().requires_grad_()
    w13, w2 = inp.w13_LIH.detach().requires_grad_(), inp.w2_LHI.detach().requires_grad_()
    x_all, idx_all, w_all = (_AllGather.apply(t, group) for t in (x, inp.topk_idx_TK, w))
    acc = x_all.new_zeros(x_all.shape, dtype=torch.float32)
    for j in range(case.local_experts):
        tok, kk = torch.nonzero(idx_all == j, as_tuple=True)
        xe = x_all[tok]
        h = F.silu(xe @ w13[j, :I].t()) * (xe @ w13[j, I:].t())
        acc = acc.index_add(0, tok, w_all[tok, kk].unsqueeze(-1) * (h @ w2[j].t()).float())
    sg, su, sd = (t.detach().requires_grad_() for t in (inp.ws_gate_IH, inp.ws_up_IH, inp.ws_down_HI))
    out = (_SumScatter.apply(acc, group) + ((F.silu(x @ sg.t()) * (x @ su.t())) @ sd.t()).float()).bfloat16()
    out.backward(inp.grad_out_TH)
    return {"out": out.detach(), "d_x": x.grad, "d_topk_w": w.grad, "d_w_gate": w13.grad[:, :I],
            "d_w_up": w13.grad[:, I:], "d_w_down": w2.grad, "d_ws_gate": sg.grad, "d_ws_up": su.grad,
            "d_ws_down": sd.grad}


def test_the_reference_builds_no_second_weight_sized_gradient(one_rank):
    """The reference's gradients: bitwise those of one [L, ...] leaf per weight, with one weight-sized allocation
    per routed weight (its gradient) instead of one per expert."""
    from harness.measure.inputs import make_inputs
    from harness.measure.reference import ReferenceBackend

    case = _case()
    inp = make_inputs(case, 0, torch.device("cpu"))
    b = ReferenceBackend(case, one_rank)
    b.setup(inp)
    with NewStorages() as m:
        got = run_once(b, inp, True)
    expect = _single_leaf_reference(case, inp, one_rank)
    # the experts' gradients go into the total as autograd makes them: none is left beside it after a backward
    b.zero_grad()
    x, w = leaves(inp, True)
    b.forward(x, inp.topk_idx_TK, w).backward(inp.grad_out_TH)
    assert all(p.grad is None for p in [*b.w13, *b.w2])
    assert b.leaves.w13.grad is not None and b.leaves.w2.grad is not None
    for k, v in expect.items():
        assert torch.equal(got[k], v), k
    w2_bytes = inp.w2_LHI.numel() * inp.w2_LHI.element_size()
    assert sorted(s for s in m.sizes if s >= w2_bytes) == [w2_bytes, 2 * w2_bytes]  # dW2, dW13; nothing else
    b.zero_grad()
    assert all(v is None for k, v in b.weight_grads().items() if k in ("w_gate", "w_up", "w_down"))
