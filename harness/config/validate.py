"""Every check a sweep point passes before anything runs: the one module of them. Each raises :class:`ConfigError`
with a message that names the fix; the command line turns it into one line on stderr and exit code 2.

* :func:`check_complete`: every value given (the composed values, before they are typed: the one check that reads
  them plain);
* :func:`validate_run_options`: the run-level options (backends, directions, timing, device, numbers, run id, the
  backends' options, several ranks on one GPU), on the typed configuration (:func:`harness.config.point.resolve`);
* :func:`check_local_experts`, :func:`validate_case`: the resolved point (sizes, workload, precision);
* :func:`check_option_conflicts`: a group option and the key it sets, both on the command line (the composed
  configuration against its overrides);
* :func:`check_device`, :func:`check_gpus`, :func:`check_cpu_memory`: what this machine (or a job's) has;
* :func:`check_job_layout`: the layout of a launcher's job (nodes, tasks, GPUs) for a point;
* :func:`given_run_id`, :func:`check_run_id`, :func:`run_id_for_sweep`, :func:`check_new_run`: the run id given, a
  run id is a name, a sweep's jobs share one, and a run id whose folder already holds rows is refused;
* :func:`check_launcher_options`: a launcher's own options.

The checks of a point take its typed configuration (:class:`~harness.config.schema.BenchConfig`), its parts or its
:class:`~contract.case.Case`; the others take the values they check (a run id, a device, the launcher's options) or
the composed configuration where they run before it is resolved (:func:`run_id_for_sweep`,
:func:`check_option_conflicts`) or typed (:func:`check_complete`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from contract.case import Case
from harness.config import backend_options
from harness.core import results
from harness.config import routing
from harness.core.backends import BACKENDS
from harness.config.schema import (BACKEND_ORDERS, COMPILE_MODES, CONFIG_DIR, DEVICES, DIRECTIONS, PRECISIONS,
                                   BenchConfig, ShapeConfig, gpus_needed)
from harness.core.errors import ConfigError
from harness.core.run_names import sweep_run_id

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]+")


def given_run_id(config: Any) -> tuple[Optional[str], str]:
    """The run id given for this run and where it came from: ``run_id=`` (the configuration: typed, or composed),
    else ``MOKBENCH_RUN_ID`` (the environment), else (None, ""): the run gets a new one."""
    rid = getattr(config, "run_id", None)
    if rid:
        return str(rid), "run_id"
    if os.environ.get("MOKBENCH_RUN_ID"):
        return os.environ["MOKBENCH_RUN_ID"], "MOKBENCH_RUN_ID"
    return None, ""


def check_run_id(run_id: Any, source: str = "run_id") -> None:
    """Raise :class:`ConfigError` unless ``run_id`` is a name (letters, digits, ``.``, ``_``, ``-``; not ``.`` or
    ``..``): the run's rows go to ``<results_dir>/<run_id>/``, so a path would write them elsewhere."""
    if run_id is None or run_id == "":
        return
    rid = str(run_id)
    if not RUN_ID_PATTERN.fullmatch(rid) or rid in (".", ".."):
        raise ConfigError(f"{source}={rid} is not a run name: use letters, digits, '.', '_' and '-' only (no '/', not "
                          f"'.' or '..'); the rows go to <results_dir>/<run_id>/")


def run_id_for_sweep(cfg: DictConfig) -> None:
    """Jobs of one multirun share a run_id (from the sweep folder) unless one was given (``run_id=`` or
    ``MOKBENCH_RUN_ID``, checked to be a name): sets ``cfg.run_id`` inside a Hydra multirun job, leaves it alone
    elsewhere. The Hydra main calls it for each job; the sweep checks (harness.launch.cli, harness.slurm) call it to
    validate the job as it will run."""
    rid, source = given_run_id(cfg)
    if rid is not None:
        check_run_id(rid, source)
        return
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            cfg.run_id = sweep_run_id(str(cfg.get("device", "auto")), str(hc.sweep.dir))
    except ValueError:
        pass


def check_complete(c: dict) -> None:
    """Every value of the composed configuration's plain values ``c`` is given (none left ``???``): what typing it
    needs, so the one check before :func:`harness.config.point.resolve` types it."""
    missing = [f"{g}.{k}" for g in ("shape", "workload", "precision", "timing") for k, v in c[g].items() if v == "???"]
    missing += [k for k, v in c.items() if v == "???"]
    if missing:
        name = c["shape"].get("name", "")
        example = (" (e.g. shape=custom shape.num_experts=64 shape.hidden=4096 shape.ffn=1536 shape.topk=6)"
                   if name == "custom" and all(m.startswith("shape.") for m in missing) else "")
        raise ConfigError(f"{', '.join(missing)} not set: give {'it' if len(missing) == 1 else 'each'} a value on the "
                          f"command line{example}")


