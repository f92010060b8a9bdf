"""Claims table, published data and the roofline floors, on small synthetic tables."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness.report import claims as C  # noqa: E402
from harness.report import labels as L  # noqa: E402
from harness.report import report as R  # noqa: E402
from harness.core import results  # noqa: E402
from harness.core.roofline import attach_calibration, layer_floors, layer_flops, load_calibration  # noqa: E402

# best baseline per published cell, as read in docs/methodology.md section 10 (values: results/published/)
PUBLISHED_BEST = {
    ("mxfp8", "fwd"): ["hybridep_megatron"] * 4,
    ("mxfp8", "bwd"): ["hybridep_megatron"] * 4,
    ("bf16", "fwd"): ["deepep", "hybridep_megatron", "deepep", "deepep"],
    ("bf16", "bwd"): ["deepep", "hybridep_megatron", "deepep", "deepep"],
}
CLAIMED = {("mxfp8", "fwd"): 2.37, ("mxfp8", "bwd"): 1.78, ("bf16", "fwd"): 1.92, ("bf16", "bwd"): 1.58}


@pytest.fixture(scope="module")
def published() -> pd.DataFrame:
    return C.load_published()


# ---------------------------------------------------------------------------------------------------------------
# published data


def test_published_file_is_labelled_and_not_a_results_file(published):
    assert len(published) == 5 * 4 * 4  # systems x shapes x panels
    assert set(published["backend"]) == {"nccl", "deepep", "deepep_te", "hybridep_megatron", "mok"}
    assert (published["gpu_name"] == "GB300 (published)").all()
    assert published["run_id"].str.startswith("published:").all()
    assert published["source"].str.contains("read off published figure").all()
    assert (published["ep_size"] == 64).all() and (published["tokens_per_gpu"] == 2048).all()
    assert C.is_published(published).all()
    # the loader never mistakes it for measurements
    assert len(results.load(C.PUBLISHED_DIR)) == 0


def test_published_latency_is_implied_by_the_formula(published):
    mok = published[published["backend"] == "mok"].set_index(["precision", "direction", "shape"])
    # docs/methodology.md section 10: implied MoK latency
    assert mok.loc[("mxfp8", "fwd", "qwen3_5_397b"), "latency_ms"] == pytest.approx(1.06, abs=0.01)
    assert mok.loc[("bf16", "bwd", "deepseek_v4_pro"), "latency_ms"] == pytest.approx(3.42, abs=0.01)
    assert mok.loc[("mxfp8", "fwd", "kimi_k2_7"), "flops_per_gpu"] == pytest.approx(1.623e12, rel=1e-3)


def test_load_published_refuses_a_results_file(tmp_path):
    p = results.write_rows(tmp_path / "r.csv", [S.row("nccl")])
    with pytest.raises(ValueError):
        C.load_published(p)


def test_claims_file():
    c = C.load_claims()
    got = {(r["precision"], r["direction"]): r["claimed_max_speedup"] for r in c.to_dict("records")}
    assert got == CLAIMED


# ---------------------------------------------------------------------------------------------------------------
# acceptance: the published table reproduces the published maxima and names the best baseline per cell


def test_report_reproduces_published_maxima_and_best_baselines(published):
    claims = C.claims_table(published, published)
    assert len(claims) == 16
    for (prec, d), best in PUBLISHED_BEST.items():
        cells = claims[(claims["precision"] == prec) & (claims["direction"] == d)].set_index("shape")
        assert list(cells.loc[list(L.SHAPE_ORDER), "best_baseline"]) == best, (prec, d)
    head = C.headline_table(claims, C.load_claims())
    assert len(head) == 4
    for r in head.to_dict("records"):
        claim = CLAIMED[(r["precision"], r["direction"])]
        assert r["max_speedup"] == pytest.approx(claim, abs=0.01)
        assert r["at_shape"] == "qwen3_5_397b"
        assert r["claimed_max_speedup"] == claim
        assert "consistency check" in r["verdict"]
    # BF16 backward of DeepSeek V4 Pro: MoK is not ahead (0.99x read, 0.98x from the readings)
    ds = claims.set_index(["precision", "direction", "shape"]).loc[("bf16", "bwd", "deepseek_v4_pro")]
    assert ds["speedup_mok"] == pytest.approx(0.99, abs=0.01)
    assert ds["best_baseline"] == "deepep"


def test_measured_run_in_published_environment_reproduces(published):
    """A measured GB300 EP=64 table equal to the published one within read error reproduces every claim."""
    rows = []
    for r in published.to_dict("records"):
        wobble = 1.0 + 0.004 * ((hash(r["row_id"]) % 3) - 1)
        rows.append(S.row(r["backend"], r["shape"], r["precision"], r["direction"], tokens_per_gpu=2048,
                          ep_size=64, tflops=r["tflops_per_gpu"] * wobble, env={"gpu_name": "NVIDIA GB300"}))
    measured = results.to_frame(rows)
    claims = C.claims_table(measured, published)
    assert claims["env_matches_published"].all()
    assert claims["ratio_mok"].between(0.99, 1.01).all()
    head = C.headline_table(claims, C.load_claims())
    assert (head["verdict"] == "reproduces").all()
    assert head["measured_over_claim"].between(0.97, 1.03).all()


# ---------------------------------------------------------------------------------------------------------------
# missing systems, failed rows, mixed environments


def test_failed_and_missing_systems_keep_their_status():
    df = S.measured_h200()
    claims = C.claims_table(df).set_index(["precision", "direction", "shape"])
    assert "tflops_reference" not in claims and "reference" not in set(claims["best_baseline"])
    q = claims.loc[("fp8", "fwd", "qwen3_5_397b")]
    assert q["status_deepep_te"] == "oom" and math.isnan(q["tflops_deepep_te"])
    assert q["status_hybridep_megatron"] == "missing"
    assert q["baselines_ok"] == "2/4"
    assert q["best_baseline"] == "deepep"
    assert q["speedup_mok_hopper"] == pytest.approx(q["tflops_mok_hopper"] / q["tflops_deepep"])
    g = claims.loc[("bf16", "bwd", "glm_5_2")]
    assert g["status_mok_hopper"] == "mismatch" and math.isnan(g["speedup_mok_hopper"])
    assert g["best_baseline"] == "hybridep_megatron"

    bad = C.not_ok_rows(df)
    assert sorted(bad["status"]) == ["mismatch", "oom", "oom"]
    md = R.format_markdown(C.claims_table(df), C.headline_table(C.claims_table(df)), bad)
    assert "| oom |" in md and "mismatch" in md and "d_w_down" in md and "—" in md


def test_the_report_lists_the_clock_each_row_was_timed_at(tmp_path):
    nan = float("nan")
    df = results.to_frame([S.row("nccl", sm_clock_mhz=1980.0, sm_clock_min_mhz=1900.0, power_w=450.0,
                                 power_capped_fraction=0.0),
                           S.row("mok_hopper", sm_clock_mhz=1500.0, sm_clock_min_mhz=1425.0, power_w=697.0,
                                 power_capped_fraction=0.8, latency_ms=5.0),
                           S.row("deepep", status="error"), S.row("hybridep", sm_clock_mhz=nan),
                           S.row("deepep_te", sm_clock_mhz=1700.0, sm_clock_min_mhz=nan, power_w=nan)])
    c = C.clock_rows(df)
    assert list(c["backend"]) == ["nccl", "mok_hopper", "deepep_te"]  # ok rows that recorded a clock
    assert c["energy_mj"][1] == pytest.approx(697.0 * 5.0) and math.isnan(c["energy_mj"][2])  # W x ms = mJ
    md = (tmp_path / "claims.md")
    written = R.write_report(df, tmp_path, charts=False)
    text = md.read_text()
    assert "## GPU clocks while timed" in text and "| 1500 (1425) | 697 | 80% | 3485 |" in text
    assert "| 1700 |  |  |  |" in text and "nan" not in text  # a row with its clock alone: no empty readings shown
    assert "clocks.csv" in written
    plain = results.to_frame([S.row("nccl"), S.row("mok_hopper")])  # no clock recorded: no section, no file
    assert "GPU clocks" not in R.format_markdown(C.claims_table(plain), pd.DataFrame(), C.not_ok_rows(plain),
                                                 clocks=C.clock_rows(plain))
    assert "clocks.csv" not in R.write_report(plain, tmp_path / "plain", charts=False)


def test_no_baseline_ok_gives_no_speedup():
    df = results.to_frame([S.row("nccl", status="error"), S.row("mok_hopper")])
    c = C.claims_table(df).iloc[0]
    assert c["best_baseline"] == "" and c["baselines_ok"] == "0/1" and math.isnan(c["speedup_mok_hopper"])
    assert "none ok" in R.format_markdown(C.claims_table(df), pd.DataFrame(), C.not_ok_rows(df))


def test_speedups_stay_within_one_environment():
    df = S.mixed_environments()
    claims = C.claims_table(df)
    assert len(claims) == 2
    h100 = claims[claims["gpu_name"].str.contains("H100")].iloc[0]
    h200 = claims[claims["gpu_name"] == "NVIDIA H200"].iloc[0]
    assert h100["status_mok_hopper"] == "missing" and math.isnan(h100["speedup_mok_hopper"])
    # H100's DeepEP is faster than H200's NCCL, but only H200's own baseline counts for the H200 kernel
    assert h100["tflops_deepep"] > h200["tflops_nccl"]
    assert h200["best_baseline"] == "nccl" and h200["baselines_ok"] == "1/1"
    assert h200["speedup_mok_hopper"] == pytest.approx(h200["tflops_mok_hopper"] / h200["tflops_nccl"])


def test_ratio_to_published_only_where_environment_matches(published):
    def table(ep_size: int, routing: str = "uniform", gpu: str = "NVIDIA GB300") -> pd.Series:
        rows = [S.row(b, "qwen3_5_397b", "mxfp8", "fwd", tokens_per_gpu=2048, ep_size=ep_size, routing=routing,
                      tflops=t, env={"gpu_name": gpu})
                for b, t in (("hybridep_megatron", 200.0), ("mok", 480.0))]
        return C.claims_table(results.to_frame(rows), published).iloc[0]

    same = table(64)
    assert same["env_matches_published"] and same["ratio_mok"] == pytest.approx(480 / 533)
    assert same["speedup_mok"] == pytest.approx(2.4) and same["published_speedup"] == pytest.approx(533 / 225)
    for other in (table(32), table(64, routing="zipf(s=1)"), table(64, gpu="NVIDIA B200")):
        assert not other["env_matches_published"]
        assert math.isnan(other["ratio_mok"])
        assert other["published_speedup"] == pytest.approx(533 / 225)  # still side by side
    head = C.headline_table(C.claims_table(results.to_frame([S.row("mok", "qwen3_5_397b", "mxfp8", "fwd",
                                                                    tokens_per_gpu=2048, ep_size=32)])),
                            C.load_claims())
    assert head.empty or (head["verdict"] != "reproduces").all()


def test_same_gpu():
    assert C.same_gpu("NVIDIA GB300", "GB300 (published)")
    assert not C.same_gpu("NVIDIA GB200", "GB300 (published)")
    assert not C.same_gpu("NVIDIA H200", "GB300 (published)")
    assert not C.same_gpu(pd.NA, "GB300 (published)")


def test_repeated_runs_take_the_median_and_any_ok_row():
    rows = [S.row("nccl", tflops=t, run_id=f"r{i}") for i, t in enumerate((100.0, 110.0, 130.0))]
    rows.append(S.row("nccl", status="timeout", run_id="r9", timestamp="2026-12-09T00:00:00+00:00"))
    rows += [S.row("deepep", status="oom", run_id="r1"),
             S.row("deepep", status="error", run_id="r2", timestamp="2026-12-05T00:00:00+00:00")]
    agg = C.aggregate(C.prepare(results.to_frame(rows), "pooled")).set_index("backend")
    assert agg.loc["nccl", "tflops_per_gpu"] == pytest.approx(110.0)
    assert agg.loc["nccl", "status"] == "ok" and agg.loc["nccl", "num_ok"] == 3
    assert agg.loc["deepep", "status"] == "error"  # the most recent row's status


def test_eager_and_compiled_rows_of_one_backend_are_separate_series():
    """A run with nccl both eager and compiled (two points of one run) reports two series: the fastest baseline is the
    faster one's own number, never a median over both."""
    rows = [S.row("nccl", tflops=100.0, compiled=False, compile_mode=""),
            S.row("nccl", tflops=140.0, compiled=True, compile_mode="max-autotune"),
            S.row("mok_hopper", tflops=280.0, compiled=False)]
    tab = C.claims_table(C.prepare(results.to_frame(rows)))
    r = tab.iloc[0]
    assert r["tflops_nccl · eager"] == pytest.approx(100.0)
    assert r["tflops_nccl · compiled max-autotune"] == pytest.approx(140.0)
    assert r["best_baseline"] == "nccl · compiled max-autotune" and r["speedup_mok_hopper"] == pytest.approx(2.0)


