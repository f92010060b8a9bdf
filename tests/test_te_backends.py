"""The Transformer Engine based backends (deepep_te, hybridep_megatron).

CPU: unsupported rows through the normal harness path when TE / megatron-core are absent, and the pure-torch
helpers (recipe choice, per-expert padding, weight layouts and gradients, the router replacement, Megatron's config)
checked against plain PyTorch. GPU (marked ``gpu``, skipped without CUDA or without TE / DeepEP / megatron-core):
each backend against the reference at EP=2, forward and backward, bf16 and fp8.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_GPU, NUM_GPUS, compose_cfg, cpu_cfg

import baselines.hybridep_megatron as hm
import baselines.te_common as tc
from baselines.common import expert_mlp, swiglu
from baselines.deepep_te import DeepEPTEBackend
from baselines.hybridep import dense_routing
from harness.config.backend_options import options_for
from harness.config.schema import ConfigError, config_hash, to_container
from harness.config.point import make_case
from harness.config.point import resolve
from harness.measure.runner import run_benchmark

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
HAS_MEGATRON = hm.has_megatron()


def by(df, backend, direction):
    sel = df[(df.backend == backend) & (df.direction == direction)]
    assert len(sel) == 1, f"expected one {backend}/{direction} row, got {len(sel)}"
    return sel.iloc[0]


def case_of(*overrides: str, ep: int = 2, device: str = "cpu"):
    return make_case(resolve(compose_cfg(f"device={device}", "shape=tiny", *overrides)), ep_size=ep, device=device)


# ---- unsupported rows -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_te_backends_are_unsupported_rows_with_the_install_hint_on_cpu(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[deepep_te,hybridep_megatron,nccl]",
                               "directions=[fwd,bwd]"))
    assert len(df) == 6
    for d in ("fwd", "bwd"):
        te_row, mg_row = by(df, "deepep_te", d), by(df, "hybridep_megatron", d)
        assert te_row.status == "unsupported" and mg_row.status == "unsupported"
        if HAS_TE:  # TE is here, so the CPU run is what stops DeepEP
            assert "GPU" in te_row.error
        else:
            assert "Transformer Engine is not installed" in te_row.error
            assert "pip install --no-build-isolation 'transformer_engine[pytorch]'" in te_row.error
        if not HAS_MEGATRON:
            assert "megatron-core is not installed" in mg_row.error and "pip install megatron-core" in mg_row.error
        assert by(df, "nccl", d).status == "ok"


@pytest.fixture
def no_te_no_megatron(monkeypatch):
    """Hide TE and megatron-core from the availability checks, whatever is installed."""
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        return None if name.split(".")[0] in ("transformer_engine", "megatron") else real(name, *a, **k)

    monkeypatch.setattr(tc.importlib.util, "find_spec", find_spec)
    return find_spec


def test_unsupported_reasons_name_the_missing_package_first(no_te_no_megatron, monkeypatch):
    case = case_of()
    why = DeepEPTEBackend.unsupported_reason(case)
    assert why.startswith("Transformer Engine is not installed") and "scripts/install_te.sh" in why
    why = hm.HybridEPMegatronBackend.unsupported_reason(case)
    assert why.startswith("megatron-core is not installed") and "pip install megatron-core" in why
    # megatron-core present, TE absent: TE's hint; TE present too: on the CPU, DeepEP's device reason
    monkeypatch.setattr(hm, "has_megatron", lambda: True)
    assert hm.HybridEPMegatronBackend.unsupported_reason(case).startswith("Transformer Engine is not installed")
    monkeypatch.setattr(tc.importlib.util, "find_spec", lambda name, *a, **k: object())
    assert "DeepEP needs CUDA GPUs" in DeepEPTEBackend.unsupported_reason(case)
    assert "DeepEP needs CUDA GPUs" in hm.HybridEPMegatronBackend.unsupported_reason(case)


# ---- recipes, option, padding ---------------------------------------------------------------------------------


def test_recipe_follows_precision_and_the_te_fp8_recipe_option():
    assert tc.recipe_name("bf16") is None
    assert tc.recipe_name("fp8") == "Float8BlockScaling"  # the harness's fp8 format is the default
    assert tc.recipe_name("fp8", "tensorwise") == "Float8CurrentScaling"
    assert tc.recipe_name("fp8", "delayed") == "DelayedScaling"
    assert tc.recipe_name("mxfp8", "delayed") == "MXFP8BlockScaling"  # the option only picks among fp8 recipes
    with pytest.raises(ValueError, match="unknown fp8 recipe 'fancy'"):
        tc.recipe_name("fp8", "fancy")
    # the option reaches each TE backend through its own options, from the alias or its scoped key
    for ov, want in (("te_fp8_recipe=tensorwise", ("tensorwise", "tensorwise")),
                     ("deepep_te.fp8_recipe=delayed", ("delayed", "blockwise")),
                     ("hybridep_megatron.fp8_recipe=tensorwise", ("blockwise", "tensorwise"))):
        c = resolve(compose_cfg("device=cpu", "shape=tiny", "precision=fp8", ov))
        got = tuple(options_for(b, c).fp8_recipe for b in ("deepep_te", "hybridep_megatron"))
        assert got == want, ov


def test_recipe_option_is_validated_and_hashed_only_where_it_changes_the_measurement():
    with pytest.raises(ConfigError, match="unknown te_fp8_recipe 'fancy'"):
        case_of("te_fp8_recipe=fancy")
    with pytest.raises(ConfigError, match="unknown deepep_te.fp8_recipe 'fancy'; choose one of: blockwise, "):
        case_of("deepep_te.fp8_recipe=fancy")

    def h(*ov):
        c = to_container(resolve(compose_cfg("device=cpu", "shape=tiny", *ov)))
        return config_hash(c, make_case(c, ep_size=2, device="cpu"))

    assert h("te_fp8_recipe=tensorwise") == h()  # bf16 ignores the recipe
    assert h("precision=fp8", "te_fp8_recipe=blockwise") == h("precision=fp8")
    assert h("precision=fp8", "te_fp8_recipe=tensorwise") != h("precision=fp8")
    assert h("precision=fp8", "te_fp8_recipe=delayed") != h("precision=fp8", "te_fp8_recipe=tensorwise")
    # one backend's own recipe is a point of its own, and not the alias's (which sets both backends)
    assert h("precision=fp8", "deepep_te.fp8_recipe=delayed") not in (h("precision=fp8"),
                                                                     h("precision=fp8", "te_fp8_recipe=delayed"))
    assert h("precision=fp8", "deepep_te.fp8_recipe=delayed", "hybridep_megatron.fp8_recipe=delayed") == \
        h("precision=fp8", "te_fp8_recipe=delayed")


def test_recipes_need_their_compute_capability():
    assert tc.recipe_unsupported(None, (0, 0)) is None
    why = tc.recipe_unsupported("MXFP8BlockScaling", (9, 0))
    assert "10.0" in why and "SM90" in why and "precision=fp8" in why
    assert tc.recipe_unsupported("MXFP8BlockScaling", (10, 0)) is None
    assert "te_fp8_recipe=tensorwise" in tc.recipe_unsupported("Float8BlockScaling", (8, 9))
    assert tc.recipe_unsupported("Float8BlockScaling", (9, 0)) is None
    assert tc.recipe_unsupported("Float8CurrentScaling", (8, 9)) is None
    assert "8.9" in tc.recipe_unsupported("DelayedScaling", (8, 6))


def test_rows_per_expert_are_padded_to_the_quantized_gemm_alignment():
    assert tc.align_size(None) == 1 and tc.align_size("Float8BlockScaling") == 16
    assert tc.align_size("MXFP8BlockScaling") == 32
    assert tc.padded_splits([0, 1, 15, 16, 17, 33], 16) == [0, 16, 16, 16, 32, 48]
    assert tc.padded_splits([0, 1, 31, 33], 32) == [0, 32, 32, 64]
    assert tc.padded_splits([3, 0, 5], 1) == [3, 0, 5]


def test_scaling_column_names_the_recipe_and_the_dispatch_format():
    assert tc.scaling_label(None, "bf16") == "none"
    s = tc.scaling_label("Float8BlockScaling", "bf16")
    assert "Float8BlockScaling" in s and "1x128" in s and "128x128" in s and s.endswith("dispatch bf16")
    assert "Float8CurrentScaling" in tc.scaling_label("Float8CurrentScaling", "bf16")
    assert "DelayedScaling" in tc.scaling_label("DelayedScaling", "bf16")


# ---- deepep_te: weight layout, routing, the experts in plain torch ---------------------------------------------


class FakeGrouped(torch.nn.Module):
    """A GroupedLinear stand-in: ``weight{i}`` [out, in] per group, y[rows of group i] = x @ weight{i}^T."""

    def __init__(self, num: int, n_in: int, n_out: int) -> None:
        super().__init__()
        for i in range(num):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(n_out, n_in)))
        self.num = num

    def forward(self, x, m_splits):
        return torch.cat([xi @ getattr(self, f"weight{i}").t() for i, xi in enumerate(x.split(list(m_splits)))])


def _weights(L=3, H=16, I=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2 * I, H, generator=g), torch.randn(L, H, I, generator=g)


def test_grouped_weights_split_w13_into_gate_then_up():
    w13, w2 = _weights()
    w = tc.grouped_weights(w13, w2)
    assert torch.equal(w["gate"], w13[:, :8]) and torch.equal(w["up"], w13[:, 8:]) and w["down"] is w2
    assert w["gate"].data_ptr() == w13.data_ptr()  # views, no copy


def test_load_grouped_and_module_grads_round_trip_with_zero_for_missing():
    w13, w2 = _weights()
    m = FakeGrouped(3, 16, 8)
    tc.load_grouped(m, tc.grouped_weights(w13, w2)["up"])
    for i in range(3):
        assert torch.equal(getattr(m, f"weight{i}").detach(), w13[i, 8:])
    m.weight0.grad, m.weight2.grad = torch.ones(8, 16), torch.full((8, 16), 2.0)
    g = tc.module_grads(m, 3)
    assert g.shape == (3, 8, 16) and (g[0] == 1).all() and (g[1] == 0).all() and (g[2] == 2).all()


def test_local_routing_matches_a_loop_and_carries_router_weight_gradients():
    g = torch.Generator().manual_seed(1)
    R, K, L = 7, 3, 4
    local = torch.randint(-1, L, (R, K), generator=g)
    local[2] = -1  # a row with nothing for this rank
    local[3] = torch.tensor([1, -1, 2])
    w = torch.rand(R, K, generator=g).requires_grad_()
    routing, probs = tc.local_routing(local, w, L)
    want_r, want_p = torch.zeros(R, L, dtype=torch.int32), torch.zeros(R, L)
    for r in range(R):
        for k in range(K):
            if local[r, k] >= 0:
                want_r[r, local[r, k]] += 1
                want_p[r, local[r, k]] += w[r, k].detach()
    assert routing.dtype == torch.int32 and torch.equal(routing, want_r) and torch.allclose(probs, want_p)
    probs.sum().backward()
    assert torch.equal(w.grad, (local >= 0).float())


def _te_style_experts(x_RH, local_RK, w_RK, gate, up, down, L, align):
    """What deepep_te's routed_experts computes, with torch in place of TE: mask-map permute (rows grouped by expert,
    token order within), zero rows padding each expert to ``align``, three grouped linears, unpermute merged with
    the router weights."""
    routing, probs = tc.local_routing(local_RK, w_RK, L)
    counts = routing.sum(0).tolist()
    splits = tc.padded_splits(counts, align)
    rows, owners = [], []
    for e in range(L):
        tok = torch.nonzero(routing[:, e], as_tuple=True)[0]
        rows += [x_RH[tok], x_RH.new_zeros(splits[e] - counts[e], x_RH.shape[1])]
        owners.append(tok)
    rows = torch.cat(rows)
    y = down(swiglu(gate(rows, splits), up(rows, splits), None), splits)
    out = torch.zeros_like(x_RH)
    start = 0
    for e in range(L):
        tok = owners[e]
        out = out.index_add(0, tok, y[start : start + len(tok)] * probs[tok, e, None])
        start += splits[e]
    return out


@pytest.mark.parametrize("align", [1, 16])
def test_three_grouped_linears_on_the_harness_weights_equal_the_fused_pytorch_experts(align):
    """The weight mapping and the permute/merge semantics, against the deepep backend's expert math."""
    L, H, I, R, K = 3, 16, 8, 9, 2
    w13, w2 = _weights(L, H, I)
    lin = {k: FakeGrouped(L, *dims) for k, dims in {"gate": (H, I), "up": (H, I), "down": (I, H)}.items()}
    for k, w in tc.grouped_weights(w13, w2).items():
        tc.load_grouped(lin[k], w)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(R, H, generator=g)
    local = torch.randint(-1, L, (R, K), generator=g)
    local[:, 1] = torch.where(local[:, 1] == local[:, 0], -1, local[:, 1])  # top-k experts are distinct
    w = torch.rand(R, K, generator=g)
    got = _te_style_experts(x, local, w, lin["gate"], lin["up"], lin["down"], L, align)
    # the deepep backend: slots sorted by expert, fused w13 grouped GEMMs, weighted index_add
    j, k = torch.nonzero(local >= 0, as_tuple=True)
    e = local[j, k]
    order = torch.argsort(e, stable=True)
    j, k, e = j[order], k[order], e[order]
    counts = torch.bincount(e, minlength=L)
    y = expert_mlp(x[j], w13, w2, torch.cumsum(counts, 0), counts.tolist(), None) * w[j, k, None]
    want = torch.zeros_like(x).index_add(0, j, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- hybridep_megatron: router, weights, config --------------------------------------------------------------


def test_precomputed_router_returns_topk_routing_as_megatron_does():
    g = torch.Generator().manual_seed(3)
    T, E, K = 6, 8, 2
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1).requires_grad_()
    router = hm.PrecomputedRouter(E)
    router.set_topk(idx, w)
    probs, rmap = router(torch.zeros(T, 1, 16))  # Megatron passes [S, B, H]
    assert probs.shape == (T, E) and probs.dtype == torch.float32 and rmap.dtype == torch.bool
    assert torch.equal(rmap.sum(1), torch.full((T,), K)) and router.last_map is rmap
    for t in range(T):
        for k in range(K):
            assert rmap[t, idx[t, k]] and probs[t, idx[t, k]] == w[t, k]
    assert probs[~rmap].abs().sum() == 0
    (probs * torch.arange(E)).sum().backward()
    assert torch.equal(w.grad, idx.float())  # the router weight gradient reaches topk_w
    router.set_layer_number(1)
    with pytest.raises(AssertionError, match="one top-k row per token"):
        router(torch.zeros(T + 1, 1, 16))
    # the same routing HybridEP gets in the hybridep backend
    p2, m2 = dense_routing(idx, w.detach(), E)
    assert torch.equal(p2, probs.detach()) and torch.equal(m2, rmap)


