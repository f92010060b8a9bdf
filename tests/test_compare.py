"""Regression check between two result sets: thresholds, noise, status changes, exit codes."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness.gate import compare as C  # noqa: E402
from harness.core import results  # noqa: E402

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
    base = base_rows() + derive(base_rows(), lambda r: 1.02, run_id="base2") + derive(base_rows(), lambda r: 0.99,
                                                                                     run_id="base3")
    new = derive(base_rows(), lambda r: 1.01, run_id="new") + derive(base_rows(), lambda r: 1.0, run_id="new2") + \
        derive(base_rows(), lambda r: 1.02, run_id="new3")
    table = run(base, new)
    assert (table["num_rows_base"] == 3).all() and (table["num_rows_new"] == 3).all()
    assert (table["n_base"] == 3).all() and (table["n_new"] == 3).all() and not table["paired"].any()
    assert set(table["noise_source"]) == {"reruns"} and set(table["verdict"]) == {"unchanged"}
    # two runs of BASE and one of NEW: one degree of freedom for the run-to-run noise cannot resolve 5%
    table = run(base[: 2 * len(base) // 3], new[: len(new) // 3])
    assert set(table["verdict"]) == {"inconclusive"} and (table["noise"] > 0.05).all()


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
    # the baselines' code did not change but this machine runs them 60% slower; the kernel itself is 1% faster
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
    # the same rerun against an A/A of BASE (no --backend): the A/A rerun is a second BASE run, whose spread covers it
    aa = derive(base, lambda r: 1.4 if r["direction"] == "fwd" else 0.7, run_id="aa1")  # as noisy as the rerun
    table = run(base, rerun, aa=results.to_frame(aa))
    assert "regression" not in set(table["verdict"]) and (table["noise_source"] == "reruns").all()
    # a real 10% slowdown of the kernel on a quiet machine (others within 1%): a regression
    slow = derive(base, lambda r: 1.10 if r["backend"] == "mok_hopper" else 1.01)
    table = run(base, slow, backends=["mok_hopper"])
    assert set(table["verdict"]) == {"regression"} and C.exit_code(table) == C.EXIT_REGRESSION
    assert (table["noise"] < 0.10).all()
    # ... and with quiet A/A reruns as BASE runs and NEW run twice: the runs' spread is the noise
    quiet = derive(base, lambda r: 1.01, run_id="aa2") + derive(base, lambda r: 0.99, run_id="aa3")
    slow2 = slow + derive(base, lambda r: 1.11 if r["backend"] == "mok_hopper" else 1.0, run_id="new2")
    table = run(base, slow2, aa=results.to_frame(quiet), backends=["mok_hopper"])
    assert set(table["verdict"]) == {"regression"} and set(table["noise_source"]) == {"reruns"}


def test_a_cpu_point_run_twice_is_inconclusive_without_a_run_to_run_estimate():
    cpu = dict(device="cpu", gpu_name=None)
    base = [dict(r, **cpu) for r in base_rows(spread=0.2)]
    rerun = derive(base, lambda r: 2.04 if r["backend"] == "nccl" else 1.0)  # "+104% REGRESSION" before
    table = run(base, rerun)
    assert set(table["verdict"]) == {"inconclusive"}
    assert table["noise_source"].str.contains("CPU").all()


def test_repeated_runs_give_the_run_to_run_noise():
    base = base_rows() + derive(base_rows(), lambda r: 1.20, run_id="base2")  # two machine allocations, 20% apart
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
    slower = derive(base, lambda r: 1.30 if r["backend"] == "nccl" else 1.28)  # a slower machine: every backend
    assert set(run(base, slower)["verdict"]) == {"regression"}  # every row, judged on latency
    assert set(run(base, slower, backends=["mok_hopper"])["verdict"]) == {"inconclusive"}  # the machine moved nccl
    table = run(base, slower, backends=["mok_hopper"], normalize="control", control="nccl")
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


def test_no_match_names_the_backends_each_side_holds(tmp_path, capsys):
    """A judged backend that ran on one side only: NO MATCH says what each side holds, not that nothing matched."""
    b = _write(tmp_path, "base", [S.row("nccl", "kimi_k2_7", run_id="b")])
    n = _write(tmp_path, "new", [S.row("nccl", "kimi_k2_7", run_id="n"), S.row("mok_hopper", "kimi_k2_7", run_id="n")])
    assert C.main([str(b), str(n), "--backend", "mok_hopper"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("harness.compare: NO MATCH: no rows of backend mok_hopper present in both BASE and NEW on "
                   "(config_hash, backend, direction) (exit 2); BASE holds nccl; NEW holds mok_hopper, nccl"), err


# ---------------------------------------------------------------------------------------------------------------
# one verdict whatever the order: log-ratio symmetry, A/A runs as BASE runs, a run against itself

FLIP = {"regression": "improvement", "improvement": "regression", "unchanged": "unchanged",
        "inconclusive": "inconclusive"}
CPU = dict(device="cpu", gpu_name=None)


def side(factors: dict[str, Callable[[dict], float]], *, cpu: bool = False, spread: float = 0.02) -> list[dict]:
    """Several runs of one side: run_id -> latency factor of each row against base_rows()."""
    rows = [dict(r, **CPU) for r in base_rows(spread)] if cpu else base_rows(spread)
    return [x for rid, f in factors.items() for x in derive(rows, f, run_id=rid)]


def noisy(seed: int, scale: float, slow: float = 1.0) -> Callable[[dict], float]:
    """A deterministic per-row factor: log-normal noise of the given scale, times ``slow`` on the target row."""
    import random

    rng = random.Random(seed)
    cache: dict[str, float] = {}

    def f(r: dict) -> float:
        k = r["row_id"]
        if k not in cache:
            cache[k] = math.exp(rng.gauss(0.0, scale)) * (slow if is_target(r) else 1.0)
        return cache[k]

    return f


SCENARIOS = {
    # one run a side on a GPU, a 10% slowdown of one row; NEW's spread wider than BASE's
    "single gpu": (lambda: side({"b": lambda r: 1.0}),
                   lambda: side({"n": lambda r: 1.10 if is_target(r) else 1.01}, spread=0.03)),
    # the new user's CPU runs: one run a side, other backends moved, --backend mok_hopper
    "single cpu": (lambda: side({"b": lambda r: 1.0}, cpu=True, spread=0.2),
                   lambda: side({"n": lambda r: 1.3 if r["backend"] == "nccl" else 1.25}, cpu=True, spread=0.2)),
    # interleaved rounds, paired; a 30% slowdown on a noisy machine
    "rounds": (lambda: side({f"g-base-r{k}": noisy(k, 0.1) for k in range(1, 6)}),
               lambda: side({f"g-new-r{k}": noisy(10 + k, 0.1, slow=1.3) for k in range(1, 6)})),
    # reruns, not paired, 3 + 2 runs
    "reruns": (lambda: side({f"b{k}": noisy(k, 0.05) for k in range(3)}),
               lambda: side({f"n{k}": noisy(20 + k, 0.05, slow=0.8) for k in range(2)})),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("backends", [(), ("mok_hopper",)])
def test_swapping_base_and_new_flips_the_change_and_keeps_the_verdict(scenario, backends):
    make_base, make_new = SCENARIOS[scenario]
    b, n = make_base(), make_new()
    fwd = run(b, n, backends=backends).set_index(list(C.KEY))
    rev = run(n, b, backends=backends).set_index(list(C.KEY)).loc[fwd.index]
    assert list(rev["verdict"]) == [FLIP.get(v, v) for v in fwd["verdict"]]
    ok = fwd["change"].notna()
    assert ok.any()
    assert ((1 + fwd["change"][ok]) * (1 + rev["change"][ok])).to_numpy() == pytest.approx(1.0)
    lo = fwd["change_low"].notna()
    assert ((1 + fwd["change_low"][lo]) * (1 + rev["change_high"][lo])).to_numpy() == pytest.approx(1.0)
    assert set(fwd["verdict"]) - {"unchanged", "inconclusive"} or scenario == "single cpu"


def test_swap_symmetry_under_normalisation():
    base = [dict(r, sm_clock_mhz=1980.0) for r in side({f"x-r{k}": noisy(k, 0.05) for k in (1, 2, 3)})]
    new = [dict(r, sm_clock_mhz=1900.0) for r in side({f"y-r{k}": noisy(5 + k, 0.05, 1.2) for k in (1, 2, 3)})]
    for kw in (dict(normalize="clock"), dict(normalize="control", control="nccl", backends=["mok_hopper"])):
        fwd, rev = run(base, new, **kw).set_index(list(C.KEY)), run(new, base, **kw).set_index(list(C.KEY))
        rev = rev.loc[fwd.index]
        assert list(rev["verdict"]) == [FLIP[v] for v in fwd["verdict"]]
        assert ((1 + fwd["change"]) * (1 + rev["change"])).to_numpy() == pytest.approx(1.0)


def users_cpu_runs() -> dict[str, pd.DataFrame]:
    """Three CPU runs of one commit (nccl, hybridep unsupported, mok_hopper), as a new user made them: BASE
    ``main``, its A/A rerun ``main-aa`` and ``branch``; the machine moved mok_hopper's rows by -20% and +20% and
    nccl's by 5% between runs. Judged with an A/A rerun as a separate estimate of the noise, the three orders gave
    three different tables."""
    rows = [dict(r, **CPU) for r in base_rows(spread=0.05)]
    rows += [S.row("hybridep", s, direction=d, status="unsupported", run_id="base", **CPU)
             for s in ("qwen3_5_397b", "glm_5_2") for d in ("fwd", "bwd")]
    moves = {"main": (1.0, 1.0), "main-aa": (0.8, 0.95), "branch": (1.2, 1.05)}
    return {k: results.to_frame(derive(rows, lambda r, f=f: f[r["backend"] != "mok_hopper"], run_id=k))
            for k, f in moves.items()}


def test_the_a_a_rerun_and_base_are_both_base_whatever_the_order():
    r = users_cpu_runs()
    kw = dict(backends=["mok_hopper"])
    orders = {
        "README order": C.compare(r["main"], r["branch"], aa=r["main-aa"], **kw),
        "A/A as BASE": C.compare(r["main-aa"], r["branch"], aa=r["main"], **kw),
        "both as BASE": C.compare(pd.concat([r["main"], r["main-aa"]]), r["branch"], **kw),
    }
    first = orders["README order"].set_index(list(C.KEY))
    assert set(first["verdict"]) == {"inconclusive"} and C.exit_code(orders["README order"]) == 3
    for name, t in orders.items():
        t = t.set_index(list(C.KEY)).loc[first.index]
        assert list(t["verdict"]) == list(first["verdict"]), name
        assert t["change"].to_numpy() == pytest.approx(first["change"].to_numpy()), name
        assert t["noise"].to_numpy() == pytest.approx(first["noise"].to_numpy()), name
        assert (t["n_base"] == 2).all() and (t["n_new"] == 1).all()


def test_cli_several_base_paths_are_one_side_like_aa(tmp_path, capsys):
    r = users_cpu_runs()
    p = {}
    for k, df in r.items():
        results.write_rows(tmp_path / k / "rows.csv", df.to_dict("records"))
        p[k] = str(tmp_path / k)
    codes, outs = [], []
    for args in ([p["main"], p["branch"], "--aa", p["main-aa"]], [p["main-aa"], p["branch"], "--aa", p["main"]],
                 [p["main"], p["main-aa"], p["branch"]]):
        codes.append(C.main([*args, "--backend", "mok_hopper", "--csv", str(tmp_path / "c.csv")]))
        outs.append(capsys.readouterr().out.splitlines()[-1])
        outs[-1] += pd.read_csv(tmp_path / "c.csv")[["verdict", "change", "noise"]].round(9).to_csv()
    assert codes == [C.EXIT_INCONCLUSIVE] * 3 and len(set(outs)) == 1


@pytest.mark.parametrize("cpu", [False, True])
@pytest.mark.parametrize("nruns", [1, 3])
def test_a_run_compared_with_itself_is_unchanged(cpu, nruns):
    rows = side({f"r{k}": noisy(k, 0.3) for k in range(nruns)}, cpu=cpu, spread=0.3)
    table = run(rows, rows)
    assert set(table["verdict"]) == {"unchanged"} and (table["change"] == 0).all()
    assert set(table["noise_source"]) == {"same runs"} and C.exit_code(table) == C.EXIT_OK
    table = run(rows, rows, backends=["mok_hopper"])
    assert set(table["verdict"]) == {"unchanged"}


def test_the_threshold_maps_to_both_directions_alike():
    base = side({"b": lambda r: 1.0}, spread=0.0)
    t = 0.05

    def verdict(factor: float) -> str:
        return verdicts(run(base, side({"n": lambda r: factor if is_target(r) else 1.0}, spread=0.0),
                            min_change=t))[("mok_hopper", "qwen3_5_397b", "fwd")]

    assert verdict(1.06) == "regression" and verdict(1 / 1.06) == "improvement"
    assert verdict(1.049) == "unchanged" and verdict(1 / 1.049) == "unchanged"
    assert verdict(0.953) == "unchanged"  # -4.7%: within 1 / 1.05 = -4.76%
    assert verdict(0.951) == "improvement"


def test_paired_rounds_cancel_a_machine_that_drifts_between_rounds():
    drift = [1.0, 1.6, 0.7, 1.3, 0.9]  # every backend of a round moves alike (a machine allocation, a neighbour's job)
    base = side({f"g-base-r{k + 1}": (lambda r, f=f, e=noisy(k, 0.01): f * e(r)) for k, f in enumerate(drift)})
    new = side({f"g-new-r{k + 1}": (lambda r, f=f, e=noisy(9 + k, 0.01): f * e(r) * (
        1.10 if r["backend"] == "mok_hopper" else 1.0)) for k, f in enumerate(drift)})
    table = run(base, new, backends=["mok_hopper"])
    assert set(table["verdict"]) == {"regression"} and table["paired"].all()
    assert set(table["noise_source"]) == {"rounds"} and (table["n_base"] == 5).all()
    assert (table["change_low"] > 0.05).all() and (table["change_high"] < 0.15).all()
    # the same runs without round names cannot be paired: the drift is noise, too large to decide
    unpaired = [dict(r, run_id=r["run_id"].replace("-r", "-x")) for r in new]
    table = run(base, unpaired, backends=["mok_hopper"])
    assert set(table["verdict"]) == {"inconclusive"} and not table["paired"].any()
    assert set(table["noise_source"]) == {"reruns"}


def test_pairs_by_round_or_same_runs_only():
    assert C.pairs(["a-base-r1", "a-base-r2"], ["a-new-r2", "a-new-r1"]) == [("a-base-r1", "a-new-r1"),
                                                                              ("a-base-r2", "a-new-r2")]
    assert C.pairs(["x", "y"], ["y", "x"]) == [("x", "x"), ("y", "y")]
    assert C.pairs(["a-base-r1", "a-base-r2"], ["a-new-r1"]) == []  # a round missing on one side
    assert C.pairs(["a-base-r1", "aa"], ["a-new-r1", "a-new-r2"]) == []  # a run without a round


def test_t_quantile_matches_the_tables():
    assert C.t_quantile(0.95, 1) == pytest.approx(12.706, abs=1e-3)
    assert C.t_quantile(0.95, 4) == pytest.approx(2.776, abs=1e-3)
    assert C.t_quantile(0.95, 29) == pytest.approx(2.045, abs=1e-3)
    assert C.t_quantile(0.99, 9) == pytest.approx(3.250, abs=1e-3)
    assert C.t_quantile(0.95, 10000) == pytest.approx(1.960, abs=1e-3)


def test_paired_rounds_rarely_call_noise_a_regression_and_catch_a_change_beyond_it():
    """Simulated gates (log-normal run-to-run noise of 0.3 a run, 5 rounds, 95%): an A/A pair calls a regression in
    about 2.5% of gates (the upper tail of the interval); a 2.5x slowdown, 2.2 sigmas of a round's log ratio, is
    caught in most."""
    import random

    rng = random.Random(7)

    def gate(change: float) -> str:
        b = {f"g-base-r{k}": (rng.gauss(0, 0.3), 0.0, 0.0) for k in range(1, 6)}
        n = {f"g-new-r{k}": (rng.gauss(change, 0.3), 0.0, 0.0) for k in range(1, 6)}
        e = C.estimate(b, n, 0.95)
        return "regression" if e["est"] > math.log1p(0.05) and e["est"] - e["below"] > 0 else "other"

    aa = [gate(0.0) for _ in range(4000)].count("regression") / 4000
    assert 0.01 < aa < 0.04
    slow = [gate(math.log(2.5)) for _ in range(1000)].count("regression") / 1000
    assert slow > 0.85


# ---------------------------------------------------------------------------------------------------------------
# --threshold and --confidence: a percentage with % or a fraction; a bare number above 1 is ambiguous


@pytest.mark.parametrize("text,value", [("5%", 0.05), ("0.05", 0.05), ("12.5%", 0.125), ("0", 0.0), ("0%", 0.0),
                                        (".1", 0.1), ("1%", 0.01)])
def test_threshold_accepts_a_percentage_or_a_fraction(text, value):
    assert C.parse_fraction(text, "--threshold") == pytest.approx(value)


@pytest.mark.parametrize("text,words", [("5", "write 5% or 0.05"), ("50", "write 50% or 0.5"),
                                        ("-1%", "out of range"), ("-0.1", "out of range"),
                                        ("100%", "out of range"), ("1", "out of range"), ("150%", "out of range"),
                                        ("five", "not a number"), ("nan", "not a finite"), ("5%%", "not a number")])
def test_cli_threshold_refusals_are_one_line_and_exit_2(tmp_path, capsys, text, words):
    b = _write(tmp_path, "base", base_rows())
    csv = tmp_path / "out" / "c.csv"
    assert C.main([str(b), str(b), f"--threshold={text}", "--csv", str(csv)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and words in cap.err, cap.err
    assert "--threshold" in cap.err and not csv.parent.exists()


def test_cli_threshold_percent_is_the_fraction(tmp_path, capsys):
    base = base_rows(spread=0.002)
    b, n = _write(tmp_path, "base", base), _write(tmp_path, "new", derive(base, lambda r: 1.03))
    assert C.main([str(b), str(n), "--threshold", "2%"]) == 1
    assert C.main([str(b), str(n), "--threshold", "0.02"]) == 1
    assert C.main([str(b), str(n), "--threshold", "5%"]) == 0
    capsys.readouterr()
    assert C.main([str(b), str(n), "--confidence", "95"]) == 2
    assert "write 95% or 0.95" in capsys.readouterr().err
    assert C.main([str(b), str(n), "--confidence", "0"]) == 2


def test_help_states_the_threshold_rule(capsys):
    with pytest.raises(SystemExit):
        C.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a percentage with % (5%) or a fraction (0.05)" in out and "ambiguous" in out
    assert "1 / (1 + T)" in out


# ---------------------------------------------------------------------------------------------------------------
# --across-options: a change that flips a backend option's default


def _flipped_default(base: list[dict], factor: float) -> list[dict]:
    """NEW: the same points after a change of mok_hopper's default option, so every row hashes differently."""
    return derive(base, lambda r: factor if is_target(r) else 1.0,
                  edit=lambda n: dict(n, config_hash="f" + n["config_hash"][1:],
                                      backend_options=("forward=save_h,rows=packed" if n["backend"] == "mok_hopper"
                                                       else n.get("backend_options"))))