def test_variants_of_one_backend_in_one_run_are_separate_series(tmp_path):
    """A run with nccl's fp8 rows on two GEMM paths (their `scaling` differs) reports one series per path: the
    fastest baseline and the speedups use the faster path's own number, not a median over both; a run with one path
    keeps the plain name; the chart draws the two series apart (hatches)."""
    from harness.report import plots

    row_wise = "e4m3 rowwise (per-row activation / per-channel weight scales), torch._scaled_grouped_mm: forward"
    loop = ("e4m3 block 1x128/128x128, torch scaled_mm v2 per-expert loop (fallback: DeepGEMM not loadable): "
            "forward")
    rows = [S.row("nccl", precision="fp8", tflops=100.0, scaling=row_wise),
            S.row("nccl", precision="fp8", tflops=30.0, scaling=loop),
            S.row("mok_hopper", precision="fp8", tflops=300.0),
            S.row("nccl", precision="fp8", tflops=90.0, scaling=row_wise, run_id="run-b"),
            S.row("mok_hopper", precision="fp8", tflops=270.0, run_id="run-b")]
    tab = C.claims_table(C.prepare(results.to_frame(rows)))
    a, b = (tab[tab["run_id"] == r].iloc[0] for r in ("run-a", "run-b"))
    assert a["tflops_nccl · rowwise"] == pytest.approx(100.0) and a["tflops_nccl · scaled_mm loop"] == 30.0
    assert a["best_baseline"] == "nccl · rowwise" and a["speedup_mok_hopper"] == pytest.approx(3.0)
    assert b["best_baseline"] == "nccl" and b["speedup_mok_hopper"] == pytest.approx(3.0)
    assert L.system_label("nccl · rowwise") == "NCCL+PyTorch (rowwise)" and L.is_baseline("nccl · rowwise")
    assert L.systems_in(pd.DataFrame({"backend": ["mok_hopper", "nccl · scaled_mm loop", "nccl · rowwise"]})) == [
        "nccl · rowwise", "nccl · scaled_mm loop", "mok_hopper"]
    assert plots.hatch("nccl · rowwise") != plots.hatch("nccl · scaled_mm loop") and plots.hatch("nccl") is None
    assert plots.color("nccl · rowwise") == plots.color("nccl")


