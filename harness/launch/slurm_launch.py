"""The launchers of sweeps on Slurm (or local submitit) through Hydra, and of one node's points
(``hydra/launcher=node``).

    python -m harness.run -m hydra/launcher=h200_8gpu hydra.launcher.partition=gpu \\
        shape=kimi_k2_7,glm_5_2 precision=bf16,fp8 direction=fwd,bwd
    python -m harness.run -m +experiment=gb300_published hydra.launcher.dry_run=true

The launchers extend hydra-submitit-launcher's. One Slurm job per sweep point, with nodes x tasks_per_node tasks;
every task runs the Hydra task function and joins the rank layout from the Slurm environment
(:func:`harness.measure.dist.from_environment`), so rank 0 of each job writes that job's rows. Presets ask for
``gpus_per_node``, never ``gpus_per_task``: each task then sees every GPU of its node and picks ``cuda:local_rank``
(DeepEP needs its peers' GPUs visible).

Before anything is submitted, every point is planned and validated (harness/launch/slurm_plan.py: one bad point
rejects the sweep with exit code 2; ``hydra.launcher.dry_run=true`` stops there). After the sweep, a job that ended
without its rank 0 reporting (cancelled, timed out, failed, killed) gets its missing rows, with the status taken from
Slurm accounting (harness/launch/slurm_accounting.py). Each point's folder in the sweep directory keeps
``mokbench.yaml`` (the validated config), Hydra's ``.hydra/``, ``slurm_job.json`` (written by rank 0 when it starts)
and links to the submitit logs; the sweep folder keeps ``jobs.csv``, one line per job with its final state.

Plain sbatch instead of submitit: ``slurm/submit.sh`` (the same dry run writes ``plan.tsv``, then one sbatch per
point), then ``python -m harness.slurm collect <sweep dir>`` for the rows of jobs that did not report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import DictConfig, OmegaConf, open_dict

from harness.launch.cli import reject
from harness.config.launcher_options import OWN_KEYS
from harness.launch.slurm_accounting import (log_tail, print_summary, sacct_info, slurm_status, wait_slurm,
                                          write_manifest, write_status_rows)
from harness.launch.slurm_plan import Point, dry_run_report, plan_all, write_plan, write_point

log = logging.getLogger(__name__)


class _JobTimedOut(BaseException):
    """submitit's 'not requeued: timed out' raised from its signal handler. A BaseException so that the runner's
    per-step ``except Exception`` cannot swallow it and carry on until Slurm kills the job."""


def _guard_timeout_signal() -> None:
    try:
        import submitit
        from submitit.core.utils import UncompletedJobError

        sig = submitit.JobEnvironment._usr_sig()
    except Exception:  # noqa: BLE001 - not under submitit: nothing to guard
        return
    orig = signal.getsignal(sig)
    if not callable(orig):
        return

    def handler(signum, frame):  # type: ignore[no-untyped-def]
        try:
            orig(signum, frame)
        except UncompletedJobError as e:
            raise _JobTimedOut(str(e)) from None

    signal.signal(sig, handler)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


class MokbenchLauncherMixin:
    """The launchers' behaviour, mixed in before hydra-submitit-launcher's BaseSubmititLauncher by the plugin
    classes in ``hydra_plugins/mokbench_launcher`` (Hydra instantiates launchers only from ``hydra_plugins.*``)."""

    _EXECUTOR: str
    params: dict
    config: Optional[DictConfig]
    hydra_context: Any
    task_function: Any

    def __init__(self, **params: Any) -> None:
        self.dry_run = bool(params.pop("dry_run", False))
        self.nvlink_domain_nodes = params.pop("nvlink_domain_nodes", None)
        super().__init__(**params)  # type: ignore[call-arg]

    # -- in the job, on every task -------------------------------------------------------------------------------

    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict) -> JobReturn:
        import submitit
        from submitit.core.utils import UncompletedJobError

        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        env = submitit.JobEnvironment()
        with open_dict(sweep_config.hydra.job) as job:
            job.id = env.job_id
            sweep_config.hydra.job.num = job_num
        rank = env.global_rank
        e = os.environ
        print(f"mokbench task: job {e.get('SLURM_JOB_ID', env.job_id)} point #{job_num} rank {rank}/{env.num_tasks} "
              f"local_rank {env.local_rank} on {socket.gethostname()} "
              f"CUDA_VISIBLE_DEVICES={e.get('CUDA_VISIBLE_DEVICES', '<unset>')}", flush=True)
        if rank == 0:
            _write_json(Path(str(sweep_config.hydra.sweep.dir)) / str(job_num) / "slurm_job.json", {
                "point": job_num,
                "submitit_job_id": env.job_id,
                "slurm_job_id": e.get("SLURM_JOB_ID"),
                "array_job_id": e.get("SLURM_ARRAY_JOB_ID"),
                "array_task_id": e.get("SLURM_ARRAY_TASK_ID"),
                "nodelist": e.get("SLURM_JOB_NODELIST", socket.gethostname()),
                "ntasks": env.num_tasks,
                "restart_count": int(e.get("SLURM_RESTART_COUNT", "0")),
                "cuda_visible_devices": e.get("CUDA_VISIBLE_DEVICES"),
                "started": pd.Timestamp.now(tz="UTC").isoformat(),
            })
        else:  # rank 0 saves .hydra/ for the job; the others would only race it
            with open_dict(sweep_config.hydra):
                sweep_config.hydra.output_subdir = None
        _guard_timeout_signal()
        try:
            return run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=sweep_config,
                           job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir")
        except _JobTimedOut as exc:
            raise UncompletedJobError(str(exc)) from None

    # -- in the launching process -------------------------------------------------------------------------------

    def plan_points(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Point]:
        """Every point validated for the job it will run in (:func:`plan_all`); the sweeper calls it first
        (harness.launch.cli.check_sweep)."""
        assert self.hydra_context is not None and self.config is not None
        return plan_all(self.hydra_context, self.config, job_overrides, initial_job_idx, self._EXECUTOR)

    def _executor_params(self, point: Point) -> dict:
        return {k: v for k, v in point.launcher.items() if k not in OWN_KEYS}

    def _make_executor(self, params: dict) -> Any:
        import submitit

        init = {"folder": params["submitit_folder"]}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()
                                      if k not in ("submitit_folder", "max_num_timeout")})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        points = self.plan_points(job_overrides, initial_job_idx)
        for p in points:
            if self.nvlink_domain_nodes and p.nodes > int(self.nvlink_domain_nodes):
                log.warning(f"#{p.num}: {p.nodes} nodes span more than one {self.nvlink_domain_nodes}-node NVLink "
                            f"domain")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        for p in points:
            write_point(p, self._executor_params(p))
        if not self.dry_run:
            from harness.measure.runner import watch_run_dir

            for p in points:  # what a Ctrl-C here reports as kept: the rows the jobs wrote
                watch_run_dir(Path(p.cfg["results_dir"]) / p.run_id)
        if self.dry_run:
            write_plan(sweep_dir, points, [self._executor_params(p) for p in points])
            print(dry_run_report(points, self._EXECUTOR))
            print(f"nothing submitted (hydra.launcher.dry_run=true); plan: {sweep_dir / 'plan.tsv'}")
            return []
        if self._EXECUTOR == "slurm":
            self._check_accounting()

        # One executor (one job array) per distinct set of launcher options: ep_size can change nodes per point.
        groups: dict[str, list[Point]] = {}
        for p in points:
            groups.setdefault(json.dumps(self._executor_params(p), sort_keys=True, default=str), []).append(p)
        jobs: dict[int, Any] = {}
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        for key, group in groups.items():
            executor = self._make_executor(json.loads(key))
            args = [(p.overrides, "hydra.sweep.dir", p.num, f"job_id_for_{p.num}", Singleton.get_state())
                    for p in group]
            for p, job in zip(group, executor.map_array(self, *zip(*args))):
                jobs[p.num] = job
                log.info(f"\t#{p.num} : {p.label} -> job {job.job_id}")
                _link_logs(p.job_dir, job)

        ended = self._wait_all(points, jobs)
        returns, summary = [], []
        for p in points:
            ret, row = self._collect(p, jobs[p.num], ended[p.num])
            returns.append(ret)
            summary.append(row)
        write_manifest(sweep_dir / "jobs.csv", summary)
        print_summary(points, summary)
        return returns

    def _check_accounting(self) -> None:
        try:
            out = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=60)
            ok = out.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            log.warning("sacct does not answer: without Slurm accounting the end state of a job comes only from the "
                        "controller, which forgets it MinJobAge after the job ends (a job it forgot is reported "
                        "cancelled)")

    def _wait_all(self, points: Sequence[Point], jobs: dict[int, Any]) -> dict[int, str]:
        """Wait until every job has ended; each one's end state (``RESULTS``: every task wrote its result)."""
        by_num = {p.num: p for p in points}

        def results_ready(num: int) -> bool:
            p = by_num[num]
            return all(_result_path(jobs[num], t).exists() for t in range(p.nodes * p.tasks_per_node))

        if self._EXECUTOR == "slurm":
            return wait_slurm({p.num: jobs[p.num].job_id for p in points}, results_ready)
        ended: dict[int, str] = {}
        while len(ended) < len(points):
            for p in points:
                if p.num not in ended and (results_ready(p.num) or jobs[p.num].done()):
                    ended[p.num] = "RESULTS" if results_ready(p.num) else str(jobs[p.num].state)
                    log.info(f"\t#{p.num} : job {jobs[p.num].job_id} ended ({ended[p.num]})")
            if len(ended) < len(points):
                time.sleep(2.0)
        return ended

    def _collect(self, p: Point, job: Any, ended: str) -> tuple[JobReturn, dict]:
        """Rows for what the job's rank 0 did not report, with a status from the job's end. Never raises."""
        from submitit.core.utils import pickle_load

        marker = _read_json(p.job_dir / "slurm_job.json")
        raw_id, nodes, state = marker.get("slurm_job_id"), marker.get("nodelist"), ended
        if self._EXECUTOR == "slurm":
            info = sacct_info(job.job_id, wait_s=20 if ended == "RESULTS" else 5)
            state = info.get("State") or ("COMPLETED" if ended == "RESULTS" else ended)
            if ended.startswith("CANCELLED") and not info:
                state = ended
            raw_id = raw_id or info.get("JobIDRaw") or None
            nodes = nodes or info.get("NodeList") or None
        result = _result_path(job, 0)
        if not result.exists() and state.split(" ")[0] in ("COMPLETED", "FINISHED", "RESULTS"):
            for _ in range(15):  # a shared filesystem can show the file late
                if result.exists():
                    break
                time.sleep(1)
        ret: Optional[JobReturn] = None
        error, trace = "", ""
        if result.exists():
            try:
                outcome, value = pickle_load(result)
                if outcome == "success" and isinstance(value, JobReturn):
                    ret = value
                elif outcome == "error":
                    trace = str(value)
                    error = trace.strip().splitlines()[-1]
            except Exception as e:  # noqa: BLE001 - unreadable result: the state decides
                error = f"unreadable result {result}: {type(e).__name__}: {e}"
        if ret is not None and ret.status == JobStatus.FAILED:
            exc = ret._return_value
            error = f"{type(exc).__name__}: {exc}"
        if ret is not None and ret.status == JobStatus.COMPLETED:
            status = "ok"
        elif "timed-out" in trace:
            status = "timeout"  # submitit's timeout signal reached rank 0 (job not requeued)
        elif state.split(" ")[0] in ("COMPLETED", "FINISHED", "RESULTS"):
            status = "error"
        else:
            status = slurm_status(state)
        if status == "timeout":
            error = (f"{self._EXECUTOR} job {job.job_id} reached its time limit (hydra.launcher.timeout_min="
                     f"{p.launcher.get('timeout_min')}) and was not resubmitted (max_num_timeout="
                     f"{p.launcher.get('max_num_timeout', 0)})")
        if not error and status != "ok":
            error = f"{self._EXECUTOR} job {job.job_id} ended {state}"
            tail = log_tail(job.paths.stderr, 3)
            if tail and status == "error":
                error += f"; stderr: {tail}"
        why = error or f"{self._EXECUTOR} job {job.job_id} ended {state}, but rank 0 wrote no row for it"
        # Only the (backend, direction) pairs the job did not report get a row.
        # Slurm rows carry the job id (rank 0's SLURM_JOB_ID), which also finds the job's own rows; local ones none.
        sid = (raw_id or job.job_id) if self._EXECUTOR == "slurm" else None
        written = write_status_rows(p, "error" if status == "ok" else status, f"no row reported: {why}"[:2000], sid,
                                    nodes)
        if written is not None and status == "ok":
            status = "error"
        summary = {"num": p.num, "overrides": p.label, "job_id": job.job_id, "slurm_job_id": raw_id,
                   "state": state, "status": status, "launcher_rows": str(written) if written else "",
                   "error": error, "log": str(job.paths.stdout), "dir": str(p.job_dir)}
        if ret is None or ret.status != JobStatus.COMPLETED:
            # Failures are rows: hand Hydra a completed job so the sweep goes on.
            ret = JobReturn(overrides=p.overrides, working_dir=os.getcwd(), task_name=str(self.config.hydra.job.name),
                            status=JobStatus.COMPLETED, _return_value=None)
        return ret, summary