def validate_run_options(c: BenchConfig) -> None:
    """Checks on the run-level options (backends, directions, timing, device) of the typed configuration ``c``, its
    backends' options and aliases as given (before :func:`harness.config.backend_options.apply_aliases`)."""
    if not c.backends:
        raise ConfigError("no backend selected: set backend=<name> or backends=[a,b]")
    for b in c.backends:
        if b not in BACKENDS:
            raise ConfigError(f"unknown backend '{b}'; choose from: {', '.join(BACKENDS)}")
    # an empty own_pythonpath value (a preset's unset environment variable) gives that backend no folder of its own
    own_paths = {b: str(p) for b, p in (c.own_pythonpath or {}).items() if p is not None and str(p).strip()}
    for key, named in (("own_process", c.own_process or []), ("own_pythonpath", own_paths)):
        stray = [b for b in named if b not in c.backends]
        if stray:
            them = "it" if len(stray) == 1 else "them"
            raise ConfigError(f"{key} names {', '.join(stray)}, not among backends={list(c.backends)}: add {them} "
                              f"to backends, or drop {them} from {key}")
    for b, path in own_paths.items():
        if b not in (c.own_process or []):
            raise ConfigError(f"own_pythonpath.{b} takes effect only in a process of its own: add {b} to own_process")
        for folder in str(path).split(os.pathsep):
            if not os.path.isdir(folder):
                raise ConfigError(f"own_pythonpath.{b}: {folder} is not a folder: give the site-packages folder (or "
                                  f"folders, {os.pathsep}-separated) that holds {b}'s packages")
    if c.backend_order not in BACKEND_ORDERS:
        raise ConfigError(f"unknown backend_order '{c.backend_order}'; choose one of: {', '.join(BACKEND_ORDERS)}")
    if not c.directions:
        raise ConfigError("no direction selected: set direction=fwd|bwd|fwd_bwd or directions=[fwd,bwd]")
    for d in c.directions:
        if d not in DIRECTIONS:
            raise ConfigError(f"unknown direction '{d}'; choose from: {', '.join(DIRECTIONS)}")
    for k in TIMING_FIELDS:
        if getattr(c.timing, k) is None:
            raise ConfigError(f"timing.{k} is not set: give it a value (timing.{k}=...) or pick a timing preset "
                              f"(timing=quick, timing=published)")
    if c.timing.align not in ("barrier", "none"):
        raise ConfigError(f"timing.align must be barrier or none (got {c.timing.align})")
    if c.device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)} (got {c.device})")
    if c.results_format not in ("csv", "parquet"):
        raise ConfigError(f"results_format must be csv or parquet (got {c.results_format})")
    if c.compile_mode not in COMPILE_MODES:  # checked with compile off too: it is recorded and swept
        raise ConfigError(f"unknown compile_mode '{c.compile_mode}'; choose one of: {', '.join(COMPILE_MODES)}")
    check_run_id(*given_run_id(c))
    _check_shared_gpu(c)
    _check_backend_options(c)
    for key, low, high, closed, unit, null in NUMERIC_RANGES:
        value = _select(c, key)
        if value is None and null:
            continue
        if value is None or not (low <= value <= high) or (value == low and not closed):  # (NaN fails too)
            lo, hi = (str(int(v)) if float(v).is_integer() else f"{v:g}" for v in (low, high))
            span = (f"{'>=' if closed else '>'} {lo}" if high == _INF else
                    f"between {lo} and {hi}" if closed else f"> {lo} and <= {hi}")
            raise ConfigError(f"{key} must be {span}{unit}{f', or null for {null}' if null else ''} (got {value})")


def _check_shared_gpu(c: BenchConfig) -> None:
    """What ``ranks_per_gpu`` > 1 needs: a GPU, the reference check (it is the whole point of such a run), and no
    calibration (gloo over the host has no interconnect rate to measure)."""
    rpg = c.ranks_per_gpu
    if not isinstance(rpg, int) or rpg <= 1:
        return
    if c.device != "cuda":
        raise ConfigError(f"ranks_per_gpu={rpg} puts several ranks on one GPU, and this run has none "
                          f"(device={c.device}): drop ranks_per_gpu (CPU ranks already share the machine)")
    if not c.check:
        raise ConfigError(f"ranks_per_gpu={rpg} runs the reference check only (ranks that share a GPU time nothing): "
                          f"drop check=false")
    if c.calibrate:
        raise ConfigError(f"ranks_per_gpu={rpg} has no interconnect to calibrate (the ranks talk over the host): "
                          f"drop calibrate=true")


