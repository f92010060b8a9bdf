"""The backend registry (one table of names, labels, roles, colours), the anchors in reports and charts, and the two
anchor adapters: Liger-Kernel's fused MoE (its real Triton kernels under Triton's CPU interpreter, in fp32: the
interpreter's bf16 results are wrong) and SonicMoE (a stand-in ``sonicmoe`` module that checks the documented
weight and routing contract and does the math in torch)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform
import subprocess
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")  # before liger_kernel (its @triton.jit) is imported
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # the interpreter cannot benchmark configs

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from conftest import ROOT, compose_cfg  # noqa: E402
from harness.core import backends as hb  # noqa: E402
from harness.report import claims as C  # noqa: E402
from harness.report import labels as L  # noqa: E402
from harness.report import report as R  # noqa: E402
from harness.config.point import make_case  # noqa: E402
from harness.measure.inputs import make_inputs  # noqa: E402
from synthetic_results import row  # noqa: E402

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None


# ---- the registry ----------------------------------------------------------------------------------------------


def test_registry_is_the_one_table_of_names():
    from harness.report import plots

    assert set(hb.BACKENDS) == {k for k, s in hb.REGISTRY.items() if s.target}
    for key, s in hb.REGISTRY.items():
        assert s.role in hb.ROLES and s.label and s.color.startswith("#"), key
        assert L.system_label(key) == s.label and plots.color(key) == s.color
    assert hb.names_with_role("anchor") == ("liger", "sonicmoe", "liger_cute", "deepgemm_megamoe", "flashinfer")
    assert len({s.color for s in hb.REGISTRY.values()} | set(hb._FALLBACK_COLORS)) == len(hb.REGISTRY) + len(
        hb._FALLBACK_COLORS)  # every backend its own colour, none a fallback's
    assert set(hb.names_with_role("published baseline")) == {"nccl", "deepep", "deepep_te", "hybridep_megatron"}
    assert L.FUSED == ("mok", "mok_hopper", "mok_hopper_cpu_twin") and L.NOT_CONTENDERS == ("reference",)
    assert L.is_anchor("liger") and not L.is_baseline("liger") and not L.is_fused("sonicmoe")
    assert L.is_baseline("hybridep") and L.is_baseline("nccl") and L.is_fused("mok_hopper")
    assert plots.hatch("liger") and plots.hatch("nccl") is None
    with pytest.raises(ValueError, match="role"):
        hb.BackendSpec("a:B", "A", "rival", "#000000")


def test_unknown_and_extra_backends_get_defaults():
    s = hb.spec("my_backend")
    assert (s.label, s.role) == ("my_backend", "baseline") and s.color.startswith("#")
    assert L.is_baseline("my_backend") and L.system_label("my_backend") == "my_backend"
    code = ("import harness.core.backends as b, harness.report.labels as L; s = b.spec('extra1'); "
            "print(b.BACKENDS['extra1'], s.role, s.label, L.is_baseline('extra1'))")
    env = dict(os.environ, MOKBENCH_EXTRA_BACKENDS="extra1=fake_backends:WrongOutput")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["fake_backends:WrongOutput", "baseline", "extra1", "True"]


def test_reports_import_the_registry_without_torch():
    code = "import sys, harness.report, harness.core.backends; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_anchor_backends_are_valid_config_choices():
    cfg = compose_cfg("device=cpu", "backends=[nccl,liger,sonicmoe,liger_cute,deepgemm_megamoe,flashinfer]")
    assert list(cfg.backends) == ["nccl", "liger", "sonicmoe", "liger_cute", "deepgemm_megamoe", "flashinfer"]
    for name in ("liger", "sonicmoe", "liger_cute", "deepgemm_megamoe", "flashinfer"):  # without their libraries
        assert hb.load_backend(name).name == name


# ---- reports: anchors beside the baselines, never counted as one -------------------------------------------------


def _anchored_rows() -> pd.DataFrame:
    from harness.core import results

    rows = []
    for shape, (nccl, liger, sonic, mok) in {"kimi_k2_7": (300.0, 420.0, 380.0, 504.0),
                                             "glm_5_2": (250.0, 200.0, 260.0, 375.0)}.items():
        for b, tf in (("nccl", nccl), ("liger", liger), ("sonicmoe", sonic), ("mok_hopper", mok)):
            rows.append(row(b, shape, "bf16", "fwd", tflops=tf, ep_size=1))
    rows.append(row("sonicmoe", "kimi_k2_7", "bf16", "bwd", ep_size=1, status="unsupported",
                    error="sonic-moe is not installed"))
    rows.append(row("nccl", "kimi_k2_7", "bf16", "bwd", tflops=280.0, ep_size=1))
    return results.to_frame(rows)


def test_claims_speedups_over_baselines_and_over_all():
    claims = C.claims_table(C.prepare(_anchored_rows())).set_index(["direction", "shape"])
    kimi, glm = claims.loc[("fwd", "kimi_k2_7")], claims.loc[("fwd", "glm_5_2")]
    assert kimi["best_baseline"] == "nccl" and kimi["baselines_ok"] == "1/1"  # anchors are no baselines
    assert kimi["speedup_mok_hopper"] == pytest.approx(504 / 300)
    assert (kimi["best_anchor"], kimi["best_overall"]) == ("liger", "liger")
    assert kimi["speedup_all_mok_hopper"] == pytest.approx(504 / 420)
    assert (glm["best_anchor"], glm["best_overall"]) == ("sonicmoe", "sonicmoe")
    assert glm["speedup_all_mok_hopper"] == pytest.approx(375 / 260)
    assert claims.loc[("bwd", "kimi_k2_7")]["status_sonicmoe"] == "unsupported"
    assert "speedup_all_mok_hopper" in claims and "speedup_all" not in C.fused_columns(claims.reset_index())
    head = C.headline_table(claims.reset_index())
    fwd = head[head["direction"] == "fwd"].iloc[0]
    assert fwd["max_speedup"] == pytest.approx(1.68) and fwd["best_baseline"] == "nccl"
    assert fwd["min_speedup_all"] == pytest.approx(504 / 420) and fwd["min_all_over"] == "liger"
    assert fwd["max_speedup_all"] == pytest.approx(375 / 260)


def test_report_and_chart_mark_the_anchors(tmp_path):
    written = R.write_report(_anchored_rows(), tmp_path, formats=("png",))
    md = written["claims.md"].read_text()
    assert "Liger fused MoE (anchor)" in md and "SonicMoE (anchor)" in md
    assert "fastest of all" in md and "MoK Hopper (ours) × all" in md
    assert "Against the fastest of all (baselines and anchors)" in md and "1.20×" in md
    assert any(p.name.startswith("panels_") for p in written.values())


def test_no_anchor_columns_without_anchors(tmp_path):
    from harness.core import results

    df = results.to_frame([row(b, "glm_5_2", "bf16", "fwd", ep_size=1) for b in ("nccl", "mok_hopper")])
    md = R.format_markdown(C.claims_table(C.prepare(df)), pd.DataFrame(), C.not_ok_rows(df))
    assert "| fastest of all |" not in md and "× all |" not in md and "### Against" not in md


# ---- adapters --------------------------------------------------------------------------------------------------


def _case(*overrides: str, ep_size: int = 1, device: str = "cpu"):
    cfg = compose_cfg("device=cpu", "shape=tiny", "workload.tokens_per_gpu=64", *overrides)
    return make_case(cfg, ep_size=ep_size, device=device)


def _fp32_inputs(case):
    inp = make_inputs(case, 0, torch.device("cpu"))
    floats = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)}
    return dataclasses.replace(
        inp, **{k: t.float() for k, t in floats.items() if t is not None and t.is_floating_point()})


def _reference(case, inp):
    """fp32 autograd through a per-expert loop: output and the 8 gradients in the harness layout."""
    x = inp.x_TH.detach().clone().requires_grad_()
    w = inp.topk_w_TK.detach().clone().requires_grad_()
    w13 = inp.w13_LIH.detach().clone().requires_grad_()
    w2 = inp.w2_LHI.detach().clone().requires_grad_()
    shared = [t.detach().clone().requires_grad_() for t in (inp.ws_gate_IH, inp.ws_up_IH, inp.ws_down_HI)]
    out = F.silu(x @ shared[0].t()) * (x @ shared[1].t()) @ shared[2].t()
    for e in range(case.num_experts):
        t, k = (inp.topk_idx_TK == e).nonzero(as_tuple=True)
        g, u = (x[t] @ w13[e].t()).chunk(2, dim=-1)
        out = out.index_add(0, t, (F.silu(g) * u @ w2[e].t()) * w[t, k].unsqueeze(-1))
    out.backward(inp.grad_out_TH)
    I = case.ffn
    return out.detach(), {"x": x.grad, "topk_w": w.grad, "w_gate": w13.grad[:, :I], "w_up": w13.grad[:, I:],
                          "w_down": w2.grad, "ws_gate": shared[0].grad, "ws_up": shared[1].grad,
                          "ws_down": shared[2].grad}


def _check_backend(b, case, inp):
    ref_out, ref_grads = _reference(case, inp)
    x = inp.x_TH.detach().clone().requires_grad_()
    w = inp.topk_w_TK.detach().clone().requires_grad_()
    out = b.forward(x, inp.topk_idx_TK, w)
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)  # bf16 rounding of the output
    out.float().backward(inp.grad_out_TH)
    got = {"x": x.grad, "topk_w": w.grad, **b.weight_grads()}
    assert set(got) == set(ref_grads)
    for name, g in ref_grads.items():
        assert got[name] is not None and got[name].shape == g.shape, name
        torch.testing.assert_close(got[name].float(), g, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel not installed (pip install liger-kernel==0.8.5)")
def test_liger_adapter_matches_the_reference_output_and_all_gradients():
    """Liger's own Triton kernels (interpreted, fp32) behind the adapter: routing, gate/up layout, router weights,
    shared expert and the gradients' harness layout; a second call after zero_grad gives the same gradients."""
    from baselines.liger import LigerBackend

    case = _case()
    inp = _fp32_inputs(case)
    b = LigerBackend(case, None)
    b.setup(inp)  # the untimed forward + backward of setup
    assert all(g is None for g in b.weight_grads().values())
    _check_backend(b, case, inp)
    b.zero_grad()
    _check_backend(b, case, inp)
    info = b.info()
    assert "LigerFusedMoEFunction" in info["notes"] and "LIGER_FUSED_MOE_AUTOTUNE=0" in info["notes"]


