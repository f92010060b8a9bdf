"""Slurm accounting after a sweep: a job's final state from ``squeue`` / ``sacct`` (:func:`wait_slurm`,
:func:`sacct_info`), its row status (:func:`slurm_status`), and the rows of a job that ended without its rank 0
reporting (cancelled, timed out, failed, killed: :func:`write_status_rows`); the sweep folder's ``jobs.csv``, one line
per job with its final state.

    python -m harness.slurm collect <sweep dir>

waits for the jobs of a sweep submitted with plain sbatch (``slurm/submit.sh``) and writes those rows (:func:`collect`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from harness.launch.slurm_plan import Point, load_point

log = logging.getLogger(__name__)


def slurm_status(state: str) -> str:
    """Row status for a job's final Slurm (or submitit local) state."""
    s = (state or "UNKNOWN").split()[0].upper()
    if s.startswith("CANCELLED") or s in ("PREEMPTED", "REVOKED", "INTERRUPTED"):
        return "cancelled"
    if s in ("TIMEOUT", "DEADLINE"):
        return "timeout"
    return "error"  # FAILED, OUT_OF_MEMORY, NODE_FAIL, BOOT_FAIL, COMPLETED without rows, ...


def reported_pairs(point: Point, slurm_job_id: Optional[str]) -> set[tuple[str, str]]:
    """(backend, direction) pairs this point's job already wrote rows for."""
    from harness.core import results

    run_dir = Path(point.cfg["results_dir"]) / point.run_id
    if not run_dir.is_dir():
        return set()
    df = results.load(run_dir)
    if slurm_job_id:
        df = df[df["slurm_job_id"] == str(slurm_job_id)]
    else:
        df = df[df["config_hash"] == point.config_hash]
    return set(zip(df["backend"], df["direction"]))


def write_status_rows(point: Point, status: str, error: str, slurm_job_id: Optional[str] = None,
                      hostname: Optional[str] = None) -> Optional[Path]:
    """Rows with ``status`` for every (backend, direction) of ``point`` its job did not report. Written by the
    launching process into a file of its own under ``<results_dir>/<run_id>/``. Returns the file, or None."""
    from harness.measure import env as envinfo
    from harness.core import results
    from harness.config.point import Point as TypedPoint

    have = reported_pairs(point, slurm_job_id)
    missing = [(b, d) for b in point.cfg["backends"] for d in point.cfg["directions"] if (b, d) not in have]
    if not missing:
        return None
    # The environment columns describe this (launching) machine; the GPU ones would be wrong, so they are replaced.
    pt = TypedPoint.build(point.cfg, ep_size=point.world_size, device=point.case.device)
    base = results.base_row(pt, run_id=point.run_id, num_nodes=point.nodes, world_size=point.world_size,
                            env=envinfo.collect("cpu"))
    base.update(device=point.case.device, gpu_name=None, driver_version=None, num_gpus=point.gpus_per_node,
                hostname=hostname, slurm_job_id=slurm_job_id)
    note = f"row written by the launching process on {socket.gethostname()}: the job's rank 0 did not report it"
    rows = [results.make_row(base, b, d, status, error=error, notes=note, backend_options=pt.options_text(b))
            for b, d in missing]
    path = results.job_file(point.cfg["results_dir"], point.run_id, point.config_hash, point.cfg["results_format"])
    return results.write_rows(path, rows)


_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
           "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT", "PREEMPTED")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def slurm_states(job_ids: Sequence[str]) -> dict[str, str]:
    """Current state of each job ("12", "12_3"): from the controller, which keeps ended jobs for MinJobAge, else from
    accounting. A job neither knows is absent: a pending array task cancelled before Slurm split it off leaves no
    record at all (seen with Slurm 22.05)."""
    states: dict[str, str] = {}
    arrays = sorted({j.split("_")[0] for j in job_ids})
    if arrays:
        for line in _run(["squeue", "-h", "-t", "all", "-r", "-j", ",".join(arrays), "-o", "%i|%T"]).splitlines():
            jid, _, st = line.strip().partition("|")
            states[jid] = st
    missing = [j for j in job_ids if j not in states]
    if missing:
        states.update(sacct_states(missing))
    return {j: states[j] for j in job_ids if j in states}


def sacct_states(job_ids: Sequence[str]) -> dict[str, str]:
    out = _run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)])
    return {f[0]: f[1] for f in (ln.split("|") for ln in out.splitlines()) if len(f) == 2}


def sacct_info(job_id: str, wait_s: float = 20.0) -> dict[str, str]:
    """The job's accounting record (JobID, JobIDRaw, State, NodeList, ExitCode), waiting up to ``wait_s`` for a
    final state while slurmdbd catches up."""
    deadline = time.time() + wait_s
    info: dict[str, str] = {}
    while True:
        out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,JobIDRaw,State,NodeList,ExitCode"])
        for line in out.splitlines():
            f = line.split("|")
            if len(f) == 5 and f[0] == job_id:
                info = dict(zip(("JobID", "JobIDRaw", "State", "NodeList", "ExitCode"), f))
        state = info.get("State", "").split(" ")[0]
        if (state and state not in _ACTIVE) or time.time() > deadline:
            return info
        time.sleep(1.0)