def test_megatron_weight_names_and_gradients_round_trip_in_the_harness_layout():
    L, H, I = 3, 16, 8
    w13, w2 = _weights(L, H, I)
    sg, su, sd = torch.randn(I, H), torch.randn(I, H), torch.randn(H, I)
    names = hm.megatron_weights(w13, w2, (sg, su, sd))
    assert len(names) == 2 * L + 2
    assert names["experts.linear_fc1.weight2"].shape == (2 * I, H)
    assert names["experts.linear_fc2.weight0"].shape == (H, I)
    assert torch.equal(names["shared_experts.linear_fc1.weight"], torch.cat([sg, su]))
    params = {n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in names.items()}
    for n, t in names.items():
        params[n].grad = t.clone()
    params["experts.linear_fc2.weight1"].grad = None  # an expert without rows
    g = hm.harness_grads(params, L, I, shared=True)
    assert torch.equal(g["w_gate"], w13[:, :I]) and torch.equal(g["w_up"], w13[:, I:])
    assert torch.equal(g["w_down"][[0, 2]], w2[[0, 2]]) and (g["w_down"][1] == 0).all()
    assert torch.equal(g["ws_gate"], sg) and torch.equal(g["ws_up"], su) and torch.equal(g["ws_down"], sd)
    assert hm.harness_grads(params, L, I, shared=False)["ws_gate"] is None
    assert set(hm.megatron_weights(w13, w2)) == {n for n in names if n.startswith("experts.")}


