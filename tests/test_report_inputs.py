"""harness.report and harness.compare on inputs that cannot work: one stderr line naming the fix, exit code 2,
nothing printed on stdout or written; damaged result files, mixed environments, progress, the report's own output."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT

sys.path.insert(0, str(Path(__file__).resolve().parent))

import synthetic_results as S  # noqa: E402

from harness.core import tool_args as cli_args, results  # noqa: E402
from harness.report import plots
from harness.gate import compare as CMP  # noqa: E402
from harness.report import report as R  # noqa: E402

UNWRITABLE = Path("/proc/mokbench-test-out")  # no file can be made under /proc, not even by root


def tool(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", f"harness.{module}", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def refused(p: subprocess.CompletedProcess, *words: str) -> str:
    """The one stderr line of a refused command (exit 2, nothing on stdout), holding every word."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def write(folder: Path, rows: list[dict], name: str = "rows.csv") -> Path:
    results.write_rows(folder / name, rows)
    return folder


def h200_rows(run_id: str = "gpu-run") -> list[dict]:
    """Four ok rows of one H200 run (no calibration rates: its report draws one chart)."""
    return S.grid(["nccl", "mok_hopper"], shapes=("qwen3_5_397b",), run_id=run_id,
                  env={"device": "cuda", "gpu_name": "NVIDIA H200"})


def cpu_rows(run_id: str = "cpu-run") -> list[dict]:
    return S.grid(["nccl", "mok_hopper"], shapes=("qwen3_5_397b",), run_id=run_id, env=S.CPU)


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---------------------------------------------------------------------------------------------------------------
# argument errors: one line, what is wrong and the fix


ARG_ERRORS = {  # name -> (tool, arguments, words the one line holds); {good} is a folder of good rows
    "threshold not a number": ("compare", ["{good}", "{good}", "--threshold", "abc"],
                               ["harness.compare: --threshold", "'abc' is not a number",
                                "5% or a fraction such as 0.05"]),
    "NEW missing": ("compare", ["{good}"], ["missing NEW (NEW results: a file or a folder)",
                                            "usage: python -m harness.compare BASE ... NEW [options]"]),
    "both missing": ("compare", [], ["missing BASE (BASE results: a file or a folder) and NEW"]),
    "normalize choice": ("compare", ["{good}", "{good}", "--normalize", "speed"],
                         ["--normalize 'speed' is not one of its choices; choose one of none, clock, control"]),
    "scope choice": ("report", ["{good}", "--scope", "bogus"], ["harness.report: --scope 'bogus'",
                                                               "choose one of run, latest, pooled"]),
    "misspelled option": ("report", ["{good}", "--formts", "png"], ["unknown option --formts",
                                                                   "did you mean --formats?"]),
    "option without its value": ("report", ["{good}", "--out"], ["--out needs a value; give --out OUT"]),
    "exclusive options": ("report", ["{good}", "--pool", "--scope", "latest"], ["cannot be given together"]),
    "value to a flag": ("compare", ["{good}", "{good}", "--all=yes"], ["--all takes no value"]),
}


@pytest.mark.parametrize("case", sorted(ARG_ERRORS))
def test_an_argument_error_is_one_line_naming_the_fix(tmp_path, capsys, case):
    module, args, words = ARG_ERRORS[case]
    good = write(tmp_path / "good", h200_rows())
    main = {"compare": CMP.main, "report": R.main}[module]
    try:  # argparse's errors leave through SystemExit, the tool's own checks return the code
        code = main([a.format(good=good) for a in args])
    except SystemExit as e:
        code = e.code
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and cap.out == "", cap.err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_every_tool_reports_argument_errors_in_one_line_from_the_process(tmp_path):
    good = write(tmp_path / "good", h200_rows())
    refused(tool("compare", good, cwd=tmp_path), "harness.compare: missing NEW")
    refused(tool("compare", good, good, "--threshold", "abc", cwd=tmp_path), "'abc' is not a number")
    refused(tool("report", good, "--scope", "bogus", cwd=tmp_path), "choose one of run, latest, pooled")
    refused(tool("slurm", cwd=tmp_path), "harness.slurm: missing COMMAND (one of collect)")
    refused(tool("slurm", "collect", cwd=tmp_path), "missing SWEEP_DIR", "harness.slurm collect SWEEP_DIR")
    assert not (tmp_path / "results").exists()


