"""The committed report's layout: the verdict table, README.md's generated block, results/REPORT.md and its headline
charts, the size of results/, and the run folders' meta.json."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness.report import claims as C  # noqa: E402
from harness.report import plots as P  # noqa: E402
from harness.report import report as R  # noqa: E402
from harness.core import results  # noqa: E402
from harness.core import run_meta as M  # noqa: E402
from harness.report import verdicts as V  # noqa: E402
from harness.core.run_names import display_name, run_id_of  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAX_IMAGES = P.HEADLINE_MAX_IMAGES
MAX_RESULTS_BYTES = 10 * 1024 * 1024
OLD, NEW, NEWER = "2026-12-01T00:00:00+00:00", "2026-12-02T00:00:00+00:00", "2026-12-03T00:00:00+00:00"
SHAPES = ("kimi_k2_7", "qwen3_5_397b")


def frame(*runs: list) -> pd.DataFrame:
    return results.to_frame([r for run in runs for r in run])


def one(table: pd.DataFrame, **where) -> dict:
    """The one verdict row matching ``where``."""
    m = table
    for k, v in where.items():
        m = m[m[k] == v]
    assert len(m) == 1, (where, table[["environment", "panel", "run_id"]])
    return m.iloc[0].to_dict()


# ---------------------------------------------------------------------------------------------------------------
# the verdict table


def test_the_newest_run_of_each_panel_wins():
    """Each (environment kind, panel) takes its own newest run: the new run has only the forward, so the backward
    verdict stays the old run's; speedups are min-max over that run's shapes, over its own fastest opponent."""
    old = S.verdict_run("old", OLD, ["nccl", "deepep", "mok_hopper"], SHAPES,
                        tflops={"nccl": 100.0, "deepep": 120.0, "mok_hopper": 300.0})
    new = S.verdict_run("new", NEW, ["nccl", "mok_hopper"], SHAPES, directions=("fwd",),
                        tflops={"nccl": 100.0, "mok_hopper": 150.0})
    new[1]["tflops_per_gpu"] = 80.0  # nccl on qwen: 150 / 80
    t = V.verdict_table(frame(old, new))
    assert list(t["panel"]) == ["BF16 forward", "BF16 backward"]
    fwd, bwd = one(t, direction="fwd"), one(t, direction="bwd")
    assert fwd["run_id"] == "new" and bwd["run_id"] == "old"
    assert (fwd["speedup_min"], fwd["speedup_max"], fwd["shapes"]) == (pytest.approx(1.5), pytest.approx(1.875), 2)
    assert bwd["speedup_min"] == pytest.approx(2.5) and bwd["fastest_opponents"] == "deepep"
    assert fwd["environment"] == "1x NVIDIA H200, EP 1, 4096 tokens/GPU"
    assert fwd["contender"] == "mok_hopper" and fwd["pairs"] == "training forwards" and bwd["pairs"] == "backward"
    md = V.format_verdicts(t)
    assert ("| 1x NVIDIA H200, EP 1, 4096 tokens/GPU | BF16 forward | training forwards | 1.50-1.88× (2 shapes) | "
            "NCCL+PyTorch | — | — | `new` |") in md
    assert "| backward | 2.50× (2 shapes) | DeepEP+PyTorch |" in md


def test_environment_kinds_are_kept_apart():
    """The GPUs of the machine and the EP size make their own kinds, each with its own newest run."""
    one_gpu = S.verdict_run("one", OLD, ["nccl", "mok_hopper"], directions=("fwd",))
    two_gpu = S.verdict_run("two", NEW, ["nccl", "mok_hopper"], directions=("fwd",), num_gpus=2, ep_size=2)
    t = V.verdict_table(frame(one_gpu, two_gpu))
    assert list(t["environment"]) == ["1x NVIDIA H200, EP 1, 4096 tokens/GPU", "2x NVIDIA H200, EP 2, 4096 tokens/GPU"]
    assert list(t["run_id"]) == ["one", "two"]


def test_cpu_twin_rows_never_count():
    """A newer run whose mok_hopper rows ran the CPU twin gives no verdict; the GPU run stays the latest one."""
    gpu = S.verdict_run("gpu", OLD, ["nccl", "mok_hopper"], directions=("fwd",))
    cpu = S.verdict_run("cpu", NEWER, ["nccl", "mok_hopper"], directions=("fwd",), device="cpu", gpu_name="cpu",
                        num_gpus=0)
    t = V.verdict_table(frame(gpu, cpu))
    assert list(t["run_id"]) == ["gpu"]
    assert V.verdict_table(frame(cpu)).empty
    assert "No verdict" in V.format_verdicts(V.verdict_table(frame(cpu)))


def test_a_panel_with_no_baseline_ok_is_skipped():
    """The newest run's fp8 baseline failed: its fp8 panel gives no verdict, the older run's does; a panel no run
    has a baseline ok for has no row."""
    real = {"scaling": "e4m3 rowwise (per-row activation / per-channel weight scales), torch._scaled_grouped_mm"}
    old = S.verdict_run("old", OLD, ["nccl", "mok_hopper"], precisions=("fp8",), directions=("fwd",),
                        per_backend={"nccl": real})
    new = S.verdict_run("new", NEW, ["nccl", "mok_hopper"], precisions=("bf16", "fp8"), directions=("fwd",),
                        per_backend={"nccl": real})
    for r in new:
        if r["backend"] == "nccl" and r["precision"] == "fp8":
            r.update(status="oom", tflops_per_gpu=None, latency_ms=None, error="CUDA out of memory")
    only_failed = S.verdict_run("x", NEW, ["nccl", "mok_hopper"], directions=("bwd",), per_backend={
        "nccl": {"status": "error"}}, ep_size=4)
    t = V.verdict_table(frame(old, new, only_failed))
    assert {(r["panel"], r["run_id"]) for r in t.to_dict("records")} == {("BF16 forward", "new"),
                                                                         ("FP8 forward", "old")}


def test_fp8_flag_says_real_or_emulated():
    """fp8 panels: the fastest opponent's GEMM path, from its ``scaling``; emulated GEMMs say so."""
    emulated = "block 1x128/128x128 emulated (bf16 GEMM on e4m3 values): measures accuracy, not fp8 GEMM speed"
    deepgemm = "e4m3 block 1x128/128x128, DeepGEMM (deep_gemm 2.6.1): forward and dgrad m-grouped contiguous"
    te = "TE Float8BlockScaling e4m3, 1x128 activation / 128x128 weight blocks; dispatch bf16"
    emu = S.verdict_run("emu", OLD, ["nccl", "deepep", "mok_hopper"], precisions=("fp8",), directions=("fwd",),
                        tflops={"nccl": 200.0, "deepep": 100.0, "mok_hopper": 300.0},
                        per_backend={"nccl": {"scaling": emulated}, "deepep": {"scaling": deepgemm}})
    real = S.verdict_run("real", OLD, ["deepep_te", "mok_hopper"], precisions=("fp8",), directions=("fwd",),
                         ep_size=2, num_gpus=2, per_backend={"deepep_te": {"scaling": te}})
    t = V.verdict_table(frame(emu, real))
    assert one(t, run_id="emu")["fp8"] == "emulated"
    assert one(t, run_id="real")["fp8"] == "real (TE blockwise)"
    assert V.fp8_label(deepgemm) == "real (DeepGEMM)"
    assert one(t, run_id="emu")["published_claim"] == pytest.approx(2.37)  # the MXFP8 forward claim, labelled
    assert one(t, run_id="emu")["published_claim_panel"] == "MXFP8 forward"
    md = V.format_verdicts(t)
    assert "| emulated | 1.50× (1 shape) over NCCL+PyTorch | 2.37× (published, MXFP8 forward) |" in md
    bf16 = V.verdict_table(frame(S.verdict_run("b", OLD, ["nccl", "mok_hopper"], directions=("fwd",))))
    assert one(bf16, run_id="b")["fp8"] == ""
    assert "| eager | — | 1.80× (1 shape) over NCCL+PyTorch | 1.92× (published) |" in V.format_verdicts(bf16)