# The numeric options and the values that can work: (dotted key, lowest, highest, whether the lowest itself is
# allowed, unit, what null means: None where null is not allowed). Checked before anything runs; the shape's sizes,
# the tokens and comm_sms are checked on the resolved point (validate_case).
_YEAR_S = 365 * 24 * 3600
_INF = float("inf")
NUMERIC_RANGES: tuple[tuple[str, float, float, bool, str, Optional[str]], ...] = (
    ("ep_size", 1, _INF, True, "", "all local GPUs (2 ranks on a CPU)"),
    ("ranks_per_gpu", 1, 64, True, "", None),
    ("dist_timeout_s", 1, _YEAR_S, True, " seconds", None),
    ("watchdog_s", 1, _YEAR_S, True, " seconds", "no watchdog (900 s with ranks_per_gpu > 1)"),
    ("setup_timeout_s", 0, _YEAR_S, False, " seconds", "no limit"),
    ("timing.num_iters", 1, _INF, True, "", None),
    ("timing.num_warmup", 0, _INF, True, "", None),
    ("timing.phase_iters", 0, _INF, True, " (0: no per-phase bandwidth timing)", None),
    ("workload.seed", -(2**31), 2**31 - 1, True, "", None),  # seeds of the per-rank and per-expert generators
    ("precision.act_block", 1, _INF, True, "", None),
    ("precision.weight_block", 1, _INF, True, "", None),
    ("precision.atol", 0, _INF, True, "", None),
    ("precision.rtol", 0, _INF, True, "", None),
)
TIMING_FIELDS = ("num_warmup", "num_iters", "l2_flush", "align", "phase_iters")


def _select(c: Any, key: str) -> Any:
    """The value of the dotted ``key`` (``timing.num_iters``) in the configuration ``c``, as plain values."""
    group, _, leaf = key.rpartition(".")
    get = backend_options.config_value
    value = get(get(c, group) or {}, leaf) if group else get(c, key)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def check_local_experts(shape: ShapeConfig) -> None:
    """``shape.local_experts``, where set, is at least one (it replaces the shape's expert count)."""
    local = shape.local_experts
    if local is not None and local < 1:
        raise ConfigError(f"shape.local_experts must be >= 1 (got {local}): the experts on each GPU; leave it unset "
                          f"(shape.local_experts=null) for the shape's own {shape.num_experts} experts")


