"""The results schema, atomic writes, the loader, and the timing statistics."""

from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from harness.core import results
from harness.measure.timing import Stats, Timer

CONTRACT = ("run_id timestamp git_sha config_hash backend shape precision scaling direction compiled tokens_per_gpu "
            "ep_size num_nodes world_size routing status error latency_ms latency_p20_ms latency_p80_ms "
            "latency_min_ms latency_max_ms num_warmup num_iters tflops_per_gpu tokens_per_s_per_gpu max_abs_err "
            "rel_err gpu_name num_gpus slurm_job_id torch_version cuda_version nccl_version dispatch_bytes "
            "combine_bytes dispatch_local_bytes combine_local_bytes dispatch_gb_s combine_gb_s roofline_fraction "
            "local_experts").split()


def row(**kw):
    base = {"run_id": "r1", "row_id": results.new_row_id(), "backend": "nccl", "shape": "tiny", "direction": "fwd",
            "status": "ok", "latency_ms": 1.5, "compiled": True, "ep_size": 2}
    base.update(kw)
    return base


def test_every_contract_column_exists_and_status_values():
    for col in CONTRACT:
        assert col in results.COLUMNS, col
    assert set(results.STATUSES) == {"ok", "unsupported", "mismatch", "error", "oom", "timeout", "cancelled"}
    for col in ("deepep_version", "transformer_engine_version", "megatron_core_version", "mok_version"):
        assert col in results.COLUMNS


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_roundtrip_keeps_types_and_leaves_no_temp_files(tmp_path, fmt):
    path = results.job_file(tmp_path, "r1", "abc", fmt)
    rows = [row(), row(direction="bwd", status="error", error="boom", latency_ms=None, compiled=False)]
    results.write_rows(path, rows[:1])
    results.write_rows(path, rows)  # the job's own file grows atomically
    df = results.load(tmp_path)
    assert len(df) == 2 and list(df.columns[: len(results.COLUMNS)]) == list(results.COLUMNS)
    assert df.latency_ms.dtype == "float64" and str(df.compiled.dtype) == "boolean"
    assert df.compiled.tolist() == [True, False] and pd.isna(df.latency_ms.iloc[1])
    assert str(df.ep_size.dtype) == "Int64"
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_repeated_runs_are_never_merged_away(tmp_path):
    a = results.job_file(tmp_path, "run-a", "h", "csv")
    results.write_rows(a, [row(run_id="run-a", row_id="x1")])
    b = results.job_file(tmp_path, "run-b", "h", "csv")
    results.write_rows(b, [row(run_id="run-b", row_id="x1", latency_ms=2.0)])  # same config, another run
    df = results.load(tmp_path)
    assert sorted(df.run_id) == ["run-a", "run-b"] and sorted(df.latency_ms) == [1.5, 2.0]


def test_job_files_never_collide(tmp_path):
    names = {results.job_file(tmp_path, "r", "h").name for _ in range(200)}
    assert len(names) == 200


def test_loader_skips_non_result_tables_and_rejects_duplicate_keys(tmp_path):
    (tmp_path / "published.csv").write_text("panel,shape,tflops\nbf16 fwd,kimi,982\n")
    p = results.job_file(tmp_path, "r", "h")
    results.write_rows(p, [row(row_id="k")])
    assert len(results.load(tmp_path)) == 1
    results.write_rows(p.with_name("copy.csv"), [row(row_id="k")])
    with pytest.raises(ValueError, match="share a"):
        results.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        results.load(tmp_path / "missing")


def test_stats_are_median_and_quantiles():
    s = Stats.from_samples(torch.arange(1, 101, dtype=torch.float64), num_warmup=3)
    assert s.median_ms == pytest.approx(50.5) and s.p20_ms == pytest.approx(20.8) and s.p80_ms == pytest.approx(80.2)
    assert (s.min_ms, s.max_ms, s.num_iters, s.num_warmup) == (1, 100, 100, 3)


def test_host_timer_measures_and_runs_pre_untimed(monkeypatch):
    """The host clock is the test's own: each timed call advances it 20 ms and each ``pre`` 50 ms, so the samples
    are exact however the machine schedules the process."""
    import types

    from harness.measure import timing

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from harness.measure.dist import free_port

    now = [1000.0]  # seconds

    def advance(s):
        now[0] += s

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        calls = []
        t = Timer(torch.device("cpu"), dist.group.WORLD)
        s = t.run(lambda: advance(0.02), num_warmup=1, num_iters=4, pre=lambda: (calls.append(1), advance(0.05)))
        assert s.median_ms == pytest.approx(20.0) and s.min_ms == pytest.approx(20.0)  # the 50 ms pre is untimed
        assert s.max_ms == pytest.approx(20.0) and len(calls) == 5 and s.num_iters == 4
    finally:
        dist.destroy_process_group()


def test_base_row_and_make_row_build_schema_rows():
    """The row builders live with the schema: every column they set is a schema column, each row gets its own id and
    timestamp, and a row's own values override the point's."""
    from conftest import compose_cfg

    from harness.config.point import Point
    from harness.config.point import resolve

    point = Point.build(resolve(compose_cfg("device=cpu", "shape=tiny", "workload=zipf")), ep_size=2, device="cpu")
    base = results.base_row(point, run_id="r1", num_nodes=1, world_size=2, env={"gpu_name": None, "hostname": "h"})
    assert (base["shape"], base["ep_size"], base["world_size"], base["hostname"]) == ("tiny", 2, 2, "h")
    assert base["routing"] == "zipf(s=1)" and base["config_hash"] == point.config_hash  # the label, not the name
    # every column of the point is a schema column, and every field of its case is a column or said elsewhere
    assert set(point.columns()) <= set(results.COLUMNS), set(point.columns()) - set(results.COLUMNS)
    assert {"zipf_exponent", "act_block", "compile"}.isdisjoint(base)
    a = results.make_row(base, "nccl", "fwd", "ok", latency_ms=1.0, hostname="other")
    b = results.make_row(base, "nccl", "bwd", "error", error="boom")
    assert a["row_id"] != b["row_id"] and a["timestamp"] and a["hostname"] == "other" and base["hostname"] == "h"
    assert set(a) | set(b) <= set(results.COLUMNS), (set(a) | set(b)) - set(results.COLUMNS)
    df = results.to_frame([a, b])
    assert list(df["status"]) == ["ok", "error"] and df["config_hash"].eq(point.config_hash).all()