def test_baseline_flag_says_eager_or_compiled():
    """The fastest opponent's compile state; where the fastest opponent differs per shape, each distinct state."""
    compiled = {"compiled": True, "compile_mode": "max-autotune"}
    run = S.verdict_run("r", OLD, ["nccl", "deepep", "mok_hopper"], SHAPES, directions=("fwd",),
                        tflops={"nccl": 100.0, "deepep": 90.0, "mok_hopper": 200.0}, per_backend={"nccl": compiled})
    assert one(V.verdict_table(frame(run)), run_id="r")["opponent_compile"] == "compiled (max-autotune)"
    for r in run:
        if r["backend"] == "deepep" and r["shape"] == "qwen3_5_397b":
            r["tflops_per_gpu"] = 150.0  # deepep (eager) is the fastest on one shape
    v = one(V.verdict_table(frame(run)), run_id="r")
    assert v["opponent_compile"] == "compiled (max-autotune), eager" and v["fastest_opponents"] == "nccl, deepep"
    assert V.compile_label(True, None) == "compiled" and V.compile_label(None, None) == "unrecorded"


def test_timing_flag_is_published_only_when_every_compared_row_is():
    pub = S.verdict_run("p", OLD, ["nccl", "mok_hopper"], directions=("fwd",))
    assert one(V.verdict_table(frame(pub)), run_id="p")["timing"] == "published"
    custom = S.verdict_run("c", OLD, ["nccl", "mok_hopper"], directions=("fwd",), per_backend={
        "mok_hopper": {"timing_preset": "custom", "num_warmup": 20, "num_iters": 50}})
    assert one(V.verdict_table(frame(custom)), run_id="c")["timing"] == "published, custom 20/50"
    # the published preset's name with other counts is not the published timing
    odd = S.verdict_run("o", OLD, ["nccl", "mok_hopper"], directions=("fwd",), num_warmup=10, num_iters=30)
    assert one(V.verdict_table(frame(odd)), run_id="o")["timing"] == "published 10/30"
    assert V.timing_label("quick", None, None, (500, 100)) == "quick"