def test_across_options_matches_a_flipped_default_and_still_catches_a_regression(tmp_path, capsys):
    base = [dict(r, backend_options="forward=save_h" if r["backend"] == "mok_hopper" else None) for r in base_rows()]
    b = _write(tmp_path, "base", base)
    slow = _write(tmp_path, "slow", _flipped_default(base, 1.10))
    same = _write(tmp_path, "same", _flipped_default(base, 1.0))
    assert C.main([str(b), str(slow), "--backend", "mok_hopper"]) == 2  # the hashes differ: nothing matches
    err = capsys.readouterr().err
    assert "NO MATCH" in err and "--across-options" in err
    assert C.main([str(b), str(slow), "--backend", "mok_hopper", "--across-options"]) == 1
    out = capsys.readouterr().out
    assert "regression" in out and "judged as BASE's" in out
    assert "mok_hopper: forward=save_h -> forward=save_h,rows=packed" in out
    assert C.main([str(b), str(same), "--backend", "mok_hopper", "--across-options"]) == 0
    table = pd.read_csv(tmp_path / "t.csv") if C.main([str(b), str(same), "--across-options", "--csv",
                                                          str(tmp_path / "t.csv")]) == 0 else None
    assert table is not None and set(table["config_hash"]) == {r["config_hash"] for r in base}
    assert len(table) == len(base) and set(table["verdict"]) == {"unchanged"}


def test_across_options_refuses_a_side_with_two_option_sets_at_one_point(tmp_path, capsys):
    """NEW ran one point twice, padded and packed: which stands for NEW is not the tool's guess."""
    base = base_rows()
    flipped = _flipped_default(base, 1.0)
    again = [dict(r, config_hash="e" + r["config_hash"][1:], run_id="new2",
                  row_id=r["row_id"] + "2") for r in flipped]
    b, n = _write(tmp_path, "base", base), _write(tmp_path, "new", flipped + again)
    assert C.main([str(b), str(n), "--across-options"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NEW holds rows of 2 configurations at one point" in err


def test_point_keys_ignore_only_the_options_and_the_hash():
    from harness.gate.across import point_keys

    r = S.row("mok_hopper", backend_options="rows=packed", scaling="a label")
    keys = point_keys(results.to_frame([r, dict(r, config_hash="other", backend_options="rows=padded",
                                                scaling="another label"),
                                        dict(r, tokens_per_gpu=2048), dict(r, direction="bwd")]))
    assert keys.iloc[0] == keys.iloc[1] and len(set(keys)) == 3
