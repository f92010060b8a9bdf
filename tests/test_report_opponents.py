"""The verdicts' headline: each contender over its fastest opponent, like with like (harness.report.opponents,
harness.report.verdicts), on synthetic rows built with harness.core.results.to_frame."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness.report import claims as C  # noqa: E402
from harness.report import opponents as O  # noqa: E402
from harness.report import plots as P  # noqa: E402
from harness.core import results  # noqa: E402
from harness.report import verdicts as V  # noqa: E402
from harness.core.backends import series_name  # noqa: E402
from harness.report.labels import forward_kind  # noqa: E402
from harness.report.markdown import claims_sections  # noqa: E402

OLD, NEW = "2026-12-01T00:00:00+00:00", "2026-12-02T00:00:00+00:00"
SHAPES = ("kimi_k2_7", "qwen3_5_397b")
INFERENCE = {"backend_options": "forward=inference"}
GB = 1_000_000_000


def frame(*runs: list):
    return results.to_frame([r for run in runs for r in run])


def one(table, **where) -> dict:
    m = table
    for k, v in where.items():
        m = m[m[k] == v]
    assert len(m) == 1, (where, table[["panel", "pairs", "run_id"]])
    return m.iloc[0].to_dict()


def inference_rows(run_id: str, timestamp: str, backend: str, tflops: float, **kw) -> list[dict]:
    """``verdict_run`` rows of one backend's inference forward (their own row ids: the run has its training rows
    too)."""
    rows = S.verdict_run(run_id, timestamp, [backend], directions=("fwd",), tflops={backend: tflops}, **kw)
    return [dict(r, row_id=r["row_id"] + "-inf") for r in rows]


# ---------------------------------------------------------------------------------------------------------------
# the forward kind


def test_forward_kind_reads_the_column_then_derives_it():
    assert forward_kind({"direction": "fwd", "backend": "nccl", "forward_kind": "inference"}) == "inference"
    assert forward_kind({"direction": "fwd", "backend": "flashinfer", "forward_kind": "training"}) == "training"
    # rows written before the column
    assert forward_kind({"direction": "fwd", "backend": "deepgemm_megamoe"}) == "inference"
    assert forward_kind({"direction": "fwd", "backend": "flashinfer", "forward_kind": None}) == "inference"
    assert forward_kind({"direction": "fwd", "backend": "mok_hopper",
                         "backend_options": "forward=inference,tile=64"}) == "inference"
    assert forward_kind({"direction": "fwd", "backend": "mok_hopper",
                         "backend_options": "forward=save_h"}) == "training"
    assert forward_kind({"direction": "fwd", "backend": "liger", "backend_options": None}) == "training"
    assert forward_kind({"direction": "fwd", "backend": "deepgemm_megamoe · DeepGEMM"}) == "inference"
    # backward rows have no kind: they pair as they are
    assert forward_kind({"direction": "bwd", "backend": "mok_hopper", "backend_options": "forward=inference"}) == ""


# ---------------------------------------------------------------------------------------------------------------
# the opponent table


def test_the_opponent_table_pairs_like_with_like():
    """Per cell and contender: the fastest opponent of the same forward kind (no contender, no reference), the
    fastest baseline, the own-peak memory ratio over that opponent, and the fastest bf16 opponent of an fp8 cell."""
    run = S.verdict_run("r", OLD, ["nccl", "liger", "mok", "mok_hopper"], precisions=("bf16", "fp8"),
                        directions=("fwd",), tflops={"nccl": 100.0, "liger": 200.0, "mok": 1000.0, "mok_hopper": 300.0},
                        per_backend={"liger": {"mem_peak_own_bytes": 4 * GB},
                                     "mok_hopper": {"mem_peak_own_bytes": 2 * GB, "mem_peak_allocated_bytes": 9 * GB}})
    run += inference_rows("r", OLD, "deepgemm_megamoe", 900.0)
    run.append(S.row("reference", run_id="r", timestamp=OLD, ep_size=1, env=dict(S.H200, num_gpus=1), tflops=5e3))
    t = O.opponent_table(frame(run))
    hop = t[t["contender"] == "mok_hopper"].set_index("precision")
    assert set(t["contender"]) == {"mok", "mok_hopper"} and set(t["forward_kind"]) == {"training"}
    assert (hop["opponent"] == "liger").all() and (hop["baseline"] == "nccl").all()
    assert hop.loc["bf16", "speedup"] == pytest.approx(1.5) and hop.loc["bf16", "baseline_speedup"] == 3.0
    assert hop.loc["bf16", "memory_ratio"] == pytest.approx(0.5)
    assert hop.loc["fp8", "bf16_opponent"] == "liger" and hop.loc["fp8", "bf16_speedup"] == pytest.approx(1.5)
    assert hop.loc["bf16", "bf16_opponent"] == ""


# ---------------------------------------------------------------------------------------------------------------
# like with like


def test_an_inference_forward_never_pairs_with_a_training_forward():
    """mok_hopper's training forward (300) meets nccl's (100), its inference forward (500) meets the inference
    anchors (DeepGEMM MegaMoE 400, FlashInfer 450); neither meets the other kind, and the two mok_hopper kinds are never
    one median."""
    run = S.verdict_run("r", OLD, ["nccl", "mok_hopper"], directions=("fwd",),
                        tflops={"nccl": 100.0, "mok_hopper": 300.0})
    run += inference_rows("r", OLD, "mok_hopper", 500.0, per_backend={"mok_hopper": INFERENCE})
    run += inference_rows("r", OLD, "deepgemm_megamoe", 400.0)
    run += inference_rows("r", OLD, "flashinfer", 450.0, per_backend={"flashinfer": {"forward_kind": "inference"}})
    t = V.verdict_table(frame(run))
    train, infer = one(t, forward_kind="training"), one(t, forward_kind="inference")
    assert train["fastest_opponents"] == "nccl" and train["speedup_min"] == pytest.approx(3.0)
    assert infer["fastest_opponents"] == "flashinfer" and infer["speedup_min"] == pytest.approx(500 / 450)
    assert (train["pairs"], infer["pairs"]) == ("training forwards", "inference forwards")
    assert train["contender"] == infer["contender"] == "mok_hopper"
    assert infer["fastest_baselines"] == ""  # both inference opponents are anchors; nccl is a training forward
    md = V.format_verdicts(t)
    assert "| BF16 forward | training forwards | 3.00× (1 shape) | NCCL+PyTorch |" in md
    assert "| BF16 forward | inference forwards | 1.11× (1 shape) | FlashInfer fused MoE inference (anchor) |" in md
    assert md.index("training forwards") < md.index("inference forwards")


def test_the_claims_tables_keep_the_two_forward_kinds_apart():
    """A run with mok_hopper's training (300) and inference (500) forwards: the claims table (REPORT.md's detailed
    tables, the charts) draws them as two series, never one median, and each fused series' × and × all are over
    forwards of its own kind: training over nccl (100), inference over DeepGEMM MegaMoE (400), never each other."""
    run = S.verdict_run("r", OLD, ["nccl", "mok_hopper"], directions=("fwd",),
                        tflops={"nccl": 100.0, "mok_hopper": 300.0})
    run += inference_rows("r", OLD, "mok_hopper", 500.0, per_backend={"mok_hopper": INFERENCE})
    run += inference_rows("r", OLD, "deepgemm_megamoe", 400.0)
    claims = C.claims_table(C.prepare(frame(run)))
    inf = series_name("mok_hopper", "inference")
    r = claims.iloc[0]
    assert len(claims) == 1 and (r["tflops_mok_hopper"], r[f"tflops_{inf}"]) == (300.0, 500.0)
    assert r["speedup_mok_hopper"] == pytest.approx(3.0) and r["speedup_all_mok_hopper"] == pytest.approx(3.0)
    assert r[f"speedup_all_{inf}"] == pytest.approx(1.25) and r[f"speedup_{inf}"] != r[f"speedup_{inf}"]  # NaN
    assert (r["over_all_mok_hopper"], r[f"over_all_{inf}"], r["best_overall"]) == ("nccl", "deepgemm_megamoe",
                                                                                   "deepgemm_megamoe")
    md = "\n".join(claims_sections(claims))
    assert "| 3.00× over NCCL+PyTorch | 1.25× |" in md  # × all: named where it is not the cell's fastest of all
    head = C.headline_table(claims)
    assert list(head["min_all_over"]) == ["nccl", "deepgemm_megamoe"]
    # a run with one kind of mok_hopper forward keeps its name
    only = C.prepare(frame(inference_rows("s", OLD, "mok_hopper", 500.0, per_backend={"mok_hopper": INFERENCE})))
    assert set(only["backend"]) == {"mok_hopper"}


def test_a_contender_is_never_an_opponent():
    """MoK (a contender, far faster) is no opponent of MoK Hopper, nor is the reference: the fastest opponent is
    nccl; MoK gets its own verdict over nccl too."""
    run = S.verdict_run("r", OLD, ["nccl", "mok", "mok_hopper"], directions=("fwd",),
                        tflops={"nccl": 100.0, "mok": 1000.0, "mok_hopper": 300.0})
    run.append(S.row("reference", run_id="r", timestamp=OLD, ep_size=1, env=dict(S.H200, num_gpus=1),
                     tflops=5000.0))
    pairs = O.opponent_table(frame(run))
    assert set(pairs["opponent"]) == {"nccl"} and set(pairs["contender"]) == {"mok", "mok_hopper"}
    t = V.verdict_table(frame(run))
    assert one(t, contender="mok_hopper")["speedup_min"] == pytest.approx(3.0)
    assert one(t, contender="mok")["fastest_opponents"] == "nccl"


def test_the_opponent_named_is_the_fastest_of_each_shape():
    """Baselines and anchors are opponents alike: Liger (an anchor) is the fastest on Kimi, DeepEP on Qwen; the
    speedup over the fastest baseline stands beside."""
    run = S.verdict_run("r", OLD, ["nccl", "deepep", "liger", "sonicmoe", "mok_hopper"], SHAPES, directions=("fwd",),
                        tflops={"nccl": 100.0, "deepep": 150.0, "liger": 250.0, "sonicmoe": 200.0,
                                "mok_hopper": 300.0})
    for r in run:
        if r["shape"] == "qwen3_5_397b" and r["backend"] in ("liger", "sonicmoe"):
            r["tflops_per_gpu"] = 120.0
    pairs = O.opponent_table(frame(run)).set_index("shape")
    assert pairs.loc["kimi_k2_7", "opponent"] == "liger" and pairs.loc["qwen3_5_397b", "opponent"] == "deepep"
    v = one(V.verdict_table(frame(run)), run_id="r")
    assert (v["speedup_min"], v["speedup_max"]) == (pytest.approx(1.2), pytest.approx(2.0))
    assert v["fastest_opponents"] == "deepep, liger" and v["fastest_baselines"] == "deepep"
    assert v["baseline_speedup_min"] == pytest.approx(2.0)
    md = V.format_verdicts(V.verdict_table(frame(run)))
    assert "| 1.20-2.00× (2 shapes) | DeepEP+PyTorch, Liger fused MoE (anchor) |" in md
    assert "| 2.00× (2 shapes) over DeepEP+PyTorch; eager |" in md


# ---------------------------------------------------------------------------------------------------------------
# the memory ratio


def test_the_memory_ratio_reads_the_own_peak_of_the_fastest_opponent():
    """Own-peak memory: mok_hopper 2 GB over the fastest opponent's (liger, 4 GB), not the slower nccl's (1 GB), and
    never another memory column (set here to other values)."""
    run = S.verdict_run("r", OLD, ["nccl", "liger", "mok_hopper"], directions=("fwd",),
                        tflops={"nccl": 100.0, "liger": 200.0, "mok_hopper": 300.0}, per_backend={
                            "nccl": {"mem_peak_own_bytes": 1 * GB, "mem_peak_allocated_bytes": 9 * GB},
                            "liger": {"mem_peak_own_bytes": 4 * GB, "mem_peak_allocated_bytes": 5 * GB},
                            "mok_hopper": {"mem_peak_own_bytes": 2 * GB, "mem_peak_allocated_bytes": 20 * GB,
                                           "mem_setup_bytes": 7 * GB}})
    v = one(V.verdict_table(frame(run)), run_id="r")
    assert v["memory_ratio_min"] == pytest.approx(0.5) and v["memory_shapes"] == 1
    assert "| 1.50× (1 shape) | Liger fused MoE (anchor) | 0.50× (1 shape) |" in V.format_verdicts(
        V.verdict_table(frame(run)))


def test_a_run_without_the_own_peak_shows_a_dash_and_says_why():
    """Other memory columns measured, mem_peak_own_bytes not: no memory ratio, — and the legend says why."""
    run = S.verdict_run("r", OLD, ["nccl", "mok_hopper"], directions=("fwd",), mem_peak_allocated_bytes=3 * GB,
                        mem_setup_bytes=GB, mem_activation_bytes=GB)
    t = V.verdict_table(frame(run))
    v = one(t, run_id="r")
    assert v["memory_shapes"] == 0 and v["memory_ratio_min"] != v["memory_ratio_min"]  # NaN
    assert "| NCCL+PyTorch | — |" in V.format_verdicts(t)
    block = V.verdict_block(frame(run), table=t)
    assert "— where that run did not measure it (rows written before the `mem_peak_own_bytes` column" in block


def test_a_run_comparing_the_contenders_options_gives_no_verdict_and_its_memory_stays_blind_to_graphs():
    """A run with mok_hopper under two weight layouts is a study of mok_hopper: its series (one per layout) give no
    verdict, and the newer run's default contender does; an opponent that replayed CUDA graphs (compiled
    max-autotune) has no own-peak memory to compare (its allocator peak missed the graphs' pool)."""
    tiled, plain = ({"backend_options": f"forward=save_h,weights={w}", "mem_peak_own_bytes": m * GB}
                    for w, m in (("tiled", 20), ("plain", 10)))
    study = S.verdict_run("study", OLD, ["nccl", "mok_hopper"], directions=("fwd",),
                          tflops={"nccl": 100.0, "mok_hopper": 300.0}, per_backend={"mok_hopper": tiled})
    study += S.verdict_run("study", OLD, ["mok_hopper"], directions=("fwd",), tflops={"mok_hopper": 280.0},
                           per_backend={"mok_hopper": plain})
    graphed = {"compiled": True, "compile_mode": "max-autotune", "mem_peak_own_bytes": GB}
    newer = S.verdict_run("newer", NEW, ["torch_compiled", "mok_hopper"], directions=("fwd",),
                          tflops={"torch_compiled": 200.0, "mok_hopper": 300.0},
                          per_backend={"torch_compiled": graphed, "mok_hopper": tiled})
    t = V.verdict_table(frame(study, newer))
    assert list(t["run_id"]) == ["newer"] and list(t["contender"]) == ["mok_hopper"]
    v = one(t, run_id="newer")
    assert v["speedup_min"] == pytest.approx(1.5) and v["memory_shapes"] == 0
    assert V.verdict_table(frame(study)).empty


# ---------------------------------------------------------------------------------------------------------------
# fp8 over the fastest bf16 opponent


def test_an_fp8_verdict_gives_the_ratio_over_the_fastest_bf16_opponent():
    """fp8 mok_hopper (600) over the fastest bf16 opponent of its run, shape and forward kind (liger, 300; not the
    faster bf16 inference anchor, 1000); — in a run without bf16 opponent rows."""
    real = {"scaling": "e4m3 rowwise (per-row activation / per-channel weight scales), torch._scaled_grouped_mm"}
    run = S.verdict_run("r", OLD, ["nccl", "mok_hopper"], precisions=("fp8",), directions=("fwd",),
                        tflops={"nccl": 200.0, "mok_hopper": 600.0}, per_backend={"nccl": real})
    run += S.verdict_run("r", OLD, ["nccl", "liger"], directions=("fwd",), tflops={"nccl": 150.0, "liger": 300.0})
    run += inference_rows("r", OLD, "deepgemm_megamoe", 1000.0)
    alone = S.verdict_run("s", OLD, ["nccl", "mok_hopper"], precisions=("fp8",), directions=("fwd",), ep_size=2,
                          num_gpus=2, tflops={"nccl": 200.0, "mok_hopper": 600.0}, per_backend={"nccl": real})
    t = V.verdict_table(frame(run, alone))
    v = one(t, run_id="r")
    assert v["precision"] == "fp8" and v["speedup_min"] == pytest.approx(3.0)
    assert v["bf16_speedup_min"] == pytest.approx(2.0) and v["fastest_bf16_opponents"] == "liger"
    assert one(t, run_id="s")["bf16_shapes"] == 0
    md = V.format_verdicts(t)
    assert "| 2.00× (1 shape) over Liger fused MoE (anchor) | `r` |" in md
    assert "| — | `s` |" in md


# ---------------------------------------------------------------------------------------------------------------
# rows that carry the new columns, through the command that rewrites README's block


def test_the_report_command_on_rows_with_the_new_columns(tmp_path, monkeypatch, capsys):
    """Rows written with ``forward_kind`` and ``mem_peak_own_bytes`` (a CSV file, read back by the loader): the
    committed-report command gives README's block the memory ratio and both forward kinds."""
    rows = S.verdict_run("gpu2", NEW, ["nccl", "mok_hopper"], num_gpus=2, ep_size=2,
                         tflops={"nccl": 100.0, "mok_hopper": 250.0},
                         per_backend={"nccl": {"mem_peak_own_bytes": 5 * GB},
                                      "mok_hopper": {"mem_peak_own_bytes": 4 * GB}})
    for r in rows:
        r["forward_kind"] = "training" if r["direction"] == "fwd" else None
    rows += inference_rows("gpu2", NEW, "mok_hopper", 400.0, num_gpus=2, ep_size=2, per_backend={"mok_hopper": {
        "forward_kind": "inference", "backend_options": "forward=inference", "mem_peak_own_bytes": 1 * GB}})
    rows += inference_rows("gpu2", NEW, "flashinfer", 320.0, num_gpus=2, ep_size=2, per_backend={"flashinfer": {
        "forward_kind": "inference", "mem_peak_own_bytes": 2 * GB}})
    from test_report_layout import summary_on_a_copy

    root, readme = summary_on_a_copy(tmp_path, monkeypatch, rows)
    capsys.readouterr()
    block = V.block_of(readme.read_text())
    assert block == V.verdict_block(results.load(root / "runs")) == V.block_of((root / "REPORT.md").read_text())
    assert ("| BF16 forward | training forwards | 2.50× (1 shape) | NCCL+PyTorch | 0.80× (1 shape) | — |"
            in block)
    assert ("| BF16 forward | inference forwards | 1.25× (1 shape) | FlashInfer fused MoE inference (anchor) | 0.50× "
            "(1 shape) | — |" in block)
    assert "| BF16 backward | backward | 2.50× (1 shape) | NCCL+PyTorch | 0.80× (1 shape) | — |" in block
    assert "did not measure it" not in block  # every compared row measured its own peak
    charts = P.headline_charts(results.load(root / "runs"))
    assert sorted(p.name for p in (root / "figures").iterdir()) == sorted(charts)
