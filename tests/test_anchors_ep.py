"""The fused expert-parallel anchors on the CPU, through stand-ins of their packages: LigerCute (``liger_cute``: a
stand-in ``liger_kernel.ops.cute.ops.moe_fused`` with LigerCute's documented layouts and its one-pending-forward
stack) and DeepGEMM's SM90 MegaMoE (``deepgemm_megamoe``: a stand-in ``fp8_mega_moe`` with its buffer and gate/up
interleave). Each checks the contract it documents instead of trusting the adapter, and does the math in torch; the
adapters' outputs and gradients are compared with a plain per-expert loop. Also: their ``unsupported`` reasons (the
harness runs with them on the CPU are in test_anchors.py)."""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from conftest import compose_cfg
from contract.fp8 import dequantize_blocks, quantize_blocks
from harness.config.point import make_case
from harness.measure.inputs import make_inputs


def _case(*overrides: str, ep_size: int = 1):
    cfg = compose_cfg("device=cpu", "shape=tiny", "workload.tokens_per_gpu=64", *overrides)
    return make_case(cfg, ep_size=ep_size, device="cpu")


def _fp32_inputs(case):
    inp = make_inputs(case, 0, torch.device("cpu"))
    floats = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)}
    return dataclasses.replace(inp, **{k: t.float() for k, t in floats.items()
                                       if t is not None and t.is_floating_point()})


def _moe(x, idx, w, gate_of, up_of, down_of, E, limit=None):
    """sum_k w[t, k] * down_e(swiglu(gate_e x, up_e x)), a plain loop over experts."""
    out = torch.zeros(x.shape[0], down_of(0).shape[0], dtype=torch.float32)
    for e in range(E):
        t, k = (idx == e).nonzero(as_tuple=True)
        g, u = x[t] @ gate_of(e).t(), x[t] @ up_of(e).t()
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        out = out.index_add(0, t, (F.silu(g) * u @ down_of(e).t()) * w[t, k].unsqueeze(-1))
    return out


# ---- LigerCute ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:  # liger_kernel.ops.configure.MoEConfig's fields
    max_tokens: int
    hidden_size: int
    num_experts: int
    top_k: int
    num_hosts: int
    gpus_per_host: int
    group: Optional[str] = None
    max_inflight: int = 1


def _lck(monkeypatch) -> dict:
    """Stand-ins of liger_kernel.ops.configure, liger_kernel.ops.cute.ops and liger_cute_kernels (tvm_ffi, nvshmem):
    configure reserves ``max_inflight`` pending forwards; a training forward holds one until its backward (or
    ``moe_pop_fwd``), and a forward past the reservation raises, as LigerCute's does."""
    st = {"depth": 0, "cap": None, "moe": None, "pops": 0, "finalized": 0}

    def configure(*, process_groups=None, bootstrap_group=None, device=None, flsce=None, moe=None):
        st["cap"], st["moe"] = moe.max_inflight, moe
        return True

    class PopOnBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.view_as(y)

        @staticmethod
        def backward(ctx, g):
            st["depth"] -= 1
            return g

    def moe_fused(X, expert_indices, expert_weights, all_B, all_C, all_A, num_experts, top_k, pg=None):
        L, I, H = all_B.shape
        assert tuple(all_C.shape) == (L, I, H) and tuple(all_A.shape) == (L, H, I) and X.shape[1] == H
        assert expert_indices.dtype == torch.int32 and expert_weights.dtype == torch.bfloat16
        assert tuple(expert_weights.shape) == tuple(expert_indices.shape) == (X.shape[0], top_k)
        assert num_experts == L and st["cap"] is not None, "configure(moe=...) first; EP=1 here"
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (X, expert_weights, all_B, all_C, all_A))
        if grad and not (all_B.is_contiguous() and all_C.is_contiguous()):
            raise ValueError("Strided MoE gate/up weights are supported only when gradients are disabled")
        if st["depth"] >= st["cap"]:
            raise RuntimeError("MoE forward exceeds max_inflight retained forwards")
        y = _moe(X.float(), expert_indices.long(), expert_weights.float(), lambda e: all_B[e].float(),
                 lambda e: all_C[e].float(), lambda e: all_A[e].float(), num_experts).to(X.dtype)
        if not grad:
            return y
        st["depth"] += 1
        return PopOnBackward.apply(y)

    def pop(team):
        assert team == "WORLD"
        st["depth"] -= 1
        st["pops"] += 1

    def finalize():
        st["finalized"] += 1

    mods = {"liger_kernel": {}, "liger_kernel.ops": {}, "liger_kernel.ops.cute": {},
            "liger_kernel.ops.configure": {"MoEConfig": MoEConfig, "configure": configure},
            "liger_kernel.ops.cute.ops": {"moe_fused": moe_fused}, "liger_cute_kernels": {},
            "liger_cute_kernels.tvm_ffi": {"uniqueid_nbytes": lambda: 128, "moe_pop_fwd": pop},
            "liger_cute_kernels.nvshmem": {"resolve_team": lambda pg, create=False: "WORLD", "finalize": finalize}}
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, mod)
    return st