def test_liger_unsupported_reasons(monkeypatch):
    from baselines import liger

    cpu = _case()
    gpu = dataclasses.replace(cpu, device="cuda")
    if not HAS_LIGER:
        assert "pip install liger-kernel" in liger.LigerBackend.unsupported_reason(gpu)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert "bf16 only" in liger.LigerBackend.unsupported_reason(dataclasses.replace(gpu, precision="fp8"))
    assert "clamped SwiGLU" in liger.LigerBackend.unsupported_reason(dataclasses.replace(gpu, swiglu_limit=7.0))
    assert "ep_size=1" in liger.LigerBackend.unsupported_reason(dataclasses.replace(gpu, ep_size=2))
    assert "CUDA GPU" in liger.LigerBackend.unsupported_reason(cpu)


def test_liger_reuses_a_user_triton_cache(monkeypatch):
    from baselines.liger import prepare_environment

    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    prepare_environment("cuda")
    assert "TRITON_CACHE_AUTOTUNING" not in os.environ  # no cache set by the user: nothing persisted for them
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/some-cache")
    prepare_environment("cuda")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"


def test_liger_precompile_slices_cover_every_config_once():
    from mok_tools.liger_precompile import config_slice
    from mok_tools.shapes import shape_dims

    configs = [f"c{i}" for i in range(40)]
    parts = [config_slice(configs, i, 14) for i in range(14)]
    assert sorted(c for p in parts for c in p) == sorted(configs)  # every config once, none twice
    assert config_slice(configs[:3], 5, 14) == ["c0"]  # fewer configs than workers: the first, not none
    with pytest.raises(ValueError):
        config_slice(configs, 14, 14)
    # glm_5_2 at any expert count is one (H, I, K); qwen3_5_397b another
    assert shape_dims(["glm_5_2", "qwen3_5_397b", "glm_5_2"]) == [(6144, 2048, 8), (4096, 1024, 10)]