def test_rows_of_one_backend_with_different_options_in_one_run_are_separate_series():
    """A run with mok_hopper under two weight layouts (one sweep over `mok_hopper.weights`) reports one series per
    layout, named by the option that differs, never a median over both; an option only some rows record (written
    before it existed) splits nothing, and an inference forward is its own series once, named by its kind."""
    rows = [S.row("mok_hopper", tflops=300.0, backend_options="forward=save_h,weights=tiled"),
            S.row("mok_hopper", tflops=200.0, backend_options="forward=save_h,weights=plain"),
            S.row("nccl", tflops=100.0, backend_options="fp8_gemm=auto"),
            S.row("mok_hopper", tflops=250.0, run_id="run-b", backend_options="forward=save_h,weights=tiled"),
            S.row("mok_hopper", tflops=260.0, run_id="run-b", backend_options="forward=save_h"),
            S.row("mok_hopper", tflops=400.0, run_id="run-b", backend_options="forward=inference,weights=tiled"),
            S.row("nccl", tflops=100.0, run_id="run-b")]
    d = C.prepare(results.to_frame(rows))
    a = d[d["run_id"] == "run-a"].set_index("tflops_per_gpu")["backend"]
    assert a[300.0] == "mok_hopper · weights=tiled" and a[200.0] == "mok_hopper · weights=plain"
    assert a[100.0] == "nccl"
    b = d[d["run_id"] == "run-b"].set_index("tflops_per_gpu")["backend"]
    assert b[250.0] == b[260.0] == "mok_hopper" and b[400.0] == "mok_hopper · inference"
    tab = C.claims_table(d)
    ra = tab[tab["run_id"] == "run-a"].iloc[0]
    assert ra["speedup_mok_hopper · weights=tiled"] == pytest.approx(3.0)
    assert ra["speedup_mok_hopper · weights=plain"] == pytest.approx(2.0)