def _liger_cute(monkeypatch):
    from baselines.liger_cute import LigerCuteBackend

    st = _lck(monkeypatch)
    case = _case()
    inp = _fp32_inputs(case)
    b = LigerCuteBackend(case, None)
    b.setup(inp)
    return b, case, inp, st


def _liger_reference(case, inp):
    """Output and the 8 gradients by fp32 autograd through the loop; router weights rounded to bf16 (LigerCute's
    format)."""
    x, w = (t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.topk_w_TK))
    w13, w2 = (t.detach().clone().requires_grad_() for t in (inp.w13_LIH, inp.w2_LHI))
    sh = [t.detach().clone().requires_grad_() for t in (inp.ws_gate_IH, inp.ws_up_IH, inp.ws_down_HI)]
    I = case.ffn
    out = _moe(x, inp.topk_idx_TK, w.to(torch.bfloat16).float(), lambda e: w13[e, :I], lambda e: w13[e, I:],
               lambda e: w2[e], case.num_experts) + F.silu(x @ sh[0].t()) * (x @ sh[1].t()) @ sh[2].t()
    out.backward(inp.grad_out_TH)
    return out.detach(), {"x": x.grad, "topk_w": w.grad, "w_gate": w13.grad[:, :I], "w_up": w13.grad[:, I:],
                          "w_down": w2.grad, "ws_gate": sh[0].grad, "ws_up": sh[1].grad, "ws_down": sh[2].grad}


def _liger_errors(b, case, inp) -> dict[str, float]:
    """Relative L1 error of the output and every gradient against ``_liger_reference``."""
    ref_out, ref = _liger_reference(case, inp)
    x, w = (t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.topk_w_TK))
    out = b.forward(x, inp.topk_idx_TK, w)
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    out.float().backward(inp.grad_out_TH)
    got = {"x": x.grad, "topk_w": w.grad, **b.weight_grads()}
    assert set(got) == set(ref) and all(got[k].shape == ref[k].shape for k in ref)
    errs = {k: float((got[k].float() - ref[k]).abs().sum() / ref[k].abs().sum()) for k in ref}
    errs["out"] = float((out.detach().float() - ref_out).abs().sum() / ref_out.abs().sum())
    return errs


