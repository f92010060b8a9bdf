"""The command line on inputs that can never run: one line naming the fix, exit code 2, nothing run or written."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, compose_cfg

from harness.core import results
from harness.core.backends import BACKENDS
from harness.config.schema import ConfigError, to_container
from harness.config.point import make_case
from harness.config.point import resolve
from harness.config.validate import check_cpu_memory, cpu_rank_bytes

GB = 10**9


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "harness.run", *args, f"hydra.run.dir={tmp}/hydra",
                           f"hydra.sweep.dir={tmp}/sweep"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


# (arguments, text the one line must hold); {tmp} is the test's folder. results_dir is the test's own unless set.
BAD_INPUTS = {
    "results_dir is a file": (["results_dir={tmp}/a_file"], "results_dir={tmp}/a_file is a file: give "
                              "results_dir=<a folder you can write> (default results/local)"),
    "results_dir under a file": (["results_dir={tmp}/a_file/runs"], "which is a file"),
    "results_dir cannot be written": (["results_dir=/proc/x"], "results_dir=/proc/x cannot be written"),
    "custom shape unset": (["shape=custom"], "shape.num_experts, shape.hidden, shape.ffn, shape.topk not set"),
    "custom shape partly set": (["shape=custom", "shape.hidden=256", "shape.ffn=128"],
                                "shape.num_experts, shape.topk not set"),
    "unknown shape": (["shape=kimi"], "unknown shape 'kimi' (did you mean shape=kimi_k2_7?): choose one of auto, "
                                      "custom, deepseek_v4_pro, glm_5_2, kimi_k2_7, qwen3_5_397b, tiny"),
    "unknown direction": (["direction=sideways"], "unknown direction 'sideways': choose one of bwd, fwd, "
                                                  "fwd_and_bwd, fwd_bwd"),
    "unknown backend option": (["backend=nope"], "unknown backend 'nope': choose one of"),
    "misspelled key": (["ep_sise=2"], "unknown key 'ep_sise': did you mean ep_size?"),
    "misspelled group key": (["shape.hiden=64"], "unknown key 'shape.hiden': did you mean shape.hidden?"),
    "key in the wrong place": (["local_experts=2"], "did you mean shape.local_experts?"),
    "non-integer value": (["workload.tokens_per_gpu=1.5"], "workload.tokens_per_gpu must be an integer (got 1.5)"),
    "non-boolean value": (["compile=maybe"], "compile must be true or false (got maybe)"),
    "unparsable override": (["backends=[nccl"], "cannot parse the override 'backends=[nccl'"),
    "zero local experts": (["shape.local_experts=0"], "shape.local_experts must be >= 1 (got 0)"),
    "negative local experts": (["shape.local_experts=-3"], "shape.local_experts must be >= 1 (got -3)"),
    # more ranks than any machine's memory holds (each would all-gather 1024 ranks' tokens for the reference)
    "CPU ranks do not fit": (["device=cpu", "shape.local_experts=1", "ep_size=1024"],
                             "ep_size=1024 on CPU needs about"),
    "sweep with one invalid point": (["-m", "device=cpu", "workload.tokens_per_gpu=64", "shape.local_experts=1,0"],
                                     "sweep point #1 (shape.local_experts=0): shape.local_experts must be >= 1"),
    "sweep with an unknown option": (["-m", "device=cpu", "workload.tokens_per_gpu=64", "shape=tiny,kimi"],
                                     "sweep point #1 (shape=kimi): unknown shape 'kimi'"),
    "sweep on the local launcher": (["-m", "hydra/launcher=local", "device=cpu", "shape.local_experts=1,0"],
                                    "sweep point #1 (shape.local_experts=0): shape.local_experts must be >= 1"),
}


@pytest.mark.parametrize("args,message", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, message):
    (tmp_path / "a_file").write_text("not a folder\n")
    args = [a.format(tmp=tmp_path) for a in args]
    results_dir = tmp_path / "results"
    if not any(a.startswith("results_dir=") for a in args):
        args.append(f"results_dir={results_dir}")
    p = _cli(tmp_path, *args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("mokbench: invalid configuration: ")
    assert message.format(tmp=tmp_path) in lines[0]
    assert "Traceback" not in p.stdout + p.stderr
    assert not results_dir.exists()
    assert (tmp_path / "a_file").read_text() == "not a folder\n"
    assert not (tmp_path / "sweep").exists()  # no sweep folder: the local launcher submitted nothing
    assert not (tmp_path / "hydra").exists()  # no run folder: Hydra's files are removed with the refusal


def test_a_sweep_reports_every_invalid_point_at_once(tmp_path):
    p = _cli(tmp_path, "-m", "device=cpu", f"results_dir={tmp_path}/results", "workload.tokens_per_gpu=64",
             "shape.local_experts=1,0,-1", "ep_sise=2,4")
    lines = p.stderr.strip().splitlines()
    # one problem every point has: said once, for all of them
    assert p.returncode == 2 and lines == ["mokbench: invalid configuration: all 6 sweep points: unknown key "
                                           "'ep_sise': did you mean ep_size?"], p.stderr
    p = _cli(tmp_path, "-m", "device=cpu", f"results_dir={tmp_path}/results", "workload.tokens_per_gpu=64",
             "shape.local_experts=0,1,-1", "direction=fwd")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 2, p.stderr
    assert "#0 (shape.local_experts=0)" in lines[0] and "#2 (shape.local_experts=-1)" in lines[1]
    assert not (tmp_path / "results").exists()
    # a problem some points share: one line naming them
    p = _cli(tmp_path, "-m", "device=cpu", f"results_dir={tmp_path}/results", "workload.tokens_per_gpu=64",
             "shape.local_experts=0,1", "workload.seed=1,2")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "mokbench: invalid configuration: sweep points #0 (shape.local_experts=0 workload.seed=1), #1 "
        "(shape.local_experts=0 workload.seed=2): shape.local_experts must be >= 1 (got 0): the experts on each GPU; "
        "leave it unset (shape.local_experts=null) for the shape's own 8 experts"], p.stderr
    assert not (tmp_path / "results").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("key", sorted(BACKENDS))
def test_every_registered_backend_is_a_backend_option(key):
    assert to_container(compose_cfg(f"backend={key}"))["backends"] == [key]


def test_rows_that_cannot_be_written_are_saved_elsewhere_and_said_where(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOKBENCH_RESCUE_DIR", str(tmp_path / "rescue"))
    (tmp_path / "gone").write_text("")  # the results folder was replaced by a file after the run started
    path = results.job_file(tmp_path / "gone", "run1", "abc")
    rows = [{"run_id": "run1", "row_id": "r1", "backend": "nccl", "status": "ok"}]
    written = results.write_rows(path, rows)
    assert written == tmp_path / "rescue" / "run1" / path.name and results.written_path(path) == written
    assert str(written) in capsys.readouterr().err
    # the job's later rows go to the same rescued file, whole
    written = results.write_rows(path, rows + [{"run_id": "run1", "row_id": "r2", "backend": "nccl", "status": "ok"}])
    assert list(results.read_file(written)["row_id"]) == ["r1", "r2"]
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_run_whose_results_folder_goes_away_keeps_every_row(results_dir, tmp_path, monkeypatch, capfd):
    """The folder passes the check, then vanishes after the first backend's rows: all rows go to the rescue file."""
    import harness.core.backends as hb
    from conftest import cpu_cfg

    from harness.measure.runner import run_benchmark

    monkeypatch.setenv("MOKBENCH_EXTRA_BACKENDS", "removes_results=fake_backends:RemovesResults")
    monkeypatch.setitem(hb.BACKENDS, "removes_results", "fake_backends:RemovesResults")
    monkeypatch.setenv("MOKBENCH_TEST_RESULTS_DIR", str(results_dir))
    monkeypatch.setenv("MOKBENCH_RESCUE_DIR", str(tmp_path / "rescue"))
    df = run_benchmark(cpu_cfg(results_dir, "backends=[nccl,removes_results]", "directions=[fwd]"))
    assert results_dir.read_text() == "gone\n"
    assert sorted(df["backend"]) == ["nccl", "removes_results"] and set(df["status"]) == {"ok"}
    (rescued,) = (tmp_path / "rescue").rglob("*.csv")
    assert sorted(results.read_file(rescued)["row_id"]) == sorted(df["row_id"])
    assert f"the rows of this run are in {rescued}" in capfd.readouterr().err