class NodeLauncherMixin:
    """``hydra/launcher=node``: Hydra's basic launcher (every point in turn in this process, each spawning its ranks
    on this machine's GPUs, as a plain ``python -m harness.run`` does) that validates every point before the first
    starts and has the same dry run as the Slurm launchers. Mixed in before Hydra's ``BasicLauncher`` by
    ``hydra_plugins.mokbench_launcher.NodeLauncher``."""

    config: Optional[DictConfig]
    hydra_context: Any

    def __init__(self, dry_run: bool = False, gpus_per_node: Optional[int] = None) -> None:
        self.dry_run = bool(dry_run)
        self.gpus_per_node = gpus_per_node
        super().__init__()

    def plan_points(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Point]:
        import torch

        assert self.hydra_context is not None and self.config is not None
        seen = torch.cuda.device_count()
        gpus = self.gpus_per_node if self.gpus_per_node is not None else seen
        if not self.dry_run and gpus > seen:
            reject([f"hydra.launcher.gpus_per_node={gpus} but this machine has {seen} GPU(s), and the points run here: "
                    f"gpus_per_node plans a run for another machine, with hydra.launcher.dry_run=true (leave it unset "
                    f"to run on this machine's GPUs)"])
        return plan_all(self.hydra_context, self.config, job_overrides, initial_job_idx, "node",
                        launcher={"nodes": 1, "tasks_per_node": 1, "gpus_per_node": gpus})

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        points = self.plan_points(job_overrides, initial_job_idx)
        if self.dry_run:
            print(dry_run_report(points, "node"))
            print("nothing run (hydra.launcher.dry_run=true)", flush=True)
            return []
        return super().launch(job_overrides, initial_job_idx)  # type: ignore[misc]


def _result_path(job: Any, task: int) -> Path:
    from submitit.core.utils import JobPaths

    return JobPaths(job.paths.folder, job.job_id, task).result_pickle


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _link_logs(job_dir: Path, job: Any) -> None:
    """``<point>/log.out`` and ``log.err`` -> the job's submitit logs (rank 0)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    for name, target in (("log.out", job.paths.stdout), ("log.err", job.paths.stderr)):
        link = job_dir / name
        with contextlib.suppress(OSError):
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(target, job_dir))