def test_the_parser_explains_each_kind_of_argparse_error():
    ap = cli_args.ArgumentParser(prog="python -m harness.thing")
    ap.add_argument("src", help="where the rows are; a folder")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--mode", choices=("a", "b"))
    assert ap.tool == "harness.thing"
    assert ap.explain("the following arguments are required: src") == (
        "missing SRC (where the rows are); usage: python -m harness.thing SRC [options] (--help lists the options)")
    assert ap.explain("argument --n: invalid int value: '2.5'") == "--n '2.5' is not a whole number; give a whole " \
                                                                   "number, e.g. --n 3"
    assert ap.explain("argument --mode: invalid choice: 'c' (choose from 'a', 'b')") == (
        "--mode 'c' is not one of its choices; choose one of a, b")
    assert ap.explain("something new happened") == "something new happened; --help lists the options"
    # a type= function's ArgumentTypeError keeps its words; the option is named once
    assert ap.explain("argument --n: must be 1 or more (got 0)") == "--n: must be 1 or more (got 0); --help lists " \
                                                                   "the options"
    assert ap.explain("argument --n: --n must be 1 or more; give --n 1") == "--n must be 1 or more; give --n 1"


# ---------------------------------------------------------------------------------------------------------------
# outputs are checked before anything is read, printed or written


def test_report_refuses_an_output_it_cannot_write_before_writing_anything(tmp_path):
    good = write(tmp_path / "good", h200_rows())
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me\n")
    before = listing(tmp_path)
    refused(tool("report", good, "--out", a_file, cwd=tmp_path), f"--out {a_file} is a file",
            "give --out <a folder you can write>")
    refused(tool("report", good, "--out", a_file / "rep", cwd=tmp_path), f"which is a file")
    refused(tool("report", good, "--out", UNWRITABLE, cwd=tmp_path), "cannot be written")
    refused(tool("report", good, "--out", good, cwd=tmp_path), f"is the input folder {good}",
            "give --out another folder")
    refused(tool("report", good, "--formats", "png,bmpx", "--out", tmp_path / "o", cwd=tmp_path),
            "matplotlib cannot save bmpx", "give one or more of", "png", "svg")
    refused(tool("report", good, "--history", "deadbeef", "--out", tmp_path / "o", cwd=tmp_path),
            "--history deadbeef: no rows of this config to draw", "no config here has rows at more than one")
    assert listing(tmp_path) == before and a_file.read_text() == "keep me\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder: the mode bits stop no one")
def test_report_refuses_a_read_only_output_folder(tmp_path):
    good = write(tmp_path / "good", h200_rows())
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        refused(tool("report", good, "--out", ro / "rep", cwd=tmp_path), "cannot be written", "Permission denied")
        assert listing(ro) == []
    finally:
        ro.chmod(0o755)


