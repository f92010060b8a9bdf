"""Planning a sweep on Slurm (or local submitit): every point composed and validated in the launching process exactly
as a local run would validate it (:func:`harness.config.point.resolve` and :func:`harness.config.point.make_case`, with
the rank count of the job); one bad point rejects the sweep with the same message and exit code 2.
``hydra.launcher.dry_run=true`` stops after the plan and prints jobs, GPUs and GPU-hours (:func:`dry_run_report`).
Each point's folder keeps ``mokbench.yaml`` (the validated config: :func:`write_point`, :func:`load_point`);
``plan.tsv`` and ``setup.sh`` are what ``slurm/submit.sh`` submits with plain sbatch (:func:`write_plan`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from harness.config import validate
from harness.launch.cli import hydra_config, point_error_line, point_labels, reject, sweep_problem_lines
from harness.config.launcher_options import POINT_FILE


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
        generated = validate.given_run_id(task_cfg)[0] is None
        with hydra_config(config):
            validate.run_id_for_sweep(task_cfg)
            with _assume_cuda(device == "cuda"):
                typed = resolve(task_cfg)
    validate.check_option_conflicts(task_cfg, list(config.hydra.overrides.task))

    nodes, tpn, gpn, ws = validate.check_job_layout(typed, device, executor, opts, nodes, tpn, gpn, asked_nodes)
    pt = TypedPoint.build(typed, ep_size=ws, device=device)
    results.check_dir(typed.results_dir)
    validate.check_new_run(typed, generated_from=str(config.hydra.sweep.dir) if generated else None)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    return Point(num=num, overrides=overrides, cfg=pt.as_dict(), case=pt.case, config_hash=pt.config_hash,
                 run_id=validate.given_run_id(typed)[0] or "", launcher=opts, nodes=nodes,
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


def _write_yaml(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(data), path)
