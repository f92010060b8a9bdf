"""On a GPU (skipped without CUDA): a backend that took device memory and failed costs the next one nothing. A
planted backend holds 8 GiB in a reference cycle and raises in its setup; mok_hopper then runs glm_5_2 in the same
process, which on an 80 GB H100 fits only with that memory given back. Run:

    python -m pytest -m gpu tests/test_gpu_cleanup.py -q
"""

from __future__ import annotations

import pytest
from conftest import HAS_GPU, compose_cfg, use_fake_backends

from harness.measure import runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine: the planted "
                                                                      "backend holds device memory")]


def test_planted_backend_then_mok_hopper_on_glm_5_2(monkeypatch, tmp_path):
    use_fake_backends(monkeypatch, "holds_device_memory=fake_backends:HoldsDeviceMemoryAndFails")
    monkeypatch.setenv("MOKBENCH_PLANTED_GIB", "8")
    cfg = compose_cfg("device=cuda", "ep_size=1", "shape=glm_5_2", "backends=[holds_device_memory,mok_hopper]",
                      "timing=quick", "directions=[fwd,bwd]", f"results_dir={tmp_path}", "print_table=false")
    df = runner.run_benchmark(cfg)
    held = df[df["backend"] == "holds_device_memory"]
    assert (held["status"] == "error").all() and held["error"].str.contains("boom after taking 8").all()
    mok = df[df["backend"] == "mok_hopper"].sort_values("direction")
    assert list(mok["status"]) == ["ok", "ok"], mok[["status", "error"]].to_string()
    assert not mok["notes"].fillna("").str.contains("fresh processes").any(), "the memory did not come back"
    assert (mok["mem_peak_own_bytes"] > 0).all()