def test_megatron_glu_split_of_fc1_is_the_harness_swiglu():
    """Megatron's GLU chunks fc1's output in two and puts the first half through the activation."""
    L, H, I = 2, 16, 8
    w13, w2 = _weights(L, H, I)
    x = torch.randn(5, H)
    fc1 = hm.megatron_weights(w13, w2)["experts.linear_fc1.weight1"]
    first, second = torch.chunk(x @ fc1.t(), 2, dim=-1)
    torch.testing.assert_close(F.silu(first) * second, swiglu(x @ w13[1, :I].t(), x @ w13[1, I:].t()))


class Everything:
    def __contains__(self, name):
        return True


def test_megatron_config_is_the_published_layer():
    case = case_of()
    kw, notes = hm.config_kwargs(case, Everything(), hm.PUBLISHED_COMM_SMS)
    assert kw["moe_token_dispatcher_type"] == "flex" and kw["moe_flex_dispatcher_backend"] == "hybridep"
    assert kw["moe_flex_dispatcher_num_sms"] == 20 and kw["moe_hybridep_num_sms_preprocessing"] == 108
    assert kw["moe_permute_fusion_into_hybridep"] is True and kw["moe_grouped_gemm"] is True
    assert kw["gated_linear_unit"] is True and kw["activation_func"] is F.silu and kw["add_bias_linear"] is False
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_aux_loss_coeff"] == 0.0
    assert kw["moe_router_force_load_balancing"] is False and kw["moe_expert_capacity_factor"] is None
    assert kw["moe_router_dtype"] == "fp32" and kw["moe_shared_expert_intermediate_size"] == case.ffn
    assert kw["moe_shared_expert_overlap"] is True and kw["expert_model_parallel_size"] == 2
    assert (kw["num_moe_experts"], kw["moe_ffn_hidden_size"], kw["moe_router_topk"]) == (8, 128, 2)
    assert kw["hidden_size"] % kw["num_attention_heads"] == 0 and kw["num_layers"] == 1
    assert kw["params_dtype"] is torch.bfloat16 and kw["perform_initialization"] is False
    assert "fp8" not in kw and "moe_expert_rank_capacity_factor" not in kw
    assert any("rank capacity factor 1.25" in n and "no token is dropped" in n for n in notes)
    # the published capacity factor where megatron-core accepts it (its TE op-fuser grouped MLP)
    kw, _ = hm.config_kwargs(case, Everything(), 20, op_fuser=True)
    assert kw["moe_expert_rank_capacity_factor"] == 1.25 and kw["use_transformer_engine_op_fuser"] is True


