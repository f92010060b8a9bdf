"""Typed configuration for one mokbench sweep point.

Every Hydra group (``shape``, ``workload``, ``precision``, ``timing``) has a dataclass schema registered in the
ConfigStore as ``<group>/base_<group>``; the YAML files under ``configs/<group>/`` extend it. ``backend`` and
``direction`` groups set the ``backends`` / ``directions`` lists, so one process can run several backends and
directions on identical inputs (``backends=[nccl,deepep]``) while multirun sweeps either axis.

Checks that can be made from the configuration alone live in :func:`validate` and raise :class:`ConfigError`
with a message that says what to change; the CLI turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf

from contract.case import FP8_GEMMS, Case  # noqa: F401 (Case re-exported: make_case builds it)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"

PRECISIONS = ("bf16", "fp8", "mxfp8")
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
ROUTINGS = ("uniform", "zipf", "hot_experts", "hot_rank")
DEVICES = ("auto", "cpu", "cuda")
# Transformer Engine fp8 recipe for the TE-based backends (deepep_te, hybridep_megatron) at precision=fp8, in
# Megatron's names: blockwise = Float8BlockScaling (the harness format: 1x128 activation, 128x128 weight blocks),
# tensorwise = Float8CurrentScaling, delayed = DelayedScaling. Recorded in those rows' `scaling` column.
TE_FP8_RECIPES = ("blockwise", "tensorwise", "delayed")
# fp8 GEMMs of the PyTorch-expert baselines at precision=fp8: FP8_GEMMS (contract/case.py, the one table of names).
# What mok_hopper's forward keeps for its backward (kernels/mok_hopper/train.py): save_h = X and the pre-SwiGLU
# gate/up output H (SonicMoE's choice, the default), recompute = X only (the backward recomputes H: one more read of
# the gate/up weights), inference = nothing (the forward-only layer; its backward rows are unsupported).
MOK_HOPPER_FORWARDS = ("save_h", "recompute", "inference")
# torch.compile modes, and "published": each PyTorch baseline's mode in the published scripts (nccl max-autotune,
# DeepEP / HybridEP max-autotune-no-cudagraphs)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "published")


class ConfigError(ValueError):
    """A configuration that can never run. The message names the fix."""


@dataclass(kw_only=True)
class ShapeConfig:
    """One MoE layer shape. ``num_experts`` is the global routed expert count."""

    name: str = MISSING
    num_experts: int = MISSING
    hidden: int = MISSING
    ffn: int = MISSING
    topk: int = MISSING
    shared_expert: bool = True
    swiglu_limit: Optional[float] = None
    # Keep hidden/ffn/topk but place this many experts on each GPU (num_experts becomes local_experts * ep_size).
    local_experts: Optional[int] = None
    # Experts per GPU in the published EP=64 run (informational; recorded in rows).
    published_local_experts: Optional[int] = None
    # How reports and tools show the shape (shape_table): its place in the published figure's order (None: after
    # the ordered shapes, by name) and its display name (None: the config name). Not part of the sweep point: left
    # out of config_hash.
    display_order: Optional[int] = None
    label: Optional[str] = None


@dataclass(kw_only=True)
class WorkloadConfig:
    name: str = "uniform"
    tokens_per_gpu: int = 2048
    seed: int = 1234
    routing: str = "uniform"  # uniform | zipf | hot_experts | hot_rank
    zipf_exponent: float = 1.0
    hot_fraction: float = 0.125  # hot_experts: fraction of experts that are hot
    hot_ratio: float = 4.0  # hot_experts / hot_rank: load weight of a hot expert relative to a cold one
    hot_rank: int = 0  # hot_rank: the rank whose experts are hot (hot_ratio=0: idle, its experts get no token)


@dataclass(kw_only=True)
class PrecisionConfig:
    name: str = "bf16"  # bf16 | fp8 (Hopper e4m3, 1x128 / 128x128 block scales) | mxfp8 (Blackwell, 1x32 e8m0)
    act_block: int = 128  # activation scale block (1 x act_block)
    weight_block: int = 128  # weight scale block (weight_block x weight_block)
    atol: float = 0.5  # abs-max tolerance against the bf16 reference
    rtol: float = 0.01  # relative-L1 tolerance against the bf16 reference


@dataclass(kw_only=True)
class TimingConfig:
    """Iteration counts and alignment. The presets (configs/timing/*.yaml) set every field; ``auto`` sets none
    (None: OmegaConf does not let a ``???`` in a YAML file override a schema default, so ``auto`` used to inherit
    the defaults here), and :func:`harness.runner.resolve` fills what the command line left unset from the
    machine's preset."""

    name: str = "quick"
    num_warmup: Optional[int] = None
    num_iters: Optional[int] = None
    l2_flush: Optional[bool] = None
    align: Optional[str] = None  # barrier: aligning collective before each iteration | none
    phase_iters: Optional[int] = None  # iterations for per-phase (dispatch / combine) bandwidth timing; 0 disables


@dataclass(kw_only=True)
class BenchConfig:
    shape: ShapeConfig = MISSING
    workload: WorkloadConfig = MISSING
    precision: PrecisionConfig = MISSING
    timing: TimingConfig = MISSING
    backends: list[str] = field(default_factory=lambda: ["nccl"])
    # the order the backends run in, one after the other on the same GPUs: given | reverse | shuffle (seeded by
    # workload.seed); each row records its place (backend_position), to check that the order changes no verdict
    backend_order: str = "given"
    directions: list[str] = field(default_factory=lambda: ["fwd", "bwd"])
    device: str = "auto"  # auto | cpu | cuda
    ep_size: Optional[int] = None  # None: all local GPUs (cuda) or 2 ranks (cpu); ignored under torchrun/Slurm
    # ranks that share one GPU (cuda only). Above 1 the ranks talk over gloo with host staging and the run checks
    # correctness only: rows are `ok` or not against the reference, untimed, marked `shared_gpu`; only backends
    # that declare `runs_shared_gpu` run, the others give `unsupported` rows (docs/configuration.md)
    ranks_per_gpu: int = 1
    # spawned ranks still running this long after their start are killed and their missing rows written as
    # `timeout` (a hang inside a GPU kernel never reaches dist_timeout_s); None: no watchdog, or 900 s when
    # ranks_per_gpu > 1
    watchdog_s: Optional[int] = None
    compile: Optional[bool] = None  # torch.compile the compute parts: None = on for cuda, off for cpu
    compile_mode: str = "max-autotune-no-cudagraphs"
    comm_sms: Optional[int] = None  # SMs for communication kernels, for backends that take it (None: its default)
    te_fp8_recipe: str = "blockwise"  # fp8 recipe of the TE-based backends (TE_FP8_RECIPES); others ignore it
    fp8_gemm: str = "auto"  # fp8 GEMMs of the PyTorch-expert baselines (FP8_GEMMS); others ignore it
    mok_hopper_forward: str = "save_h"  # what mok_hopper's forward saves for the backward (MOK_HOPPER_FORWARDS)
    check: bool = True  # correctness gate against the reference before timing
    time_reference: bool = False  # the reference is not a contender; time it only when asked
    # rows of one run share it, and go to <results_dir>/<run_id>/; a name (letters, digits, '.', '_', '-'), never a
    # path; None: generated per process tree. A run id whose folder already holds rows is refused unless `append`.
    run_id: Optional[str] = None
    # add this run's rows to a run folder that already holds rows (the same run_id, on purpose: a script that runs
    # one run in several calls); rows record it in `appended`. Without it a taken run_id is refused.
    append: bool = False
    results_dir: str = "results/local"  # a user's own runs (ignored by git); results/runs holds the committed ones
    results_format: str = "csv"  # csv | parquet
    calibrate: bool = False  # measure GEMM / HBM / interconnect rates and write calibration rows
    print_table: bool = True
    # a rank stuck in a collective this long fails; the launcher then writes its rows (1 s to a year)
    dist_timeout_s: int = 600
    # a backend whose setup (construction, compiles, autotuning) runs longer becomes a `timeout` row and the point
    # goes on with the next backend; None: no limit (runner.time_limit says what it can interrupt)
    setup_timeout_s: Optional[float] = None
    # a folder: each backend's setup (construction, setup, checked first call: what setup_s holds) under cProfile,
    # one <run>-<point>-<backend>-rank<r>.prof / .txt a rank (harness/setup_profile.py); None: off
    profile_setup_dir: Optional[str] = None


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=BenchConfig)
    cs.store(group="shape", name="base_shape", node=ShapeConfig)
    cs.store(group="workload", name="base_workload", node=WorkloadConfig)
    cs.store(group="precision", name="base_precision", node=PrecisionConfig)
    cs.store(group="timing", name="base_timing", node=TimingConfig)
    # backend=<key> for every key of the registry (harness/backends.py), no file per backend: the same as
    # backends=[<key>]
    from harness.backends import BACKENDS

    for key in BACKENDS:
        cs.store(group="backend", name=key, node={"backends": [key]}, package="_global_")


def load_group_option(group: str, name: str) -> DictConfig:
    """Load ``configs/<group>/<name>.yaml`` merged onto its schema (used to resolve ``auto`` choices)."""
    schema = {
        "shape": ShapeConfig,
        "workload": WorkloadConfig,
        "precision": PrecisionConfig,
        "timing": TimingConfig,
    }[group]
    path = CONFIG_DIR / group / f"{name}.yaml"
    if not path.exists():
        options = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml") if p.stem != "auto")
        raise ConfigError(f"unknown {group} '{name}'; choose one of: {', '.join(options)}")
    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    return OmegaConf.merge(OmegaConf.structured(schema), raw)


# The fields of a timing preset its name stands for in a row's `timing_preset` (phase_iters only times the
# per-phase bandwidth columns).
TIMING_PRESET_FIELDS = ("num_warmup", "num_iters", "l2_flush", "align")


# ShapeConfig fields that only say how a shape is shown: config_hash leaves them out
SHAPE_DISPLAY_FIELDS = ("display_order", "label")


def shape_table() -> dict[str, dict[str, Any]]:
    """Every named shape (``configs/shape/*.yaml`` but ``auto`` and ``custom``) as name -> its config dict, in
    display order: the shapes with a ``display_order`` by it, then the others by name. The one table of shapes:
    the report's order and labels and the published shapes of the benchmark tools come from it."""
    shapes = {p.stem: to_container(load_group_option("shape", p.stem))
              for p in sorted((CONFIG_DIR / "shape").glob("*.yaml")) if p.stem not in ("auto", "custom")}
    return dict(sorted(shapes.items(), key=lambda kv: (kv[1]["display_order"] is None,
                                                       kv[1]["display_order"] or 0, kv[0])))


def timing_label(timing: dict) -> str:
    """What a row's ``timing_preset`` says: the preset's name while the timing is that preset's, else ``custom``
    (e.g. ``timing=published timing.num_warmup=20 timing.num_iters=50`` is not the published 500 / 100 timing;
    the ``num_warmup`` / ``num_iters`` columns say what ran)."""
    name = timing.get("name")
    if not (CONFIG_DIR / "timing" / f"{name}.yaml").exists() or name == "auto":
        return str(name)
    preset = to_container(load_group_option("timing", str(name)))
    return str(name) if all(timing.get(k) == preset[k] for k in TIMING_PRESET_FIELDS) else "custom"


RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]+")


def check_run_id(run_id: Any, source: str = "run_id") -> None:
    """Raise :class:`ConfigError` unless ``run_id`` is a name (letters, digits, ``.``, ``_``, ``-``; not ``.`` or
    ``..``): the run's rows go to ``<results_dir>/<run_id>/``, so a path would write them elsewhere."""
    if run_id is None or run_id == "":
        return
    rid = str(run_id)
    if not RUN_ID_PATTERN.fullmatch(rid) or rid in (".", ".."):
        raise ConfigError(f"{source}={rid} is not a run name: use letters, digits, '.', '_' and '-' only (no '/', not "
                          f"'.' or '..'); the rows go to <results_dir>/<run_id>/")


def given_run_id(c: Any) -> tuple[Optional[str], str]:
    """The run id given for this run and where it came from: ``run_id=`` (the config), else ``MOKBENCH_RUN_ID`` (the
    environment), else (None, ""): the run gets a new one."""
    if c.get("run_id"):
        return str(c.get("run_id")), "run_id"
    if os.environ.get("MOKBENCH_RUN_ID"):
        return os.environ["MOKBENCH_RUN_ID"], "MOKBENCH_RUN_ID"
    return None, ""


def run_id_for_sweep(cfg: DictConfig) -> None:
    """Jobs of one multirun share a run_id (from the sweep folder) unless one was given (``run_id=`` or
    ``MOKBENCH_RUN_ID``, checked to be a name): sets ``cfg.run_id`` inside a Hydra multirun job, leaves it alone
    elsewhere. The Hydra main calls it for each job; the sweep checks (harness.cli, harness.slurm) call it to validate
    the job as it will run."""
    rid, source = given_run_id(cfg)
    if rid is not None:
        check_run_id(rid, source)
        return
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            cfg.run_id = "sweep-" + "".join(ch for ch in hc.sweep.dir if ch.isalnum())[-14:]
    except ValueError:
        pass


def to_container(cfg: Any) -> dict:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return dict(cfg)




def make_case(cfg: Any, *, ep_size: int, device: str) -> Case:
    """Resolve a composed config into a :class:`Case` and validate it (raises :class:`ConfigError`)."""
    c = to_container(cfg)
    shape, wl, prec = c["shape"], c["workload"], c["precision"]
    local = shape.get("local_experts")
    if local is not None and local < 1:
        raise ConfigError(f"shape.local_experts must be >= 1 (got {local}): the experts on each GPU; leave it unset "
                          f"(shape.local_experts=null) for the shape's own {shape['num_experts']} experts")
    num_experts = local * ep_size if local else shape["num_experts"]
    compile_ = c.get("compile")
    if compile_ is None:
        compile_ = device == "cuda"
    case = Case(
        shape=shape["name"] + (f"@{local}epg" if local else ""),
        num_experts=num_experts,
        local_experts=num_experts // ep_size if ep_size > 0 else 0,
        hidden=shape["hidden"],
        ffn=shape["ffn"],
        topk=shape["topk"],
        shared_expert=bool(shape["shared_expert"]),
        swiglu_limit=shape.get("swiglu_limit"),
        experts_override=bool(local),
        published_local_experts=shape.get("published_local_experts"),
        tokens_per_gpu=wl["tokens_per_gpu"],
        seed=wl["seed"],
        routing=wl["routing"],
        zipf_exponent=wl["zipf_exponent"],
        hot_fraction=wl["hot_fraction"],
        hot_ratio=wl["hot_ratio"],
        hot_rank=wl["hot_rank"],
        precision=prec["name"],
        act_block=prec["act_block"],
        weight_block=prec["weight_block"],
        atol=prec["atol"],
        rtol=prec["rtol"],
        ep_size=ep_size,
        device=device,
        compile=bool(compile_),
        compile_mode=c.get("compile_mode", "default"),
        comm_sms=c.get("comm_sms"),
        te_fp8_recipe=c.get("te_fp8_recipe", "blockwise"),
        fp8_gemm=c.get("fp8_gemm", "auto"),
        mok_hopper_forward=c.get("mok_hopper_forward", "save_h"),
    )
    validate_case(case)
    return case


def validate_case(case: Case) -> None:
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
    need(case.routing in ROUTINGS, f"unknown workload.routing '{case.routing}'; choose one of: {', '.join(ROUTINGS)}")
    if case.routing == "hot_rank":
        need(
            0 <= case.hot_rank < case.ep_size,
            f"workload.hot_rank={case.hot_rank} is not a rank of ep_size={case.ep_size}: use 0..{case.ep_size - 1}",
        )
    if case.routing == "hot_experts":
        need(case.hot_ratio > 0, f"workload.hot_ratio must be > 0 (got {case.hot_ratio})")
    if case.routing == "hot_rank":  # hot_ratio=0: an idle rank, whose experts get no token
        need(case.hot_ratio >= 0, f"workload.hot_ratio must be >= 0 (0: an idle rank) (got {case.hot_ratio})")
        need(case.hot_ratio > 0 or case.topk <= case.num_experts - case.local_experts,
             f"workload.hot_ratio=0 leaves {case.num_experts - case.local_experts} experts to route to, fewer than "
             f"top-{case.topk}: use more ranks or a hot_ratio > 0")
    if case.routing == "hot_experts":
        need(0 < case.hot_fraction <= 1, f"workload.hot_fraction must be in (0, 1] (got {case.hot_fraction})")
    if case.routing == "zipf":
        need(case.zipf_exponent >= 0, f"workload.zipf_exponent must be >= 0 (got {case.zipf_exponent})")
    need(
        case.swiglu_limit is None or case.swiglu_limit > 0,
        f"shape.swiglu_limit must be positive or null (got {case.swiglu_limit})",
    )
    need(case.device in ("cpu", "cuda"), f"device must be cpu or cuda (got {case.device})")
    if case.comm_sms is not None:
        need(case.comm_sms > 0 and case.comm_sms % 2 == 0, f"comm_sms must be a positive even number (got {case.comm_sms})")
    need(not case.compile or case.compile_mode in COMPILE_MODES,
         f"unknown compile_mode '{case.compile_mode}'; choose one of: {', '.join(COMPILE_MODES)} (or compile=false)")
    need(case.te_fp8_recipe in TE_FP8_RECIPES,
         f"unknown te_fp8_recipe '{case.te_fp8_recipe}'; choose one of: {', '.join(TE_FP8_RECIPES)}")
    need(case.fp8_gemm in FP8_GEMMS, f"unknown fp8_gemm '{case.fp8_gemm}'; choose one of: {', '.join(FP8_GEMMS)}")
    need(case.mok_hopper_forward in MOK_HOPPER_FORWARDS, f"unknown mok_hopper_forward '{case.mok_hopper_forward}'; "
                                                         f"choose one of: {', '.join(MOK_HOPPER_FORWARDS)}")


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


BACKEND_ORDERS = ("given", "reverse", "shuffle")


def backend_order(backends: list[str], order: str, seed: int) -> list[str]:
    """The backends in the order they run (``BACKEND_ORDERS``; shuffle is the same on every rank for one seed)."""
    if order == "reverse":
        return list(reversed(backends))
    if order == "shuffle":
        import random

        out = list(backends)
        random.Random(seed).shuffle(out)
        return out
    return list(backends)


def validate_run_options(c: dict) -> None:
    """Checks on the run-level options (backends, directions, timing, device)."""
    from harness.backends import BACKENDS

    missing = [f"{g}.{k}" for g in ("shape", "workload", "precision", "timing") for k, v in c[g].items() if v == "???"]
    missing += [k for k, v in c.items() if v == "???"]
    if missing:
        name = c["shape"].get("name", "")
        example = (" (e.g. shape=custom shape.num_experts=64 shape.hidden=4096 shape.ffn=1536 shape.topk=6)"
                   if name == "custom" and all(m.startswith("shape.") for m in missing) else "")
        raise ConfigError(f"{', '.join(missing)} not set: give {'it' if len(missing) == 1 else 'each'} a value on the "
                          f"command line{example}")
    if not c.get("backends"):
        raise ConfigError("no backend selected: set backend=<name> or backends=[a,b]")
    for b in c["backends"]:
        if b not in BACKENDS:
            raise ConfigError(f"unknown backend '{b}'; choose from: {', '.join(BACKENDS)}")
    if c.get("backend_order", "given") not in BACKEND_ORDERS:
        raise ConfigError(f"unknown backend_order '{c['backend_order']}'; choose one of: {', '.join(BACKEND_ORDERS)}")
    if not c.get("directions"):
        raise ConfigError("no direction selected: set direction=fwd|bwd|fwd_bwd or directions=[fwd,bwd]")
    for d in c["directions"]:
        if d not in DIRECTIONS:
            raise ConfigError(f"unknown direction '{d}'; choose from: {', '.join(DIRECTIONS)}")
    for k in TIMING_FIELDS:
        if c["timing"].get(k) is None:
            raise ConfigError(f"timing.{k} is not set: give it a value (timing.{k}=...) or pick a timing preset "
                              f"(timing=quick, timing=published)")
    if c["timing"]["align"] not in ("barrier", "none"):
        raise ConfigError(f"timing.align must be barrier or none (got {c['timing']['align']})")
    if c["device"] not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)} (got {c['device']})")
    if c["results_format"] not in ("csv", "parquet"):
        raise ConfigError(f"results_format must be csv or parquet (got {c['results_format']})")
    if c.get("compile_mode") not in COMPILE_MODES:  # checked with compile off too: it is recorded and swept
        raise ConfigError(f"unknown compile_mode '{c.get('compile_mode')}'; choose one of: {', '.join(COMPILE_MODES)}")
    check_run_id(*given_run_id(c))
    _check_shared_gpu(c)
    for key, low, high, closed, unit, null in NUMERIC_RANGES:
        value = _select(c, key)
        if value is None and null:
            continue
        if value is None or not (low <= value <= high) or (value == low and not closed):  # (NaN fails too)
            lo, hi = (str(int(v)) if float(v).is_integer() else f"{v:g}" for v in (low, high))
            span = (f"{'>=' if closed else '>'} {lo}" if high == _INF else
                    f"between {lo} and {hi}" if closed else f"> {lo} and <= {hi}")
            raise ConfigError(f"{key} must be {span}{unit}{f', or null for {null}' if null else ''} (got {value})")


def gpus_needed(ranks: int, ranks_per_gpu: int = 1) -> int:
    """The GPUs ``ranks`` ranks take, ``ranks_per_gpu`` of them to a GPU (consecutive ranks share one)."""
    return -(-ranks // ranks_per_gpu)


def _check_shared_gpu(c: dict) -> None:
    """What ``ranks_per_gpu`` > 1 needs: a GPU, the reference check (it is the whole point of such a run), and no
    calibration (gloo over the host has no interconnect rate to measure)."""
    rpg = c.get("ranks_per_gpu", 1)
    if not isinstance(rpg, int) or rpg <= 1:
        return
    if c["device"] != "cuda":
        raise ConfigError(f"ranks_per_gpu={rpg} puts several ranks on one GPU, and this run has none "
                          f"(device={c['device']}): drop ranks_per_gpu (CPU ranks already share the machine)")
    if not c.get("check"):
        raise ConfigError(f"ranks_per_gpu={rpg} runs the reference check only (ranks that share a GPU time nothing): "
                          f"drop check=false")
    if c.get("calibrate"):
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


def _select(c: dict, key: str) -> Any:
    group, _, leaf = key.rpartition(".")
    return (c.get(group) or {}).get(leaf) if group else c.get(key)


# A config group whose option sets one key, and that key: given both on the command line, the key is merged last and
# the option would be dropped without a word, so different values are refused (the same value is fine).
OPTION_KEYS = {"backend": "backends", "direction": "directions", "precision": "precision.name",
               "workload": "workload.routing"}


def check_option_conflicts(c: dict, overrides: Sequence[str]) -> None:
    """Raise :class:`ConfigError` where the command line (``overrides``, one point's) picks a group option
    (``backend=mok_hopper``) and the composed config holds another value of the key that option sets
    (``backends=[nccl]``, given too or set by an experiment)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([o for o in overrides if "=" in o])
    given = {o.key_or_group: o for o in parsed if not o.is_delete()}
    for group, key in OPTION_KEYS.items():
        if group not in given or not isinstance(given[group].value(), str):
            continue
        option = str(given[group].value())
        want = _option_sets(group, option, key)
        got = _select(c, key)
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


# Fields that identify a measurement, not the run that made it (compare matches rows on this hash).
_HASH_EXCLUDE = {"run_id", "append", "dist_timeout_s", "watchdog_s", "setup_timeout_s", "profile_setup_dir",
                 "results_dir", "results_format", "print_table", "timing", "check", "calibrate", "time_reference",
                 "backends", "directions", "te_fp8_recipe", "backend_order", "fp8_gemm", "mok_hopper_forward"}


def config_hash(c: dict, case: Case) -> str:
    kept = {k: v for k, v in c.items() if k not in _HASH_EXCLUDE}
    if kept.get("ranks_per_gpu", 1) == 1:
        kept.pop("ranks_per_gpu", None)  # one rank per GPU: the points keep the hashes they had before the option
    if isinstance(kept.get("shape"), dict):  # how a shape is shown is not what ran
        kept["shape"] = {k: v for k, v in kept["shape"].items() if k not in SHAPE_DISPLAY_FIELDS}
    kept["case"] = dataclasses.asdict(case)
    if case.precision != "fp8" or case.te_fp8_recipe == "blockwise":
        # the recipe only changes fp8 measurements: the default (and every bf16/mxfp8 point) keeps the hash it had
        # before the option existed, so compare still matches those rows
        kept["case"].pop("te_fp8_recipe")
    if case.precision != "fp8":
        kept["case"].pop("fp8_gemm")  # only fp8 rows depend on it: bf16/mxfp8 points keep their hashes
    if case.mok_hopper_forward == "save_h":
        kept["case"].pop("mok_hopper_forward")  # the default keeps the hash the points had before the option
    blob = OmegaConf.to_yaml(OmegaConf.create(kept), sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]