def test_a_run_with_anchors():
    """Anchors are opponents, never a baseline: the headline is over the fastest anchor here, the speedup over the
    fastest baseline (what the published claim compares) stands beside."""
    run = S.verdict_run("a", OLD, ["nccl", "liger", "sonicmoe", "mok_hopper"], SHAPES, directions=("fwd",),
                        tflops={"nccl": 100.0, "liger": 250.0, "sonicmoe": 200.0, "mok_hopper": 300.0},
                        per_backend={"nccl": {"compiled": True, "compile_mode": "max-autotune"}})
    v = one(V.verdict_table(frame(run)), run_id="a")
    assert v["speedup_min"] == pytest.approx(1.2) and v["shapes"] == 2 and v["fastest_opponents"] == "liger"
    assert v["baseline_speedup_min"] == pytest.approx(3.0) and v["fastest_baselines"] == "nccl"
    assert (v["opponent_compile"], v["baseline_compile"]) == ("eager", "compiled (max-autotune)")
    md = V.format_verdicts(V.verdict_table(frame(run)))
    assert "| 1.20× (2 shapes) | Liger fused MoE (anchor) |" in md
    # the flags describe the fastest opponent; the fastest baseline, another system, carries its own
    assert "| eager | — | 3.00× (2 shapes) over NCCL+PyTorch; compiled (max-autotune) |" in md


def test_a_run_with_errata_is_marked(tmp_path):
    """A verdict whose run has an ERRATA.md beside its rows says so, so that no one reads it without the errata."""
    run = S.verdict_run("r", OLD, ["nccl", "mok_hopper"], directions=("fwd",))
    table = V.verdict_table(frame(run))
    assert V.errata_runs(["r", "s"], tmp_path) == set()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / V.ERRATA).write_text("timings in doubt\n")
    assert V.errata_runs(["r", "s"], tmp_path) == {"r"}
    assert "`r` (see its ERRATA.md)" in V.format_verdicts(table, {"r"})
    assert "ERRATA" not in V.format_verdicts(table)


