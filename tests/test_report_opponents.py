"""The verdicts' headline: each contender over its fastest opponent, like with like (harness.opponents,
harness.verdicts), on synthetic rows built with harness.results.to_frame."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness import opponents as O  # noqa: E402
from harness import results  # noqa: E402
from harness.labels import forward_kind  # noqa: E402

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