def test_shape_labels():
    assert L.shape_label("qwen3_5_397b") == "Qwen3.5-397B"
    assert L.shape_label("kimi_k2_7@6epg") == "Kimi K2.7 @6epg"
    assert L.panel_label("mxfp8", "bwd") == "MXFP8 backward"


# ---------------------------------------------------------------------------------------------------------------
# CLI and files


def test_cli_writes_markdown_and_csv(tmp_path, capsys):
    results.write_rows(tmp_path / "in" / "a.csv", S.measured_h200().to_dict("records"))
    rc = R.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--no-charts"])
    assert rc == 0
    for name in ("claims.md", "claims.csv", "headline.csv", "not_ok.csv"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    claims = pd.read_csv(tmp_path / "out" / "claims.csv")
    assert len(claims) == 16 and "speedup_mok_hopper" in claims
    assert len(pd.read_csv(tmp_path / "out" / "not_ok.csv")) == 3
    md = (tmp_path / "out" / "claims.md").read_text()
    assert "NVIDIA H200 · EP 8 · 4096 tokens/GPU" in md and "Rows not ok" in md
    # report files under results/ are never read back as results
    assert len(results.load(tmp_path / "out")) == 0
    assert "Headline" in capsys.readouterr().out


def test_cli_published_only_reproduces_claims(tmp_path):
    rc = R.main(["--include-published", "--no-measured", "--out", str(tmp_path), "--no-charts"])
    assert rc == 0
    head = pd.read_csv(tmp_path / "headline.csv")
    assert sorted(head["max_speedup"].round(2)) == [1.58, 1.78, 1.92, 2.37]
    assert (head["data"] == "published").all()


def test_cli_refuses_published_rows_among_results(tmp_path):
    pub = C.load_published()
    results.write_rows(tmp_path / "in" / "x.csv", pub.to_dict("records"))
    assert R.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--no-charts"]) == 2


def test_cli_charts_calibration_and_history(tmp_path):
    rows = [S.row(b, git_sha=sha, run_id=f"r{i}", timestamp=f"2026-12-0{i + 1}T00:00:00+00:00",
                  env={"gpu_name": "NVIDIA H200"})
            for i, sha in enumerate(("aaaa1111", "bbbb2222")) for b in ("nccl", "mok_hopper")]
    results.write_rows(tmp_path / "in" / "a.csv", rows)
    cal = tmp_path / "calib.csv"
    cal.write_text("gpu_name,calib_gemm_tflops,calib_hbm_gb_s,calib_link_gb_s\nNVIDIA H200,800,4300,360\n")
    rc = R.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--calibration", str(cal),
                 "--formats", "png", "--history"])
    assert rc == 0
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    # one panel and roofline chart per run (never pooled by default); the history spans both, named by its config
    assert pngs == ["history_qwen3-5-397b-bf16-ep8-4096tok-" + rows[0]["config_hash"][:6] + ".png",
                    *[f"{kind}_{run}-nvidia-h200-ep-8-4096-tokens-gpu-1-node.png"
                      for kind in ("panels", "roofline") for run in ("r0", "r1")]]
    md = (tmp_path / "out" / "claims.md").read_text()
    assert all(f"({p})" in md for p in pngs)