@pytest.mark.parametrize("precision,option,recipe", [
    ("fp8", "blockwise", "blockwise"), ("fp8", "tensorwise", "tensorwise"), ("fp8", "delayed", "delayed"),
    ("mxfp8", "blockwise", "mxfp8")])
def test_megatron_config_quantization(precision, option, recipe):
    kw, _ = hm.config_kwargs(case_of(f"precision={precision}"), Everything(), 20, recipe=option)
    assert kw["fp8"] == "e4m3" and kw["fp8_recipe"] == recipe


def test_megatron_config_clamp_overlap_shared_and_older_versions():
    kw, notes = hm.config_kwargs(case_of("shape.swiglu_limit=7.0"), Everything(), 24)
    assert kw["activation_func_clamp_value"] == 7.0 and kw["moe_shared_expert_overlap"] is False
    assert kw["moe_flex_dispatcher_num_sms"] == 24 and any("ignores the SwiGLU clamp" in n for n in notes)
    kw, _ = hm.config_kwargs(case_of("shape.shared_expert=false"), Everything(), 20)
    assert kw["moe_shared_expert_intermediate_size"] is None and kw["moe_shared_expert_overlap"] is False
    # megatron-core before 0.19: the per-backend SM knob, and fields it lacks are dropped with a note
    everything, _ = hm.config_kwargs(case_of(), Everything(), 20)
    old = set(everything) - {"moe_flex_dispatcher_num_sms", "moe_permute_fusion_into_hybridep"}
    old.add("moe_hybridep_num_sms")
    kw, notes = hm.config_kwargs(case_of(), old, 20)
    assert kw["moe_hybridep_num_sms"] == 20 and "moe_flex_dispatcher_num_sms" not in kw
    assert "moe_permute_fusion_into_hybridep" not in kw
    assert any("no moe_permute_fusion_into_hybridep" in n for n in notes)
    with pytest.raises(ValueError, match="moe_flex_dispatcher_backend.*pip install -U megatron-core"):
        hm.config_kwargs(case_of(), old - {"moe_flex_dispatcher_backend"}, 20)
    with pytest.raises(ValueError, match="activation_func_clamp_value"):
        hm.config_kwargs(case_of("shape.swiglu_limit=7.0"), old - {"activation_func_clamp_value"}, 20)