def test_liger_cute_layouts_and_routing_match_a_per_expert_loop(monkeypatch):
    """Gate / up copied out of w13 as [L, I, H], down as w2, int32 ids, bf16 router weights, the shared expert, and
    every gradient in the harness layout; the reservation is LigerCute's (capacity of this point, one in flight)."""
    b, case, inp, st = _liger_cute(monkeypatch)
    assert st["moe"] == MoEConfig(max_tokens=64, hidden_size=case.hidden, num_experts=case.num_experts,
                                  top_k=case.topk, num_hosts=1, gpus_per_host=1, max_inflight=1)
    assert all(g is None for g in b.weight_grads().values()) and st["depth"] == 0  # setup's warm call left nothing
    errs = _liger_errors(b, case, inp)
    assert errs["out"] < 4e-3, errs  # bf16 rounding of the output
    assert errs["topk_w"] < 4e-3, errs  # their gradient comes back in bf16
    assert all(errs[k] < 1e-5 for k in errs if k not in ("out", "topk_w")), errs
    b.zero_grad()
    assert _liger_errors(b, case, inp)["w_up"] < 1e-5  # again, after zero_grad


def test_liger_cute_comparison_sees_a_swapped_gate_and_up(monkeypatch):
    """The check above can fail: with gate and up swapped (a layout mistake) the output is far off."""
    b, case, inp, _ = _liger_cute(monkeypatch)
    b.gate, b.up = b.up, b.gate
    assert _liger_errors(b, case, inp)["out"] > 0.3


def test_liger_cute_forward_loop_releases_the_pending_forward(monkeypatch):
    """A timing loop of training forwards without backward (the harness's fwd rows) runs with one forward in flight:
    each releases the last; a backward on a released forward raises, the last one's backward runs."""
    b, case, inp, st = _liger_cute(monkeypatch)
    x, w = (t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.topk_w_TK))
    outs = [b.forward(x, inp.topk_idx_TK, w) for _ in range(3)]
    assert (b.released, st["pops"], st["depth"]) == (2, 2, 1)
    with pytest.raises(RuntimeError, match="released by a later forward"):
        outs[0].float().backward(inp.grad_out_TH)
    outs[2].float().backward(inp.grad_out_TH)
    assert st["depth"] == 0
    b.forward(x, inp.topk_idx_TK, w).float().backward(inp.grad_out_TH)  # a forward + backward releases nothing
    with torch.no_grad():
        b.forward(x, inp.topk_idx_TK, w)  # the inference path pops itself
    assert (b.released, st["depth"]) == (2, 0)
    assert "training forwards" in b.info()["notes"] and "released by the next" in b.info()["notes"]
    b.teardown()
    assert st["finalized"] == 1