def test_cli_with_no_rows(tmp_path):
    (tmp_path / "empty").mkdir()
    assert R.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out"), "--no-charts"]) == 2


# ---------------------------------------------------------------------------------------------------------------
# roofline floors


def test_layer_floors_by_hand():
    row = dict(tokens_per_gpu=2048, hidden=4096, ffn=1024, topk=10, local_experts=8, precision="bf16",
               direction="fwd", dispatch_bytes=100e6, combine_bytes=200e6, latency_ms=1.0)
    f = layer_floors(row, gemm_tflops=1000.0, hbm_gb_s=4000.0, link_gb_s=300.0)
    flops = 6.0 * (2048 + 2048 * 10) * 4096 * 1024
    weight = 3 * 8 * 4096 * 1024 * 2 + 3 * 4096 * 1024 * 2
    act = 2048 * 4096 * 2 * (2 + 2 * 10)
    assert f["flops"] == pytest.approx(flops)
    assert f["weight_bytes"] == weight and f["activation_bytes"] == act and f["remote_bytes"] == 300e6
    assert f["compute_ms"] == pytest.approx(flops / 1e15 * 1e3)
    assert f["memory_ms"] == pytest.approx((weight + act) / 4e12 * 1e3)
    assert f["link_ms"] == pytest.approx(1.0)
    assert f["roofline_ms"] == pytest.approx(1.0) and f["bound"] == "link"
    assert f["roofline_fraction"] == pytest.approx(1.0)

    fp8 = layer_floors(dict(row, precision="fp8"), 1000.0, 4000.0, 300.0)
    assert fp8["weight_bytes"] == 3 * 8 * 4096 * 1024 * 1 + 3 * 4096 * 1024 * 2  # shared expert stays bf16
    bwd = layer_floors(dict(row, direction="bwd"), 1000.0, 4000.0, 300.0)
    assert bwd["flops"] == pytest.approx(2 * flops) and bwd["remote_bytes"] == 300e6
    # the backward's own bytes: weights read, bf16 weight gradients written; X, H (routed and shared rows) and dO
    # read, dX written
    grads = 3 * 8 * 4096 * 1024 * 2 + 3 * 4096 * 1024 * 2
    act_b = 2048 * 4096 * 2 + (2048 * 10 + 2048) * 2 * 1024 * 2 + 2 * 2048 * 4096 * 2
    assert bwd["weight_bytes"] == weight + grads and bwd["activation_bytes"] == act_b
    assert bwd["memory_ms"] == pytest.approx((weight + grads + act_b) / 4e12 * 1e3)
    fp8_b = layer_floors(dict(row, direction="bwd", precision="fp8"), 1000.0, 4000.0, 300.0)
    assert fp8_b["weight_bytes"] == fp8["weight_bytes"] + grads  # e4m3 weights read, bf16 gradients written
    assert fp8_b["activation_bytes"] == act_b - 2048 * 4096  # X saved in e4m3
    fb = layer_floors(dict(row, direction="fwd_bwd", flops_per_gpu=123.0), 1000.0, 4000.0, 300.0)
    assert fb["flops"] == 123.0 and fb["remote_bytes"] == 600e6  # the flops_per_gpu column wins
    assert fb["weight_bytes"] == 2 * weight + grads and fb["activation_bytes"] == act + act_b


