"""Regression check between two result sets: thresholds, noise, status changes, exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness import compare as C  # noqa: E402
from harness import results  # noqa: E402

BASE_TIME = "2026-12-01T00:00:00+00:00"
NEW_TIME = "2026-12-02T00:00:00+00:00"


def base_rows(spread: float = 0.02) -> list[dict[str, Any]]:
    return S.grid(["nccl", "mok_hopper"], shapes=("qwen3_5_397b", "glm_5_2"), run_id="base", git_sha="aaaa1111",
                  timestamp=BASE_TIME, spread=spread)


def derive(rows: list[dict[str, Any]], factor: Callable[[dict], float], *, run_id: str = "new",
           edit: Optional[Callable[[dict], dict]] = None) -> list[dict[str, Any]]:
    """The NEW run: every latency (median, p20, p80) times factor(row), TFLOP/s divided by it."""
    out = []
    for r in rows:
        f = factor(r)
        n = dict(r, run_id=run_id, row_id=r["row_id"] + run_id[:3], git_sha="bbbb2222", timestamp=NEW_TIME)
        if n["status"] == "ok":
            for c in ("latency_ms", "latency_p20_ms", "latency_p80_ms"):
                n[c] = r[c] * f if r[c] is not None else None
            n["tflops_per_gpu"] = r["tflops_per_gpu"] / f
        out.append(edit(n) if edit else n)
    return out


def is_target(r: dict) -> bool:
    return (r["backend"], r["shape"], r["direction"]) == ("mok_hopper", "qwen3_5_397b", "fwd")


def run(base: list[dict], new: list[dict], **kw: Any) -> pd.DataFrame:
    return C.compare(results.to_frame(base), results.to_frame(new), **kw)


def verdicts(table: pd.DataFrame) -> dict[tuple[str, str, str], str]:
    return {(r["backend"], r["shape"], r["direction"]): r["verdict"] for r in table.to_dict("records")}


# ---------------------------------------------------------------------------------------------------------------
# acceptance: a 10% slowdown is flagged, a 1% wobble is not


def test_ten_percent_slowdown_is_flagged_and_one_percent_wobble_is_not():
    base = base_rows()
    table = run(base, derive(base, lambda r: 1.10 if is_target(r) else 1.01))
    v = verdicts(table)
    assert v[("mok_hopper", "qwen3_5_397b", "fwd")] == "regression"
    assert [k for k, x in v.items() if x != "unchanged"] == [("mok_hopper", "qwen3_5_397b", "fwd")]
    top = table.iloc[0]
    assert top["verdict"] == "regression" and top["change"] == pytest.approx(0.10)
    assert C.failed(table)
    text = C.format_table(table)
    assert "REGRESSION" in text and "+10.0%" in text and "FAIL" in text


def test_one_percent_wobble_everywhere_passes():
    base = base_rows()
    table = run(base, derive(base, lambda r: 0.99 if r["direction"] == "fwd" else 1.01))
    assert set(table["verdict"]) == {"unchanged"}
    assert not C.failed(table)
    assert "OK: no regression" in C.format_table(table)


# ---------------------------------------------------------------------------------------------------------------
# thresholds


def test_change_inside_the_noise_is_inconclusive_not_a_regression():
    base = base_rows(spread=0.08)  # p20/p80 at -8% / +8%: the spreads overlap unless the gap exceeds 16%
    table = run(base, derive(base, lambda r: 1.10 if is_target(r) else 1.0))
    row = table.set_index(["backend", "shape", "direction"]).loc[("mok_hopper", "qwen3_5_397b", "fwd")]
    assert row["verdict"] == "inconclusive" and row["noise"] > row["change"] > 0.05
    assert row["noise_source"] == "p20-p80"
    # the unchanged rows are inconclusive too: a 5% change could hide in 16% of noise
    assert set(table["verdict"]) == {"inconclusive"} and C.exit_code(table) == C.EXIT_INCONCLUSIVE
    table = run(base, derive(base, lambda r: 1.20 if is_target(r) else 1.0))
    assert verdicts(table)[("mok_hopper", "qwen3_5_397b", "fwd")] == "regression"


def test_min_change_option():
    base = base_rows(spread=0.002)
    new = derive(base, lambda r: 1.03 if is_target(r) else 1.0)
    assert verdicts(run(base, new))[("mok_hopper", "qwen3_5_397b", "fwd")] == "unchanged"
    assert verdicts(run(base, new, min_change=0.02))[("mok_hopper", "qwen3_5_397b", "fwd")] == "regression"
    with pytest.raises(ValueError):
        run(base, new, min_change=-1)


def test_noise_is_ignored_where_spreads_are_missing():
    base = base_rows()
    for r in base:
        r["latency_p20_ms"] = r["latency_p80_ms"] = None
    new = derive(base, lambda r: 1.06 if is_target(r) else 1.0)
    row = run(base, new).iloc[0]
    assert row["verdict"] == "regression" and row["noise"] == 0


def test_speedup_is_an_improvement_and_passes():
    base = base_rows()
    table = run(base, derive(base, lambda r: 0.8 if is_target(r) else 1.0))
    assert verdicts(table)[("mok_hopper", "qwen3_5_397b", "fwd")] == "improvement"
    assert not C.failed(table)


# ---------------------------------------------------------------------------------------------------------------
# statuses and row sets


def test_status_change_from_ok_fails_the_gate():
    base = base_rows()

    def oom(r: dict) -> dict:
        if (r["backend"], r["shape"], r["direction"]) == ("nccl", "glm_5_2", "bwd"):
            return dict(r, status="oom", error="OutOfMemoryError: CUDA out of memory", latency_ms=None,
                        latency_p20_ms=None, latency_p80_ms=None, tflops_per_gpu=None)
        return r

    table = run(base, derive(base, lambda r: 1.0, edit=oom))
    assert verdicts(table)[("nccl", "glm_5_2", "bwd")] == "status change"
    assert table.iloc[0]["verdict"] == "status change"
    assert C.failed(table)
    assert "OutOfMemoryError" in C.format_table(table)


def test_fixed_still_failing_new_and_missing_do_not_fail():
    base = base_rows()
    base[0] = dict(base[0], status="error", error="boom", latency_ms=None, tflops_per_gpu=None)
    base[1] = dict(base[1], status="unsupported", error="no DeepEP", latency_ms=None, tflops_per_gpu=None)
    new = derive(base, lambda r: 1.0)
    new[0] = dict(new[0], status="ok", latency_ms=5.0, latency_p20_ms=4.9, latency_p80_ms=5.1, tflops_per_gpu=100.0)
    dropped = new.pop(2)
    new.append(S.row("deepep", "qwen3_5_397b", run_id="new", git_sha="bbbb2222", timestamp=NEW_TIME))
    table = run(base, new)
    v = verdicts(table)
    key = lambda r: (r["backend"], r["shape"], r["direction"])  # noqa: E731
    assert v[key(base[0])] == "fixed"
    assert v[key(base[1])] == "still failing"
    assert v[key(dropped)] == "missing"
    assert v[("deepep", "qwen3_5_397b", "fwd")] == "new"
    assert not C.failed(table)


def test_repeated_runs_are_pooled():
    base = base_rows() + derive(base_rows(), lambda r: 1.02, run_id="base2")
    new = derive(base_rows(), lambda r: 1.01, run_id="new")
    table = run(base, new)
    assert (table["num_rows_base"] == 2).all() and (table["num_rows_new"] == 1).all()
    assert set(table["verdict"]) == {"unchanged"}


def test_matching_is_on_config_hash_backend_direction():
    base = base_rows()
    new = derive(base, lambda r: 1.5, edit=lambda r: dict(r, config_hash="other" + r["config_hash"][5:]))
    table = run(base, new)
    assert set(table["verdict"]) == {"missing", "new"}


def test_different_gpus_are_warned_about():
    base = base_rows()
    new = derive(base, lambda r: 1.2, edit=lambda r: dict(r, gpu_name="NVIDIA H100 80GB HBM3"))
    table = run(base, new)
    assert table["env_differs"].all()
    assert "different GPUs" in C.format_table(table)


def test_a_slower_clock_is_shown_and_warned_about_but_the_verdict_stays_on_latency():
    base = [dict(r, sm_clock_mhz=1980.0) for r in base_rows()]
    new = derive(base, lambda r: 1.10 if is_target(r) else 1.0,
                 edit=lambda r: dict(r, sm_clock_mhz=1500.0 if is_target(r) else 1980.0))
    table = run(base, new)
    t = table.set_index(["backend", "shape", "direction"])
    assert t.loc[("mok_hopper", "qwen3_5_397b", "fwd"), "clock_change"] == pytest.approx(1500 / 1980 - 1)
    assert t.loc[("nccl", "qwen3_5_397b", "fwd"), "clock_change"] == 0.0
    assert verdicts(table)[("mok_hopper", "qwen3_5_397b", "fwd")] == "regression" and C.failed(table)
    text = C.format_table(table)
    assert "SM clock" in text and "-24.2%" in text and "clocks more than 3% apart" in text
    plain = run(base_rows(), derive(base_rows(), lambda r: 1.10 if is_target(r) else 1.0))  # no clocks recorded
    assert plain["clock_change"].isna().all() and "SM clock" not in C.format_table(plain)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _write(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    results.write_rows(tmp_path / name / "rows.csv", rows)
    return tmp_path / name


def test_cli_exit_codes(tmp_path, capsys):
    base = base_rows()
    b = _write(tmp_path, "base", base)
    slow = _write(tmp_path, "slow", derive(base, lambda r: 1.10 if is_target(r) else 1.01))
    wobble = _write(tmp_path, "wobble", derive(base, lambda r: 1.01, run_id="wob"))
    assert C.main([str(b), str(slow), "--csv", str(tmp_path / "cmp.csv")]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "mok_hopper" in out
    assert len(pd.read_csv(tmp_path / "cmp.csv")) == 8
    assert C.main([str(b), str(wobble)]) == 0
    assert "OK: no regression" in capsys.readouterr().out
    assert C.main([str(b), str(wobble), "--min-change", "0.005", "--noise-factor", "0"]) == 1


def test_cli_nothing_to_compare(tmp_path):
    b = _write(tmp_path, "base", base_rows())
    other = _write(tmp_path, "other", [S.row("deepep", "kimi_k2_7", run_id="x", ep_size=4)])
    assert C.main([str(b), str(other)]) == 2
    assert C.main([str(b), str(tmp_path / "does-not-exist")]) == 2


def test_cli_history_chart(tmp_path):
    base = base_rows()
    b = _write(tmp_path, "base", base)
    slow = _write(tmp_path, "slow", derive(base, lambda r: 1.10 if is_target(r) else 1.0))
    assert C.main([str(b), str(slow), "--history-dir", str(tmp_path / "hist")]) == 1
    pngs = list((tmp_path / "hist").glob("*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "hist").glob("*.svg"))


# ---------------------------------------------------------------------------------------------------------------
# a CI gate for a kernel change: --backend, the noise model, normalisation, exit codes


def test_backend_filter_judges_the_kernel_on_its_own_rows(tmp_path, capsys):
    base = base_rows()
    # the baselines' code did not change but this lease runs them 60% slower; the kernel itself is 1% faster
    new = derive(base, lambda r: 1.60 if r["backend"] == "nccl" else 0.99)
    b, n = _write(tmp_path, "base", base), _write(tmp_path, "new", new)
    assert C.main([str(b), str(n)]) == 1  # every baseline row reads as a regression
    capsys.readouterr()
    # judged on its own rows, against a machine whose unchanged code moved 60%: too noisy to pass or fail
    assert C.main([str(b), str(n), "--backend", "mok_hopper"]) == C.EXIT_INCONCLUSIVE
    out = capsys.readouterr().out
    assert "nccl" not in out.split("compared:")[0] and "other backends" in out and "INCONCLUSIVE" in out


def test_same_config_rerun_on_a_noisy_machine_is_not_a_regression_and_a_ten_percent_slowdown_is():
    base = base_rows(spread=0.02)
    factors = iter([1.35, 0.80, 1.25, 0.70, 1.30, 0.95, 1.20, 0.75])  # same code, a noisy machine
    rerun = derive(base, lambda r: next(factors))
    table = run(base, rerun, backends=["mok_hopper"])
    assert "regression" not in set(table["verdict"]) and set(table["verdict"]) == {"inconclusive"}
    assert C.exit_code(table) == C.EXIT_INCONCLUSIVE
    # the same rerun against an A/A of BASE (no --backend): the A/A's run-to-run noise covers it
    aa = derive(base, lambda r: 1.4 if r["direction"] == "fwd" else 0.7, run_id="aa1")  # as noisy as the rerun
    table = run(base, rerun, aa=results.to_frame(aa))
    assert "regression" not in set(table["verdict"]) and (table["noise_source"] == "A/A").all()
    # a real 10% slowdown of the kernel on a quiet machine (others within 1%): a regression
    slow = derive(base, lambda r: 1.10 if r["backend"] == "mok_hopper" else 1.01)
    table = run(base, slow, backends=["mok_hopper"])
    assert set(table["verdict"]) == {"regression"} and C.exit_code(table) == C.EXIT_REGRESSION
    assert (table["noise"] < 0.10).all()
    # ... and with a quiet A/A rerun as the noise estimate
    quiet = derive(base, lambda r: 1.01, run_id="aa2")
    table = run(base, slow, aa=results.to_frame(quiet), backends=["mok_hopper"])
    assert set(table["verdict"]) == {"regression"}


def test_a_cpu_point_run_twice_is_inconclusive_without_a_run_to_run_estimate():
    cpu = dict(device="cpu", gpu_name=None)
    base = [dict(r, **cpu) for r in base_rows(spread=0.2)]
    rerun = derive(base, lambda r: 2.04 if r["backend"] == "nccl" else 1.0)  # "+104% REGRESSION" before
    table = run(base, rerun)
    assert set(table["verdict"]) == {"inconclusive"}
    assert table["noise_source"].str.contains("CPU").all()


def test_repeated_runs_give_the_run_to_run_noise():
    base = base_rows() + derive(base_rows(), lambda r: 1.20, run_id="base2")  # two leases, 20% apart
    table = run(base, derive(base_rows(), lambda r: 1.15, run_id="new"))
    assert set(table["noise_source"]) == {"reruns"} and set(table["verdict"]) == {"inconclusive"}


def test_normalize_by_clock():
    base = [dict(r, sm_clock_mhz=1980.0) for r in base_rows()]
    # the board ran 10% slower clocks in NEW (power limit) and every latency grew by the same 10%
    new = derive(base, lambda r: 1.0 / 0.9, edit=lambda r: dict(r, sm_clock_mhz=1980.0 * 0.9))
    assert set(run(base, new)["verdict"]) == {"regression"}
    table = run(base, new, normalize="clock")
    assert set(table["verdict"]) == {"unchanged"} and table["change"].abs().max() < 1e-9
    # a kernel 10% slower at the same clock is a regression, normalised or not
    slow = derive(base, lambda r: 1.10 if is_target(r) else 1.0)
    assert verdicts(run(base, slow, normalize="clock"))[("mok_hopper", "qwen3_5_397b", "fwd")] == "regression"
    # rows without a clock cannot be normalised: inconclusive, not silently judged on latency
    table = run(base_rows(), derive(base_rows(), lambda r: 1.0), normalize="clock")
    assert set(table["verdict"]) == {"inconclusive"} and table["basis"].str.contains("no SM clock").all()


def test_normalize_by_an_unchanged_control_backend():
    base = base_rows(spread=0.01)  # the ratio carries both backends' spreads: 4% here, under the 5% threshold
    lease = derive(base, lambda r: 1.30 if r["backend"] == "nccl" else 1.28)  # a slower lease: every backend
    assert set(run(base, lease)["verdict"]) == {"regression"}  # every row, judged on latency
    assert set(run(base, lease, backends=["mok_hopper"])["verdict"]) == {"inconclusive"}  # the lease moved nccl
    table = run(base, lease, backends=["mok_hopper"], normalize="control", control="nccl")
    assert set(table["verdict"]) == {"unchanged"} and set(table["backend"]) == {"mok_hopper"}
    assert table["change"].to_numpy() == pytest.approx(1.28 / 1.30 - 1)
    slow = derive(base, lambda r: 1.30 * (1.10 if is_target(r) else 1.0))
    v = verdicts(run(base, slow, backends=["mok_hopper"], normalize="control", control="nccl"))
    assert v[("mok_hopper", "qwen3_5_397b", "fwd")] == "regression"
    assert v[("mok_hopper", "glm_5_2", "fwd")] == "unchanged"
    with pytest.raises(ValueError, match="--control"):
        run(base, slow, normalize="control")


@pytest.mark.parametrize("factor,code", [(1.0, 0), (1.10, 1), (None, 3)])
def test_cli_exit_codes_with_backend(tmp_path, capsys, factor, code):
    base = base_rows(spread=0.02 if factor else 0.10)
    new = derive(base, lambda r: (factor or 1.0) if r["backend"] == "mok_hopper" else 1.0)
    b, n = _write(tmp_path, "base", base), _write(tmp_path, "new", new)
    assert C.main([str(b), str(n), "--backend", "mok_hopper"]) == code
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].endswith(f"(exit {code})")
    assert sum(line.startswith(("OK", "FAIL", "INCONCLUSIVE", "NO MATCH")) for line in out.splitlines()) == 1


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a results path that cannot be read, words the one error line must hold)."""
    good = results.to_frame(base_rows()).to_csv(index=False)
    lines = good.splitlines()
    cases = {}
    d = tmp_path / "bad"
    d.mkdir()
    (d / "empty.csv").write_text("")
    cases["empty"] = (d / "empty.csv", "empty file")
    (d / "binary.csv").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    cases["not csv"] = (d / "binary.csv", "not a CSV file")
    (d / "norowid.csv").write_text(good.replace("run_id,row_id,", "run_id,rowid,", 1))
    cases["no row_id"] = (d / "norowid.csv", "no row_id column")
    (d / "truncated.csv").write_text("\n".join(lines[:4]) + "\n" + lines[4][: len(lines[4]) // 2] + "\n")
    cases["truncated"] = (d / "truncated.csv", "line 5 has")
    (d / "text.txt.csv").write_text("hello, world\nthis is not a table of results\n")
    cases["other table"] = (d / "text.txt.csv", "no run_id / row_id column")
    return cases


@pytest.mark.parametrize("case", ["empty", "not csv", "no row_id", "truncated", "other table"])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    good = _write(tmp_path, "good", base_rows())
    path, words = _bad_inputs(tmp_path)[case]
    csv = tmp_path / "out" / "cmp.csv"
    for args in ([str(good), str(path)], [str(path), str(good)]):
        assert C.main([*args, "--csv", str(csv)]) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and len(cap.err.strip().splitlines()) == 1, cap.err
        assert str(path) in cap.err and words in cap.err
        assert not csv.exists() and not csv.parent.exists()


def test_cli_folder_with_skipped_files_says_how_many(tmp_path, capsys):
    b = _write(tmp_path, "base", base_rows())
    n = _write(tmp_path, "new", derive(base_rows(), lambda r: 1.0))
    (n / "smi.csv").write_text("timestamp,power.draw\n1,2\n")
    (n / "blank.csv").write_text("")
    assert C.main([str(b), str(n)]) == 0
    assert "NEW: skipped 2 files that hold no results: 1 empty; 1 without the results header" in \
        capsys.readouterr().out.replace("1 without the results header (other tables); 1 empty",
                                        "1 empty; 1 without the results header")


def test_cli_no_matched_rows_is_one_verdict_exit_2(tmp_path, capsys):
    b = _write(tmp_path, "base", base_rows())
    other = _write(tmp_path, "other", [S.row("deepep", "kimi_k2_7", run_id="x", ep_size=4)])
    assert C.main([str(b), str(other), "--csv", str(tmp_path / "c.csv")]) == 2
    cap = capsys.readouterr()
    assert "OK" not in cap.out + cap.err and len(cap.err.strip().splitlines()) == 1 and "NO MATCH" in cap.err
    assert not (tmp_path / "c.csv").exists()
    assert C.main([str(b), str(b), "--backend", "deepep"]) == 2  # no such backend in either
    assert "deepep" in capsys.readouterr().err