def test_config_without_shared_overlap_where_megatron_refuses_it():
    made = []

    def config(**kw):
        if kw.get("moe_shared_expert_overlap"):
            raise ValueError("moe_shared_expert_overlap only works with alltoall token dispatcher.")
        made.append(kw)
        return types.SimpleNamespace(**kw)

    notes: list[str] = []
    cfg = hm.build_config(config, {"moe_shared_expert_overlap": True, "x": 1}, notes)
    assert cfg.moe_shared_expert_overlap is False and cfg.x == 1 and "not overlapped" in notes[0]

    def bad(**kw):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):
        hm.build_config(bad, {"moe_shared_expert_overlap": True}, [])


def test_model_parallel_state_is_made_once_per_process_and_ep_size():
    calls = []

    class PS:
        ep = None

        def model_parallel_is_initialized(self):
            return self.ep is not None

        def get_expert_model_parallel_world_size(self):
            return self.ep

        def destroy_model_parallel(self):
            calls.append("destroy")
            self.ep = None

        def initialize_model_parallel(self, **kw):
            calls.append(("init", kw["expert_model_parallel_size"], kw["tensor_model_parallel_size"]))
            self.ep = kw["expert_model_parallel_size"]

    ps = PS()
    hm.ensure_model_parallel(ps, 2)
    hm.ensure_model_parallel(ps, 2)
    assert calls == [("init", 2, 1)]
    hm.ensure_model_parallel(ps, 4)
    assert calls == [("init", 2, 1), "destroy", ("init", 4, 1)]