def test_layer_floors_with_missing_inputs():
    row = dict(tokens_per_gpu=2048, hidden=4096, ffn=1024, topk=10, num_experts=512, ep_size=64, precision="mxfp8",
               direction="fwd", dispatch_bytes=pd.NA, combine_bytes=None)
    f = layer_floors(row, gemm_tflops=2000.0, hbm_gb_s=float("nan"), link_gb_s=None)
    assert f["remote_bytes"] is None and f["link_ms"] is None and f["memory_ms"] is None
    assert f["weight_bytes"] == 3 * 8 * 4096 * 1024 + 3 * 4096 * 1024 * 2  # local experts from num_experts / ep
    assert f["roofline_ms"] == f["compute_ms"] and f["bound"] == "compute"
    assert f["roofline_fraction"] is None
    assert layer_floors({}, 1.0, 1.0, 1.0)["roofline_ms"] is None
    assert layer_flops(dict(row, shared_expert=False)) == pytest.approx(6.0 * 2048 * 10 * 4096 * 1024)


def test_calibration_lookup(tmp_path):
    p = tmp_path / "calib.csv"
    p.write_text("gpu_name,precision,gemm_tflops,hbm_gb_s,link_gb_s\n"
                 ",,100,1000,100\n"
                 "NVIDIA H200,,,4000,350\n"
                 "NVIDIA H200,fp8,1500,,\n"
                 "NVIDIA H200,bf16,800,,\n")
    cal = load_calibration(p)
    df = results.to_frame([S.row("nccl", precision="fp8", env={"gpu_name": "NVIDIA H200"}),
                           S.row("nccl", precision="bf16", env={"gpu_name": "NVIDIA H200"}),
                           S.row("nccl", env={"gpu_name": "NVIDIA H100 80GB HBM3"}),
                           S.row("deepep", env=dict(S.H200, calib_gemm_tflops=900.0))])
    out = attach_calibration(df, cal)
    assert list(out["calib_gemm_tflops"]) == [1500.0, 800.0, 100.0, 900.0]  # the row's own value wins
    assert list(out["calib_hbm_gb_s"]) == [4000.0, 4000.0, 1000.0, 4300.0]
    assert list(out["calib_link_gb_s"]) == [350.0, 350.0, 100.0, 360.0]
    bad = tmp_path / "bad.csv"
    bad.write_text("gpu_name,foo\nx,1\n")
    with pytest.raises(ValueError):
        load_calibration(bad)


