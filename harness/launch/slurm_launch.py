"""Sweeps on Slurm (or local submitit) through Hydra: launchers, pre-submission validation, dry run, failure rows.

    python -m harness.run -m hydra/launcher=h200_8gpu hydra.launcher.partition=gpu \\
        shape=kimi_k2_7,glm_5_2 precision=bf16,fp8 direction=fwd,bwd
    python -m harness.run -m +experiment=gb300_published hydra.launcher.dry_run=true

The launchers extend hydra-submitit-launcher's. One Slurm job per sweep point, with nodes x tasks_per_node tasks;
every task runs the Hydra task function and joins the rank layout from the Slurm environment
(:func:`harness.measure.dist.from_environment`), so rank 0 of each job writes that job's rows. Presets ask for
``gpus_per_node``, never ``gpus_per_task``: each task then sees every GPU of its node and picks ``cuda:local_rank``
(DeepEP needs its peers' GPUs visible).

In the launching process, before anything is submitted, every point is composed and validated exactly as a local
run would validate it (:func:`harness.config.point.resolve` and :func:`harness.config.point.make_case`, with the rank count
of the job); one bad point rejects the sweep with the same message and exit code 2. ``hydra.launcher.dry_run=true``
stops there and prints jobs, GPUs and GPU-hours. After the sweep, a job that ended without its rank 0 reporting
(cancelled, timed out, failed, killed) gets its missing rows from here, with the status taken from Slurm
accounting. Each point's folder in the sweep directory keeps ``mokbench.yaml`` (the validated config), Hydra's
``.hydra/``, ``slurm_job.json`` (written by rank 0 when it starts) and links to the submitit logs; the sweep folder
keeps ``jobs.csv``, one line per job with its final state.

Plain sbatch instead of submitit: ``slurm/submit.sh`` (the same dry run writes ``plan.tsv``, then one sbatch per
point), then ``python -m harness.slurm collect <sweep dir>`` for the rows of jobs that did not report.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import pandas as pd
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from harness.config import validate
from harness.launch.cli import hydra_config, point_error_line, point_labels, reject, sweep_problem_lines
from harness.config.launcher_options import POINT_FILE, OWN_KEYS

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# one sweep point, validated in the launching process


@dataclass
class Point:
    num: int  # hydra.job.num
    overrides: list[str]  # as given (plus device=..., when device was auto)
    cfg: dict  # resolved like harness.config.point.resolve does on the node
    case: Any  # harness.config.schema.Case
    config_hash: str
    run_id: str
    launcher: dict  # this point's hydra.launcher options (nodes etc. as ep_size set them)
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    world_size: int
    job_dir: Path
    label: str = ""  # the overrides that tell this point from the others of the sweep

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@contextlib.contextmanager
def _assume_cuda(on: bool) -> Iterator[None]:
    """Validate a GPU job from a login node without GPUs: resolve() only asks whether CUDA is visible."""
    import torch

    if not on or torch.cuda.is_available():
        yield
        return
    from unittest import mock

    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        yield


def _launcher_options(config: DictConfig) -> dict:
    opts = OmegaConf.to_container(config.hydra.launcher, resolve=True)
    assert isinstance(opts, dict)
    return opts


def plan_point(config: DictConfig, num: int, overrides: Sequence[str], executor: str = "slurm") -> Point:
    """Validate one composed sweep point (its full config, ``hydra`` node included) for the job it will run in on
    ``executor``'s launcher. Raises :class:`ConfigError` with the message a local run would give."""
    from harness.core import results
    from harness.config.schema import given_run_id
    from harness.config.point import Point as TypedPoint
    from harness.config.point import resolve

    opts = _launcher_options(config)
    asked_nodes = opts.get("nodes") if any(o.lstrip("+").startswith("hydra.launcher.nodes=")
                                           for o in config.hydra.overrides.hydra) else None
    nodes = int(opts.get("nodes") or 1)
    tpn = int(opts.get("tasks_per_node") or 1)
    gpn = int(opts.get("gpus_per_node") or 0)
    overrides = list(overrides)

    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
        device = task_cfg.get("device", "auto")
        if device == "auto":
            # The node decides `auto` from what it sees; make it explicit so the job runs what was validated.
            device = "cuda" if gpn > 0 else "cpu"
            task_cfg.device = device
            overrides = [o for o in overrides if not o.lstrip("+~").startswith("device=")] + [f"device={device}"]
        generated = given_run_id(task_cfg)[0] is None
        with hydra_config(config):
            validate.run_id_for_sweep(task_cfg)
            with _assume_cuda(device == "cuda"):
                c = resolve(task_cfg)
    validate.check_option_conflicts(c, list(config.hydra.overrides.task))

    nodes, tpn, gpn, ws = validate.check_job_layout(c, device, executor, opts, nodes, tpn, gpn, asked_nodes)
    pt = TypedPoint.build(c, ep_size=ws, device=device)
    results.check_dir(c["results_dir"])
    validate.check_new_run(c, generated_from=str(config.hydra.sweep.dir) if generated else None)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    return Point(num=num, overrides=overrides, cfg=pt.as_dict(), case=pt.case, config_hash=pt.config_hash,
                 run_id=given_run_id(c)[0] or "", launcher=opts, nodes=nodes,
                 tasks_per_node=tpn, gpus_per_node=gpn, world_size=ws, job_dir=sweep_dir / str(num))