def test_report_history_names_the_configs_that_have_one(tmp_path, capsys):
    rows = [S.row(b, git_sha=sha, run_id=f"r{i}", timestamp=f"2026-12-0{i + 1}T00:00:00+00:00")
            for i, sha in enumerate(("aaaa1111", "bbbb2222")) for b in ("nccl", "mok_hopper")]
    good = write(tmp_path / "in", rows)
    assert R.main([str(good), "--history", "deadbeef", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip()
    assert f"configs with a history (rows at more than one git SHA): {rows[0]['config_hash']}" in line
    assert not (tmp_path / "o").exists()


def test_report_checks_formats_matplotlib_can_save():
    assert R.chart_formats("PNG, .svg,png") == ["png", "svg"]
    with pytest.raises(ValueError, match="names no format"):
        R.chart_formats(" , ")
    with pytest.raises(ValueError, match="cannot save bmpx; give one or more of .*pdf.*png.*svg"):
        R.chart_formats("bmpx")


def test_compare_refuses_an_output_it_cannot_write_before_printing_the_table(tmp_path):
    good = write(tmp_path / "good", h200_rows())
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    refused(tool("compare", good, good, "--csv", tmp_path, cwd=tmp_path), f"--csv {tmp_path} is a folder")
    refused(tool("compare", good, good, "--csv", UNWRITABLE / "cmp.csv", cwd=tmp_path),
            f"--csv {UNWRITABLE / 'cmp.csv'} cannot be written: its folder")
    refused(tool("compare", good, good, "--history-dir", a_file, cwd=tmp_path), f"--history-dir {a_file} is a file")
    assert a_file.read_text() == ""


def test_output_problems_by_hand(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert cli_args.dir_write_problem(tmp_path / "new" / "deeper") is None
    assert cli_args.dir_write_problem(f) == "is a file"
    assert cli_args.dir_write_problem(f / "sub") == f"is under {f}, which is a file"
    assert cli_args.file_write_problem(tmp_path / "new" / "x.csv") is None
    assert cli_args.file_write_problem(f) is None  # an existing file that can be written
    assert cli_args.file_write_problem(tmp_path) == "is a folder"
    assert cli_args.file_write_problem(f / "x.csv").startswith(f"cannot be written: its folder {f} is a file")
    assert list(tmp_path.iterdir()) == [f]  # the checks made nothing


# ---------------------------------------------------------------------------------------------------------------
# damaged row files are refused (or left out with --skip-damaged); files that are not row files are skipped


def _csv_lines(rows: list[dict]) -> list[str]:
    return results.to_frame(rows).to_csv(index=False).splitlines()


def _with_value(lines: list[str], line: int, column: str, value: str) -> list[str]:
    """``lines`` with ``column`` of the CSV record on ``line`` (1-based) set to ``value``."""
    header = lines[0].split(",")
    rec = pd.read_csv(io.StringIO("\n".join([lines[0], lines[line - 1]])), dtype=str, keep_default_na=False)
    rec.loc[0, column] = value
    assert column in header
    return [*lines[: line - 1], rec.to_csv(index=False, header=False).strip("\n"), *lines[line:]]


DAMAGED = {  # name -> (how the file is damaged, words its error holds)
    "latency not a number": (lambda ls: _with_value(ls, 3, "latency_ms", "abc"),
                             "line 3: latency_ms is 'abc', not a number"),
    "count not whole": (lambda ls: _with_value(ls, 2, "ep_size", "2.5"), "line 2: ep_size is '2.5', not a whole"),
    "flag not a boolean": (lambda ls: _with_value(ls, 4, "git_dirty", "maybe"),
                           "line 4: git_dirty is 'maybe', not true or false"),
    "unknown status": (lambda ls: _with_value(ls, 2, "status", "great"),
                       "line 2: status is 'great', not one of ok, unsupported"),
    "no status": (lambda ls: _with_value(ls, 5, "status", ""), "line 5: no status"),
    "no row_id": (lambda ls: _with_value(ls, 2, "row_id", ""), "line 2: no row_id"),
    "truncated row": (lambda ls: [*ls[:3], ls[3][: len(ls[3]) // 2]], "line 4 has"),
    "header twice": (lambda ls: [ls[0].replace(",shape,", ",backend,"), *ls[1:]], "names backend more than once"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_row_file_is_refused_naming_file_and_line(tmp_path, case):
    damage, words = DAMAGED[case]
    folder = write(tmp_path / "in", h200_rows("good"), "good.csv")
    bad = folder / "bad.csv"
    bad.write_text("\n".join(damage(_csv_lines(h200_rows("bad")))) + "\n")
    with pytest.raises(results.ResultsFileError) as e:
        results.load(folder)
    assert str(bad) in str(e.value) and words in str(e.value) and "--skip-damaged" in str(e.value)
    with pytest.raises(results.ResultsFileError, match=words.replace("(", r"\(")):
        results.read_file(bad)
    df = results.load(folder, skip_damaged=True)
    assert set(df["run_id"]) == {"good"} and len(df) == 4
    assert list(df.attrs["damaged"]) == [bad] and words in df.attrs["damaged"][bad]
    note = results.damaged_note(df.attrs["damaged"])
    assert note.startswith("left out 1 damaged file (--skip-damaged): ") and str(bad) in note


def test_binary_and_undecodable_files_among_row_files_are_damaged(tmp_path):
    folder = write(tmp_path / "in", h200_rows("good"), "good.csv")
    (folder / "x.csv").write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    (folder / "latin.csv").write_bytes("run_id,row_id\nr,caf\xe9\n".encode("latin-1"))
    padded = _csv_lines(h200_rows("padded"))
    (folder / "zeroed.csv").write_bytes(("\n".join(padded) + "\n").encode() + b"\x00" * 512)  # a crash's tail
    with pytest.raises(results.ResultsFileError, match=r"latin.csv: not a CSV file \(not UTF-8 text\).*\(2 more files"):
        results.load(folder)
    df = results.load(folder, skip_damaged=True)
    assert len(df) == 4 and sorted(p.name for p in df.attrs["damaged"]) == ["latin.csv", "x.csv", "zeroed.csv"]
    assert "binary content" in df.attrs["damaged"][folder / "x.csv"]


def test_files_that_are_not_row_files_are_skipped_and_counted(tmp_path):
    folder = write(tmp_path / "in", h200_rows("good"), "good.csv")
    (folder / "smi.csv").write_text("timestamp, index, clocks.current.sm [MHz]\n2026/12/01, 0, 1980 MHz\n")
    (folder / "calib.csv").write_text("section,hbm_gb_s,gemm_tflops\nh200,4300,800\n")
    (folder / "empty.csv").write_text("\n")
    (folder / "run.log").write_text("mokbench [ 1.0 s] done\n")
    (folder / "notes.txt").write_text("a note\n")
    (folder / "env.json").write_text("{}\n")
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "config.yaml").write_text("a: 1\n")  # tool state: neither read nor counted
    df = results.load(folder)
    assert len(df) == 4 and df.attrs["damaged"] == {}
    note = results.skipped_note(df.attrs["skipped"])
    assert note == ("skipped 6 files that hold no results: 3 not .csv or .parquet (.json, .log, .txt); 2 without "
                    "the results header (other tables); 1 empty")


@pytest.mark.parametrize("cut", [5, 20, 200])
def test_a_file_cut_inside_its_header_is_damaged_and_named(tmp_path, cut):
    """A results file whose write stopped inside the header (``run_i``, ``run_id,row_id,app``, ...): damaged, named,
    never skipped as another table."""
    folder = write(tmp_path / "in", h200_rows("good"), "good.csv")
    bad = folder / "cut.csv"
    bad.write_text(_csv_lines(h200_rows("cut"))[0][:cut])
    with pytest.raises(results.ResultsFileError) as e:
        results.load(folder)
    assert str(bad) in str(e.value) and "cut inside its header" in str(e.value)
    assert list(results.load(folder, skip_damaged=True).attrs["damaged"]) == [bad]


def test_the_gates_log_in_a_run_folder_is_the_runs_own_and_one_skipped_file_is_worded(tmp_path):
    folder = write(tmp_path / "in" / "g-base-r1", h200_rows("good"), "good.csv")
    (folder / results.GATE_LOG).write_text("harness.run output\n")
    df = results.load(tmp_path / "in")
    assert len(df) == 4 and df.attrs["skipped"] == {}
    (folder / "notes.txt").write_text("a note\n")
    assert results.skipped_note(results.load(folder).attrs["skipped"]) == (
        "skipped 1 file that holds no results: 1 not .csv or .parquet (.txt)")


def test_the_line_named_is_the_line_in_the_file_past_multiline_fields(tmp_path):
    rows = h200_rows()
    rows[0] = dict(rows[0], status="error", error="Traceback:\n  line one\n  line two")  # a quoted field, 3 lines
    df = results.to_frame(rows)
    df["num_iters"] = df["num_iters"].astype(object)
    df.loc[1, "num_iters"] = "many"
    f = tmp_path / "r.csv"
    df.to_csv(f, index=False)  # the header on line 1, rows[0] on lines 2-4, rows[1] on line 5
    assert f.read_text().splitlines()[4].startswith(f"{rows[1]['run_id']},{rows[1]['row_id']},")
    with pytest.raises(results.ResultsFileError, match="line 5: num_iters is 'many', not a whole number"):
        results.read_file(f)


def test_a_parquet_file_with_a_bad_value_is_damaged(tmp_path):
    df = results.to_frame(h200_rows())
    df["latency_ms"] = df["latency_ms"].astype(str)
    df.loc[2, "latency_ms"] = "fast"
    df.to_parquet(tmp_path / "r.parquet", index=False)
    with pytest.raises(results.ResultsFileError, match=r"r.parquet: row 3: latency_ms is 'fast', not a number"):
        results.load(tmp_path)
    good = results.to_frame(h200_rows("p"))
    good.to_parquet(tmp_path / "r.parquet", index=False)
    assert results.load(tmp_path)["latency_ms"].dtype == "float64"


def test_the_committed_runs_are_all_whole(tmp_path):
    """results/runs: every row file loads, no file is called damaged, and every row of every file is kept."""
    df = results.load()
    files, _ = results.find_files(results.REFERENCE_RUNS)
    assert df.attrs["damaged"] == {} and len(df.attrs["files"]) == len(files)
    assert len(df) == sum(len(pd.read_csv(f, dtype=str)) for f in files)


def test_report_and_compare_refuse_damaged_inputs_or_skip_them(tmp_path):
    good = write(tmp_path / "good", h200_rows())
    mixed = write(tmp_path / "mixed", h200_rows(), "rows.csv")
    (mixed / "junk.csv").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    badval = tmp_path / "badval"
    badval.mkdir()
    (badval / "r.csv").write_text("\n".join(_with_value(_csv_lines(h200_rows()), 2, "latency_ms", "abc")) + "\n")
    out = tmp_path / "out"
    refused(tool("report", badval, "--out", out, "--no-charts", cwd=tmp_path), str(badval / "r.csv"),
            "line 2: latency_ms is 'abc', not a number")
    refused(tool("report", mixed, "--out", out, "--no-charts", cwd=tmp_path), str(mixed / "junk.csv"),
            "binary content")
    refused(tool("compare", mixed, good, cwd=tmp_path), str(mixed / "junk.csv"))
    refused(tool("compare", good, badval, cwd=tmp_path), "latency_ms is 'abc'")
    assert not out.exists()
    p = tool("report", mixed, "--out", out, "--no-charts", "--skip-damaged", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"left out 1 damaged file (--skip-damaged): {mixed / 'junk.csv'}" in p.stdout
    assert "left out 1 damaged file" in (out / "claims.md").read_text()
    p = tool("compare", mixed, good, "--skip-damaged", cwd=tmp_path)
    assert p.returncode != 2 and "BASE: left out 1 damaged file (--skip-damaged)" in p.stdout, p.stderr
    refused(tool("report", badval, "--out", out / "2", "--skip-damaged", cwd=tmp_path), "no rows to report",
            "left out 1 damaged file")


# ---------------------------------------------------------------------------------------------------------------
# compare: one environment per comparison


def test_compare_refuses_rows_of_different_environments(tmp_path):
    gpu = write(tmp_path / "gpu", h200_rows("gpu-run"), "gpu.csv")
    cpu = write(tmp_path / "cpu", cpu_rows("cpu-run"), "cpu.csv")
    both = write(write(tmp_path / "both", cpu_rows("cpu-run"), "cpu.csv"), h200_rows("gpu-run"), "gpu.csv")
    line = refused(tool("compare", both, cpu, cwd=tmp_path), "BASE mixes environments", "--mixed-env")
    assert "CPU (run cpu-run" in line and "NVIDIA H200 (run gpu-run" in line
    assert str(both / "cpu.csv") in line and str(both / "gpu.csv") in line
    line = refused(tool("compare", cpu, gpu, cwd=tmp_path), "BASE and NEW ran in different environments")
    assert f"BASE on CPU (run cpu-run; {cpu / 'cpu.csv'})" in line and "NEW on NVIDIA H200 (run gpu-run" in line
    h100 = write(tmp_path / "h100", [dict(r, **S.H100, run_id="h100-run") for r in h200_rows()], "h100.csv")
    refused(tool("compare", gpu, h100, cwd=tmp_path), "NVIDIA H200", "NVIDIA H100 80GB HBM3")
    p = tool("compare", gpu, h100, "--mixed-env", "--all", cwd=tmp_path)
    assert p.returncode == 0 and "some matched rows ran on different GPUs" in p.stdout, p.stderr


def test_rows_that_do_not_say_where_they_ran_mix_with_any():
    assert results.environment("cuda", "NVIDIA H200") == "NVIDIA H200"
    assert results.environment("cpu", "cpu") == results.environment("cpu", None) == "CPU"
    assert results.environment("cuda", None) is None and results.environment(None, None) is None
    assert results.environment("xpu", "Intel Max") == "Intel Max (xpu)"
    gpu = results.to_frame(h200_rows())
    launcher = results.to_frame([dict(r, gpu_name=None, status="timeout", run_id="gpu-run", row_id=f"t{i}")
                                 for i, r in enumerate(h200_rows())])  # harness.slurm's rows for a lost job
    assert results.mixed_environments({"BASE": pd.concat([gpu, launcher]), "NEW": gpu}) == ""
    assert "different environments" in results.mixed_environments({"BASE": gpu, "NEW": results.to_frame(cpu_rows())})


def test_normalize_clock_needs_rows_that_recorded_a_clock(tmp_path, capsys):
    cpu = write(tmp_path / "cpu", cpu_rows())
    refused(tool("compare", cpu, cpu, "--normalize", "clock", cwd=tmp_path),
            "--normalize clock: no ok row of BASE recorded an SM clock (CPU", "drop --normalize clock")
    clocked = write(tmp_path / "gpu", [dict(r, sm_clock_mhz=1980.0) for r in h200_rows()])
    assert CMP.main([str(clocked), str(clocked), "--normalize", "clock"]) == 0
    assert "OK: no regression" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# progress


def test_progress_is_plain_lines_off_a_terminal_and_a_bar_on_one():
    plain = io.StringIO()
    p = cli_args.Progress(plain, tty=False, every=10)
    p.note("reading")
    p.start("rendering chart", 25, intro="rendering 25 charts")
    for i in range(1, 26):
        p.step(i, 25, f"c{i}")
    p.close("rendered 25 charts in {s} s")
    lines = plain.getvalue().splitlines()
    assert lines[:2] == ["reading", "rendering 25 charts"]
    assert lines[2:6] == ["rendering chart 1/25: c1", "rendering chart 10/25: c10", "rendering chart 20/25: c20",
                          "rendering chart 25/25: c25"]
    assert lines[6].startswith("rendered 25 charts in ") and len(lines) == 7
    bar = io.StringIO()
    p = cli_args.Progress(bar, tty=True)
    p.start("rendering chart", 3)
    for i in range(1, 4):
        p.step(i, 3, f"c{i}")
    p.close("done")
    assert "rendering chart" in bar.getvalue() and "\r" in bar.getvalue()  # a bar, redrawn in place
    assert bar.getvalue().count("\n") == 1 and bar.getvalue().split("\r")[-1] == "done\n"  # the bar is erased
    quiet = io.StringIO()
    cli_args.Progress(quiet, tty=False).reader("reading")(1, 1, Path("a.csv"))  # off a terminal: silent
    assert quiet.getvalue() == ""


def test_load_and_charts_report_progress_when_asked(tmp_path):
    write(tmp_path / "in", h200_rows("a"), "a.csv")
    write(tmp_path / "in", h200_rows("b"), "b.csv")
    seen: list[tuple] = []
    df = results.load(tmp_path / "in", progress=lambda i, n, f: seen.append((i, n, f.name)))
    assert seen == [(1, 2, "a.csv"), (2, 2, "b.csv")] and df.attrs["files"][0][1] == 4
    drawn: list[tuple] = []
    written = plots.report_charts(df, tmp_path / "out", formats=("png",),
                                  progress=lambda i, n, name: drawn.append((i, n, name)))
    assert [d[:2] for d in drawn] == [(i, len(written)) for i in range(1, len(written) + 1)]
    assert [d[2] for d in drawn] == list(written) and len(written) >= 2


def test_report_says_what_it_reads_and_renders_on_stderr(tmp_path):
    good = write(tmp_path / "good", h200_rows())
    p = tool("report", good, "--out", tmp_path / "out", "--formats", "png", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    err = p.stderr.splitlines()
    assert err[0] == "read 4 rows of 1 run from 1 file" and err[1] == "building the tables of 4 rows"
    assert err[2].startswith("rendering 1 chart (png) into ")
    assert err[3] == "rendering chart 1/1: panels_gpu-run-nvidia-h200-ep-8-4096-tokens-gpu-1-node"
    assert err[4].startswith("rendered 1 chart (1 files) in ") and len(err) == 5


# ---------------------------------------------------------------------------------------------------------------
# a report never reads its own output


def test_a_report_inside_its_input_folder_never_reads_itself(tmp_path, capsys):
    runs = write(tmp_path / "local" / "r1", h200_rows("r1")).parent
    out = runs / "reports"
    assert R.main([str(runs), "--out", str(out), "--formats", "png"]) == 0
    # a row file under the output folder (a user's copy) is left out too: the report reads its inputs only
    write(out, h200_rows("copied"), "copied.csv")
    n = len(list(out.rglob("*")))
    capsys.readouterr()
    assert R.main([str(runs), "--out", str(out), "--formats", "png"]) == 0
    stdout = capsys.readouterr().out
    assert f"skipped {n} files that hold no results: {n} in the output folder {out}" in stdout
    assert "4 measured rows from 1 runs" in (out / "claims.md").read_text()


def test_the_default_output_of_your_runs_is_left_out_of_them(tmp_path, monkeypatch, capsys):
    local = tmp_path / "local"
    monkeypatch.setattr(results, "LOCAL_RUNS", local)
    write(local / "r1", h200_rows("r1"))
    write(local / "reports", h200_rows("stale"), "stale.csv")  # would be read as rows if the folder were not left out
    assert R.main([str(local), "--no-charts"]) == 0
    assert "in the output folder" in capsys.readouterr().out
    claims = pd.read_csv(local / "reports" / "claims.csv")
    assert set(claims["run_id"]) == {"r1"}
