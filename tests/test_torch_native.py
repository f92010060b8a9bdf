"""The PyTorch-native layer (baselines/torch_native.py) and the compile fallback (baselines/compile_modes.py) on the
CPU: both implementations against the reference through the harness, its refusals, and the fallback order."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from baselines import compile_modes
from baselines.common import inverse_permutation
from conftest import cpu_cfg
from harness.measure import runner

HAS_TITAN = importlib.util.find_spec("torchtitan") is not None
NO_TITAN = ("torchtitan is not installed here: it is the README's optional set-up line "
            "(pip install --no-deps -r requirements-torchtitan.txt)")


def _run(results_dir, *overrides):
    return runner.run_benchmark(cpu_cfg(results_dir, "ep_size=1", *overrides))


@pytest.mark.parametrize("impl", ["plain", pytest.param("torchtitan", marks=pytest.mark.skipif(not HAS_TITAN,
                                                                                              reason=NO_TITAN))])
def test_torch_layer_matches_the_reference(results_dir, impl):
    df = _run(results_dir, "backends=[torch]", f"torch.impl={impl}")
    assert list(df.sort_values("direction")["status"]) == ["ok", "ok"], df[["status", "error"]].to_string()
    assert df["notes"].str.contains(f"impl={impl}").all() and df["notes"].str.contains("no host sync").all()
    assert (df["backend_options"] == f"fp8_gemm=auto,impl={impl}").all()
    assert (~df["compiled"].astype(bool)).all()


@pytest.mark.skipif(not HAS_TITAN, reason=NO_TITAN)
def test_auto_times_both_and_keeps_the_faster(results_dir):
    df = _run(results_dir, "backends=[torch]", "directions=[fwd]")
    note = df["notes"].iloc[0]
    assert df["status"].iloc[0] == "ok"
    times = dict(part.rsplit(" ", 1) for part in note.split("median ms): ")[1].split(";")[0].split(", "))
    fastest = min(times, key=lambda k: float(times[k]))
    assert note.startswith(f"impl={fastest}:")


def test_fp8_runs_the_plain_layer_and_refuses_torchtitan(results_dir, tmp_path):
    df = _run(results_dir, "backends=[torch]", "precision=fp8")
    assert (df["status"] == "ok").all(), df[["status", "error"]].to_string()
    assert df["scaling"].str.contains("emulated").all()  # a CPU has no fp8 GEMM: the row says accuracy only
    refused = _run(tmp_path / "t", "backends=[torch]", "precision=fp8", "torch.impl=torchtitan")
    assert (refused["status"] == "unsupported").all() and refused["error"].str.contains("torch.impl=plain").all()


def test_single_gpu_layer_refuses_ep2(results_dir):
    df = runner.run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[torch,torch_compiled]"))
    assert (df["status"] == "unsupported").all()
    assert df["error"].str.contains("single-GPU layer").all() and df["error"].str.contains("nccl").all()


@pytest.mark.slow
def test_compiled_layer_matches_the_reference(results_dir):
    """The whole layer under one fullgraph torch.compile (inductor on the CPU): ok, and it compiled (no fallback)."""
    df = _run(results_dir, "backends=[torch_compiled]", "torch_compiled.impl=plain", "compile_mode=default")
    assert list(df["status"]) == ["ok", "ok"], df[["status", "error"]].to_string()
    assert df["compiled"].astype(bool).all() and (df["compile_mode"] == "default").all()
    assert not df["notes"].str.contains("fell back").any()


def test_inverse_permutation():
    order = torch.randperm(97)
    inv = inverse_permutation(order)
    assert torch.equal(inv, torch.argsort(order))
    assert torch.equal(order[inv], torch.arange(97))


def test_fallback_order():
    assert compile_modes.modes_from("max-autotune") == ("max-autotune", "max-autotune-no-cudagraphs", "default",
                                                        "eager")
    assert compile_modes.modes_from("default") == ("default", "eager")
    assert compile_modes.modes_from("reduce-overhead")[0] == "reduce-overhead"


def test_fallback_tries_the_next_mode_with_a_fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MOKBENCH_INDUCTOR_CACHE_PARENT", raising=False)
    caches, dropped = [], []
    monkeypatch.setattr(compile_modes, "drop_compiled_state", lambda: dropped.append(1))

    def build(mode):
        caches.append(compile_modes.os.environ["TORCHINDUCTOR_CACHE_DIR"])
        if mode.startswith("max-autotune"):
            raise RuntimeError(f"NoValidChoicesError in {mode}\nmore lines")
        return mode

    fn, out = compile_modes.compile_with_fallback("max-autotune", build, lambda f: None)
    assert fn == out.mode == "default"
    assert [m for m, _ in out.failures] == ["max-autotune", "max-autotune-no-cudagraphs"]
    assert "RuntimeError: NoValidChoicesError in max-autotune" in out.note and "more lines" not in out.note
    assert len(set(caches)) == 3 and all(c.startswith(str(tmp_path)) for c in caches)
    assert len(dropped) == 2


def test_fallback_agrees_across_ranks():
    """A mode that fails on another rank fails here too (the agreed outcome), and eager's failure is raised."""
    fails_elsewhere = iter([True, False])
    fn, out = compile_modes.compile_with_fallback("default", lambda m: m, lambda f: None,
                                                  agree=lambda failed: failed or next(fails_elsewhere))
    assert out.mode == "eager" and out.failures == [("default", "failed on another rank")]
    with pytest.raises(ValueError):
        compile_modes.compile_with_fallback("eager", lambda m: m, lambda f: (_ for _ in ()).throw(ValueError("x")))