def test_results_dir_check_creates_nothing(tmp_path):
    results.check_dir(tmp_path / "new" / "runs")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="is a file"):
        (tmp_path / "f").write_text("")
        results.check_dir(tmp_path / "f")


def _tiny(*overrides: str, ep: int):
    c = resolve(compose_cfg("device=cpu", "shape=tiny", *overrides))
    return make_case(c, ep_size=ep, device="cpu")


def test_cpu_memory_check_says_how_many_ranks_fit():
    case = _tiny("shape.local_experts=1", ep=64)  # the example: 64 ranks of ~1 GB each
    assert 0.9 * GB < cpu_rank_bytes(case, 64) < 1.3 * GB
    with pytest.raises(ConfigError, match=r"ep_size=64 on CPU needs about \d+\.\d GB .* 24\.0 GB available: use "
                                          r"ep_size<=(\d+), or run on GPUs") as e:
        check_cpu_memory(case, 24 * GB)
    fit = int(e.value.args[0].split("ep_size<=")[1].split(",")[0])
    assert 10 <= fit < 64
    check_cpu_memory(dataclasses.replace(case, ep_size=fit, num_experts=fit), 24 * GB)
    # without shape.local_experts, the advice is an ep_size that divides the experts
    with pytest.raises(ConfigError, match=r"use ep_size<=4 \(one that divides 8\)"):
        check_cpu_memory(_tiny(ep=8), 4 * GB)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_small_gloo_runs_still_fit_a_small_machine(ep):
    """EP=4 and EP=8 of the tiny shape (and the published token count) on a machine with 8 GB free."""
    check_cpu_memory(_tiny(ep=ep), 8 * GB)
    check_cpu_memory(_tiny("shape.local_experts=1", ep=ep), 8 * GB)
