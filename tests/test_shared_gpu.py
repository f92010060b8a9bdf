"""Several ranks of mok_hopper on ONE GPU (skipped without CUDA): mok_tools/mok_hopper/shared_gpu_check.py in the
concurrent mode (every rank's phases in flight at once on its own stream, the cross-rank barriers as event waits),
P = 2, bf16 and fp8, forward and backward, uniform routing and an idle rank: the real code passes, each deliberately
broken variant fails; the same in lockstep; and scripts/probe_shared_gpu.py gives every step a record. Run:

    python -m pytest -m gpu tests/test_shared_gpu.py -q

The CPU side (the lockstep run under the interpreter, the grid-cap rule, the probe's runner) is
tests/test_shared_gpu_cpu.py.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import HAS_GPU, ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine: these checks run "
                                                                      "several ranks of mok_hopper's kernels (CUDA IPC "
                                                                      "workspaces, concurrent streams) on one GPU; the "
                                                                      "CPU side is test_shared_gpu_cpu.py and "
                                                                      "test_ipc_workspace.py")]


def _check(tmp_path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, list[dict[str, str]]]:
    out = tmp_path / "out"
    env = dict(os.environ)  # PYTHONPATH: conftest put the repo on it, before what was there
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "mok_tools.mok_hopper.shared_gpu_check", "--out", str(out), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    rows = []
    if (out / "shared_gpu_check.csv").exists():
        with open(out / "shared_gpu_check.csv") as f:
            rows = list(csv.DictReader(f))
    return p, rows


def _fp8_here() -> list[str]:
    return ["bf16", "fp8"] if torch.cuda.get_device_capability() >= (8, 9) else ["bf16"]


@pytest.mark.parametrize("flags", ["0", "1"], ids=["event-waits", "ready-flags-capped"])
def test_concurrent_ranks_on_one_gpu_match_the_references(tmp_path, flags):
    """Two ranks at once on one GPU, the up GEMM waiting for the pull by stream events (the default) or spinning on
    the ready counters under the grid cap: every rank's output and 8 gradients within tolerance, an idle rank, H
    saved and recomputed, 5 bitwise repeats."""
    p, rows = _check(tmp_path, "--mode", "concurrent", "--ready-flags", flags, "--ranks", "2", "--precisions",
                     ",".join(_fp8_here()), "--repeats", "5", "--timeout", "120")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    checked = [r for r in rows if r["direction"] in ("fwd", "bwd")]
    assert {r["routing"] for r in checked} == {"uniform", "idle"} and {r["direction"] for r in checked} == {"fwd",
                                                                                                       "bwd"}
    assert all(r["ok"] == "True" and r["mode"] == "concurrent" for r in rows), rows
    assert [r["identical"] for r in rows if r["direction"] == "fwd+bwd"] == ["5/5"] * len(_fp8_here())
    if flags == "1":  # the spinning programs of both ranks stay under the cap the kernels' occupancy gives
        for r in checked:
            assert r["spin_cap"] == "" or int(r["up_programs"]) <= int(r["spin_cap"]), r


@pytest.mark.parametrize("fault,flags", [("wrong-peer-offset", "0"), ("missing-fence", "0"),
                                         ("skip-flag-reset", "1")])
def test_each_broken_variant_fails_the_concurrent_check(tmp_path, fault, flags):
    """Each fault injection makes the concurrent check fail (or time out, reported as such) where the real code
    passes (the test above)."""
    p, rows = _check(tmp_path, "--mode", "concurrent", "--ready-flags", flags, "--ranks", "2", "--precisions",
                     ",".join(_fp8_here()), "--repeats", "2", "--break", fault, "--timeout", "60")
    assert p.returncode == 1, p.stdout[-4000:] + p.stderr[-4000:]
    assert any(r["status"] in ("mismatch", "timeout") for r in rows) and all(r["brk"] == fault for r in rows)


def test_lockstep_ranks_on_one_gpu_match_the_references(tmp_path):
    p, rows = _check(tmp_path, "--mode", "lockstep", "--ranks", "2,4", "--precisions", ",".join(_fp8_here()),
                     "--repeats", "3")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert {r["ranks"] for r in rows} == {"2", "4"} and all(r["ok"] == "True" for r in rows)


def test_the_probe_gives_every_step_a_record(tmp_path):
    """The probe runs to its report on a GPU, whatever it finds: every step of P = 2 has a record with a status."""
    env = dict(os.environ)  # PYTHONPATH: conftest put the repo on it, before what was there
    p = subprocess.run([sys.executable, "scripts/probe_shared_gpu.py", "--out", str(tmp_path), "--ranks", "2",
                        "--timeout", "120", "--repeats", "3", "--spin-limit-s", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    report = json.loads((tmp_path / "probe_shared_gpu.json").read_text())
    assert [s["step"] for s in report["steps"]] == ["gloo", "symm_mem", "cuda_ipc", "spin_wait"]
    assert all(s["status"] in ("ok", "failed", "timeout", "error") for s in report["steps"])
    assert report["steps"][0]["status"] == "ok", report["steps"][0]  # gloo with host staging must work


# the one-process check's GPU shape (T, K, E, H, I = 256, 4, 16, 1024, 512)
SHAPE = ["shape=custom", "shape.num_experts=16", "shape.hidden=1024", "shape.ffn=512", "shape.topk=4",
         "workload.tokens_per_gpu=256"]
ROW_KEYS = ["backend", "precision", "routing", "direction", "status", "error"]


def _harness(tmp_path, ranks: int, backends: str, precisions: list[str], *, fault: str = "", watchdog_s: int = 600,
             workloads: str = "uniform,hot_rank") -> tuple[subprocess.CompletedProcess, Any]:
    """``ep_size=P ranks_per_gpu=P`` on this GPU through the harness (P processes, gloo with host staging), uniform
    routing and an idle last rank, forward and backward; ``fault``: a planted fault of mok_kernels/mok_hopper/ipc.py."""
    from harness.core import results

    # PYTHONPATH: conftest put tests/ (fake_backends) and the repo on it, before what was there
    env = dict(os.environ, MOKBENCH_EXTRA_BACKENDS="one_rank_per_gpu=fake_backends:OneRankPerGpu,"
                                                   "mok_hopper_2chunks=fake_backends:MokHopperTwoChunks")
    env.pop("TRITON_INTERPRET", None)
    env.pop("MOKBENCH_IPC_FAULT", None)
    if fault:
        env["MOKBENCH_IPC_FAULT"] = fault
    p = subprocess.run([sys.executable, "-m", "harness.run", "-m", *SHAPE, "device=cuda", "compile=false",
                        "timing=quick", "directions=[fwd,bwd]", f"results_dir={tmp_path}", "print_table=false",
                        f"watchdog_s={watchdog_s}", f"ep_size={ranks}", f"ranks_per_gpu={ranks}", "run_id=shared",
                        f"backends=[{backends}]", f"precision={','.join(precisions)}", f"workload={workloads}",
                        f"workload.hot_rank={ranks - 1}", "workload.hot_ratio=0", f"hydra.sweep.dir={tmp_path}/sweep"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    df = results.load(tmp_path / "shared") if (tmp_path / "shared").exists() else None
    return p, df


def _all_ok(rows: Any, n: int, ranks: int) -> None:
    assert len(rows) == n, rows[ROW_KEYS]
    assert (rows.status == "ok").all(), rows[rows.status != "ok"][ROW_KEYS].to_string()
    assert rows.shared_gpu.all() and (rows.ranks_per_gpu == ranks).all() and rows.latency_ms.isna().all()


@pytest.mark.parametrize("ranks", [2, 4])
def test_harness_ranks_in_processes_of_their_own_share_the_gpu(tmp_path, ranks):
    """``ep_size=P ranks_per_gpu=P``: P processes on this GPU run the harness's own path (gloo with host staging),
    bf16 and fp8, forward and backward, uniform routing and an idle rank: every nccl and mok_hopper row is ok
    against the reference, untimed and marked shared_gpu (mok_hopper's kernel with its workspaces exchanged by CUDA
    IPC); a backend that needs a GPU per rank says so."""
    p, df = _harness(tmp_path, ranks, "nccl,mok_hopper,one_rank_per_gpu", _fp8_here())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    n = 2 * 2 * len(_fp8_here())  # routing x direction x precision
    _all_ok(df[df.backend == "nccl"], n, ranks)
    mok = df[df.backend == "mok_hopper"]
    _all_ok(mok, n, ranks)
    assert mok.notes.str.contains("workspaces over CUDA IPC").all(), mok.notes.iloc[0]
    other = df[df.backend == "one_rank_per_gpu"]
    assert len(other) and (other.status == "unsupported").all()


def test_harness_ranks_on_one_gpu_with_two_chunks_a_rank(tmp_path):
    """The same at P = 2 with the pull / GEMM pipeline in two chunks a rank (``num_chunks=2``)."""
    p, df = _harness(tmp_path, 2, "mok_hopper_2chunks", _fp8_here())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = df[df.backend == "mok_hopper_2chunks"]
    _all_ok(rows, 2 * 2 * len(_fp8_here()), 2)
    assert rows.notes.str.contains("2 chunk").all(), rows.notes.iloc[0]


@pytest.mark.parametrize("fault", ["wrong-peer-pointer", "skip-barrier"])
def test_planted_ipc_faults_turn_harness_rows_into_mismatch_or_timeout(tmp_path, fault):
    """A planted fault in the P-process route (rank 0's IPC peer pointer wrong; rank 0 skipping the cross-process
    barrier before the epilogue) turns mok_hopper's rows into ``mismatch`` or ``timeout`` (the watchdog) where the
    real route gives ``ok`` (the tests above)."""
    p, df = _harness(tmp_path, 2, "mok_hopper", ["bf16"], fault=fault, watchdog_s=300,
                     workloads="uniform")
    assert df is not None, p.stdout[-4000:] + p.stderr[-4000:]
    rows = df[df.backend == "mok_hopper"]
    assert len(rows) and rows.status.isin(["mismatch", "timeout"]).all(), rows[ROW_KEYS].to_string()
