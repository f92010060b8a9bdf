"""Several ranks on one GPU, prepared on the CPU: the ``shared_gpu`` rows that no speed table reads, the one-process
check (benchmarks/mok_hopper/shared_gpu_check.py) in lockstep under the Triton interpreter with its fault injections,
its grid-cap rule, and the probe's runner and report (scripts/probe_shared_gpu.py) with fake steps. The GPU side is
tests/test_shared_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness import claims as C  # noqa: E402
from harness import results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTE = "ran several ranks on one GPU (shared_gpu): correctness only, left out of speed tables"


# ---------------------------------------------------------------------------------------------------------------
# the shared_gpu column and the speed tables that leave its rows out


def test_the_shared_gpu_column_is_a_boolean_empty_in_older_rows(tmp_path):
    cols = list(results.COLUMNS)
    assert cols[cols.index("appended") + 1] == "shared_gpu" and results.COLUMNS["shared_gpu"] == "boolean"
    old = results.to_frame([S.row("nccl")])
    assert old["shared_gpu"].isna().all() and not C.is_shared_gpu(old).any()
    results.write_rows(tmp_path / "r" / "rows.csv", [S.row("nccl")] + S.shared_gpu([S.row("mok_hopper")]))
    back = results.load(tmp_path)
    assert str(back["shared_gpu"].dtype) == "boolean"
    assert C.is_shared_gpu(back).tolist() == [False, True]
    assert C.is_shared_gpu(old.drop(columns="shared_gpu")).tolist() == [False]  # a frame without the column
    assert C.shared_gpu_note(0) == "" and C.shared_gpu_note(1).startswith("1 row ran")


def _with_shared(df: pd.DataFrame, **extra) -> tuple[pd.DataFrame, int]:
    """``df`` plus ten-times-faster shared-GPU copies of its mok_hopper rows, and how many were added."""
    shared = S.shared_gpu([r for r in df.to_dict("records") if r["backend"] == "mok_hopper"], **extra)
    return results.to_frame(df.to_dict("records") + shared), len(shared)


def test_claims_headline_clocks_and_counts_leave_shared_gpu_rows_out_and_say_so():
    base = S.measured_h200()
    base["sm_clock_mhz"], base["num_warmup"], base["num_iters"] = 1980.0, 500, 100
    both, n = _with_shared(base, num_iters=7)
    claims, plain = C.claims_table(both), C.claims_table(base)
    pd.testing.assert_frame_equal(claims, plain)
    assert claims.attrs["notes"] == [f"{n} rows {NOTE}"] and plain.attrs["notes"] == []
    head = C.headline_table(claims)
    pd.testing.assert_frame_equal(head, C.headline_table(plain))
    assert head.attrs["notes"] == claims.attrs["notes"]
    assert len(C.clock_rows(both)) == len(C.clock_rows(base))
    assert C.timing_counts(both).empty  # the shared copies' 7 iterations are no timing to report
    only = C.claims_table(results.to_frame(S.shared_gpu(S.grid(["nccl", "mok_hopper"]))))
    assert only.empty and only.attrs["notes"] == [f"16 rows {NOTE}"]


def test_verdicts_never_read_shared_gpu_rows_and_the_block_says_so():
    from harness import verdicts as V

    old = S.verdict_run("run-a", "2026-12-01T00:00:00+00:00", ["nccl", "mok_hopper"])
    newer = S.shared_gpu(S.verdict_run("run-b", "2026-12-05T00:00:00+00:00", ["nccl", "mok_hopper"]))
    df = results.to_frame(old + newer)
    table = V.verdict_table(df)
    pd.testing.assert_frame_equal(table, V.verdict_table(results.to_frame(old)))
    assert set(table["run_id"]) == {"run-a"} and table.attrs["notes"] == [f"4 rows {NOTE}"]
    block = V.verdict_block(df)
    assert f"4 rows {NOTE}." in block and "newest run: 2026-12-01" in block
    assert "shared_gpu" not in V.verdict_block(results.to_frame(old))


def _bar_heights(fig) -> list[float]:
    return sorted(round(p.get_height(), 6) for ax in fig.axes for p in ax.patches)


def _footnote(fig) -> str:
    return " ".join(t.get_text() for t in fig.texts).replace("\n", " ")


def test_charts_leave_shared_gpu_rows_out_and_say_so_in_their_footnote():
    from harness import plots as P

    base = S.measured_h200()
    both, n = _with_shared(base)
    for draw in (P.plot_panels, P.plot_roofline):
        fig, plain = draw(both), draw(base)
        assert _bar_heights(fig) == _bar_heights(plain)
        assert f"{n} rows {NOTE}" in _footnote(fig) and "shared_gpu" not in _footnote(plain)
    sweep, _ = _with_shared(S.sweeps_h200())
    fig = P.plot_sweep(sweep, "tokens_per_gpu")
    ys = sorted(float(y) for ax in fig.axes for line in ax.lines for y in line.get_ydata())
    assert ys == sorted(float(y) for ax in P.plot_sweep(S.sweeps_h200(), "tokens_per_gpu").axes
                        for line in ax.lines for y in line.get_ydata())
    assert NOTE in _footnote(fig)
    hist = S.grid(["nccl", "mok_hopper"], shapes=("qwen3_5_397b",), directions=("fwd",))
    hist += [S.row(b, git_sha="bbbb2222", run_id="r2", timestamp="2026-12-02T00:00:00+00:00")
             for b in ("nccl", "mok_hopper")]
    fig = P.plot_history(results.to_frame(hist + S.shared_gpu([hist[1]])))
    top = max(float(y) for ax in fig.axes for line in ax.lines for y in line.get_ydata())
    assert top < 1000 and f"1 row {NOTE}" in _footnote(fig)  # (the 10x copy would be ~4000 TFLOP/s)
    # an environment of shared-GPU rows alone gets no chart; a history of them alone is not drawn
    lone = results.to_frame(base.to_dict("records") + S.shared_gpu(S.grid(["nccl", "mok_hopper"], ep_size=2,
                                                                           run_id="lone")))
    assert [name for name, _ in P.chart_plan(lone)] == [name for name, _ in P.chart_plan(base)]
    h = lone[lone["run_id"] == "lone"]["config_hash"].iloc[0]
    assert not [name for name, _ in P.chart_plan(lone, history=[h]) if name.startswith("history_")]
    with pytest.raises(ValueError, match="shared_gpu"):
        P.plot_panels(lone[lone["run_id"] == "lone"])


def test_compare_leaves_shared_gpu_rows_out_with_a_note_and_refuses_a_side_of_them_alone(tmp_path, capsys):
    from harness import compare

    base = S.grid(["nccl", "mok_hopper"], shapes=("qwen3_5_397b",), run_id="base")
    new = [dict(r, run_id="new", row_id=r["row_id"] + "n") for r in base]
    slow = S.shared_gpu([r for r in new if r["backend"] == "mok_hopper"], speedup=0.5)  # 2x slower: never judged
    results.write_rows(tmp_path / "base" / "rows.csv", base)
    results.write_rows(tmp_path / "new" / "rows.csv", new + slow)
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert f"NEW: 2 rows {NOTE}" in out and "REGRESSION" not in out
    results.write_rows(tmp_path / "alone" / "rows.csv", slow)
    assert compare.main([str(tmp_path / "base"), str(tmp_path / "alone")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "NEW has no rows to compare" in err and "shared_gpu" in err