@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel not installed (pip install liger-kernel==0.8.5)")
def test_liger_precompile_worker_runs_its_slice_of_every_autotuner():
    """A worker (here on the CPU, Liger's kernels interpreted in fp32, one config per kernel) keeps its slice of
    each of Liger's autotuners and runs the op forward and backward on the small problem."""
    from mok_tools import liger_precompile as P

    from baselines.liger import autotuners

    saved = {n: (t.configs, t.cache_results) for n, t in autotuners().items()}
    try:
        got = P._worker(2, 3, [(64, 32, 2)], device="cpu")
        assert set(got["configs"]) == {n.strip("_") for n in saved}
        assert all(n == 1 for n in got["configs"].values())  # pinned: one config, so each worker keeps it
        assert not any(t.cache_results for t in autotuners().values())
    finally:
        for n, t in autotuners().items():
            t.configs, t.cache_results = saved[n]
    out, dx = P.run_small_problem(64, 32, 2, device="cpu")
    assert out.dtype == torch.float32  # (the interpreter's bf16 is wrong: fp32 on the CPU)
    assert out.shape == (P.TOKENS, 64) and dx.shape == (P.TOKENS, 64)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all() and dx.abs().sum() > 0


@pytest.mark.parametrize("env, args, says", [
    ({}, ["--shapes", "glm_5_2"], "set TRITON_CACHE_DIR"),
    ({"TRITON_CACHE_DIR": "CACHE", "LIGER_FUSED_MOE_AUTOTUNE": "0"}, ["--shapes", "glm_5_2"], "unset it"),
    ({"TRITON_CACHE_DIR": "CACHE"}, ["--shapes", "no_such_shape"], "unknown shape"),
    ({"TRITON_CACHE_DIR": "CACHE", "CUDA_VISIBLE_DEVICES": ""}, ["--shapes", "glm_5_2"],
     "needs a CUDA GPU" if HAS_LIGER else "pip install liger-kernel"),
])
def test_liger_precompile_refuses_what_cannot_run(tmp_path, env, args, says):
    _assert_refuses("mok_tools.liger_precompile", ("TRITON_CACHE_DIR", "LIGER_FUSED_MOE_AUTOTUNE"), tmp_path, env,
                    args, says)