# ---------------------------------------------------------------------------------------------------------------
# scope: a report never pools runs unless asked


def _two_runs() -> pd.DataFrame:
    """The same cell measured in two runs: the kernel 2.0x its baseline in the old run, 1.2x in the new one."""
    rows = []
    for run, t, speed in (("old", "2026-12-01T00:00:00+00:00", 2.0), ("new", "2026-12-02T00:00:00+00:00", 1.2)):
        rows += [S.row("nccl", tflops=100.0, run_id=run, timestamp=t),
                 S.row("mok_hopper", tflops=100.0 * speed, run_id=run, timestamp=t)]
    rows.append(S.row("deepep", tflops=150.0, run_id="old", timestamp="2026-12-01T00:00:00+00:00"))
    return results.to_frame(rows)


def test_report_never_pools_by_default(tmp_path):
    df = _two_runs()
    head = C.headline_table(C.claims_table(C.prepare(df)))
    got = {r["run_id"]: r["max_speedup"] for r in head.to_dict("records")}
    assert got == {"new": pytest.approx(1.2), "old": pytest.approx(200 / 150)}  # each over its own run's best
    assert list(head["run_id"]) == ["new", "old"]  # newest first
    pooled = C.headline_table(C.claims_table(C.prepare(df, "pooled")))
    assert list(pooled["run_id"]) == ["POOLED over 2 runs"]
    assert pooled["max_speedup"].iloc[0] == pytest.approx(160 / 150)  # median 160 over deepep 150, across runs
    latest = C.headline_table(C.claims_table(C.prepare(df, "latest")))
    assert list(latest["run_id"]) == ["new"]

    results.write_rows(tmp_path / "in" / "a.csv", df.to_dict("records"))
    assert R.main([str(tmp_path / "in"), "--out", str(tmp_path / "run"), "--no-charts"]) == 0
    md = (tmp_path / "run" / "claims.md").read_text()
    assert "Scope: each run on its own" in md and "POOLED" not in md
    assert md.index("## new · NVIDIA H200") < md.index("## old · NVIDIA H200")
    assert R.main([str(tmp_path / "in"), "--out", str(tmp_path / "pool"), "--pool", "--formats", "png"]) == 0
    md = (tmp_path / "pool" / "claims.md").read_text()
    assert "Scope: POOLED across runs" in md and "## POOLED over 2 runs · NVIDIA H200" in md
    charts = [p.name for p in (tmp_path / "pool").glob("*.png")]
    assert charts and all("pooled-over-2-runs" in n for n in charts)  # the chart says so too
    assert len(pd.read_csv(tmp_path / "pool" / "claims.csv")) == 1


