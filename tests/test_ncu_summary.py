"""mok_tools.mok_hopper.ncu_summary on a raw page in Nsight Compute's CSV layout (no GPU here: the file is
written by the test, in the layout `ncu --import R --csv --page raw --print-units base` prints)."""

from __future__ import annotations

import csv

import pytest

from mok_tools.mok_hopper import ncu_summary

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Block Size", "Grid Size",
          "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
          "lts__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread",
          "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"]
UNITS = ["", "", "", "", "", "", "", "nsecond", "byte", "byte", "%", "register/thread", "%", "inst", "inst", "inst"]
LAUNCHES = [
    ["0", "42", "python3", "h", "_bwd_wgrad_resident_kernel", "(128, 1, 1)", "(264, 1, 1)", "2,601,000",
     "4,300,000,000", "8,600,000,000", "91.5", "255", "27.0", "3.5", "9.25", "0.5"],
    ["1", "42", "python3", "h", "_bwd_rows_kernel", "(256, 1, 1)", "(132, 1, 1)", "1,271,000",
     "4,400,000,000", "200,000,000", "40.0", "236", "n/a", "12.0", "1.0", "2.0"],
]


def _write(path, header=HEADER, rows=(UNITS, *LAUNCHES)):
    with open(path, "w", newline="") as f:
        f.write('==PROF== Disconnected from process 42\n')  # ncu's notices can precede the table
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def test_one_line_per_launch_in_the_units_the_notes_use(tmp_path):
    header, rows = ncu_summary.read_raw(_write(tmp_path / "raw.csv"))
    assert [r["ID"] for r in rows] == ["0", "1"]  # the units row is not a launch
    wgrad, dgate = ncu_summary.summarize(header, rows)
    assert wgrad["kernel"] == "_bwd_wgrad_resident_kernel"
    assert wgrad["us"] == pytest.approx(2601.0) and wgrad["HBM wr GB"] == pytest.approx(8.6)
    assert wgrad["L2 %"] == pytest.approx(91.5) and wgrad["regs"] == 255
    assert wgrad["tensor %"] == pytest.approx(27.0)  # the hmma name, the only tensor metric this page has
    assert wgrad["DRAM %"] is None and wgrad["L2 hit %"] is None  # not collected: n/a, not 0
    assert dgate["tensor %"] is None  # ncu printed n/a
    other = [c.replace("sm__pipe_tensor_op_hmma_cycles_active", "sm__pipe_tensor_op_dmma_cycles_active")
             for c in header]  # a name outside the list: found by its pattern
    assert ncu_summary.summarize(other, [{other[i]: r[c] for i, c in enumerate(header)} for r in rows]
                                 )[0]["tensor %"] == pytest.approx(27.0)
    assert wgrad["stalls"] == "barrier 9.2, long_scoreboard 3.5, math_pipe_throttle 0.5"  # largest first
    assert dgate["stalls"].startswith("long_scoreboard 12.0")
    only = ncu_summary.summarize(header, rows, match="wgrad")
    assert [x["kernel"] for x in only] == ["_bwd_wgrad_resident_kernel"]
    text = ncu_summary.table([wgrad, dgate])
    assert text.count("\n") == 4 and "| _bwd_rows_kernel | 1.27e+03 |" in text and "| n/a |" in text


def test_the_command_refuses_a_file_that_is_not_the_raw_page(tmp_path, capsys):
    path = _write(tmp_path / "raw.csv")
    assert ncu_summary.main([path, "--match", "wgrad"]) == 0
    assert "_bwd_wgrad_resident_kernel" in capsys.readouterr().out
    assert ncu_summary.main([path, "--match", "no_such_kernel"]) == 1  # nothing matched: not a success
    other = _write(tmp_path / "other.csv", header=["backend", "latency_ms"], rows=[["nccl", "6.4"]])
    assert ncu_summary.main([other]) == 2
    assert "not ncu's raw page" in capsys.readouterr().err


FAKE_NCU = """#!/usr/bin/env bash
# records each call's arguments, one line a call; an import prints the raw page the test wrote
printf '%s\\n' "$*" >> "$NCU_CALLS"
[ "$1" = --version ] && echo "fake ncu 0"
[ "$1" = --import ] && cat "$NCU_RAW"
exit 0
"""


@pytest.mark.parametrize("what,precision,kernel", [("bwd", "bf16", "bwd_rows"), ("bwd-fp8", "fp8", "fp8_rows"),
                                                    ("fwd-fp8", None, "up_swiglu")])
def test_the_ncu_script_profiles_what_it_is_asked_for(tmp_path, what, precision, kernel):
    """mok_tools/mok_hopper/ncu.sh with a stand-in ncu that records its calls (no GPU here): each shape of the default
    three gets one profiling call over the right driver (bwd_check in the asked precision, or gpu_check) with the
    kernels of that pass, then one import of its report; an unknown pass is one line and exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    ncu, calls = tmp_path / "ncu", tmp_path / "calls.txt"
    ncu.write_text(FAKE_NCU)
    ncu.chmod(0o755)
    _write(tmp_path / "raw.csv")
    env = {**os.environ, "NCU": str(ncu), "NCU_CALLS": str(calls), "NCU_RAW": str(tmp_path / "raw.csv"),
           "WHEELS": str(tmp_path / "no-wheels"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "mok_tools/mok_hopper/ncu.sh", str(tmp_path / "out"), what], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = calls.read_text().splitlines()
    profiled = [ln for ln in lines if "--kernel-name" in ln]
    assert [ln.split("--shapes ")[1].split()[0] for ln in profiled] == ["kimi_k2_7", "glm_5_2", "qwen3_5_397b"]
    for ln in profiled:
        assert "regex:^_(" in ln and kernel in ln.split("regex:")[1].split()[0], ln
        if precision:
            assert "mok_tools.mok_hopper.bwd_check" in ln and f"--precision {precision}" in ln, ln
        else:
            assert "mok_tools.mok_hopper.gpu_check" in ln and "--precisions fp8" in ln, ln
    assert sum("--import" in ln for ln in lines) == 3
    assert "_bwd_wgrad_resident_kernel" in (tmp_path / "out" / f"ncu-{what}-glm_5_2.txt").read_text()
    bad = subprocess.run(["bash", "mok_tools/mok_hopper/ncu.sh", str(tmp_path / "bad"), "bwd-int4"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "bwd-fp8" in bad.stderr