def test_the_committed_errata_reach_the_verdicts():
    """The DeepGEMM runs' errata (a racing weight-gradient kernel) are marked wherever those runs give a verdict."""
    committed = results.load(results.REFERENCE_RUNS)
    table = V.verdict_table(committed)
    cited = V.errata_runs(table["run_id"])
    block = V.verdict_block(committed, table=table)
    for run_id in cited:
        assert f"`{display_name(run_id)}` (see its ERRATA.md)" in block
    deepgemm = [run_id_of(n) for n in ("nccl-fp8-fwd-bwd_h200x1_20261203-2",
                                       "mok_hopper-fp8-fwd-bwd_h200x1_20261204-3")]
    assert V.errata_runs(deepgemm) == set(deepgemm)


def test_published_rows_are_never_a_verdict():
    pub = C.load_published()
    assert V.verdict_table(pub).empty
    run = S.verdict_run("r", OLD, ["nccl", "mok_hopper"], directions=("fwd",))
    assert list(V.verdict_table(pd.concat([frame(run), pub], ignore_index=True))["run_id"]) == ["r"]


# ---------------------------------------------------------------------------------------------------------------
# the generated block


def test_the_block_replaces_what_is_between_the_markers(tmp_path):
    text = f"intro\n{V.MARK_START}\nold table\n{V.MARK_END}\nrest\n"
    assert V.block_of(text) == "old table"
    assert V.replace_block(text, "new\ntable") == f"intro\n{V.MARK_START}\nnew\ntable\n{V.MARK_END}\nrest\n"
    assert V.block_of("no markers") is None
    with pytest.raises(ValueError):
        V.replace_block("no markers", "x")
    for bad in (f"{V.MARK_START}\nx\n", f"{V.MARK_END}\n{V.MARK_START}\n",
                f"{V.MARK_START}\n{V.MARK_END}\n{V.MARK_START}\n{V.MARK_END}\n"):
        with pytest.raises(ValueError):
            V.block_of(bad)
    f = tmp_path / "README.md"
    f.write_text(text)
    assert V.rewrite_block(f, "x") and not V.rewrite_block(f, "x")
    assert f.read_text() == f"intro\n{V.MARK_START}\nx\n{V.MARK_END}\nrest\n"


def test_the_block_depends_on_the_rows_only():
    rows = frame(S.verdict_run("r", NEW, ["nccl", "mok_hopper"], directions=("fwd",)),
                 S.verdict_run("s", OLD, ["nccl", "mok_hopper"], directions=("fwd",), num_gpus=2, ep_size=2))
    block = V.verdict_block(rows)
    assert block == V.verdict_block(rows.sample(frac=1.0, random_state=1))
    assert block.endswith("Generated by `python3 -m harness.report` from results/runs (newest run: 2026-12-02); "
                          "do not edit by hand.")
    assert block.startswith(V.format_verdicts(V.verdict_table(rows)))


# ---------------------------------------------------------------------------------------------------------------
# REPORT.md and its charts


def _summary_rows() -> pd.DataFrame:
    return frame(S.verdict_run("gpu1", NEW, ["nccl", "mok_hopper"], SHAPES),
                 S.verdict_run("gpu1-old", OLD, ["nccl", "deepep", "mok_hopper"], SHAPES, precisions=("fp8",),
                               directions=("fwd",), per_backend={"nccl": {"scaling": "emulated"},
                                                                 "deepep": {"scaling": "emulated"}}),
                 S.verdict_run("gpu2", OLD, ["nccl", "mok_hopper"], directions=("fwd",), num_gpus=2, ep_size=2),
                 [S.row("deepep", run_id="gpu1", timestamp=NEW, ep_size=1, status="error", error="boom\nmore",
                        env=dict(S.H200, num_gpus=1))])