def test_default_output_keeps_full_reports_out_of_the_committed_results(tmp_path):
    # a full report goes to the ignored results/local/reports, of the committed runs too (what results/ commits from
    # them is REPORT.md and its headline charts: tests/test_report_layout.py)
    assert R.DEFAULT_OUT == results.LOCAL_RUNS / "reports"
    assert R.default_out([]) == R.DEFAULT_OUT
    assert R.default_out([str(results.REFERENCE_RUNS / "h200x2-v11-compiled-20261130T174618")]) == R.DEFAULT_OUT
    assert R.default_out([str(results.LOCAL_RUNS)]) == results.LOCAL_RUNS / "reports"
    assert R.default_out([str(tmp_path)]) == results.LOCAL_RUNS / "reports"
    from harness.config.schema import BenchConfig

    assert Path(BenchConfig.results_dir) == Path("results/local")  # harness.run writes there by default
    ignored = (REPO / ".gitignore").read_text().split()
    assert "results/local/" in ignored


REPO = Path(__file__).resolve().parent.parent


def _bad(tmp_path: Path, case: str) -> tuple[Path, str]:
    good = results.to_frame([S.row("nccl"), S.row("mok_hopper"), S.row("deepep")]).to_csv(index=False)
    lines = good.splitlines()
    d = tmp_path / "in"
    d.mkdir()
    f = d / "r.csv"
    if case == "empty":
        f.write_text("")
        return f, "empty file"
    if case == "not csv":
        f.write_bytes(b"PK\x03\x04\x00\x00binary")
        return f, "not a CSV file"
    if case == "no row_id":
        f.write_text(good.replace("run_id,row_id,", "run_id,id,", 1))
        return f, "no row_id column"
    if case == "truncated":
        f.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40] + "\n")
        return f, "line 3 has"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["empty", "not csv", "no row_id", "truncated"])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    f, words = _bad(tmp_path, case)
    out = tmp_path / "out"
    assert R.main([str(f), "--out", str(out), "--no-charts"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err
    assert str(f) in cap.err and words in cap.err
    assert not out.exists()


def test_cli_says_how_many_files_it_skipped(tmp_path, capsys):
    results.write_rows(tmp_path / "in" / "a.csv", [S.row("nccl"), S.row("mok_hopper")])
    (tmp_path / "in" / "smi.csv").write_text("timestamp,power.draw\n1,2\n")
    (tmp_path / "in" / "empty.csv").write_text("")
    assert R.main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--no-charts"]) == 0
    assert "skipped 2 files that hold no results" in capsys.readouterr().out
    assert "skipped 2 files" in (tmp_path / "out" / "claims.md").read_text()
    only = tmp_path / "only"
    only.mkdir()
    (only / "smi.csv").write_text("timestamp,power.draw\n1,2\n")
    assert R.main([str(only), "--out", str(tmp_path / "o2"), "--no-charts"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "skipped 1 file" in err and not (tmp_path / "o2").exists()


def test_the_report_shows_iteration_counts_other_than_the_published(tmp_path):
    df = results.to_frame([S.row("nccl", num_warmup=500, num_iters=100, timing_preset="published"),
                           S.row("mok_hopper", num_warmup=20, num_iters=50, timing_preset="custom"),
                           S.row("mok_hopper", "glm_5_2", num_warmup=20, num_iters=50, timing_preset="custom"),
                           S.row("deepep", status="error")])
    t = C.timing_counts(df)
    assert t[["run_id", "num_warmup", "num_iters", "backends", "rows"]].values.tolist() == [
        ["run-a", 20, 50, "mok_hopper", 2]]
    R.write_report(df, tmp_path, charts=False)
    text = (tmp_path / "claims.md").read_text()
    assert "## Iteration counts other than the published ones" in text and "500 warmup and 100 timed" in text
    assert "| run-a · NVIDIA H200 · EP 8 · 4096 tokens/GPU · 1 node | 20 / 50 | MoK Hopper (ours) | 2 |" in text
    plain = results.to_frame([S.row("nccl", num_warmup=500, num_iters=100)])
    R.write_report(plain, tmp_path / "plain", charts=False)
    assert "Iteration counts" not in (tmp_path / "plain" / "claims.md").read_text()