def _assert_refuses(module, unset, tmp_path, env, args, says):
    """A precompile tool run with ``unset`` removed from the environment and ``env`` added (CACHE: ``tmp_path``):
    one line naming the fix, exit code 2, and nothing written to the cache."""
    run_env = {k: v for k, v in os.environ.items() if k not in unset}
    run_env.update({k: v.replace("CACHE", str(tmp_path)) for k, v in env.items()})
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=run_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_liger_notes_cite_a_precompiled_cache(monkeypatch, tmp_path):
    from baselines import liger

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert liger.precompile_record() is None
    (tmp_path / liger.PRECOMPILE_RECORD).write_text(
        '{"shapes": "glm_5_2", "workers": 15, "seconds": 61.2, "utc": "2026-12-02T18:00:00Z"}')
    assert liger.precompile_record()["workers"] == 15
    b = liger.LigerBackend(_case(), None)
    b.params = types.SimpleNamespace(columns=lambda: {})
    monkeypatch.setenv(liger.AUTOTUNE_ENV, "1")
    assert "compiled ahead by mok_tools.liger_precompile for glm_5_2: 15 processes, 61.2 s" in b.info()["notes"]
    monkeypatch.setenv(liger.AUTOTUNE_ENV, "0")  # pinned: one config, nothing of the precompile is used
    assert "compiled ahead" not in b.info()["notes"]


# ---- SonicMoE through a stand-in module ---------------------------------------------------------------------------


