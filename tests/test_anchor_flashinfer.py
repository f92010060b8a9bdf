"""The FlashInfer anchor (baselines/flashinfer.py) on the CPU: its up/gate interleave and routing tensors, its calls
through a stand-in ``flashinfer`` module that computes what ``cute_dsl_fused_moe_bf16`` computes from the interleaved
layout (so a wrong interleave fails), its ``unsupported`` rows, and its options' hash rule."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import compose_cfg
from harness.config.point import make_case

ROOT = Path(__file__).resolve().parent.parent
FLT_MAX = torch.finfo(torch.float32).max


def _case(*overrides: str, ep_size: int = 1):
    cfg = compose_cfg("device=cpu", "shape=tiny", "workload.tokens_per_gpu=64", *overrides)
    return make_case(cfg, ep_size=ep_size, device="cpu")


# ---- the weight layout and the routing tensors ---------------------------------------------------------------------


def test_interleave_puts_32_up_rows_before_each_32_gate_rows():
    from baselines.flashinfer import interleave_up_gate

    L, I, H = 3, 96, 5
    w13 = torch.randn(L, 2 * I, H)
    got = interleave_up_gate(w13)
    assert got.shape == (L, 2 * I, H) and got.is_contiguous() and got.data_ptr() != w13.data_ptr()
    for e in range(L):
        for r in range(2 * I):
            block, j = divmod(r, 64)
            want = w13[e, I + 32 * block + j] if j < 32 else w13[e, 32 * block + j - 32]  # up first, then gate
            assert torch.equal(got[e, r], want), (e, r)
    with pytest.raises(ValueError, match="multiple of 32"):
        interleave_up_gate(torch.randn(2, 2 * 48, 4))


def _flashinfer_reference_interleave():
    """FlashInfer's own reference of its w1 layout, where FlashInfer and its CuTe DSL stack import here (None
    elsewhere)."""
    try:
        from flashinfer.fused_moe.cute_dsl.sm90_contiguous_gather_grouped_gemm_act_fusion import (
            interleave_up_gate_sm90)
    except Exception:  # noqa: BLE001 (not installed, or its CuTe DSL stack does not import)
        return None
    return interleave_up_gate_sm90


@pytest.mark.skipif(_flashinfer_reference_interleave() is None,
                    reason="flashinfer-python 0.7.2.post1 with nvidia-cutlass-dsl 4.8 does not import here (run with "
                           "its own folder on the path: docs/backends.md, 'Anchor: FlashInfer fused MoE')")
def test_interleave_matches_flashinfer_s_own_reference():
    from baselines.flashinfer import interleave_up_gate

    w13 = torch.randn(3, 2 * 96, 40, dtype=torch.bfloat16)
    assert torch.equal(interleave_up_gate(w13), _flashinfer_reference_interleave()(w13))


def test_routing_tensors_are_int32_ids_and_fp32_weights():
    from baselines.flashinfer import routing

    idx = torch.tensor([[3, 1], [0, 2]], dtype=torch.int64)
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4]], dtype=torch.float32, requires_grad=True)
    ids, scales = routing(idx.t().t(), w)
    assert ids.dtype == torch.int32 and ids.is_contiguous() and torch.equal(ids.long(), idx)
    assert scales.dtype == torch.float32 and not scales.requires_grad and torch.equal(scales, w.detach())


# ---- a stand-in flashinfer that computes what the kernel computes ---------------------------------------------------


def emulate_sm90_moe(x, ids, scales, w1, w2, swiglu_limit=FLT_MAX):
    """What cute_dsl_fused_moe_bf16 computes with use_fused_finalize=False, from its interleaved w1: per (token, k)
    the GEMM1 row split into 32-column up / gate blocks, SwiGLU (clamped at swiglu_limit), rounded to x's dtype, the
    down GEMM rounded to x's dtype, then the router weights and the top-k sum in fp32, cast to x's dtype."""
    T, K = ids.shape
    I = w2.shape[2]
    h = torch.einsum("th,tkih->tki", x.float(), w1[ids.long()].float())  # [T, K, 2I]
    blocks = h.view(T, K, I // 32, 2, 32)
    up, gate = blocks[:, :, :, 0].reshape(T, K, I), blocks[:, :, :, 1].reshape(T, K, I)
    act = (F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)).to(x.dtype)
    rows = torch.einsum("tki,tkhi->tkh", act.float(), w2[ids.long()].float()).to(x.dtype)  # expanded, unscaled
    return (rows.float() * scales.unsqueeze(-1)).sum(1).to(x.dtype)


def fake_flashinfer(calls: list) -> types.ModuleType:
    """``flashinfer`` with ``cute_dsl_fused_moe_bf16`` and ``autotune`` as flashinfer-python 0.7.2.post1 declares them;
    it asserts the documented contract instead of trusting the adapter and records each call."""
    mod = types.ModuleType("flashinfer")
    state = {"tuning": False}

    def cute_dsl_fused_moe_bf16(x, token_selected_experts, token_final_scales, w1_weight, w2_weight, num_experts,
                                top_k, num_local_experts=None, local_expert_offset=0, use_fused_finalize=True,
                                moe_output=None, enable_pdl=True, activation_type=3, swiglu_alpha=1.0,
                                swiglu_beta=0.0, swiglu_limit=FLT_MAX, situ_beta=None, situ_linear_beta=None, *,
                                intermediate_buffer=None, tactic=None):
        T, H = x.shape
        L, I2, H1 = w1_weight.shape
        assert H1 == H and tuple(w2_weight.shape) == (L, H, I2 // 2) and (I2 // 2) % 32 == 0
        assert w1_weight.is_contiguous() and w2_weight.is_contiguous() and x.is_contiguous()
        assert x.dtype == w1_weight.dtype == w2_weight.dtype
        assert token_selected_experts.dtype == torch.int32 and token_selected_experts.shape == (T, top_k)
        assert token_final_scales.dtype == torch.float32 and token_final_scales.shape == (T, top_k)
        assert token_selected_experts.is_contiguous() and token_final_scales.is_contiguous()
        assert num_experts == L and num_local_experts is None and local_expert_offset == 0
        assert not torch.is_grad_enabled()  # an inference forward
        calls.append({"fused": use_fused_finalize, "tuning": state["tuning"], "limit": swiglu_limit})
        return emulate_sm90_moe(x, token_selected_experts, token_final_scales, w1_weight, w2_weight, swiglu_limit)

    @contextlib.contextmanager
    def autotune(tune_mode=True, cache=None):
        state["tuning"] = tune_mode
        try:
            yield
        finally:
            state["tuning"] = False

    mod.cute_dsl_fused_moe_bf16, mod.autotune = cute_dsl_fused_moe_bf16, autotune
    return mod


def _loop_forward(case, inp):
    """fp32 forward through a per-(token, k) loop on the harness's gate-first w13, with the shared expert."""
    x, w13, w2 = inp.x_TH.float(), inp.w13_LIH.float(), inp.w2_LHI.float()
    limit = case.swiglu_limit if case.swiglu_limit is not None else FLT_MAX

    def swiglu(gate, up):  # the harness's clamp (shape.swiglu_limit), for the routed and the shared experts
        return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)

    I = case.ffn
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(case.topk):
            e = int(inp.topk_idx_TK[t, k])
            h = w13[e] @ x[t]
            out[t] += inp.topk_w_TK[t, k].float() * (w2[e] @ swiglu(h[:I], h[I:]))
    g, u, d = (t.float() for t in (inp.ws_gate_IH, inp.ws_up_IH, inp.ws_down_HI))
    return out + swiglu(x @ g.t(), x @ u.t()) @ d.t()


