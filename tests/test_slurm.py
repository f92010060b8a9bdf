"""Sweeps through the mokbench launchers (harness/launch/slurm_launch.py, slurm_plan.py, slurm_accounting.py,
hydra_plugins/mokbench_launcher).

The dry-run tests need no cluster. The others run against a real Slurm cluster with accounting (CI starts a
single-node one with .ci/start_slurm.sh) and skip, saying why, where none answers. They run the CPU default (tiny
shape, quick timing, 64 tokens per rank) as 2-task jobs: each task joins as one gloo rank.
Knobs: MOKBENCH_SLURM_PARTITION (default: the cluster's default partition); MOKBENCH_SLURM_SLOW=1 adds the
time-limit test (about 90 s).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness.core import results
from harness.launch.slurm_accounting import slurm_status

REPO = Path(__file__).resolve().parents[1]


def _sh(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def _no_slurm_reason() -> Optional[str]:
    if shutil.which("sinfo") is None:
        return "no Slurm cluster: `sinfo` is not installed (CI starts one with .ci/start_slurm.sh)"
    try:
        r = _sh("sinfo", "-h", "-o", "%P %a", timeout=30)
    except subprocess.TimeoutExpired:
        return "no Slurm cluster: sinfo timed out"
    if r.returncode != 0 or not r.stdout.strip():
        return f"no Slurm cluster answers: sinfo: {(r.stderr or r.stdout).strip()[:200] or 'no partition'}"
    if " up" not in r.stdout:
        return f"no Slurm partition is up: {r.stdout.strip()[:200]}"
    a = _sh("sacct", "-n", "-X", "-j", "1", timeout=30)
    if a.returncode != 0:
        return f"Slurm accounting (sacct) does not answer, and the launcher needs it: {a.stderr.strip()[:200]}"
    return None


_REASON = _no_slurm_reason()
needs_slurm = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
pytestmark = pytest.mark.slurm


def _partition() -> str:
    if os.environ.get("MOKBENCH_SLURM_PARTITION"):
        return os.environ["MOKBENCH_SLURM_PARTITION"]
    for line in _sh("sinfo", "-h", "-o", "%P").stdout.split():
        if line.endswith("*"):
            return line.rstrip("*")
    return _sh("sinfo", "-h", "-o", "%P").stdout.split()[0].rstrip("*")


def _gres_gpus(partition: str) -> int:
    """GPUs (gres) per node of the partition; the test cluster declares fake ones."""
    out = _sh("sinfo", "-h", "-p", partition, "-o", "%G").stdout
    m = re.search(r"gpu(?::[^:,\s]+)?:(\d+)", out)
    return int(m.group(1)) if m else 0


def _sweep(tmp: Path, name: str, *overrides: str, launcher: str = "slurm") -> list[str]:
    cmd = [sys.executable, "-m", "harness.run", "-m", f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp}/sweep",
           f"results_dir={tmp}/results", "device=cpu", "workload.tokens_per_gpu=64"]
    if launcher == "slurm":
        part = _partition()
        gpus = 2 if _gres_gpus(part) >= 2 else 0
        cmd += [f"hydra.launcher.partition={part}", "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=2",
                # fake GPUs (when declared) check that each task sees every GPU of the node
                f"hydra.launcher.gpus_per_node={gpus or 'null'}", "hydra.launcher.cpus_per_task=1",
                "hydra.launcher.timeout_min=5", f"hydra.launcher.name={name}"]
    return cmd + list(overrides)


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"sweep did not finish in {timeout} s:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _wait_for(what: str, fn, timeout: float = 120.0, every: float = 0.2):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what}")


def _job_ids(name: str) -> list[str]:
    return _sh("squeue", "-h", "-r", "-n", name, "-o", "%i").stdout.split()


def _point_hashes(sweep: Path) -> dict[int, str]:
    return {int(d.name): OmegaConf.load(d / "mokbench.yaml").config_hash
            for d in sweep.iterdir() if d.is_dir() and d.name.isdigit()}


def _task_started(sweep: Path, job_id: str) -> bool:
    return any("mokbench task" in f.read_text() for f in sweep.glob(f".submitit/{job_id}/{job_id}_0_log.out"))


# ---------------------------------------------------------------------------------------------------------------
# no cluster needed


def test_slurm_status_mapping():
    assert slurm_status("CANCELLED by 0") == "cancelled"
    assert slurm_status("CANCELLED (removed from the queue before it ran)") == "cancelled"
    assert slurm_status("TIMEOUT") == "timeout"
    for s in ("FAILED", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "COMPLETED", "", "UNKNOWN"):
        assert slurm_status(s) == "error"


@pytest.mark.slow
def test_dry_run_rejects_bad_point_like_a_local_run(tmp_path):
    bad = ["workload.routing=hot_rank", "workload.hot_rank=5"]
    local = subprocess.run([sys.executable, "-m", "harness.run", "device=cpu", *bad], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert local.returncode == 2
    message = local.stderr.strip().splitlines()[-1].removeprefix("mokbench: invalid configuration: ")
    assert "hot_rank=5 is not a rank of ep_size=2" in message

    cmd = [sys.executable, "-m", "harness.run", "-m", "hydra/launcher=slurm", "hydra.launcher.dry_run=true",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.gpus_per_node=null", f"hydra.sweep.dir={tmp_path}/sweep",
           f"results_dir={tmp_path}/results", "device=cpu", "workload.routing=hot_rank", "workload.hot_rank=0,5"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [f"mokbench: invalid configuration: sweep point #1 "
                                             f"(workload.hot_rank=5): {message}"]
    assert "#0" not in r.stderr  # the good point is not reported
    assert not (tmp_path / "sweep" / ".submitit").exists()
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
@pytest.mark.parametrize("experiment,jobs,gpus_per_job,precisions,contender", [
    ("gb300_published", 8, 64, ("bf16", "mxfp8"), "mok"),
    ("h200_published", 8, 8, ("bf16", "fp8"), "mok_hopper"),
])
def test_dry_run_of_the_published_sweeps(tmp_path, experiment, jobs, gpus_per_job, precisions, contender):
    """The published sweeps: four shapes x two precisions, forward and backward in one job, every backend of the
    figure, validated for GPU jobs from a CPU machine. (tests/test_reproduce.py runs the README's commands.)"""
    r = subprocess.run([sys.executable, "-m", "harness.run", "-m", f"+experiment={experiment}",
                        "hydra.launcher.dry_run=true", f"hydra.sweep.dir={tmp_path}/sweep"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    total = gpus_per_job * jobs
    assert f"{jobs} sweep points -> {jobs} slurm jobs" in r.stdout
    assert (f"total: {jobs} jobs x {gpus_per_job} GPUs = {total} GPUs allocated, at most {total:.1f} GPU-hours"
            in r.stdout)
    for shape in ("deepseek_v4_pro", "glm_5_2", "kimi_k2_7", "qwen3_5_397b"):
        for prec in precisions:
            assert f"shape={shape} precision={prec}: " in r.stdout
    backends = f"backends: nccl, deepep, hybridep, deepep_te, hybridep_megatron, {contender}; directions: fwd, bwd"
    assert r.stdout.count(backends) == jobs, r.stdout
    assert f"EP {gpus_per_job}," in r.stdout
    assert not (tmp_path / "sweep" / ".submitit").exists()


@pytest.mark.slow
def test_node_launcher_dry_run_and_up_front_validation(tmp_path):
    """hydra/launcher=node: a bad point stops the sweep before the first point runs; a dry run plans and runs
    nothing."""
    base = [sys.executable, "-m", "harness.run", "-m", "hydra/launcher=node", f"hydra.sweep.dir={tmp_path}/sweep",
            f"results_dir={tmp_path}/results", "device=cpu", "workload.routing=hot_rank"]
    r = subprocess.run(base + ["workload.hot_rank=0,5"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "sweep point #1 (workload.hot_rank=5): workload.hot_rank=5 is not a rank of ep_size=2" in r.stderr
    assert not (tmp_path / "results").exists()  # point #0 did not run either
    r = subprocess.run(base + ["workload.hot_rank=0,1", "backends=[nccl,reference]", "hydra.launcher.dry_run=true"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 sweep points -> 2 run one after another on this machine" in r.stdout
    assert r.stdout.count("backends: nccl, reference; directions: fwd, bwd") == 2
    assert "EP 2, 0 GPUs, cpu, no time limit" in r.stdout
    assert not (tmp_path / "results").exists()


def test_dry_run_ep_size_sets_the_node_count(tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness.run", "-m", "hydra/launcher=gb300_nvl72",
                        "hydra.launcher.dry_run=true", "shape=kimi_k2_7", "ep_size=8,64",
                        f"hydra.sweep.dir={tmp_path}/sweep"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 node(s) x 4 task(s), EP 8, 8 GPUs" in r.stdout
    assert "16 node(s) x 4 task(s), EP 64, 64 GPUs" in r.stdout


@pytest.mark.slow
def test_local_launcher_sweep(tmp_path):
    """hydra/launcher=local: submitit on this machine, one job per point, each spawning its 2 gloo ranks."""
    log = tmp_path / "sweep.log"
    text = _finish(_start(_sweep(tmp_path, "", "direction=fwd", "workload.seed=7", launcher="local"), log), log, 300)
    assert "1 jobs: 1 ok" in text, text[-3000:]
    df = results.load(tmp_path / "results")
    assert list(df["status"]) == ["ok"] and df["slurm_job_id"].isna().all()
    assert (tmp_path / "sweep" / "0" / "mokbench.yaml").exists() and (tmp_path / "sweep" / "jobs.csv").exists()


# ---------------------------------------------------------------------------------------------------------------
# a real Slurm cluster


@needs_slurm
def test_slurm_sweep_rows_ids_and_cancelled_jobs(tmp_path):
    """Four points, one 2-task job each: #0 is cancelled while it runs, #3 while it waits in the queue; #1 and #2
    finish. Every point ends with one row per (backend, direction)."""
    name = f"mbt-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "sweep.log"
    # Only point #0 must still be running when it is cancelled, so only it is long: 100000 timed iterations (about
    # half an hour here). #1 and #2 time 100 and 101 and finish well inside the 5-minute limit on a slow machine; #3
    # is cancelled while it waits. (One count for all four failed both ways: at 100-200 iterations #0 sometimes
    # finished before its cancel; at 2000, #2 reached the time limit in a CI run whose pytest took 26 minutes.)
    proc = _start(_sweep(tmp_path, name, "timing.num_iters=100000,100,101,102", "timing.phase_iters=20"), log)
    sweep = tmp_path / "sweep"
    ids = _wait_for("the sweep's jobs in the queue", lambda: _job_ids(name))
    array = ids[0].split("_")[0]
    assert _sh("scancel", f"{array}_3").returncode == 0  # still pending: only one 2-task job fits at a time
    _wait_for("point #0 to start", lambda: _task_started(sweep, f"{array}_0"), timeout=180)
    assert _sh("scancel", f"{array}_0").returncode == 0
    text = _finish(proc, log, timeout=420)
    assert "mokbench sweep: 4 jobs" in text

    df = results.load(tmp_path / "results")
    assert sorted(_point_hashes(sweep)) == [0, 1, 2, 3]
    # The points differ only in their timing, which the config hash leaves out (the same measurement), so rows are
    # matched to points by the job that wrote them: the Slurm job id of a job that started, else submitit's id.
    jobs = pd.read_csv(sweep / "jobs.csv", dtype=str).set_index("num")
    job_of = {int(n): j for n, j in jobs["slurm_job_id"].fillna(jobs["job_id"]).items()}
    assert len(set(job_of.values())) == 4, job_of
    pairs = {("nccl", "fwd"), ("nccl", "bwd")}
    by_point = {n: df[df["slurm_job_id"] == j] for n, j in job_of.items()}
    assert sum(len(rows) for rows in by_point.values()) == len(df), df[["slurm_job_id", "status"]]
    for n in (0, 1, 2, 3):
        assert set(zip(by_point[n]["backend"], by_point[n]["direction"])) == pairs, (n, by_point[n])
        assert len(by_point[n]) == 2, by_point[n]
    ok_ids = set()
    for n in (1, 2):
        rows = by_point[n]
        assert (rows["status"] == "ok").all(), rows[["status", "error"]]
        assert rows["slurm_job_id"].str.fullmatch(r"\d+").all()
        assert (rows["num_iters"] == 99 + n).all(), rows["num_iters"]  # the point's own timing override
        assert (rows["world_size"] == 2).all() and (rows["num_nodes"] == 1).all()
        ok_ids |= set(rows["slurm_job_id"])
        # rank 0 of the job wrote one file; the other task joined as rank 1 instead of spawning ranks of its own
        files = {f for f in (tmp_path / "results").rglob("*.csv")
                 if job_of[n] in set(results.load(f)["slurm_job_id"])}
        assert len(files) == 1, files
    assert len(ok_ids) == 2  # one Slurm job per sweep point
    assert (by_point[3]["status"] == "cancelled").all(), by_point[3][["status", "error"]]
    assert set(by_point[0]["status"]) <= {"ok", "cancelled"} and "cancelled" in set(by_point[0]["status"])

    assert dict(zip(jobs.index.astype(int), jobs["status"])) == {0: "cancelled", 1: "ok", 2: "ok", 3: "cancelled"}
    # every point keeps its validated config; every job that ran keeps Hydra's config and the logs of both tasks
    for n in (0, 1, 2, 3):
        assert (sweep / str(n) / "mokbench.yaml").exists()
    gpus = _gres_gpus(_partition()) >= 2
    for n in (1, 2):
        assert (sweep / str(n) / ".hydra" / "config.yaml").exists()
        assert (sweep / str(n) / "log.out").read_text()  # link to rank 0's submitit log
        for rank in (0, 1):
            out = (sweep / ".submitit" / f"{array}_{n}" / f"{array}_{n}_{rank}_log.out").read_text()
            assert re.search(rf"mokbench task: job \d+ point #{n} rank {rank}/2 local_rank {rank}", out), out
            if gpus:  # gpus_per_node, not per task: each task sees both GPUs and picks cuda:local_rank itself
                assert "CUDA_VISIBLE_DEVICES=0,1" in out, out


@needs_slurm
def test_preempted_job_is_requeued_and_reports(tmp_path):
    """submitit's preemption signal: rank 0 checkpoints and requeues the job; the rerun reports ok rows."""
    name = f"mbt-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "sweep.log"
    # a long time limit, so that submitit reads the signal as preemption, not as the time limit coming
    proc = _start(_sweep(tmp_path, name, "hydra.launcher.timeout_min=30", "direction=fwd", "timing.num_iters=200"),
                  log)
    sweep = tmp_path / "sweep"
    job = _wait_for("the job in the queue", lambda: _job_ids(name))[0]
    _wait_for("the job to start", lambda: _task_started(sweep, job), timeout=180)
    time.sleep(1.0)
    assert _sh("scancel", "--signal=USR2", job).returncode == 0  # what Slurm sends a preempted job (submitit's)
    _wait_for("the requeue", lambda: "PENDING" in _sh("squeue", "-h", "-j", job, "-o", "%T").stdout, timeout=60)
    _sh("scontrol", "update", f"JobId={job}", "StartTime=now")  # skip the requeue's begin-time delay
    text = _finish(proc, log, timeout=300)
    assert "1 jobs: 1 ok" in text, text[-3000:]
    df = results.load(tmp_path / "results")
    assert list(df["status"]) == ["ok"] and list(df["slurm_job_id"]) == [job]
    marker = OmegaConf.load(sweep / "0" / "slurm_job.json")
    assert marker.restart_count == 1
    out = (sweep / ".submitit" / job / f"{job}_0_log.out").read_text()
    assert "this job is preempted" in out and f"Requeued job {job}" in out
    history = _sh("sacct", "-X", "-D", "-n", "-P", "-o", "JobID,State", "-j", job).stdout
    assert f"{job}|REQUEUED" in history and f"{job}|COMPLETED" in history


@needs_slurm
@pytest.mark.skipif(os.environ.get("MOKBENCH_SLURM_SLOW") != "1", reason="slow (about 90 s): set MOKBENCH_SLURM_SLOW=1")
def test_time_limit_becomes_timeout_rows(tmp_path):
    name = f"mbt-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "sweep.log"
    proc = _start(_sweep(tmp_path, name, "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=30",
                         "timing.num_iters=100000"), log)
    _finish(proc, log, timeout=400)
    df = results.load(tmp_path / "results")
    assert len(df) == 2 and (df["status"] == "timeout").all(), df[["status", "error"]]
    assert df["slurm_job_id"].str.fullmatch(r"\d+").all()


@needs_slurm
def test_plain_sbatch_submit_and_collect(tmp_path):
    """slurm/submit.sh (sites without submitit): same expansion and validation, one sbatch per point; `python -m
    harness.slurm collect` waits and writes the rows of a job that never reported (here: cancelled while queued)."""
    part = _partition()
    env = dict(os.environ, MOKBENCH_SWEEP_DIR=str(tmp_path / "sweep"), PYTHON=sys.executable)
    r = subprocess.run(["bash", "slurm/submit.sh", "slurm", f"hydra.launcher.partition={part}",
                        "hydra.launcher.tasks_per_node=2", "hydra.launcher.gpus_per_node=null",
                        "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=5", "device=cpu",
                        "workload.tokens_per_gpu=64", "direction=fwd", f"results_dir={tmp_path}/results",
                        "workload.seed=1,2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = dict(line.split("\t") for line in (tmp_path / "sweep" / "sbatch_jobs.tsv").read_text().splitlines())
    assert sorted(jobs) == ["0", "1"]
    assert _sh("scancel", jobs["1"]).returncode == 0  # the node takes one job at a time: #1 is still queued
    c = subprocess.run([sys.executable, "-m", "harness.slurm", "collect", str(tmp_path / "sweep")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert c.returncode == 0, c.stdout + c.stderr
    assert "2 jobs: 1 ok, 1 cancelled" in c.stdout, c.stdout
    df = results.load(tmp_path / "results")
    got = {(row.slurm_job_id, row.status) for row in df.itertuples()}
    assert got == {(jobs["0"], "ok"), (jobs["1"], "cancelled")}, df[["slurm_job_id", "status", "error"]]
    assert (df["run_id"] == df["run_id"].iloc[0]).all()  # one run id for the sweep
    assert (tmp_path / "sweep" / "0" / ".hydra" / "config.yaml").exists()
    assert (tmp_path / "sweep" / "0" / f"slurm-{jobs['0']}.out").exists()