def test_nccl_warms_its_compile_and_falls_back(monkeypatch, results_dir):
    """nccl compiles in its setup on the rank's shapes; a mode that fails there gives the next one, recorded in the
    row's compile_mode and notes (torch.compile stood in: the fallback, not inductor, is under test)."""
    real = torch.compile

    def fake_compile(fn, mode=None, **kw):
        if mode == "max-autotune-no-cudagraphs":
            def broken(*a, **k):
                raise RuntimeError("InductorError: NoValidChoicesError (planted)")
            return broken
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    from conftest import free_port_env

    free_port_env(monkeypatch)
    try:
        df = _run(results_dir, "backends=[nccl]", "compile=true", "compile_mode=max-autotune-no-cudagraphs")
    finally:
        monkeypatch.setattr(torch, "compile", real)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    assert (df["status"] == "ok").all(), df[["status", "error"]].to_string()
    assert (df["compile_mode"] == "default").all()
    assert df["notes"].str.contains("compile fell back to default").all()
    assert df["notes"].str.contains("NoValidChoicesError").all()


@pytest.mark.parametrize("backend", ["nccl", "torch_compiled"])
def test_the_compile_warm_never_accumulates_into_a_gradient_of_the_last_call(monkeypatch, results_dir, backend):
    """Under CUDA graphs (max-autotune) a weight's gradient is an output of the last replay, which the next replay
    overwrites: the warm calls must leave no gradient for the next call to accumulate into (on an H100 nccl's warm
    failed so in every mode, eager included, once a try had left one). Stood in on the CPU: the 'compiled' layer
    refuses to run while a weight it takes still has a gradient."""
    real = torch.compile

    def fake_compile(fn, mode=None, **kw):
        def graphed(*args, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.is_leaf and a.grad is not None for a in args):
                raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten (planted)")
            return fn(*args, **kwargs)
        return graphed if mode == "max-autotune" else fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    from conftest import free_port_env

    free_port_env(monkeypatch)
    try:
        df = _run(results_dir, f"backends=[{backend}]", "compile=true", "compile_mode=max-autotune")
    finally:
        monkeypatch.setattr(torch, "compile", real)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    assert (df["status"] == "ok").all(), df[["status", "error"]].to_string()
    assert (df["compile_mode"] == "max-autotune").all(), df[["compile_mode", "notes"]].to_string()
    assert not df["notes"].fillna("").str.contains("compile fell back").any()