def validate_case(case: Case) -> None:
    """Checks on the resolved point (its sizes, workload, precision and device)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(case.ep_size >= 1, f"ep_size must be >= 1 (got {case.ep_size})")
    for name in ("hidden", "ffn", "topk", "num_experts", "tokens_per_gpu"):
        need(getattr(case, name) >= 1, f"{name} must be >= 1 (got {getattr(case, name)})")
    need(
        case.num_experts % case.ep_size == 0,
        f"shape '{case.shape}' has {case.num_experts} experts, not divisible by ep_size={case.ep_size}: "
        f"use an ep_size that divides {case.num_experts}, or set shape.local_experts",
    )
    need(
        case.topk <= case.num_experts,
        f"topk={case.topk} exceeds num_experts={case.num_experts}: lower shape.topk",
    )
    need(case.precision in PRECISIONS, f"unknown precision '{case.precision}'; choose one of: {', '.join(PRECISIONS)}")
    if case.precision == "fp8":
        for name in ("hidden", "ffn"):
            need(
                getattr(case, name) % case.act_block == 0 and getattr(case, name) % case.weight_block == 0,
                f"fp8 block scaling needs shape.{name} ({getattr(case, name)}) divisible by the scale blocks "
                f"({case.act_block}, {case.weight_block}): pick another shape or precision=bf16",
            )
    if case.precision == "mxfp8":
        for name in ("hidden", "ffn"):
            need(
                getattr(case, name) % 32 == 0,
                f"mxfp8 needs shape.{name} ({getattr(case, name)}) divisible by 32: pick another shape or precision",
            )
    routing.check(case)  # the model's checks (harness/config/routing_models.py)
    need(
        case.swiglu_limit is None or case.swiglu_limit > 0,
        f"shape.swiglu_limit must be positive or null (got {case.swiglu_limit})",
    )
    need(case.device in ("cpu", "cuda"), f"device must be cpu or cuda (got {case.device})")
    if case.comm_sms is not None:
        need(case.comm_sms > 0 and case.comm_sms % 2 == 0,
             f"comm_sms must be a positive even number (got {case.comm_sms})")
    need(not case.compile or case.compile_mode in COMPILE_MODES,
         f"unknown compile_mode '{case.compile_mode}'; choose one of: {', '.join(COMPILE_MODES)} (or compile=false)")


# Memory of one CPU (gloo) rank, for the check that the ranks of a local run fit this machine. Measured with torch
# 2.14 on CPU: a rank of the tiny shape at 64 tokens peaks at 0.79 GB resident, of which 0.28 GB are library pages
# shared by every rank (torch's code) and ~0.52 GB its own (interpreter, imports, gloo, allocator arenas).
_RANK_BASE_BYTES = 530 * 2**20
_SHARED_LIB_BYTES = 280 * 2**20


def cpu_rank_bytes(case: Case, ranks: int) -> int:
    """Estimated peak memory of one CPU rank of ``case`` run on ``ranks`` ranks (bytes, its own pages only).

    The base process, plus five copies of the rank's bf16 weights (the inputs, the reference's and the backend's
    leaves, and the gradients of both), plus the larger of two phases that do not overlap: the reference, which
    all-gathers every rank's tokens (bf16 copy, fp32 accumulator and its sum, and their gradients: ~16 bytes per
    token x hidden, growing with the rank count), and the backend's routed and shared rows (tokens x (topk + 1)
    x (hidden + ffn), ~16 bytes each: activations, dispatch buffers and their gradients). With the shared library
    pages, 0.93-1.12x the peak resident memory measured for ten nccl runs of 0.79-2.1 GB per rank (tiny shape,
    64 to 65536 tokens, EP 1-8, 1-64 experts per rank, hidden up to 1024).
    """
    h, i, t, k = case.hidden, case.ffn, case.tokens_per_gpu, case.topk
    weights = (case.local_experts + (1 if case.shared_expert else 0)) * 3 * h * i * 2 * 5
    reference = ranks * t * h * 16
    rows = t * (k + 1) * (h + i) * 16
    return _RANK_BASE_BYTES + weights + max(reference, rows)


def check_cpu_memory(case: Case, available_bytes: int) -> None:
    """Raise :class:`ConfigError` when ``case.ep_size`` CPU ranks cannot fit in ``available_bytes`` (with 10% left
    to the rest of the machine); the message says how many ranks fit."""
    budget = 0.9 * available_bytes - _SHARED_LIB_BYTES

    def total(n: int) -> int:
        return n * cpu_rank_bytes(dataclasses.replace(case, ep_size=n, local_experts=_local(case, n)), n)

    need = total(case.ep_size)
    if need <= budget:
        return
    fit = [n for n in range(1, case.ep_size) if total(n) <= budget and (case.experts_override
                                                                       or case.num_experts % n == 0)]
    gb = 1e9
    advice = (f"use ep_size<={fit[-1]}" + ("" if case.experts_override else f" (one that divides {case.num_experts})")
              if fit else "not even one rank fits: pick a smaller shape or fewer workload.tokens_per_gpu")
    raise ConfigError(f"ep_size={case.ep_size} on CPU needs about {need / gb:.1f} GB ({case.ep_size} gloo ranks x "
                      f"{need / case.ep_size / gb:.2f} GB, estimated from the shape) but this machine has "
                      f"{available_bytes / gb:.1f} GB available: {advice}, or run on GPUs")


def _local(case: Case, n: int) -> int:
    """Experts per rank of ``case`` on ``n`` ranks."""
    return case.local_experts if case.experts_override else max(1, case.num_experts // n)


# A config group whose option sets one key, and that key: given both on the command line, the key is merged last and
# the option would be dropped without a word, so different values are refused (the same value is fine).
OPTION_KEYS = {"backend": "backends", "direction": "directions", "precision": "precision.name",
               "workload": "workload.routing"}


def check_option_conflicts(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Raise :class:`ConfigError` where the command line (``overrides``, one point's) picks a group option
    (``backend=mok_hopper``) and the composed config ``cfg`` holds another value of the key that option sets
    (``backends=[nccl]``, given too or set by an experiment)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([o for o in overrides if "=" in o])
    given = {o.key_or_group: o for o in parsed if not o.is_delete()}
    for group, key in OPTION_KEYS.items():
        if group not in given or not isinstance(given[group].value(), str):
            continue
        option = str(given[group].value())
        want = _option_sets(group, option, key)
        got = _select(cfg, key)
        if want is None or got == want:
            continue
        if key in given:
            source = f"{key}={given[key].get_value_element_as_str()}"
            alone = (f"{group}={got} alone" if isinstance(got, str) and (CONFIG_DIR / group / f"{got}.yaml").exists()
                     else f"{key}={_show(got)} alone")
            fix = f"give one of the two ({group}={option} alone, or {alone})"
        else:  # an experiment set the key
            source = f"{key}={_show(got)}" + "".join(f" (set by {o.input_line})" for o in parsed
                                                      if o.key_or_group == "experiment")
            fix = f"drop {group}={option}, or give {key}=... to replace the experiment's"
        raise ConfigError(f"{group}={option} conflicts with {source}, which replaces it: {fix}")


def _option_sets(group: str, option: str, key: str) -> Any:
    """The value a group option sets for ``key`` (None: not an option with a file)."""
    if group == "backend":
        return [option]
    path = CONFIG_DIR / group / f"{option}.yaml"
    if not path.exists():
        return None
    value = OmegaConf.select(OmegaConf.load(path), key.removeprefix(f"{group}."))
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _show(value: Any) -> str:
    return f"[{','.join(map(str, value))}]" if isinstance(value, list) else str(value)


def _check_backend_options(c: BenchConfig) -> None:
    """Each backend option (and each alias given) is one of its choices; an alias and a scoped value that it would
    drop are not both given."""
    for key, value, spec in backend_options.option_values(c):
        if value not in spec.choices:
            raise ConfigError(f"unknown {key} '{value}'; choose one of: {', '.join(spec.choices)}")
    conflicts = backend_options.alias_conflicts(c)
    if conflicts:
        raise ConfigError(conflicts[0])


def check_device(device: str, cuda_available: bool) -> None:
    """``device=cuda`` needs a visible GPU."""
    if device == "cuda" and not cuda_available:
        raise ConfigError("device=cuda but no CUDA GPU is visible: use device=cpu (gloo ranks) or run on a GPU node")


def check_gpus(ranks: int, ranks_per_gpu: int, gpus: int) -> None:
    """``ranks`` ranks, ``ranks_per_gpu`` to a GPU, fit the ``gpus`` GPUs of this machine."""
    if gpus_needed(ranks, ranks_per_gpu) > gpus:
        per = f" at ranks_per_gpu={ranks_per_gpu}" if ranks_per_gpu > 1 else ""
        raise ConfigError(f"ep_size={ranks} needs {gpus_needed(ranks, ranks_per_gpu)} GPUs{per} but this machine has "
                          f"{gpus}: set ep_size<={gpus * ranks_per_gpu}, or launch across nodes with torchrun or Slurm")


def check_new_run(config: BenchConfig, generated_from: Optional[str] = None) -> None:
    """Raise :class:`ConfigError` when the run id (given as ``run_id=`` or ``MOKBENCH_RUN_ID``, or a sweep's, made from
    its folder ``generated_from``) names a run folder that already holds rows and ``append`` is off: this run's rows
    would be pooled with another run's without a word."""
    rid, source = given_run_id(config)
    if rid is None or config.append:
        return
    run_dir = Path(config.results_dir) / rid
    files = results.find_files(run_dir)[0] if run_dir.is_dir() else []
    if not files:
        return
    held = f"{run_dir} already holds the rows of a run ({len(files)} file{'s' if len(files) != 1 else ''})"
    if generated_from:
        raise ConfigError(f"the sweep's run id {rid} (made from hydra.sweep.dir={generated_from}) is taken: {held}: "
                          f"give another hydra.sweep.dir or a run_id, or append=true to add the rows to that run")
    raise ConfigError(f"{source}={rid} is taken: {held}: give a new run_id, or append=true to add this run's rows "
                      f"to it")