def _fake_sonic(calls: list) -> types.ModuleType:
    """``sonicmoe`` with ``moe_general_routing_inputs`` as documented in sonic-moe 0.1.2.post1 (w1 (2I, H, E) and
    w2 (H, I, E) in stride order (2, 0, 1), token_indices ascending, concat_layout = gate rows then up rows), done in
    torch; it asserts the contract instead of trusting the adapter."""
    mod = types.ModuleType("sonicmoe")
    enums = types.ModuleType("sonicmoe.enums")

    class ActivationType:
        SWIGLU = "swiglu"

    enums.ActivationType = ActivationType

    def moe_general_routing_inputs(x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id,
                                   activation_type, is_inference_mode_enabled=False, concat_layout=False):
        I2, H, E_ = w1.shape
        assert (H, I2 // 2, E_) == tuple(w2.shape) and E == E_ and x.shape[1] == H
        for w in (w1, w2):  # stride order (2, 0, 1): E slowest, dim 1 fastest
            assert w.stride(1) == 1 and w.stride(0) == w.shape[1] and w.stride(2) == w.shape[0] * w.shape[1]
        assert token_indices.dtype == torch.int32 and expert_indices.dtype == torch.int32
        assert bool((token_indices.diff() >= 0).all()), "token_indices must be sorted"
        assert router_scores.dtype == torch.float32 and router_scores.shape == token_indices.shape
        assert b1 is None and b2 is None and activation_type == "swiglu" and not is_inference_mode_enabled
        calls.append(concat_layout)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            sel = (expert_indices == e).nonzero(as_tuple=True)[0]
            t = token_indices[sel].long()
            h = x[t] @ w1[:, :, e].t()
            g, u = (h[:, : I2 // 2], h[:, I2 // 2:]) if concat_layout else (h[:, 0::2], h[:, 1::2])
            out = out.index_add(0, t, (F.silu(g) * u @ w2[:, :, e].t()) * router_scores[sel].unsqueeze(-1))
        return out.to(x.dtype), torch.bincount(expert_indices.long(), minlength=E).int()

    mod.moe_general_routing_inputs = moe_general_routing_inputs
    mod.enums = enums
    return mod


@pytest.mark.slow
def test_sonicmoe_adapter_against_a_stand_in(monkeypatch):
    from baselines import sonicmoe

    calls: list = []
    mod = _fake_sonic(calls)
    monkeypatch.setitem(sys.modules, "sonicmoe", mod)
    monkeypatch.setitem(sys.modules, "sonicmoe.enums", mod.enums)
    case = _case()
    inp = _fp32_inputs(case)
    b = sonicmoe.SonicMoEBackend(case, None)
    b.setup(inp)
    assert calls == [True]  # setup's untimed forward + backward (QuACK's autotuning); concat_layout: gate, then up
    assert all(g is None or not g.any() for g in b.weight_grads().values())  # setup leaves no gradient behind
    _check_backend(b, case, inp)
    assert calls == [True, True]
    assert "moe_general_routing_inputs" in b.info()["notes"] and "untimed" in b.info()["notes"]


def test_sonic_routed_matches_a_per_expert_loop(monkeypatch):
    """The adapter's call (shared with mok_tools.sonic_precompile) through the stand-in, against plain torch."""
    from baselines import sonicmoe

    calls: list = []
    mod = _fake_sonic(calls)
    monkeypatch.setitem(sys.modules, "sonicmoe", mod)
    monkeypatch.setitem(sys.modules, "sonicmoe.enums", mod.enums)
    g = torch.Generator().manual_seed(1)
    T, H, I, E, K = 12, 16, 8, 4, 2
    x, w13 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g)
    w_TK, idx_TK = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, -1)
    got = sonicmoe.sonic_routed(x, idx_TK, w_TK, w13, w2)
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(idx_TK[t, k])
            h = w13[e] @ x[t]
            want[t] += w_TK[t, k] * (w2[e] @ (F.silu(h[:I]) * h[I:]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert calls == [True]


def test_sonic_precompile_small_problem_through_a_stand_in(monkeypatch):
    from mok_tools import sonic_precompile as P
    from mok_tools.shapes import shape_dims

    mod = _fake_sonic([])
    monkeypatch.setitem(sys.modules, "sonicmoe", mod)
    monkeypatch.setitem(sys.modules, "sonicmoe.enums", mod.enums)
    out, dx = P.run_small_problem(32, 16, 4, device="cpu")
    assert out.shape == (P.TOKENS, 32) and dx is not None and dx.shape == (P.TOKENS, 32) and bool(dx.abs().sum() > 0)
    assert shape_dims(["glm_5_2", "glm_5_2"]) == shape_dims(["glm_5_2"])


@pytest.mark.parametrize("env, args, says", [
    ({}, [], "set QUACK_CACHE_DIR"),
    ({"QUACK_CACHE_DIR": "CACHE"}, ["--shapes", "no_such_shape"], "unknown shape"),
    ({"QUACK_CACHE_DIR": "CACHE"}, ["--workers", "0"], "at least 1"),
    ({"QUACK_CACHE_DIR": "CACHE", "CUDA_VISIBLE_DEVICES": ""}, [],
     "pip install sonic-moe" if importlib.util.find_spec("sonicmoe") is None else "needs a Hopper"),
    ({"QUACK_CACHE_DIR": "CACHE"}, ["--cpu", "sm_80"], "an arch like sm_90a"),
    ({"QUACK_CACHE_DIR": "CACHE"}, ["--python", "3.12"], "with --cpu"),
    ({"QUACK_CACHE_DIR": "CACHE"}, ["--cpu", "sm_90a", "--python", "312"], "a version like 3.12"),
    ({"QUACK_CACHE_DIR": "CACHE"}, ["--cpu", "sm_90a"],
     "quack-kernels==0.3.11 is not installed" if importlib.util.find_spec("quack") is None else "sonic-moe"),
])
def test_sonic_precompile_refuses_what_cannot_run(tmp_path, env, args, says):
    _assert_refuses("mok_tools.sonic_precompile", ("QUACK_CACHE_DIR",), tmp_path, env, args, says)


def test_sonic_cpu_compile_arch_and_host():
    from mok_tools import sonic_cpu_compile as C

    assert C.parse_arch("sm_90a") == "sm_90a" and C.parse_arch("sm_100a") == "sm_100a"
    for bad in ("sm_90", "90", "sm_80a", "sm_90a "):
        with pytest.raises(ValueError):
            C.parse_arch(bad)
    cpu = C.host_cpu()
    assert cpu["model"] and isinstance(cpu["simd_flags"], list)
    if os.path.exists("/proc/cpuinfo"):  # every x86-64 CPU has SSE2 (the flags are what the host code is built for)
        assert "sse2" in cpu["simd_flags"] or platform.machine() != "x86_64"


def test_sonic_cpu_compile_environment(monkeypatch):
    from mok_tools import sonic_cpu_compile as C

    for k in ("CUTE_DSL_ARCH", "QUACK_ARCH", "TRITON_INTERPRET", "QUACK_COMPILE_WORKERS"):
        monkeypatch.setenv(k, "unset")  # restored (or removed) after the test
    C.set_environment("sm_90a")
    assert (os.environ["CUTE_DSL_ARCH"], os.environ["QUACK_ARCH"]) == ("sm_90a", "90")
    assert os.environ["TRITON_INTERPRET"] == "1" and os.environ["QUACK_COMPILE_WORKERS"] == "1"
    C.set_environment("sm_100a")
    assert os.environ["QUACK_ARCH"] == "100"


def _stand_in(monkeypatch, name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    if "." in name:
        parent, _, leaf = name.rpartition(".")
        monkeypatch.setattr(sys.modules[parent], leaf, mod, raising=False)
    return mod


def test_sonic_cpu_compile_apply_through_stand_ins(monkeypatch):
    """What --cpu changes, on stand-ins of QuACK and CuTe DSL (the real ones need Python >= 3.12 for sonic-moe): the
    driver check is skipped, compile-only is on, a CUDA-only GEMM op runs on CPU tensors, the autotuner's benchmark
    calls the config once (its compile), Triton launches are no-ops, and the cache fingerprint is the named Python's,
    computed by QuACK's own function."""
    import functools
    import hashlib

    import triton.runtime.autotuner as triton_autotuner
    import triton.runtime.interpreter as triton_interpreter

    from mok_tools import sonic_cpu_compile as C

    for cls, attr in ((triton_autotuner.Autotuner, "do_bench"), (triton_interpreter.InterpretedFunction, "run")):
        monkeypatch.setattr(cls, attr, cls.__dict__[attr])  # restored after the test

    class Compiler:
        def _check_cuda_dependencies_once(self, shared_libs):
            raise RuntimeError("no driver")

    _stand_in(monkeypatch, "cutlass")
    _stand_in(monkeypatch, "cutlass.base_dsl")
    _stand_in(monkeypatch, "cutlass.base_dsl.compiler", Compiler=Compiler)

    class Autotuner:
        @property
        def do_bench(self):
            raise RuntimeError("needs a GPU")

    calls = []

    @torch.library.custom_op("mokbench_test::cuda_only_gemm", mutates_args={"out"}, device_types="cuda")
    def cuda_only_gemm(a: torch.Tensor, out: torch.Tensor) -> None:
        calls.append(a.device.type)

    _stand_in(monkeypatch, "quack")
    _stand_in(monkeypatch, "quack.autotuner", Autotuner=Autotuner, _gpu_warmup=lambda: 1 / 0)
    cache = _stand_in(monkeypatch, "quack.cache_utils", COMPILE_ONLY=False, sys=sys, hashlib=hashlib,
                      functools=functools)
    exec("@functools.lru_cache(maxsize=1)\ndef _compute_source_fingerprint():\n"  # reads its module's sys, as QuACK's
         "    return hashlib.sha256(f'py{sys.version_info.major}.{sys.version_info.minor}'.encode()).hexdigest()",
         cache.__dict__)
    _stand_in(monkeypatch, "quack.gemm_interface", gemm_out=cuda_only_gemm)
    here = cache._compute_source_fingerprint()

    C.apply("3.9")
    Compiler()._check_cuda_dependencies_once([])
    assert cache.COMPILE_ONLY is True
    sys.modules["quack.autotuner"]._gpu_warmup()
    cuda_only_gemm(torch.zeros(2), torch.zeros(2))
    assert calls == ["cpu"]
    assert Autotuner().do_bench(lambda: calls.append("config"), quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
    assert calls == ["cpu", "config"]
    assert triton_interpreter.InterpretedFunction.run(object(), 1, grid=(1,)) is None
    assert C.fingerprint() == hashlib.sha256(b"py3.9").hexdigest() != here or sys.version_info[:2] == (3, 9)


def test_sonic_notes_cite_a_precompiled_cache(monkeypatch, tmp_path):
    from baselines import sonicmoe

    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path))
    assert sonicmoe.precompile_record() is None
    b = sonicmoe.SonicMoEBackend(_case(), None)
    b.params, b.autotune_s = types.SimpleNamespace(columns=lambda: {}), 12.5
    assert "compiled ahead" not in b.info()["notes"] and str(tmp_path) in b.info()["notes"]
    (tmp_path / sonicmoe.PRECOMPILE_RECORD).write_text(
        '{"workers": 16, "seconds": 530.2, "utc": "2026-12-05T10:00:00Z"}')
    assert "compiled ahead by mok_tools.sonic_precompile: 16 workers, 530.2 s" in b.info()["notes"]
    (tmp_path / sonicmoe.PRECOMPILE_RECORD).write_text(
        '{"workers": 1, "seconds": 155.8, "utc": "2026-12-04T21:30:00Z", "compiled_on": {"mode": "cpu", '
        '"arch": "sm_90a", "host_cpu": {"model": "AMD EPYC", "simd_flags": ["avx2"]}, "fingerprint_python": "3.12"}}')
    assert "compiled ahead without a GPU by mok_tools.sonic_precompile --cpu sm_90a on AMD EPYC" in b.info()["notes"]


def test_sonicmoe_unsupported_reasons(monkeypatch):
    from baselines import sonicmoe

    gpu = dataclasses.replace(_case(), device="cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    why = sonicmoe.SonicMoEBackend.unsupported_reason(gpu)
    assert "not installed" in why and "torch<=2.9.1" in why and "pip install sonic-moe==0.1.2.post1" in why
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert "bf16 only" in sonicmoe.SonicMoEBackend.unsupported_reason(dataclasses.replace(gpu, precision="fp8"))
    assert "no clamp" in sonicmoe.SonicMoEBackend.unsupported_reason(dataclasses.replace(gpu, swiglu_limit=7.0))
    assert "ep_size=1" in sonicmoe.SonicMoEBackend.unsupported_reason(dataclasses.replace(gpu, ep_size=2))
    assert "Hopper (SM90)" in sonicmoe.SonicMoEBackend.unsupported_reason(_case())
    monkeypatch.setattr(sonicmoe, "device_capability", lambda dev: (9, 0))
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # installed but does not import
    why = sonicmoe.SonicMoEBackend.unsupported_reason(gpu)
    assert "does not import with torch" in why and "torch<=2.9.1" in why


@pytest.mark.parametrize("version,ok", [("2.9.1", True), ("2.9.1+cu128", True), ("2.8.0", True),
                                        ("2.11.0+cu130", False), ("2.10.0a0", False)])
def test_sonicmoe_torch_pin(version, ok):
    from baselines.sonicmoe import torch_within_pin

    assert torch_within_pin(version) is ok


@pytest.mark.slow
def test_anchors_on_the_cpu_are_unsupported_rows_beside_ok_rows(results_dir):
    """A CPU sweep point with both anchors: each gets an unsupported row per direction with its reason, nccl runs."""
    from conftest import cpu_cfg
    from harness.measure.runner import run_benchmark

    df = run_benchmark(cpu_cfg(results_dir, "ep_size=1", "backends=[nccl,liger,sonicmoe]", "directions=[fwd,bwd]"))
    st = {(r.backend, r.direction): (r.status, str(r.error)) for r in df.itertuples()}
    assert st[("nccl", "fwd")][0] == "ok" and st[("nccl", "bwd")][0] == "ok"
    for d in ("fwd", "bwd"):
        assert st[("liger", d)][0] == "unsupported"
        assert ("CUDA GPU" if HAS_LIGER else "pip install liger-kernel") in st[("liger", d)][1]
        assert st[("sonicmoe", d)][0] == "unsupported" and "sonic" in st[("sonicmoe", d)][1].lower()


# ---- nccl compiled: how inductor autotuned --------------------------------------------------------------------------


def test_nccl_notes_say_inductor_autotuned_in_subprocesses(monkeypatch):
    """With TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1 (what nccl's published max-autotune needs at EP=1: docs/backends.md,
    "Anchors: Liger-Kernel and SonicMoE") a compiled nccl row says so; an eager row, or autotuning in the process,
    says nothing."""
    from torch._inductor import config

    from baselines import nccl

    code = "from baselines.nccl import inductor_note; print(inductor_note(True))"
    for value, says in (("1", "inductor autotuning in subprocesses (TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1)"), ("0", "")):
        env = dict(os.environ, TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == says
    b = nccl.NcclBackend.__new__(nccl.NcclBackend)
    for compiled, sub in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(config, "autotune_in_subproc", sub)
        b.params = types.SimpleNamespace(columns=lambda dispatch, c=compiled: {"compiled": c}, gemm_name=lambda: "g",
                                         compile_note="")
        notes = b.info()["notes"]
        assert notes.startswith("grouped GEMM: g; shared expert not overlapped")
        assert ("inductor autotuning in subprocesses" in notes) == (compiled and sub)


# ---- LigerCute and DeepGEMM MegaMoE through the harness (their adapters: test_anchors_ep.py) ------------------


@pytest.mark.slow
def test_harness_rows_of_the_new_anchors_on_the_cpu(results_dir):
    """One CPU point: both new anchors give an unsupported row per direction with their reason; nccl still runs."""
    from conftest import cpu_cfg
    from harness.measure.runner import run_benchmark

    df = run_benchmark(cpu_cfg(results_dir, "ep_size=1", "backends=[nccl,liger_cute,deepgemm_megamoe]",
                               "directions=[fwd,bwd]"))
    st = {(r.backend, r.direction): (r.status, str(r.error)) for r in df.itertuples()}
    assert st[("nccl", "fwd")][0] == "ok" and st[("nccl", "bwd")][0] == "ok"
    for d in ("fwd", "bwd"):
        assert st[("liger_cute", d)][0] == "unsupported" and "Hopper (SM90)" in st[("liger_cute", d)][1]
        assert st[("deepgemm_megamoe", d)] == ("unsupported", st[("deepgemm_megamoe", "fwd")][1])
        assert "fp8 only" in st[("deepgemm_megamoe", d)][1]


@pytest.mark.slow
def test_megamoe_beside_mok_hopper_inference_is_one_valid_run(tmp_path):
    """The comparison's command line on the CPU: exit 0, megamoe's row unsupported (no SM90 GPU), mok_hopper's
    inference forward (its CPU twin) ok."""
    from harness.core import results

    out = tmp_path / "res"
    r = subprocess.run([sys.executable, "-m", "harness.run", "backends=[deepgemm_megamoe,mok_hopper]", "precision=fp8",
                        "mok_hopper_forward=inference", "direction=fwd", "ep_size=1", "timing.num_iters=2",
                        f"results_dir={out}", "print_table=false"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
    df = results.load(out)
    st = {r.backend: (r.status, str(r.error)) for r in df.itertuples()}
    assert set(df["direction"]) == {"fwd"} and st["mok_hopper"][0] == "ok"
    megamoe = st["deepgemm_megamoe"]
    assert megamoe[0] == "unsupported" and "Hopper GPU (SM90); this is the CPU" in megamoe[1]
