"""Identical inputs: seeding per rank and per global expert, routing models, weight scaling."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg

from harness.config.point import make_case
from harness.measure.inputs import make_inputs
from harness.config.routing import expert_popularity, load_stats, make_routing
from harness.config.point import resolve


def case_for(ep: int, *overrides: str, tokens: int = 256):
    c = resolve(compose_cfg("device=cpu", "shape=tiny", f"workload.tokens_per_gpu={tokens}", *overrides))
    return make_case(c, ep_size=ep, device="cpu")


def test_expert_weights_do_not_depend_on_ep_size():
    one = make_inputs(case_for(1), 0, torch.device("cpu"))
    for ep in (2, 4):
        case = case_for(ep)
        for rank in range(ep):
            part = make_inputs(case, rank, torch.device("cpu"))
            lo = rank * case.local_experts
            assert torch.equal(part.w13_LIH, one.w13_LIH[lo : lo + case.local_experts])
            assert torch.equal(part.w2_LHI, one.w2_LHI[lo : lo + case.local_experts])
            assert torch.equal(part.ws_gate_IH, one.ws_gate_IH)


def test_tokens_and_routing_are_seeded_per_rank():
    case = case_for(2)
    a0, a1 = make_inputs(case, 0, torch.device("cpu")), make_inputs(case, 1, torch.device("cpu"))
    again = make_inputs(case, 0, torch.device("cpu"))
    assert torch.equal(a0.x_TH, again.x_TH) and torch.equal(a0.topk_idx_TK, again.topk_idx_TK)
    assert not torch.equal(a0.x_TH, a1.x_TH)
    # published: randn logits seeded with seed + rank, top-k, softmax over the top-k values
    g = torch.Generator().manual_seed(case.seed + 1)
    logits = torch.randn(case.tokens_per_gpu, case.num_experts, generator=g)
    vals, idx = logits.topk(case.topk, dim=-1)
    assert torch.equal(a1.topk_idx_TK, idx) and torch.allclose(a1.topk_w_TK, torch.softmax(vals, -1))


def test_router_weights_and_dtypes():
    inp = make_inputs(case_for(2), 0, torch.device("cpu"))
    assert inp.x_TH.dtype == torch.bfloat16 and inp.topk_w_TK.dtype == torch.float32
    assert inp.topk_idx_TK.dtype == torch.int64
    assert torch.allclose(inp.topk_w_TK.sum(-1), torch.ones(inp.topk_w_TK.shape[0]))
    # each token picks distinct experts
    s = inp.topk_idx_TK.sort(-1).values
    assert (s[:, 1:] != s[:, :-1]).all()


def test_weight_scaling_follows_the_published_rule():
    case = case_for(1, "shape.hidden=1024", "shape.ffn=512")
    inp = make_inputs(case, 0, torch.device("cpu"))
    assert inp.w13_LIH.float().std().item() == pytest.approx(1024**-0.5, rel=0.05)
    assert inp.w2_LHI.float().std().item() == pytest.approx(512**-0.5, rel=0.05)
    # the upstream gradient too: randn * H^-0.5 (MoK tests/utils.py::generate_inputs)
    assert inp.grad_out_TH.float().std().item() == pytest.approx(1024**-0.5, rel=0.05)


@pytest.mark.parametrize("routing", ["zipf", "hot_experts"])
def test_imbalance_models_skew_the_expert_load(routing):
    uni = case_for(2, tokens=4096)
    skew = case_for(2, f"workload={routing}", tokens=4096)
    stat = lambda c: load_stats(torch.cat([make_routing(c, r)[0] for r in range(2)]), c)  # noqa: E731
    assert stat(skew)["expert_load_max_over_mean"] > stat(uni)["expert_load_max_over_mean"] * 1.3
    assert expert_popularity(uni) is None


def test_hot_rank_loads_that_rank():
    case = case_for(2, "workload=hot_rank", "workload.hot_rank=1", "workload.hot_ratio=4", tokens=4096)
    idx = torch.cat([make_routing(case, r)[0] for r in range(2)])
    per_rank = torch.bincount(idx.flatten() // case.local_experts, minlength=2)
    assert per_rank[1] > 1.5 * per_rank[0]
    assert load_stats(idx, case)["rank_load_max_over_mean"] > 1.2