def _run_adapter(monkeypatch, case, options=None):
    from baselines import flashinfer
    from harness.measure.inputs import make_inputs

    calls: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(calls))
    inp = make_inputs(case, 0, torch.device("cpu"))  # bf16, as the harness gives them
    b = flashinfer.FlashInferBackend(case, None, options)
    b.setup(inp)
    setup_calls = list(calls)
    x = inp.x_TH.detach().clone().requires_grad_()
    w = inp.topk_w_TK.detach().clone().requires_grad_()
    out = b.forward(x, inp.topk_idx_TK, w)
    return b, inp, out, setup_calls, calls[len(setup_calls):]


@pytest.mark.parametrize("limit", [None, 0.5])
def test_adapter_through_the_stand_in_matches_a_torch_loop(monkeypatch, limit):
    case = dataclasses.replace(_case(), swiglu_limit=limit)
    b, inp, out, setup_calls, calls = _run_adapter(monkeypatch, case)
    assert out.dtype == torch.bfloat16 and out.grad_fn is None and out.shape == inp.x_TH.shape
    want = _loop_forward(case, inp)
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)  # bf16 intermediate, output
    # setup: one forward under autotune(True), one plain; the combine in fp32 (use_fused_finalize=False)
    assert [c["tuning"] for c in setup_calls] == [True, False]
    assert all(c["fused"] is False for c in setup_calls + calls) and not calls[0]["tuning"]
    assert calls[0]["limit"] == (FLT_MAX if limit is None else limit)
    info = b.info()
    assert info["forward_kind"] == "inference" and "use_fused_finalize=False" in info["notes"]
    assert b.weight_grads() == {} and b.traffic() == {}