def check_job_layout(config: BenchConfig, device: str, executor: str, opts: dict, nodes: int, tpn: int, gpn: int,
                     asked_nodes: Optional[int]) -> tuple[int, int, int, int]:
    """The job a launcher (``executor``: slurm, local or node) runs one point in: its ``nodes``, tasks and GPUs per
    node as the launcher options ``opts`` give them (``asked_nodes``: the nodes given on the command line). One rank
    per task; ``ep_size`` sets the nodes of a multi-task job (``opts`` is updated to match). Returns (nodes,
    tasks_per_node, gpus_per_node, world size)."""
    world = nodes * tpn
    if opts.get("gpus_per_task"):
        raise ConfigError("hydra.launcher.gpus_per_task gives each task only its own GPU, but backends such as DeepEP "
                          "need every GPU of the node visible to each task: set gpus_per_node and leave gpus_per_task "
                          "unset")
    if device == "cuda" and gpn < 1 and executor == "node":
        raise ConfigError("device=cuda but this machine has no GPU: run on the GPU machine, or plan its run from here "
                          "with hydra.launcher.gpus_per_node=<its GPUs> and hydra.launcher.dry_run=true (or use "
                          "device=cpu)")
    if device == "cuda" and gpn < 1:
        raise ConfigError("device=cuda but hydra.launcher.gpus_per_node is not set: set it to the GPUs per node (and "
                          "tasks_per_node to the same number), or use device=cpu")
    ep = config.ep_size
    if world > 1 and ep is not None and ep != world:
        # One rank per task: ep_size picks the job's layout (so ep_size=8,16,32,64 sweeps the node count).
        if ep % tpn == 0:
            nodes = ep // tpn
        elif ep < tpn:
            nodes, tpn = 1, ep
            gpn = ep if gpn else 0
        else:
            raise ConfigError(f"ep_size={ep} is not a multiple of hydra.launcher.tasks_per_node={tpn}: use a multiple "
                              f"of {tpn} (one rank per task, nodes = ep_size / tasks_per_node)")
        world = nodes * tpn
        opts.update(nodes=nodes, tasks_per_node=tpn, gpus_per_node=gpn or opts.get("gpus_per_node"))
    if asked_nodes is not None and nodes != asked_nodes:
        raise ConfigError(f"hydra.launcher.nodes={asked_nodes} conflicts with ep_size={ep}, which sets the nodes of "
                          f"a job (ep_size / tasks_per_node = {nodes}): give one of the two")
    rpg = config.ranks_per_gpu if device == "cuda" else 1
    if world > 1:
        if rpg > 1:
            raise ConfigError(f"ranks_per_gpu={rpg} runs its ranks as processes that one task spawns on its GPUs: set "
                              f"hydra.launcher.tasks_per_node=1 and hydra.launcher.nodes=1")
        if device == "cuda" and tpn != gpn:
            raise ConfigError(f"hydra.launcher.tasks_per_node={tpn} but gpus_per_node={gpn}: mokbench runs one rank "
                              f"per GPU, set hydra.launcher.tasks_per_node={gpn}")
        ws = world
    else:  # one task per job: it spawns its local ranks (harness.config.point.world_size_for)
        ws = ep or (gpn * rpg if device == "cuda" else 2)
        if device == "cuda" and gpus_needed(ws, rpg) > gpn:
            per = f" at ranks_per_gpu={rpg}" if rpg > 1 else ""
            raise ConfigError(f"ep_size={ws} needs {gpus_needed(ws, rpg)} GPUs{per} but a job gets {gpn} "
                              f"(hydra.launcher.gpus_per_node): set ep_size<={gpn * rpg}, or launch across nodes "
                              f"(hydra.launcher.nodes, tasks_per_node)")
    return nodes, tpn, gpn, ws


def check_launcher_options(opts: dict, executor: str) -> None:
    """Raise :class:`ConfigError` for a key the launcher does not take (added with ``+hydra.launcher.``) or a count
    below its least value (``LAUNCHER_MINIMA``)."""
    import difflib

    from harness.config.launcher_options import LAUNCHER_MINIMA, LAUNCHER_SCHEMAS, launcher_keys

    keys = launcher_keys(LAUNCHER_SCHEMAS[executor])
    for k in opts:
        if k not in keys and not k.startswith("_"):
            close = difflib.get_close_matches(k, keys, n=1, cutoff=0.7)
            hint = f" (did you mean hydra.launcher.{close[0]}?)" if close else ""
            raise ConfigError(f"unknown key 'hydra.launcher.{k}'{hint}; the keys of the mokbench_{executor} launcher: "
                              f"{', '.join(keys)}")
    fields = {f.name: f for f in dataclasses.fields(LAUNCHER_SCHEMAS[executor])}
    for k, least in LAUNCHER_MINIMA.items():
        v = opts.get(k)
        if k in fields and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < least):
            null = " (or null)" if "Optional" in str(fields[k].type) else ""
            raise ConfigError(f"hydra.launcher.{k} must be >= {least}{null} (got {v})")