def wait_slurm(job_ids: dict[int, str], results_ready: Any = None, gone_grace_s: float = 30.0) -> dict[int, str]:
    """Wait until every Slurm job has ended; return each one's end state, keyed like ``job_ids`` (``RESULTS`` when
    ``results_ready(key)`` said so first). Polls squeue / sacct itself instead of submitit's watcher, which waits
    forever for a job Slurm no longer knows (a pending array task cancelled before it was split off)."""
    ended: dict[int, str] = {}
    gone_since: dict[int, float] = {}
    delay = 2.0
    while len(ended) < len(job_ids):
        before = set(ended)
        if results_ready is not None:
            for n in job_ids:
                if n not in ended and results_ready(n):
                    ended[n] = "RESULTS"
        waiting = [n for n in job_ids if n not in ended]
        states = slurm_states([job_ids[n] for n in waiting]) if waiting else {}
        for n in waiting:
            st = states.get(job_ids[n])
            if st is None:  # unknown to the controller and to accounting
                if time.time() - gone_since.setdefault(n, time.time()) > gone_grace_s:
                    ended[n] = "CANCELLED (removed from the queue before it ran)"
            elif st.split(" ")[0] not in _ACTIVE:
                ended[n] = st
        for n in job_ids:
            if n in ended and n not in before:
                log.info(f"\t#{n} : job {job_ids[n]} ended ({ended[n]})")
        if len(ended) < len(job_ids):
            time.sleep(delay)
            delay = min(delay * 1.5, 30.0)
    return ended


def log_tail(path: Path, n: int = 6) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def collect(sweep_dir: Path) -> int:
    """For sweeps submitted with plain sbatch (slurm/submit.sh): wait for the jobs in ``sbatch_jobs.tsv``, then
    write rows with their end status for whatever each job's rank 0 did not report, and ``jobs.csv``."""
    sweep_dir = Path(sweep_dir)
    listed = [ln.split("\t") for ln in (sweep_dir / "sbatch_jobs.tsv").read_text().splitlines() if ln.strip()]
    job_ids = {int(num): jid for num, jid in listed}
    points = {n: load_point(sweep_dir / str(n)) for n in job_ids}
    ended = wait_slurm(job_ids)
    summary = []
    for n, jid in job_ids.items():
        p = points[n]
        info = sacct_info(jid, wait_s=10)
        state = info.get("State") or ended[n]
        status = "ok" if state.split(" ")[0] == "COMPLETED" else slurm_status(state)
        why = f"slurm job {jid} ended {state}" + ("" if status != "ok" else ", but rank 0 wrote no row for it")
        tail = log_tail(p.job_dir / f"slurm-{jid}.out", 3) if status == "error" else ""
        written = write_status_rows(p, "error" if status == "ok" else status,
                                    f"no row reported: {why}" + (f"; log: {tail}" if tail else ""), jid,
                                    info.get("NodeList") or None)
        if written is not None and status == "ok":
            status = "error"
        summary.append({"num": n, "overrides": p.label, "job_id": jid, "slurm_job_id": jid, "state": state,
                        "status": status, "launcher_rows": str(written) if written else "",
                        "error": "" if status == "ok" else why, "log": str(p.job_dir / f"slurm-{jid}.out"),
                        "dir": str(p.job_dir)})
    write_manifest(sweep_dir / "jobs.csv", summary)
    print_summary(list(points.values()), summary)
    return 0


def write_manifest(path: Path, summary: list[dict]) -> None:
    df = pd.DataFrame(summary)
    tmp = path.with_name(f".{path.name}.tmp")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def print_summary(points: Sequence[Point], summary: list[dict]) -> None:
    counts = pd.Series([s["status"] for s in summary]).value_counts()
    print(f"mokbench sweep: {len(summary)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    for s in summary:
        if s["status"] != "ok":
            print(f"  #{s['num']} {s['overrides']}: {s['status']}: {s['error']}")
    dirs = sorted({str(Path(p.cfg["results_dir"]) / p.run_id) for p in points})
    print("rows: " + ", ".join(dirs), flush=True)
    from harness.launch.run_table import report_command

    print(f"report: {report_command(dirs)}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from harness.core.tool_args import ArgumentParser

    ap = ArgumentParser(prog="python -m harness.slurm",
                        description="Sweeps on Slurm (or local submitit) through Hydra: launchers, pre-submission "
                                    "validation, dry run, failure rows.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="after slurm/submit.sh: wait for the sweep's jobs, then write rows for "
                                       "what their rank 0 did not report")
    c.add_argument("sweep_dir", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return collect(args.sweep_dir)


if __name__ == "__main__":
    from harness.core.own_packages import exit_on_clash

    exit_on_clash()
    sys.exit(main())