def test_liger_cute_unsupported_reasons(monkeypatch):
    from baselines import liger_cute as lc

    why = lc.LigerCuteBackend.unsupported_reason
    cpu = _case()
    gpu = dataclasses.replace(cpu, device="cuda")
    assert "bf16 only" in why(dataclasses.replace(cpu, precision="fp8"))
    assert "no clamped SwiGLU" in why(dataclasses.replace(cpu, swiglu_limit=7.0))
    assert "MOKBENCH_LIGER_CUTE_EP=1" in why(dataclasses.replace(cpu, ep_size=2))
    monkeypatch.setenv(lc.EP_ENV, "1")
    assert "Hopper (SM90) and Blackwell" in why(dataclasses.replace(cpu, ep_size=2))  # past the EP check
    monkeypatch.delenv(lc.EP_ENV)
    assert "this is the CPU" in why(cpu)
    monkeypatch.setattr(lc, "device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(lc.importlib.util, "find_spec", lambda name, *a: None)
    assert "liger-kernel is not installed" in why(gpu) and "liger-cute-kernels[cu12]" in why(gpu)
    monkeypatch.setattr(lc.importlib.util, "find_spec", lambda name, *a: None if name == "liger_cute_kernels" else 1)
    assert "liger-cute-kernels is not installed" in why(gpu)
    monkeypatch.setattr(lc.importlib.util, "find_spec", lambda name, *a: None if name.startswith("nvidia") else 1)
    monkeypatch.setitem(sys.modules, "liger_cute_kernels", None)  # installed, but does not load
    assert "LigerCute does not load (ModuleNotFoundError" in why(gpu)
    _lck(monkeypatch)
    assert why(gpu) is None


def test_liger_cute_teardown_without_configure_finalizes_nothing(monkeypatch):
    from baselines.liger_cute import LigerCuteBackend

    st = _lck(monkeypatch)
    b = LigerCuteBackend(_case(), None)
    b.teardown()
    assert st["finalized"] == 0


# ---- DeepGEMM MegaMoE ----------------------------------------------------------------------------------------------


def _interleave(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    """MegaMoE's L1 layout: gate and up rows interleaved in groups of ``gran`` (DeepGEMM #352's transform)."""
    g, n, *rest = t.shape
    gate = t[:, : n // 2].reshape(g, n // 2 // gran, gran, *rest)
    up = t[:, n // 2:].reshape(g, n // 2 // gran, gran, *rest)
    return torch.stack([gate, up], dim=2).reshape(g, n, *rest).contiguous()


def _deinterleave(t: torch.Tensor, gran: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g, n, *rest = t.shape
    v = t.reshape(g, n // 2 // gran, 2, gran, *rest)
    return v[:, :, 0].reshape(g, n // 2, *rest), v[:, :, 1].reshape(g, n // 2, *rest)


def _megamoe(monkeypatch, name: str = "deep_gemm", pre_dispatch: bool = False, **extra) -> dict:
    """A stand-in module with DeepGEMM's SM90 MegaMoE API: the symmetric buffer's views (e4m3 x, fp32 [T, H/128] x
    scales, int64 top-k ids, fp32 weights), the L1 interleave, and fp8_mega_moe in torch on what the buffer holds
    (dequantized x and weights; SwiGLU with its clamp; no further rounding)."""
    st = {"buffers": [], "calls": 0, "pre": 0}

    def get_symm_buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden):
        t = num_max_tokens_per_rank
        buf = types.SimpleNamespace(x=torch.zeros(t, hidden, dtype=torch.float8_e4m3fn),
                                    x_sf=torch.zeros(t, hidden // 128),
                                    topk_idx=torch.zeros(t, num_topk, dtype=torch.long),
                                    topk_weights=torch.zeros(t, num_topk), num_experts=num_experts, destroyed=False)
        buf.destroy = lambda: setattr(buf, "destroyed", True)
        st["buffers"].append(buf)
        return buf

    def transform(l1, l2):
        assert l1[0].dtype == l2[0].dtype == torch.float8_e4m3fn and l1[1].dtype == torch.float32
        return (_interleave(l1[0]), l1[1]), l2

    def fp8_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                     recipe=(128, 128, 128), activation="swiglu", activation_clamp=None, fast_math=True):
        assert recipe == (128, 128, 128) and activation == "swiglu" and y.dtype == torch.bfloat16
        st["calls"] += 1
        T, b = y.shape[0], sym_buffer
        x = dequantize_blocks(b.x[:T], b.x_sf[:T], 1, 128)
        gate_q, up_q = _deinterleave(l1_weights[0])
        half = l1_weights[1].shape[1] // 2  # scales are not interleaved: gate blocks, then up blocks
        gate = dequantize_blocks(gate_q, l1_weights[1][:, :half], 128, 128)
        up = dequantize_blocks(up_q, l1_weights[1][:, half:], 128, 128)
        down = dequantize_blocks(*l2_weights, 128, 128)
        y.copy_(_moe(x, b.topk_idx[:T], b.topk_weights[:T], gate.__getitem__, up.__getitem__, down.__getitem__,
                     b.num_experts, activation_clamp))

    def pre(x, topk_idx, topk_weights, buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, num_tokens, group_size=128,
            routed_scaling_factor=1.0):
        assert topk_idx.dtype == torch.int32 and topk_weights.dtype == torch.float32 and group_size == 128
        st["pre"] += 1
        v = x.float().view(num_tokens, -1, 128)
        sf = v.abs().amax(-1).clamp(min=1e-10) / 448.0
        buf_x[:num_tokens] = (v * (1.0 / sf).unsqueeze(-1)).to(torch.float8_e4m3fn).view(num_tokens, -1)
        buf_x_sf[:num_tokens] = sf
        buf_topk_idx[:num_tokens] = topk_idx.long()
        buf_topk_weights[:num_tokens] = topk_weights * routed_scaling_factor

    mod = types.ModuleType(name)
    mod.__version__ = "2.6.1"
    mod.__dict__.update(transform_weights_for_mega_moe_sm90=transform, fp8_mega_moe=fp8_mega_moe,
                        get_symm_buffer_for_mega_moe=get_symm_buffer, **extra)
    if pre_dispatch:
        mod.mega_moe_pre_dispatch_sm90 = pre
    monkeypatch.setitem(sys.modules, name, mod)
    return st


def _megamoe_reference(case, inp):
    """The layer on the harness's fp8 values (x 1x128, weights 128x128), the shared expert in fp32."""
    x = dequantize_blocks(*quantize_blocks(inp.x_TH, 1, 128), 1, 128)
    w13 = dequantize_blocks(*quantize_blocks(inp.w13_LIH, 128, 128), 128, 128)
    w2 = dequantize_blocks(*quantize_blocks(inp.w2_LHI, 128, 128), 128, 128)
    I, lim = case.ffn, case.swiglu_limit
    out = _moe(x, inp.topk_idx_TK, inp.topk_w_TK, lambda e: w13[e, :I], lambda e: w13[e, I:], w2.__getitem__,
               case.num_experts, lim)
    g, u = inp.x_TH @ inp.ws_gate_IH.t(), inp.x_TH @ inp.ws_up_IH.t()
    if lim is not None:
        g, u = g.clamp(max=lim), u.clamp(-lim, lim)
    return out + (F.silu(g) * u) @ inp.ws_down_HI.t()


def _megamoe_error(b, case, inp) -> float:
    ref = _megamoe_reference(case, inp)
    out = b.forward(inp.x_TH, inp.topk_idx_TK, inp.topk_w_TK)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and out.grad_fn is None
    return float((out.float() - ref).abs().sum() / ref.abs().sum())


@pytest.mark.parametrize("pre_dispatch", [False, True])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_megamoe_layouts_and_routing_match_a_per_expert_loop(monkeypatch, pre_dispatch, limit):
    """Weights in the harness's 128x128 blocks through MegaMoE's interleave, x in 1x128 blocks copied into its
    buffer (by the package's pre-dispatch kernel where it has one), top-k ids and router weights, the clamp and the
    shared expert."""
    from baselines.deepgemm_megamoe import DeepGemmMegaMoEBackend

    st = _megamoe(monkeypatch, pre_dispatch=pre_dispatch)
    monkeypatch.setitem(sys.modules, "sgl_deep_gemm", None)
    case = dataclasses.replace(_case("precision=fp8"), swiglu_limit=limit)
    inp = _fp32_inputs(case)
    b = DeepGemmMegaMoEBackend(case, None)
    b.setup(inp)
    assert st["calls"] == 1 and st["pre"] == int(pre_dispatch)  # setup's warm-up forward
    assert _megamoe_error(b, case, inp) < 5e-3  # bf16 rounding of the output (and x's rounding, pre-dispatch)
    notes = b.info()["notes"]
    assert ("mega_moe_pre_dispatch_sm90" in notes) == pre_dispatch and "deep_gemm 2.6.1" in notes
    b.teardown()
    assert st["buffers"][0].destroyed and b.buf is None


@pytest.mark.parametrize("mistake, at_least", [
    ("scales", 0.02),  # weight scales laid out [.., K/128, N/128] (random weights' block scales are alike: 0.04)
    ("gate_up", 0.3),  # up rows before gate rows in the quantised w13
])
def test_megamoe_comparison_sees_a_wrong_weight_layout(monkeypatch, mistake, at_least):
    """The check above can fail: a weight layout mistake puts the output far past its 5e-3."""
    from baselines import deepgemm_megamoe as dm

    _megamoe(monkeypatch)
    real = dm.quantize_experts
    case = _case("precision=fp8")
    inp = _fp32_inputs(case)

    def wrong(w):
        q, s = real(w)
        if mistake == "scales":
            return q, s.transpose(-2, -1).contiguous().view_as(s)
        if w is inp.w13_LIH:  # [L, 2I, H]: up rows first
            n = q.shape[1] // 2
            return torch.cat([q[:, n:], q[:, :n]], 1), torch.cat([s[:, n // 128:], s[:, :n // 128]], 1)
        return q, s

    monkeypatch.setattr(dm, "quantize_experts", wrong)
    b = dm.DeepGemmMegaMoEBackend(case, None)
    b.setup(inp)
    assert _megamoe_error(b, case, inp) > at_least


def test_megamoe_picks_its_package_and_names_the_build(monkeypatch):
    from importlib import metadata

    from baselines import deepgemm_megamoe as dm

    monkeypatch.setitem(sys.modules, "sgl_deep_gemm", None)
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))  # a DeepGEMM without MegaMoE
    mod, why = dm.load_megamoe()
    assert mod is None and "no sgl_deep_gemm" in why and "deep_gemm ? has no fp8_mega_moe" in why
    _megamoe(monkeypatch, "deep_gemm")
    _megamoe(monkeypatch, "sgl_deep_gemm", get_symm_buffer_for_sm90_mega_moe=lambda *a: None)
    assert dm.load_megamoe()[0].__name__ == "sgl_deep_gemm"  # #323's package first
    b = dm.DeepGemmMegaMoEBackend(_case("precision=fp8"), None)
    b.dg = sys.modules["deep_gemm"]
    monkeypatch.setattr(metadata, "packages_distributions", lambda: {"deep_gemm": ["deep_gemm"]})
    monkeypatch.setattr(metadata, "version", lambda d: "2.6.1+1f6f3f3")
    monkeypatch.setenv("MOKBENCH_DEEPGEMM_REF", "pull/352/head")
    assert b.build() == "deep_gemm 2.6.1 (commit 1f6f3f3, MOKBENCH_DEEPGEMM_REF=pull/352/head)"
    monkeypatch.setattr(metadata, "version", lambda d: "2.6.1+local")  # a dirty tree: no commit
    monkeypatch.delenv("MOKBENCH_DEEPGEMM_REF")
    assert b.build() == "deep_gemm 2.6.1"


def test_megamoe_unsupported_reasons(monkeypatch):
    from baselines import deepgemm_megamoe as dm

    why = dm.DeepGemmMegaMoEBackend.unsupported_reason
    cpu = _case("precision=fp8")
    gpu = dataclasses.replace(cpu, device="cuda")
    assert "fp8 only" in why(_case())
    assert "MOKBENCH_DEEPGEMM_MEGAMOE_EP=1" in why(dataclasses.replace(cpu, ep_size=2))
    assert "needs a Hopper GPU (SM90); this is the CPU" in why(cpu)
    monkeypatch.setattr(dm, "device_capability", lambda dev: (10, 0))
    assert "this is SM100" in why(gpu)
    monkeypatch.setattr(dm, "device_capability", lambda dev: (9, 0))
    assert "ffn <= 4096" in why(dataclasses.replace(gpu, ffn=8192))
    assert "top-k <= 32" in why(dataclasses.replace(gpu, topk=33))
    for name in dm.MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    got = why(gpu)
    assert "no sgl_deep_gemm; no deep_gemm" in got and "pull/352/head" in got and "build_sgl_deep_gemm.sh" in got
    _megamoe(monkeypatch)
    assert why(gpu) is None  # the clamp is supported (its activation_clamp)
    assert why(dataclasses.replace(gpu, swiglu_limit=7.0)) is None
    for d in ("bwd", "fwd_bwd"):
        assert "saves nothing for a backward" in dm.DeepGemmMegaMoEBackend.direction_unsupported(gpu, d)
    assert dm.DeepGemmMegaMoEBackend.direction_unsupported(gpu, "fwd") is None
