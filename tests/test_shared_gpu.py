"""Several ranks of mok_hopper on ONE GPU (skipped without CUDA): benchmarks/mok_hopper/shared_gpu_check.py in the
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

import pytest
import torch
from conftest import HAS_GPU, ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine: these checks run "
                                                                      "several ranks on one GPU")]


def _check(tmp_path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, list[dict[str, str]]]:
    out = tmp_path / "out"
    env = dict(os.environ)  # PYTHONPATH: conftest put the repo on it, before what was there
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "benchmarks.mok_hopper.shared_gpu_check", "--out", str(out), *args],
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


SMALL = ["shape=custom", "shape.num_experts=16", "shape.hidden=512", "shape.ffn=256", "shape.topk=4",
         "workload.tokens_per_gpu=256"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_harness_ranks_in_processes_of_their_own_share_the_gpu(tmp_path, ranks):
    """``ep_size=P ranks_per_gpu=P``: P processes on this GPU run the harness's own path (gloo with host staging),
    bf16 and fp8, uniform routing and an idle rank: every nccl row is ok against the reference, untimed and marked
    shared_gpu; a backend that needs a GPU per rank says so, and mok_hopper's kernel says why its symmetric memory
    cannot (torch's rendezvous refuses processes that share a device)."""
    from harness import results

    # PYTHONPATH: conftest put tests/ (fake_backends) and the repo on it, before what was there
    env = dict(os.environ, MOKBENCH_EXTRA_BACKENDS="one_rank_per_gpu=fake_backends:OneRankPerGpu")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "harness.run", "-m", *SMALL, "device=cuda", "compile=false",
                        "timing=quick", "directions=[fwd,bwd]", f"results_dir={tmp_path}", "print_table=false",
                        "watchdog_s=240", f"ep_size={ranks}", f"ranks_per_gpu={ranks}", "run_id=shared",
                        "backends=[nccl,mok_hopper,one_rank_per_gpu]", f"precision={','.join(_fp8_here())}",
                        "workload=uniform,hot_rank", f"workload.hot_rank={ranks - 1}", "workload.hot_ratio=0",
                        f"hydra.sweep.dir={tmp_path}/sweep"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    df = results.load(tmp_path / "shared")
    ran = df[df.backend == "nccl"]
    assert len(ran) == 2 * 2 * len(_fp8_here()), ran[["backend", "precision", "routing", "direction", "status"]]
    assert (ran.status == "ok").all(), ran[ran.status != "ok"][["backend", "precision", "routing", "direction",
                                                                 "error"]].to_string()
    assert ran.shared_gpu.all() and (ran.ranks_per_gpu == ranks).all() and ran.latency_ms.isna().all()
    other = df[df.backend == "one_rank_per_gpu"]
    assert len(other) and (other.status == "unsupported").all()
    mok = df[df.backend == "mok_hopper"]
    assert len(mok) and (mok.status == "unsupported").all() and mok.error.str.contains("shared_gpu_check").all()
