"""Charts (Agg, PNG + SVG) and the analysis notebook, executed headless."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness.report import plots as P  # noqa: E402
from harness.report import claims as C  # noqa: E402
from harness.report import labels as L  # noqa: E402
from harness.core import results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for t in fig.texts]


def legend_labels(fig) -> list[str]:
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def saved(fig, tmp_path: Path, name: str, formats: tuple[str, ...] = ("png",)) -> list[Path]:
    """Save (PNG only unless asked: rendering dominates the test time) and check the files."""
    paths = P.save(fig, tmp_path / name, formats)
    assert [p.suffix for p in paths] == [f".{f}" for f in formats]
    assert paths[0].read_bytes()[:8] == PNG
    if "svg" in formats:
        assert b"<svg" in paths[1].read_bytes()[:2000]
    return paths


def test_published_four_panel_chart(tmp_path):
    fig = P.plot_panels(C.load_published())
    assert isinstance(fig.canvas, FigureCanvasAgg)
    assert [ax.get_title() for ax in fig.axes] == ["MXFP8 forward", "MXFP8 backward", "BF16 forward",
                                                   "BF16 backward"]
    labels = texts(fig)
    for claim in ("2.37×", "1.78×", "1.92×", "1.58×"):
        assert claim in labels
    assert legend_labels(fig) == ["NCCL+PyTorch", "DeepEP+PyTorch", "DeepEP+TE", "HybridEP+Megatron", "MoK"]
    assert sum(len(ax.patches) for ax in fig.axes) == 80  # 5 systems x 4 shapes x 4 panels
    saved(fig, tmp_path, "published", ("png", "svg"))


def test_panels_show_failed_rows_as_status(tmp_path):
    fig = P.plot_panels(S.measured_h200())  # the reference rows are ignored, not an environment of their own
    labels = texts(fig)
    assert labels.count("oom") == 2 and labels.count("mismatch") == 1
    assert any(t.startswith("Not ok") and "DeepEP+TE" in t for t in (x.get_text() for x in fig.texts))
    assert "reference" not in " ".join(legend_labels(fig))
    saved(fig, tmp_path, "h200")


def test_charts_say_how_the_baselines_ran():
    """The footnote names each baseline's torch.compile mode, from the rows (``ok`` rows only, fused kernels and
    the reference left out); a system with eager and compiled rows lists both, since the medians mix them."""
    rows = [S.row("nccl", s, compiled=True, compile_mode="max-autotune") for s in ("glm_5_2", "qwen3_5_397b")]
    rows += [S.row("nccl", "kimi_k2_7", compiled=False, compile_mode=""),
             S.row("deepep", "glm_5_2", compiled=True, compile_mode="max-autotune-no-cudagraphs"),
             S.row("deepep", "kimi_k2_7", status="error", compiled=True, compile_mode="default"),
             S.row("deepep_te", "glm_5_2", compiled=False), S.row("mok_hopper", "glm_5_2", compiled=True),
             S.row("reference", "glm_5_2", notes="ground truth, not timed")]
    df = results.to_frame(rows)
    want = ("torch.compile: NCCL+PyTorch max-autotune + eager; DeepEP+PyTorch max-autotune-no-cudagraphs; "
            "DeepEP+TE eager")
    assert L.compile_caption(df) == want
    for fig in (P.plot_panels(df), P.plot_roofline(df)):
        foot = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
        assert want in foot and "Not ok" in foot and foot.index("torch.compile") < foot.index("Not ok")
    assert L.compile_caption(results.to_frame([S.row("mok_hopper")])) == ""


def test_charts_name_the_baselines_fp8_gemm_path():
    """A run with one fp8 GEMM path per baseline keeps the plain series name ("NCCL+PyTorch"), so the footnote says
    which path ran (from the rows' ``scaling``): rowwise here, DeepGEMM there; bf16 rows, not-ok rows and the fused
    kernel add nothing, and a series already named by its variant is not repeated."""
    rowwise = "e4m3 rowwise (per-row activation / per-channel weight scales), torch._scaled_grouped_mm: forward"
    deepgemm = "e4m3 block 1x128 / 128x128, DeepGEMM m-grouped contiguous: forward"
    rows = [S.row("nccl", s, precision="fp8", scaling=rowwise, compiled=False, compile_mode="")
            for s in ("glm_5_2", "kimi_k2_7")]
    rows += [S.row("mok_hopper", "glm_5_2", precision="fp8", scaling="block 1x128 act / 128x128 weight, e4m3"),
             S.row("nccl", "glm_5_2", precision="bf16", scaling="bf16"),
             S.row("deepep", "glm_5_2", precision="fp8", status="error", scaling=deepgemm)]
    df = results.to_frame(rows)
    assert L.fp8_caption(df) == "fp8 GEMMs: NCCL+PyTorch rowwise"
    assert L.run_caption(df) == "torch.compile: NCCL+PyTorch eager. fp8 GEMMs: NCCL+PyTorch rowwise"
    for fig in (P.plot_panels(df[df["precision"] == "fp8"]), P.plot_roofline(df[df["precision"] == "fp8"])):
        foot = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
        assert "fp8 GEMMs: NCCL+PyTorch rowwise" in foot
    df2 = results.to_frame([S.row("nccl", precision="fp8", scaling=deepgemm)])
    assert L.fp8_caption(df2) == "fp8 GEMMs: NCCL+PyTorch DeepGEMM"
    split = results.to_frame([S.row("nccl · rowwise", precision="fp8", tflops=100.0, scaling=rowwise)])
    assert L.fp8_caption(split) == "" and L.fp8_caption(results.to_frame([S.row("mok_hopper")])) == ""


def test_panels_need_one_environment():
    df = S.mixed_environments()
    with pytest.raises(ValueError, match="environments"):
        P.plot_panels(df)
    env = C.environments(df)[0]
    assert P.plot_panels(df, env).axes


def test_sweeps(tmp_path):
    df = S.sweeps_h200()
    assert P.sweep_axes_present(df) == ["tokens_per_gpu", "ep_size", "routing"]
    for x in P.SWEEP_AXES:
        fig = P.plot_sweep(df, x)
        assert len([ax for ax in fig.axes if ax.get_visible()]) == 2  # Kimi and Qwen, bf16 fwd
        assert legend_labels(fig) == ["NCCL+PyTorch", "DeepEP+PyTorch", "MoK Hopper (ours)"]
        saved(fig, tmp_path, f"sweep_{x}")
    routing = P.plot_sweep(df, "routing")
    assert [t.get_text() for t in routing.axes[0].get_xticklabels()] == ["uniform", "zipf(s=1)",
                                                                         "hot_experts(f=0.125,x4)"]
    tokens = P.plot_sweep(df, "tokens_per_gpu")
    assert any("oom" in t.get_text() for t in tokens.texts)  # the 16384-token oom point is listed
    with pytest.raises(ValueError):
        P.plot_sweep(S.measured_h200(), "tokens_per_gpu")
    with pytest.raises(ValueError):
        P.plot_sweep(df, "hidden")


def test_roofline_chart(tmp_path):
    df = S.measured_h200()
    assert P.has_floors(df)
    fig = P.plot_roofline(df)
    labels = legend_labels(fig)
    for floor in ("compute floor", "HBM floor", "NVLink floor", "roofline"):
        assert any(floor in lab for lab in labels), floor
    percents = [t for t in texts(fig) if t.endswith("%")]
    assert len(percents) == len(df[(df["status"] == "ok") & (df["backend"] != "reference")])
    saved(fig, tmp_path, "roofline")
    bare = df.drop(columns=["calib_gemm_tflops", "calib_hbm_gb_s", "calib_link_gb_s"])
    assert not P.has_floors(bare)
    cal = pd.DataFrame({"gpu_name": ["NVIDIA H200"], "precision": [pd.NA], "calib_gemm_tflops": [900.0],
                        "calib_hbm_gb_s": [4000.0], "calib_link_gb_s": [350.0]})
    assert P.has_floors(bare, cal)
    assert any("NVLink floor" in lab for lab in legend_labels(P.plot_roofline(bare, cal)))


def test_history_chart(tmp_path):
    rows = []
    for i, (sha, slow) in enumerate((("cccc3333", 1.0), ("aaaa1111", 1.1), ("bbbb2222", 1.0))):
        t = f"2026-12-0{i + 1}T00:00:00+00:00"
        for b in ("nccl", "mok_hopper"):
            tf = S.tflops_for(b, "qwen3_5_397b", "bf16", "fwd") / (slow if b == "mok_hopper" else 1.0)
            rows.append(S.row(b, tflops=tf, git_sha=sha, run_id=f"r{i}", timestamp=t))
    rows.append(S.row("mok_hopper", direction="bwd", status="error", git_sha="bbbb2222", run_id="r2",
                      timestamp="2026-12-03T00:00:00+00:00"))
    df = results.to_frame(rows)
    fig = P.plot_history(df)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["cccc333", "aaaa111", "bbbb222"]  # timestamp order, not alphabetical
    foot = " ".join(t.get_text() for t in fig.texts).replace("\n", " ")
    assert "MoK Hopper (ours) backward at bbbb222: error" in foot  # the status in the footnote, not stacked on the axis
    assert not [t for ax in fig.axes for t in ax.texts if "error" in t.get_text()]
    title = fig.texts[0].get_text().replace("\n", " ")
    assert "Qwen3.5-397B, BF16, NVIDIA H200 · EP 8" in title  # named, not a hash alone
    saved(fig, tmp_path, "history")
    with pytest.raises(ValueError):
        P.plot_history(pd.concat([df, results.to_frame([S.row("nccl", "glm_5_2")])]))


def test_report_charts_names(tmp_path):
    sweep = [S.row(b, tokens_per_gpu=t) for b in ("nccl", "mok_hopper") for t in (2048, 4096)]
    published = C.load_published()
    df = pd.concat([results.to_frame(sweep), published[published["precision"] == "bf16"]], ignore_index=True)
    written = P.report_charts(df, tmp_path, formats=("png",), history=[sweep[0]["config_hash"]])
    assert set(written) == {"panels_published-mok-gb300-figure-gb300-published-ep-64-2048-tokens-gpu",
                            "panels_run-a-nvidia-h200-ep-8-2048-tokens-gpu-1-node",
                            "panels_run-a-nvidia-h200-ep-8-4096-tokens-gpu-1-node",
                            "sweep_tokens_per_gpu_run-a",
                            "roofline_run-a-nvidia-h200-ep-8-2048-tokens-gpu-1-node",
                            "roofline_run-a-nvidia-h200-ep-8-4096-tokens-gpu-1-node",  # none for the published data
                            f"history_qwen3-5-397b-bf16-ep8-2048tok-{sweep[0]['config_hash'][:6]}"}
    assert all(p.exists() and p.suffix == ".png" for ps in written.values() for p in ps)


def _run_notebook(monkeypatch, results_path: Path, out: Path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed: pip install nbformat nbclient")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed: pip install nbclient")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed: pip install ipykernel")
    monkeypatch.setenv("MOKBENCH_RESULTS", str(results_path))
    monkeypatch.setenv("MOKBENCH_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("MOKBENCH_NOTEBOOK_FORMATS", "png")
    monkeypatch.setenv("PYTHONPATH", str(REPO) + ":" + __import__("os").environ.get("PYTHONPATH", ""))
    nb = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    # Every wait is a safety net far beyond a loaded machine's: the kernel's start (nbclient's default: 60 s), and a
    # cell's output after its reply (default 4 s, after which nbclient drops the output with a warning only).
    nbclient.NotebookClient(nb, timeout=600, startup_timeout=600, iopub_timeout=600, raise_on_iopub_timeout=True,
                            kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    errors = [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    out_text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    return out_text, images, {p.name for p in out.glob("*.png")}


@pytest.mark.slow
def test_analysis_notebook_runs_headless(tmp_path, monkeypatch):
    rows = pd.concat([S.mixed_environments(), results.to_frame([S.row("deepep_te", status="oom"),
                                                                 S.row("mok_hopper", "glm_5_2", run_id="h200",
                                                                       latency_p20_ms=None, latency_p80_ms=None)])],
                     ignore_index=True)
    results.write_rows(tmp_path / "results" / "run" / "rows.csv", rows.to_dict("records"))
    out, images, charts = _run_notebook(monkeypatch, tmp_path / "results", tmp_path / "charts")
    assert f"{len(rows)} measured rows" in out
    assert images == len(charts) >= 5
    assert "published_panels.png" in charts
    assert any(n.startswith("roofline_h200-nvidia-h200") for n in charts)  # one per run and environment


@pytest.mark.slow
def test_analysis_notebook_runs_on_the_committed_results(tmp_path, monkeypatch):
    """The notebook on what a clean clone holds (results/runs, as harness.report reads it): single-sample rows
    (p20 = p80 = median), failed rows, several runs and environments."""
    from harness.core.run_names import display_name

    committed = results.load(results.REFERENCE_RUNS)
    assert len(committed), "results/runs holds no rows"
    out, images, charts = _run_notebook(monkeypatch, results.REFERENCE_RUNS, tmp_path / "charts")
    assert f"{len(committed)} measured rows, {committed['run_id'].nunique()} runs" in out
    # charts are named by the run's display name (harness.core.run_names), slugged
    v11 = display_name("h200x2-v11-compiled-20261130T174618").replace("_", "-")
    assert images == len(charts) and any(n.startswith(f"panels_{v11}-") for n in charts), sorted(charts)[:5]


def test_panels_draw_p20_p80_whiskers_and_no_axis_without_an_ok_row(tmp_path):
    rows = [S.row("nccl", spread=0.05), S.row("mok_hopper", spread=0.0),  # one sample: p20 = p80 = median
            S.row("nccl", direction="bwd", status="error"), S.row("mok_hopper", direction="bwd", status="oom")]
    fig = P.plot_panels(results.to_frame(rows))
    fwd, bwd = fig.axes[0], fig.axes[1]
    lines = [c for c in fwd.collections if c.__class__.__name__ == "LineCollection"]
    segs = [seg for c in lines for seg in c.get_segments()]
    assert len(segs) == 2  # a whisker per bar
    nccl = S.tflops_for("nccl", "qwen3_5_397b", "bf16", "fwd")
    lo, hi = sorted(segs, key=lambda s: -abs(s[1][1] - s[0][1]))[0][:, 1]
    assert sorted((lo, hi)) == pytest.approx([nccl / 1.05, nccl / 0.95])
    assert list(bwd.get_yticks()) == [] and any("no ok row" in t.get_text() for t in bwd.texts)
    assert len(fwd.get_yticks()) > 0
    saved(fig, tmp_path, "whiskers")


def test_cpu_twin_rows_are_labelled_as_the_twin_not_the_kernel():
    cpu = {"gpu_name": None, "device": "cpu"}
    df = C.prepare(results.to_frame([S.row("nccl", env=cpu), S.row("mok_hopper", env=cpu, notes="CPU twin (pure "
                                                                                                   "torch, gloo)"),
                                     S.row("mok_hopper")]))  # the H200 row is the kernel
    assert sorted(df["backend"]) == ["mok_hopper", "mok_hopper_cpu_twin", "nccl"]
    envs = C.environments(df)
    cpu_env = next(e for e in envs if L.isna(e["gpu_name"]))
    labels = legend_labels(P.plot_panels(df, cpu_env))
    assert "MoK Hopper CPU twin (pure torch, not the kernel)" in labels and "MoK Hopper (ours)" not in labels


def test_wide_panels_stay_legible(tmp_path):
    shapes = [f"{s}@{n}epg" for s in S.SHAPES for n in (4, 8)]  # eight shape groups, two directions
    rows = [dict(S.row(b, "kimi_k2_7", "bf16", d), shape=s) for b in ("nccl", "deepep", "mok_hopper") for s in shapes
            for d in ("fwd", "bwd")]
    fig = P.plot_panels(results.to_frame(rows))
    width, _ = fig.get_size_inches()
    assert width <= P.MAX_WIDTH_IN
    assert [ax.get_title() for ax in fig.axes] == ["BF16 forward", "BF16 backward"]  # stacked, one per row
    saved(fig, tmp_path, "wide")


def _stable_figure(ys):
    fig = P.new_figure(3, 2)
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], ys, label="series")
    ax.legend()
    return fig


def test_saved_charts_are_byte_stable(tmp_path):
    """The same figure saved twice gives the same bytes (no date in the metadata, SVG ids from a fixed salt), so a
    regenerated report only changes the charts whose data changed; a changed figure does change."""
    a = P.save(_stable_figure([1, 2, 3]), tmp_path / "a", formats=("svg", "png"))
    b = P.save(_stable_figure([1, 2, 3]), tmp_path / "b", formats=("svg", "png"))
    c = P.save(_stable_figure([1, 2, 4]), tmp_path / "c", formats=("svg",))
    assert a[0].read_bytes() == b[0].read_bytes() and a[1].read_bytes() == b[1].read_bytes()
    assert a[0].read_bytes() != c[0].read_bytes()
    assert b"<dc:date>" not in a[0].read_bytes()


def test_latency_against_imbalance(tmp_path):
    """The routing sweep's latency against the measured imbalance: one line per backend, x the imbalance of each
    routing in order, the slowest routing step of a row of several steps as a triangle; in the report's plan."""
    df = S.sweeps_h200()
    steps = [S.row(b, s, routing="burst(f=0.25,every=4)+4steps", run_id="sweep")
             for b in ("nccl", "deepep", "mok_hopper") for s in ("qwen3_5_397b", "kimi_k2_7")]
    for r in steps:
        r.update(expert_load_max_over_mean=3.0, latency_step_max_ms=r["latency_ms"] * 1.5)
    df = pd.concat([df, results.to_frame(steps)], ignore_index=True)
    fig = P.plot_imbalance(df)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 2 and legend_labels(fig) == ["NCCL+PyTorch", "DeepEP+PyTorch", "MoK Hopper (ours)"]
    line = next(ln for ln in axes[0].get_lines() if ln.get_label() == "NCCL+PyTorch")
    xs, ys = line.get_data()
    assert list(xs) == sorted(xs) and list(xs) == [1.1, 2.5, 3.0, 4.0]  # uniform, zipf, the burst, hot experts
    assert all(y > 0 for y in ys) and "latency" in axes[0].get_ylabel()
    triangles = [ln for ln in axes[0].get_lines() if ln.get_marker() == "^"]
    assert len(triangles) == 3 and all(ln.get_data()[0][0] == 3.0 for ln in triangles)
    assert "routing imbalance" in axes[0].get_xlabel()
    marks = {t.get_text(): t.xy[0] for t in axes[0].texts}  # each routing named at its imbalance on a numeric axis
    assert marks == {"uniform": 1.1, "zipf(s=1)": 2.5, "burst(f=0.25,every=4)+4steps": 3.0,
                     "hot_experts(f=0.125,x4)": 4.0}
    path = saved(fig, tmp_path, "imbalance")[0]
    assert path.stat().st_size > 20_000
    assert "imbalance" in [name for name, _ in P.chart_plan(df)]
    with pytest.raises(ValueError, match="no routing sweep"):
        P.plot_imbalance(S.measured_h200())