def _check_local_memory(point: Point) -> None:
    """A CPU point of the local launcher spawns its gloo ranks on this machine: they must fit its memory."""
    from harness.measure.env import available_memory_bytes

    avail = available_memory_bytes()
    if avail is not None:
        validate.check_cpu_memory(point.case, avail)


def dry_run_report(points: Sequence[Point], executor: str = "slurm") -> str:
    """The plan: one line per job (its resources, then the backends and directions it runs), and the total."""
    where = "run one after another on this machine" if executor == "node" else f"{executor} jobs"
    lines = [f"mokbench dry run: {len(points)} sweep points -> {len(points)} {where}"]
    gpu_hours = cpu_hours = 0.0
    gpus = 0
    for p in points:
        minutes = float(p.launcher.get("timeout_min") or 0)
        gpus += p.gpus
        gpu_hours += p.gpus * minutes / 60
        cpus = p.world_size * int(p.launcher.get("cpus_per_task") or 1)
        cpu_hours += cpus * minutes / 60
        limit = f"time limit {minutes:g} min" if minutes else "no time limit"
        lines.append(f"  #{p.num:<3} {p.label}: {p.nodes} node(s) x {p.tasks_per_node} task(s), EP {p.world_size}, "
                     f"{p.gpus} GPUs, {p.case.device}, {limit}")
        lines.append(f"        backends: {', '.join(p.cfg['backends'])}; directions: {', '.join(p.cfg['directions'])}")
    per_job = sorted({p.gpus for p in points})
    span = f"{per_job[0]}" if len(per_job) == 1 else f"{per_job[0]}-{per_job[-1]}"
    if executor == "node":
        lines.append(f"total: {len(points)} points x {span} GPUs, one after another in this process")
    else:
        lines.append(f"total: {len(points)} jobs x {span} GPUs = {gpus} GPUs allocated, at most {gpu_hours:.1f} "
                     f"GPU-hours (time limit x GPUs" + (f"; {cpu_hours:.1f} CPU-hours)" if gpus == 0 else ")"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# rows for jobs whose rank 0 did not report


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


def _tail(path: Path, n: int = 6) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def plan_all(hydra_context: Any, config: DictConfig, job_overrides: Sequence[Sequence[str]], initial_job_idx: int,
             executor: str, launcher: Optional[dict] = None) -> list[Point]:
    """Compose and validate every point of a sweep for ``executor``'s launcher before any runs; any bad point: one
    line on stderr for each problem (Hydra's composition errors included, harness.launch.cli; a problem every point has,
    once), and exit code 2 with nothing started. ``launcher``: options set on every point's ``hydra.launcher``;
    points of the node and local launchers run on this machine, so a CPU point's gloo ranks must fit its memory."""

    points, bad = [], []
    labels = point_labels(job_overrides)
    for i, overrides in enumerate(job_overrides):
        num = initial_job_idx + i
        try:
            point_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
            with open_dict(point_config.hydra.job):
                point_config.hydra.job.num = num
            validate.check_launcher_options(_launcher_options(point_config), executor)
            if launcher:
                with open_dict(point_config.hydra.launcher):
                    point_config.hydra.launcher.update(launcher)
            points.append(plan_point(point_config, num, overrides, executor))
            points[-1].label = labels[i]
            if executor in ("node", "local") and points[-1].case.device == "cpu":
                _check_local_memory(points[-1])
        except Exception as e:  # noqa: BLE001 - configuration and Hydra's composition errors; anything else: raise
            line = point_error_line(e)
            if line is None:
                raise
            bad.append((num, labels[i], line))
    if bad:
        reject(sweep_problem_lines(bad, len(job_overrides)))
    return points


# ---------------------------------------------------------------------------------------------------------------
# in each task


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
        _write_manifest(sweep_dir / "jobs.csv", summary)
        _print_summary(points, summary)
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
            tail = _tail(job.paths.stderr, 3)
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


def write_point(p: Point, launcher: dict) -> Path:
    """``<sweep>/<num>/mokbench.yaml``: the point as validated (enough to rebuild it with :func:`load_point`)."""
    path = p.job_dir / POINT_FILE
    _write_yaml(path, {"num": p.num, "overrides": p.overrides, "label": p.label, "run_id": p.run_id,
                       "config_hash": p.config_hash, "nodes": p.nodes, "tasks_per_node": p.tasks_per_node,
                       "gpus_per_node": p.gpus_per_node, "ep_size": p.world_size, "launcher": launcher,
                       "config": p.cfg, "case": dataclasses.asdict(p.case)})
    return path


def load_point(job_dir: Path) -> Point:
    from harness.config.schema import Case

    d = OmegaConf.to_container(OmegaConf.load(Path(job_dir) / POINT_FILE), resolve=False)
    assert isinstance(d, dict)
    case = dict(d["case"], routing_params=tuple(tuple(pv) for pv in d["case"].get("routing_params", ())))
    return Point(num=d["num"], overrides=d["overrides"], cfg=d["config"], case=Case(**case),
                 config_hash=d["config_hash"], run_id=d["run_id"], launcher=d["launcher"], nodes=d["nodes"],
                 tasks_per_node=d["tasks_per_node"], gpus_per_node=d["gpus_per_node"], world_size=d["ep_size"],
                 job_dir=Path(job_dir), label=d.get("label", ""))


PLAN_COLUMNS = ("num", "nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "timeout_min", "partition",
                "account", "qos", "sbatch_flags", "run_id", "overrides")


def write_plan(sweep_dir: Path, points: Sequence[Point], launchers: Sequence[dict]) -> Path:
    """``plan.tsv`` (one line per point: its resources and shell-quoted overrides, ``-`` for empty) and ``setup.sh``
    (the preset's setup lines), for slurm/submit.sh, which submits the points with plain sbatch."""
    import shlex

    lines = ["\t".join(PLAN_COLUMNS)]
    for p, opts in zip(points, launchers):
        flags = []
        for k, v in (opts.get("additional_parameters") or {}).items():
            flags.append(f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}")
        for k in ("constraint", "exclude", "comment", "mem_per_gpu", "mem_per_cpu"):
            if opts.get(k):
                flags.append(f"--{k.replace('_', '-')}={opts[k]}")
        if opts.get("mem_gb"):
            flags.append(f"--mem={opts['mem_gb']}G")
        row = [p.num, p.nodes, p.tasks_per_node, p.gpus_per_node or "", opts.get("cpus_per_task") or "",
               opts.get("timeout_min") or "", opts.get("partition") or "", opts.get("account") or "",
               opts.get("qos") or "", " ".join(flags), p.run_id, shlex.join(p.overrides)]
        lines.append("\t".join(str(v) if v not in ("", None) else "-" for v in row))  # "-": empty (bash's read
        # would merge two tabs)
    (sweep_dir / "plan.tsv").write_text("\n".join(lines) + "\n")
    setup = (launchers[0].get("setup") or []) if launchers else []
    (sweep_dir / "setup.sh").write_text("# setup lines of the launcher preset (sourced by slurm/mokbench.sbatch)\n"
                                        + "".join(f"{ln}\n" for ln in setup))
    return sweep_dir / "plan.tsv"


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
        tail = _tail(p.job_dir / f"slurm-{jid}.out", 3) if status == "error" else ""
        written = write_status_rows(p, "error" if status == "ok" else status,
                                    f"no row reported: {why}" + (f"; log: {tail}" if tail else ""), jid,
                                    info.get("NodeList") or None)
        if written is not None and status == "ok":
            status = "error"
        summary.append({"num": n, "overrides": p.label, "job_id": jid, "slurm_job_id": jid, "state": state,
                        "status": status, "launcher_rows": str(written) if written else "",
                        "error": "" if status == "ok" else why, "log": str(p.job_dir / f"slurm-{jid}.out"),
                        "dir": str(p.job_dir)})
    _write_manifest(sweep_dir / "jobs.csv", summary)
    _print_summary(list(points.values()), summary)
    return 0


def _write_yaml(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(data), path)


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


def _write_manifest(path: Path, summary: list[dict]) -> None:
    df = pd.DataFrame(summary)
    tmp = path.with_name(f".{path.name}.tmp")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def _print_summary(points: Sequence[Point], summary: list[dict]) -> None:
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

    ap = ArgumentParser(prog="python -m harness.slurm", description=__doc__.split("\n\n")[0])
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