def test_shared_expert_linears_run_with_quantization_off(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def fake_autocast(recipe, amax_group=None, enabled=None):
        seen.append(("enter", recipe, enabled))
        yield
        seen.append("exit")

    monkeypatch.setattr(hm, "te_autocast", fake_autocast)
    wrapped = hm.bf16_region(lambda x, y=0: seen.append(("call", x, y)) or x + y, "RECIPE")
    assert wrapped(1, y=2) == 3
    assert seen == [("enter", "RECIPE", False), ("call", 1, 2), "exit"]


def test_deep_ep_is_imported_after_a_global_libstdcxx(monkeypatch):
    """HybridEPBuffer's constructor crashed in processes where nothing had loaded libstdc++ globally (its
    extension carries its own copy); every backend imports deep_ep through import_deep_ep, which preloads it."""
    import ctypes
    import types

    from baselines import deepep

    calls = []
    fake = types.ModuleType("deep_ep")
    monkeypatch.setattr(ctypes, "CDLL", lambda name, mode=0: calls.append((name, mode)))
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.delenv(deepep.PRELOAD_ENV, raising=False)
    assert deepep.import_deep_ep() is fake
    assert calls == [("libstdc++.so.6", ctypes.RTLD_GLOBAL)]
    monkeypatch.setenv(deepep.PRELOAD_ENV, "none")
    assert deepep.import_deep_ep() is fake and len(calls) == 1


def test_attention_heads_divide_hidden():
    for h in (7168, 6144, 4096, 256, 100, 7):
        assert h % hm.attention_heads(h) == 0


# ---- GPU: each backend against the reference ------------------------------------------------------------------


def _needs(*modules: str):
    missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed "
                                                    "(docs/backends.md, 'Transformer Engine and Megatron-core')")


NEEDS = {"deepep_te": _needs("transformer_engine", "deep_ep"),
         "hybridep_megatron": _needs("transformer_engine", "deep_ep", "megatron")}
gpu2 = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine"),
        pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs (DeepEP has no single-rank path)")]


