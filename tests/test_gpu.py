"""GPU runs of the harness (skipped without a CUDA GPU). Run on the H200 machines."""

from __future__ import annotations

import pytest
from conftest import HAS_GPU, NUM_GPUS, compose_cfg

from harness.measure.runner import run_benchmark

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine")]


def gpu_cfg(results_dir, *overrides):
    return compose_cfg("device=cuda", "shape=tiny", "timing=quick", "workload.tokens_per_gpu=256",
                       f"results_dir={results_dir}", "print_table=false", *overrides)


@pytest.mark.parametrize("compiled", [False, True])
def test_nccl_matches_reference_on_gpu(results_dir, compiled):
    ep = min(NUM_GPUS, 2)
    df = run_benchmark(gpu_cfg(results_dir, f"ep_size={ep}", f"compile={str(compiled).lower()}", "compile_mode=default",
                               "directions=[fwd,bwd,fwd_bwd]"))
    assert (df.status == "ok").all(), df[["direction", "status", "error", "rel_err", "max_abs_err"]].to_string()
    # the gate passes at the tolerance (error <= tol): compiled, one bf16 ulp at |x| in [64, 128) is exactly 0.5
    assert (df.rel_err <= 0.01).all() and (df.max_abs_err <= 0.5).all()
    assert (df.compiled == compiled).all() and df.gpu_name.str.contains("H|A|B|L").all()


def test_fp8_runs_on_hopper(results_dir):
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    df = run_benchmark(gpu_cfg(results_dir, f"ep_size={min(NUM_GPUS, 2)}", "precision=fp8", "directions=[fwd]"))
    assert (df.status == "ok").all(), df.error.tolist()


@pytest.mark.multigpu
@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")
def test_published_shape_smoke(results_dir):
    df = run_benchmark(compose_cfg("device=cuda", "shape=glm_5_2", "timing=quick", "ep_size=2", "compile=false",
                                   f"results_dir={results_dir}", "print_table=false", "directions=[fwd]"))
    r = df.iloc[0]
    assert r.status == "ok", r.error
    assert r.dispatch_gb_s > 50 and r.raw_a2a_gb_s > 50


@pytest.mark.multigpu
@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs (DeepEP has no single-rank path)")
@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_deepep_backends_match_reference_on_gpu(results_dir, backend):
    """DeepEP V1 and HybridEP with the PyTorch experts, forward and backward, against the reference (HybridEP's
    constructor needs the libstdc++ preload of ``baselines.deepep.import_deep_ep``)."""
    import importlib.util

    if importlib.util.find_spec("deep_ep") is None:
        pytest.skip("deep_ep not installed (docs/backends.md, 'DeepEP and HybridEP')")
    df = run_benchmark(gpu_cfg(results_dir, "ep_size=2", f"backends=[{backend}]", "compile=false",
                               "directions=[fwd,bwd,fwd_bwd]"))
    show = df[["direction", "status", "error", "rel_err", "max_abs_err"]].to_string()
    assert sorted(df.direction) == ["bwd", "fwd", "fwd_bwd"], show
    assert (df.status == "ok").all() and (df.rel_err <= 0.01).all() and (df.max_abs_err <= 0.5).all(), show


def test_rows_record_the_gpu_clock_and_power(results_dir):
    """NVML through ctypes on a real driver: the SM clock and board power of the timed iterations."""
    df = run_benchmark(gpu_cfg(results_dir, "ep_size=1", "backends=[nccl]", "directions=[fwd]",
                               "timing.num_iters=2000"))
    r = df.iloc[0]
    assert r.status == "ok", r.error
    assert 100 < r.sm_clock_min_mhz <= r.sm_clock_mhz < 4000 and 10 < r.power_w < 2000
    assert 0 <= r.power_capped_fraction <= 1 and 0 <= r.thermal_capped_fraction <= 1
