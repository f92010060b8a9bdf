"""The mok_hopper backend inside the harness, on gloo ranks: the CPU twin is checked against the reference like
any backend, forward and backward (the twin's backward on the same ranks), its byte counts follow the routing; the
upstream ``mok`` backend becomes an ``unsupported`` row with its reason. Also the backend's reasons on CUDA
machines, and which directions it declines for which cases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import cpu_cfg

from harness.measure.runner import run_benchmark
from mok_kernels.mok_hopper.backend import MokHopperBackend


def by(df, backend, direction):
    sel = df[(df.backend == backend) & (df.direction == direction)]
    assert len(sel) == 1, f"expected one {backend}/{direction} row, got {len(sel)}"
    return sel.iloc[0]


@pytest.mark.slow
def test_cpu_twin_passes_the_reference_gate_and_mok_is_unsupported(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "ep_size=2", "backends=[mok_hopper,mok]",
                               "directions=[fwd,bwd,fwd_bwd]"))
    r = by(df, "mok_hopper", "fwd")
    assert r.status == "ok", r.error
    assert r.rel_err < 0.01 and r.max_abs_err < 0.5 and r.rel_err > 0  # bf16 gate; a real comparison happened
    assert "CPU twin" in r.notes and r.latency_ms > 0
    # T * topk rows leave each rank in dispatch and come back in combine (bf16 rows)
    assert r.dispatch_bytes + r.dispatch_local_bytes == 64 * 2 * 256 * 2
    assert r.combine_bytes + r.combine_local_bytes == 64 * 2 * 256 * 2
    assert "training forward (saves X and H)" in r.notes
    for d in ("bwd", "fwd_bwd"):  # the output and all 8 gradients within the bf16 gate
        b = by(df, "mok_hopper", d)
        assert b.status == "ok", b.error
        assert 0 < b.rel_err < 0.01 and b.latency_ms > 0
    for d in ("fwd", "bwd"):
        m = by(df, "mok", d)
        assert m.status == "unsupported" and "Blackwell" in m.error


def _case(**kw):
    base = dict(precision="bf16", device="cuda", hidden=7168, ffn=2048)
    base.update(kw)
    return SimpleNamespace(**base)


def test_unsupported_reasons(monkeypatch):
    import torch

    assert "use the `mok` backend on Blackwell" in MokHopperBackend.unsupported_reason(_case(precision="mxfp8"))
    assert MokHopperBackend.unsupported_reason(_case(device="cpu")) is None  # the twin
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "fp8 needs compute capability 8.9+" in MokHopperBackend.unsupported_reason(_case(precision="fp8"))
    assert MokHopperBackend.unsupported_reason(_case()) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    assert "SM80+" in MokHopperBackend.unsupported_reason(_case())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert "multiples of 128" in MokHopperBackend.unsupported_reason(_case(ffn=1000))


@pytest.mark.slow
def test_inference_forward_declines_the_backward(results_dir):
    df = run_benchmark(cpu_cfg(results_dir, "backends=[mok_hopper]", "directions=[fwd,bwd]",
                               "mok_hopper_forward=inference"))
    r = by(df, "mok_hopper", "fwd")
    assert r.status == "ok", r.error
    assert "inference forward (saves nothing)" in r.notes
    b = by(df, "mok_hopper", "bwd")
    assert b.status == "unsupported" and "mok_hopper_forward=inference saves nothing" in b.error
    # the alias reached the backend's own option
    assert (df.backend_options == "forward=inference,weights=plain,rows=packed").all()


def test_directions_it_declines():
    from contract import direction_unsupported

    from mok_kernels.mok_hopper.options import MokHopperOptions

    def why(direction, forward="save_h", **kw):
        base = dict(precision="bf16", device="cuda", ep_size=1)
        return direction_unsupported(MokHopperBackend, SimpleNamespace(**{**base, **kw}), direction,
                                     MokHopperOptions(forward=forward))

    assert why("fwd", precision="fp8", ep_size=8) is None
    assert why("bwd") is None and why("fwd_bwd", forward="recompute") is None
    assert why("bwd", device="cpu", ep_size=4) is None  # the twin's backward
    assert why("bwd", precision="fp8") is None and why("fwd_bwd", precision="fp8", ep_size=2) is None  # issue 25
    assert why("fwd_bwd", ep_size=2) is None  # across ranks: the dO pull and the dX push
    assert "saves nothing" in why("bwd", forward="inference") and why("fwd", forward="inference") is None
    # without options (a tool or test that builds the backend itself): the defaults
    assert direction_unsupported(MokHopperBackend, SimpleNamespace(precision="bf16", device="cuda", ep_size=1),
                                 "bwd") is None


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_traffic_row_bytes(precision):
    b = MokHopperBackend.__new__(MokHopperBackend)
    b.case = SimpleNamespace(device="cpu", hidden=4096, precision=precision)
    b.impl = SimpleNamespace(rows_per_peer=lambda: ([3, 4], [5, 6]))
    tr = b.traffic()
    assert tr["dispatch_rows_to"] == [3, 4] and tr["combine_rows_to"] == [5, 6]
    assert tr["dispatch_row_bytes"] == (4096 + 4 * 32 if precision == "fp8" else 8192)
    assert tr["combine_row_bytes"] == 8192


def test_rows_packed_is_the_default_option_of_the_backend_and_padded_hashes_as_before_it(results_dir):
    """``mok_hopper.rows=packed`` (alias ``mok_hopper_rows``; the default) reaches the backend and enters the point's
    hash (padded, the value before the option, does not), and on the CPU twin says that it acts on the CUDA kernels
    only."""
    import json

    from harness.config.point import make_case
    from harness.config.schema import config_hash
    from mok_kernels.mok_hopper.tiles import TileConfig, packed_rows

    df = run_benchmark(cpu_cfg(results_dir, "backends=[mok_hopper]", "directions=[fwd]", "mok_hopper_rows=packed"))
    r = by(df, "mok_hopper", "fwd")
    assert r.status == "ok", r.error
    assert r.backend_options == "forward=save_h,weights=plain,rows=packed"
    assert "acts on the CUDA kernels only" in r.notes
    c = json.loads(r.point_config)
    assert config_hash(c, make_case(c, ep_size=int(r.ep_size), device=r.device)) == r.config_hash
    c["mok_hopper"]["rows"] = "padded"
    assert config_hash(c, make_case(c, ep_size=int(r.ep_size), device=r.device)) != r.config_hash
    t = packed_rows(TileConfig(half_tiles=True, tail_rows=16, save_h_tma=True))
    assert t.packed_rows and t.tail_rows == 0 and not t.save_h_tma