def test_a_wrong_interleave_fails_against_the_loop(monkeypatch):
    """The check above can fail: gate-first weights handed to the kernel unconverted (or up and gate swapped)."""
    from baselines import flashinfer

    case = _case()
    right = flashinfer.interleave_up_gate
    for wrong in (lambda w: w.contiguous(), lambda w: right(w.roll(w.shape[1] // 2, dims=1))):
        monkeypatch.setattr(flashinfer, "interleave_up_gate", wrong)
        _, inp, out, _, _ = _run_adapter(monkeypatch, case)
        assert not torch.allclose(out.float(), _loop_forward(case, inp), atol=3e-2, rtol=3e-2)


def test_options_pick_the_combine_and_the_tuning(monkeypatch):
    from baselines.options import FlashInferOptions

    b, _, _, setup_calls, calls = _run_adapter(monkeypatch, _case(), FlashInferOptions(finalize="fused",
                                                                                        autotune="off"))
    assert [c["tuning"] for c in setup_calls] == [False, False]
    assert all(c["fused"] is True for c in setup_calls + calls)
    notes = b.info()["notes"]
    assert "use_fused_finalize=True" in notes and "default tactic" in notes


# ---- where it cannot run --------------------------------------------------------------------------------------------


def test_unsupported_reasons(monkeypatch):
    from baselines import flashinfer
    from contract import direction_unsupported

    B = flashinfer.FlashInferBackend
    cpu = _case()
    gpu = dataclasses.replace(cpu, device="cuda")
    for d in ("bwd", "fwd_bwd"):
        assert "inference forward" in direction_unsupported(B, cpu, d)
    assert direction_unsupported(B, cpu, "fwd") is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    why = B.unsupported_reason(gpu)
    assert "not installed" in why and "pip install --no-deps --target DIR flashinfer-python==0.7.2.post1" in why
    assert "-libs-core" in why and "one call" in why
    assert "own_pythonpath.flashinfer=DIR" in why and flashinfer.SITE_ENV in why
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert "bf16 only" in B.unsupported_reason(dataclasses.replace(gpu, precision="fp8"))
    assert "ep_size=1" in B.unsupported_reason(dataclasses.replace(gpu, ep_size=2))
    assert "multiple of 32" in B.unsupported_reason(dataclasses.replace(gpu, ffn=48))
    assert "Hopper GPU (SM90); this is the CPU" in B.unsupported_reason(cpu)
    monkeypatch.setattr(flashinfer, "device_capability", lambda dev: (10, 0))
    assert "this is SM100" in B.unsupported_reason(gpu)
    monkeypatch.setattr(flashinfer, "device_capability", lambda dev: (9, 0))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # installed but does not import
    assert "flashinfer does not import" in B.unsupported_reason(gpu)
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))  # no CuTe DSL: no MoE entry
    why = B.unsupported_reason(gpu)
    assert "has no cute_dsl_fused_moe_bf16 (ModuleNotFoundError: " in why and "pip install --no-deps --target" in why
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer([]))
    assert B.unsupported_reason(gpu) is None


@pytest.mark.slow
def test_its_rows_on_this_machine_are_unsupported_with_reason_and_fix(results_dir):
    """A CPU point with nccl and flashinfer: nccl runs; flashinfer's forward row says what is missing here and how to
    get it, its backward row that it has none."""
    from conftest import cpu_cfg
    from harness.measure.runner import run_benchmark

    df = run_benchmark(cpu_cfg(results_dir, "ep_size=1", "backends=[nccl,flashinfer]", "directions=[fwd,bwd]"))
    st = {(r.backend, r.direction): (r.status, str(r.error)) for r in df.itertuples()}
    assert st[("nccl", "fwd")][0] == "ok"
    fwd, bwd = st[("flashinfer", "fwd")], st[("flashinfer", "bwd")]
    assert fwd[0] == bwd[0] == "unsupported"
    if importlib.util.find_spec("flashinfer") is None:
        assert "flashinfer-python is not installed" in fwd[1] and "own_pythonpath.flashinfer=DIR" in fwd[1]
    else:
        assert "Hopper GPU (SM90); this is the CPU" in fwd[1]
    assert bwd[1] == fwd[1] or "inference forward" in bwd[1]


def test_only_its_forward_rows_carry_the_forward_kind():
    from harness.core.results import make_row

    info = {"forward_kind": "inference", "notes": "n"}
    assert make_row({}, "flashinfer", "fwd", "ok", **info)["forward_kind"] == "inference"
    for d in ("bwd", "fwd_bwd"):
        row = make_row({}, "flashinfer", d, "unsupported", error="e", **info)
        assert "forward_kind" not in row and row["notes"] == "n"


# ---- its options and the hashes of committed points ---------------------------------------------------------------


def test_its_options_at_their_defaults_change_no_committed_hash():
    """Every committed point that stores its configuration keeps its hash with FlashInfer's options written out at
    their defaults, or left out (points stored before the options existed lack them); a non-default value makes
    another point."""
    from harness.core import results
    from harness.config.schema import config_hash

    runs = results.load(ROOT / "results" / "runs")
    stored = runs[runs.point_config.notna()].drop_duplicates("config_hash")
    assert len(stored) > 5
    for _, r in stored.iterrows():
        c = json.loads(r.point_config)
        assert c.pop("flashinfer", None) in (None, {"finalize": "fixed_order", "autotune": "on"}), r.run_id
        case = make_case(c, ep_size=int(r.ep_size), device=r.device)
        with_defaults = {**c, "flashinfer": {"finalize": "fixed_order", "autotune": "on"}}
        assert config_hash(with_defaults, case) == r.config_hash == config_hash(c, case), r.run_id
        for opt in ({"finalize": "fused"}, {"autotune": "off"}):
            assert config_hash({**c, "flashinfer": opt}, case) != r.config_hash