def gpu_cfg(results_dir, *overrides):
    return compose_cfg("device=cuda", "shape=tiny", "timing=quick", "workload.tokens_per_gpu=256", "compile=false",
                       f"results_dir={results_dir}", "print_table=false", *overrides)


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[*gpu2, NEEDS[b]]) for b in NEEDS])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_te_backend_matches_reference_on_gpu(results_dir, backend, precision):
    import torch as _torch

    if precision == "fp8" and _torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("Float8BlockScaling needs SM90+")
    df = run_benchmark(gpu_cfg(results_dir, "ep_size=2", f"backends=[{backend}]", f"precision={precision}",
                               "directions=[fwd,bwd,fwd_bwd]"))
    show = df[["direction", "status", "error", "rel_err", "max_abs_err", "worst_tensor"]].to_string()
    assert sorted(df.direction) == ["bwd", "fwd", "fwd_bwd"], show  # one row per direction (none lost)
    if precision == "bf16":
        assert (df.status == "ok").all(), show
        assert (df.rel_err <= 0.01).all() and (df.max_abs_err <= 0.5).all() and (df.scaling == "none").all()
    else:
        # the forward passes the fp8 gate; gradients are quantized too (e4m3 everywhere): weight gradients reach
        # tens, so ~4% element errors may pass the abs-max 1.0 while the relative L1 error stays within 0.1
        assert by(df, backend, "fwd").status == "ok", show
        assert df.status.isin(["ok", "mismatch"]).all() and (df.rel_err < 0.1).all(), show
        assert df[df.status == "mismatch"].error.str.contains("(tol 1.0)", regex=False).all(), show
        assert df.scaling.str.contains("Float8BlockScaling").all()
    assert (df.rel_err > 0).all() and (df.compiled == False).all()  # noqa: E712
    assert (df.dispatch_bytes > 0).all() and df.notes.str.len().gt(0).all()


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[*gpu2, NEEDS[b]]) for b in NEEDS])
@pytest.mark.parametrize("option", ["tensorwise", "delayed"])
def test_te_backend_other_hopper_fp8_recipes_on_gpu(results_dir, backend, option):
    df = run_benchmark(gpu_cfg(results_dir, "ep_size=2", f"backends=[{backend}]", "precision=fp8",
                               f"te_fp8_recipe={option}", "directions=[fwd,bwd]"))
    show = df[["direction", "status", "error", "rel_err", "max_abs_err"]].to_string()
    assert by(df, backend, "fwd").status == "ok" and (df.rel_err < 0.1).all(), show
    assert (df.status == "ok").all() or "(tol 1.0)" in by(df, backend, "bwd").error, show
    want = {"tensorwise": "Float8CurrentScaling", "delayed": "DelayedScaling"}[option]
    assert df.scaling.str.contains(want).all()


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[*gpu2, NEEDS[b]]) for b in NEEDS])
def test_te_backend_mxfp8_is_unsupported_before_blackwell(results_dir, backend):
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU runs mxfp8")
    df = run_benchmark(gpu_cfg(results_dir, "ep_size=2", f"backends=[{backend}]", "precision=mxfp8",
                               "directions=[fwd]"))
    r = by(df, backend, "fwd")
    assert r.status == "unsupported" and "10.0" in r.error


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=[*gpu2, NEEDS["deepep_te"]]),
                                       pytest.param("fp8", marks=[*gpu2, NEEDS["deepep_te"]])])
def test_deepep_te_more_than_128_local_experts_on_gpu(results_dir, precision):
    """deepep_te reuses DeepEP's coarse expert ids above 128 local experts (three published shapes at EP=2); with
    fp8 most experts get a few rows, each padded to 16."""
    df = run_benchmark(gpu_cfg(results_dir, "ep_size=2", "backends=[deepep_te]", "shape.local_experts=130",
                               "shape.topk=4", f"precision={precision}", "directions=[fwd,bwd]"))
    show = df[["direction", "status", "error", "rel_err", "max_abs_err"]].to_string()
    assert by(df, "deepep_te", "fwd").status == "ok", show
    assert (df.status == "ok").all() or (precision == "fp8" and "(tol 1.0)" in by(df, "deepep_te", "bwd").error), show
    assert (df.rel_err <= (0.01 if precision == "bf16" else 0.1)).all()
    assert df.notes.str.contains("coarsened").all()
    assert df.notes.str.contains("padded per expert").all() == (precision == "fp8")