def test_write_summary_writes_the_report_its_charts_and_nothing_else(tmp_path):
    df = _summary_rows()
    root = tmp_path / "results"
    (root / "figures").mkdir(parents=True)
    (root / "figures" / "stale.svg").write_text("<svg/>")  # a chart no verdict cites any more
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{V.MARK_START}\nstale\n{V.MARK_END}\n")
    written = R.write_summary(df, root, published=C.load_published(), readme_claims=C.load_claims(), readme=readme)
    names = P.headline_charts(df)
    assert len(names) == 6  # panels + roofline of the three runs the verdicts cite
    assert sorted(p.name for p in (root / "figures").iterdir()) == sorted(names)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == sorted(
        ["REPORT.md", *(f"figures/{n}" for n in names)])
    text = (root / "REPORT.md").read_text()
    block = V.verdict_block(df)
    assert V.block_of(text) == block and V.block_of(readme.read_text()) == block
    assert all(f"(figures/{n})" in text for n in names)
    assert text.index("### 1x NVIDIA H200, EP 1, 4096 tokens/GPU") < text.index("#### `gpu1`") < text.index(
        "#### `gpu1-old`") < text.index("### 2x NVIDIA H200, EP 2, 4096 tokens/GPU")
    assert "## The published figure's values (published, not measured here)" in text
    assert "| MXFP8 forward | Kimi K2.7 | 568 |" in text  # the published values, in their own section
    assert "## Rows not ok in these runs" in text and "| error | boom |" in text
    assert "python3 -m harness.report results/runs/<run> --out DIR" in text
    assert set(written) == {"REPORT.md", "README.md", *(f"figures/{n}" for n in names)}


def test_headline_charts_are_the_cited_runs_panels_and_rooflines():
    df = _summary_rows()
    names = P.headline_charts(df)
    assert names == [f"{kind}_{run}-nvidia-h200-ep-{ep}-4096-tokens-gpu-1-node.png"
                     for run, ep in (("gpu1", 1), ("gpu1-old", 1), ("gpu2", 2)) for kind in ("panels", "roofline")]
    no_floors = df.drop(columns=["calib_hbm_gb_s", "calib_gemm_tflops", "calib_link_gb_s"])
    assert all(n.startswith("panels_") for n in P.headline_charts(results.to_frame(no_floors.to_dict("records"))))


def summary_on_a_copy(tmp_path: Path, monkeypatch, rows: list) -> tuple[Path, Path]:
    """``python -m harness.report`` with no paths (exit 0 checked) on a copy: ``rows`` as the committed runs, a
    README with an empty verdict block; returns (the results folder, the README)."""
    root = tmp_path / "results"
    results.write_rows(root / "runs" / "gpu2" / "rows.csv", rows)
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{V.MARK_START}\n{V.MARK_END}\nbottom\n")
    monkeypatch.setattr(results, "REFERENCE_RUNS", root / "runs")
    monkeypatch.setattr(results, "REPO_RESULTS", root)
    monkeypatch.setattr(R, "README", readme)
    assert R.main([]) == 0
    return root, readme


def test_cli_summary_on_a_copy(tmp_path, monkeypatch, capsys):
    """``python -m harness.report`` with no paths: REPORT.md, its charts and README's block, from results/runs
    (here a copy holding synthetic runs), and nothing else."""
    root, readme = summary_on_a_copy(
        tmp_path, monkeypatch,
        S.verdict_run("gpu2", OLD, ["nccl", "mok_hopper"], directions=("fwd",), num_gpus=2, ep_size=2))
    out = capsys.readouterr().out
    assert "| 2x NVIDIA H200, EP 2, 4096 tokens/GPU | BF16 forward |" in out and "2 charts" in out
    block = V.verdict_block(results.load(root / "runs"))
    assert V.block_of(readme.read_text()) == block == V.block_of((root / "REPORT.md").read_text())
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "REPORT.md", *(f"figures/{n}" for n in sorted(P.headline_charts(results.load(root / "runs")))),
        "runs/gpu2/rows.csv"]


@pytest.mark.parametrize("argv, words", [(["--pool"], "--scope/--pool"), (["--no-charts"], "--no-charts"),
                                         (["--formats", "png"], "--formats"),
                                         (["--include-published", "--no-measured"], "--include-published")])
def test_cli_summary_takes_no_options(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.setattr(results, "REPO_RESULTS", tmp_path / "results")
    monkeypatch.setattr(R, "README", tmp_path / "README.md")
    assert R.main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and words in cap.err and "--out DIR" in cap.err
    assert not (tmp_path / "results").exists()


def test_cli_summary_refuses_malformed_readme_markers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "REPO_RESULTS", tmp_path / "results")
    readme = tmp_path / "README.md"
    readme.write_text(f"{V.MARK_START}\nno end\n")
    monkeypatch.setattr(R, "README", readme)
    assert R.main([]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and V.MARK_END in err
    assert not (tmp_path / "results").exists() and readme.read_text() == f"{V.MARK_START}\nno end\n"


# ---------------------------------------------------------------------------------------------------------------
# the committed layout: results/ holds the rows, the published values, REPORT.md and its headline charts


def tracked(prefix: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", prefix], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs a git checkout to list the tracked files ({e})")
    return [REPO / p for p in out.stdout.decode().split("\0") if p]


def images(files: list[Path]) -> list[Path]:
    return [p for p in files if p.suffix.lower() in R.IMAGE_SUFFIXES]


def size(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files if p.exists())


@pytest.fixture(scope="module")
def committed() -> pd.DataFrame:
    df = results.load(results.REFERENCE_RUNS)
    assert len(df), "results/runs holds no rows"
    return df


def test_results_hold_only_the_headline_images(committed):
    """(a) The only images under results/ are the headline charts of the committed runs, at most 10."""
    allowed = {results.REPO_RESULTS / "figures" / n for n in P.headline_charts(committed)}
    assert len(allowed) <= MAX_IMAGES
    found = set(images(tracked("results")))
    extra, missing = sorted(found - allowed), sorted(allowed - found)
    assert not extra, f"{len(extra)} images under results/ that are no headline chart, e.g. {extra[:3]}"
    assert not missing, f"headline charts not committed: {missing} (run python3 -m harness.report)"


def test_results_stay_small():
    """(b) Everything tracked under results/ is under 10 MB."""
    assert size(tracked("results")) < MAX_RESULTS_BYTES


def test_report_md_holds_the_generated_verdicts(committed):
    """(c) results/REPORT.md exists and its verdict table is what the committed runs give."""
    report = results.REPO_RESULTS / "REPORT.md"
    assert report.exists(), "results/REPORT.md is missing: run python3 -m harness.report"
    assert V.block_of(report.read_text()) == V.verdict_block(committed), "stale: run python3 -m harness.report"


def test_readme_block_is_generated_from_the_committed_runs(committed):
    """(d) README.md's block between the verdict markers is what the committed runs give: it cannot go stale."""
    text = (REPO / "README.md").read_text()
    assert V.MARK_START in text and V.MARK_END in text, "README.md needs the verdict markers"
    assert V.block_of(text) == V.verdict_block(committed), "stale: run python3 -m harness.report"


@pytest.mark.slow
def test_the_writer_on_a_copy_of_the_committed_results_passes_the_layout_checks(tmp_path, committed):
    """(a)-(c) on a copy of results/runs and results/published, the writer pointed at it."""
    root = tmp_path / "results"
    shutil.copytree(results.REFERENCE_RUNS, root / "runs")
    shutil.copytree(C.PUBLISHED_DIR, root / "published")
    df = results.load(root / "runs")
    R.write_summary(df, root, published=C.load_published(root / "published" / C.PUBLISHED_FIGURE.name),
                    readme_claims=C.load_claims(root / "published" / C.PUBLISHED_CLAIMS.name))
    files = [p for p in root.rglob("*") if p.is_file()]
    names = P.headline_charts(committed)
    assert 0 < len(names) <= MAX_IMAGES
    assert set(images(files)) == {root / "figures" / n for n in names}
    assert size(files) < MAX_RESULTS_BYTES
    assert V.block_of((root / "REPORT.md").read_text()) == V.verdict_block(committed)


# ---------------------------------------------------------------------------------------------------------------
# meta.json


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "my-run"
    a = S.verdict_run("r1", OLD, ["nccl", "mok_hopper"], SHAPES, directions=("fwd",), git_sha="aaaa", seed=1,
                      torch_version="2.11.0", hostname="h1")
    b = S.verdict_run("r1", NEW, ["nccl"], precisions=("fp8",), directions=("bwd",), git_sha="bbbb", seed=1,
                      torch_version="2.11.0", hostname="h1", timing_preset="custom", num_warmup=20, num_iters=50,
                      per_backend={"nccl": {"status": "oom", "scaling": "emulated"}})
    results.write_rows(run / "job-a.csv", a)
    results.write_rows(run / "job-b.csv", b)
    return run


def test_meta_json_is_derived_from_the_rows(tmp_path):
    run = _run_folder(tmp_path)
    path = M.write_meta(run)
    assert path == run / "meta.json"
    meta = json.loads(path.read_text())
    assert meta["derived_from"] == "rows" and meta["run_dir"] == "my-run" and meta["run_ids"] == ["r1"]
    assert meta["rows"] == 5 and meta["status_counts"] == {"ok": 4, "oom": 1}
    assert (meta["first_timestamp"], meta["last_timestamp"]) == (OLD, NEW)
    assert meta["commits"] == [{"git_sha": "aaaa", "git_dirty": False, "rows": 4},
                               {"git_sha": "bbbb", "git_dirty": False, "rows": 1}]
    env = meta["environment"]
    assert env["constant"]["gpu_name"] == "NVIDIA H200" and env["constant"]["num_gpus"] == 1
    assert env["constant"]["torch_version"] == "2.11.0" and env["constant"]["hostname"] == "h1"
    assert env["constant"]["slurm_job_id"] is None and env["varies"] == {}
    cfg = meta["config"]
    assert cfg["constant"]["seed"] == 1 and cfg["constant"]["ep_size"] == 1 and cfg["constant"]["routing"] == "uniform"
    assert cfg["varies"]["shape"] == ["kimi_k2_7", "qwen3_5_397b"]
    assert cfg["varies"]["backend"] == ["mok_hopper", "nccl"] and cfg["varies"]["precision"] == ["bf16", "fp8"]
    assert cfg["varies"]["direction"] == ["bwd", "fwd"]
    assert cfg["varies"]["timing_preset"] == ["custom", "published"] and cfg["varies"]["num_iters"] == [50, 100]
    assert set(M.ENV_COLUMNS) | set(M.CONFIG_COLUMNS) <= set(results.COLUMNS)
    before = path.read_bytes()
    assert M.write_meta(run).read_bytes() == before  # the same rows give the same bytes
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temp file left


def test_the_loader_ignores_meta_json(tmp_path):
    run = _run_folder(tmp_path)
    before = results.load(run)
    M.write_meta(run)
    after = results.load(run)
    assert len(after) == len(before) == 5 and after.attrs["skipped"] == {}
    assert results.find_files(run)[0] == sorted(run.glob("*.csv"))


def test_run_meta_cli(tmp_path, capsys):
    run = _run_folder(tmp_path)
    assert M.main([str(run)]) == 0
    assert (run / "meta.json").exists() and "5 rows" in capsys.readouterr().out
    (run / "meta.json").unlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad in ([str(run), str(empty)], [str(run), str(tmp_path / "nope")]):
        assert M.main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "run folder" in err
        assert not (run / "meta.json").exists()  # nothing written when any path is bad
    with pytest.raises(SystemExit):
        M.main(["--help"])
    assert "meta.json" in capsys.readouterr().out


def test_refresh_meta_never_raises(tmp_path, capsys):
    assert M.refresh_meta(tmp_path / "no-such-run") is None
    assert "meta.json not written" in capsys.readouterr().err
    assert M.refresh_meta(_run_folder(tmp_path)) == tmp_path / "runs" / "my-run" / "meta.json"
