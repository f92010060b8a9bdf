"""Typed configuration for one mokbench sweep point.

Every Hydra group (``shape``, ``workload``, ``precision``, ``timing``) has a dataclass schema registered in the
ConfigStore as ``<group>/base_<group>``; the YAML files under ``configs/<group>/`` extend it. ``backend`` and
``direction`` groups set the ``backends`` / ``directions`` lists, so one process can run several backends and
directions on identical inputs (``backends=[nccl,deepep]``) while multirun sweeps either axis.

The top-level schema (:func:`schema`) is :class:`BenchConfig` plus a node per backend that declares options, and their
aliases (harness/config/backend_options.py). This module also loads the group options, names timing presets and computes
a point's identity (:func:`config_hash`). Every check lives in :mod:`harness.config.validate` and raises
:class:`~harness.core.errors.ConfigError`, which names the fix; the CLI turns it into one line on stderr and
exit code 2.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from contract.case import Case
from harness.core.errors import ConfigError  # noqa: F401 (re-exported: the error every check raises)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"

PRECISIONS = ("bf16", "fp8", "mxfp8")
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
DEVICES = ("auto", "cpu", "cuda")
# torch.compile modes, and "published": each PyTorch baseline's mode in the published scripts (nccl max-autotune,
# DeepEP / HybridEP max-autotune-no-cudagraphs)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "published")


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
class WorkloadBase:
    """The workload's own fields; :func:`workload_schema` adds every routing model's parameters
    (harness/config/routing.py)."""

    name: str = "uniform"
    tokens_per_gpu: int = 2048
    seed: int = 1234
    routing: str = "uniform"  # a key of harness.config.routing.MODELS
    # routings per rank, cycled through warmup and timing: every timed iteration sees the next (1: one routing)
    steps: int = 1


@functools.cache
def workload_schema() -> type:
    """:class:`WorkloadBase` plus a field per routing model parameter (its default from the model): the ``workload``
    group's schema, importable as ``harness.config.schema.WorkloadConfig``. The parameters of the first four models:
    ``zipf_exponent``; ``hot_fraction`` (hot_experts: fraction of experts that are hot); ``hot_ratio`` (hot_experts /
    hot_rank: load weight of a hot expert relative to a cold one); ``hot_rank`` (the rank whose experts are hot;
    hot_ratio=0: idle, its experts get no token). The others: harness/config/routing_models.py."""
    from harness.config.routing import param_defaults, param_types

    types = param_types()
    fields = [(p, types[p], dataclasses.field(default=d)) for p, d in param_defaults().items()]
    cls = dataclasses.make_dataclass("WorkloadConfig", fields, bases=(WorkloadBase,), kw_only=True)
    cls.__module__, cls.__qualname__ = __name__, "WorkloadConfig"
    return cls


def rebuild_schemas() -> None:
    """Build the schemas again (after :func:`harness.config.routing.register` added a model with new parameters) and
    register them with Hydra."""
    workload_schema.cache_clear()
    schema.cache_clear()
    register_configs()


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
    the defaults here), and :func:`harness.config.point.resolve` fills what the command line left unset from the
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
    workload: Any = MISSING  # workload_schema() (schema() sets the type)
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
    # backends that run in processes of their own: a fresh set of ranks (the inputs and the reference made again,
    # from the same seed) for each, after the others; the rows say so. For anchors whose packages cannot share a
    # process with another's. A backend after which device memory did not come back sends the backends after it to
    # fresh processes too (harness/measure/runner.py)
    own_process: list[str] = field(default_factory=list)
    # backend -> folders put first on sys.path of its own processes (own_process), for a package installed apart
    own_pythonpath: dict[str, str] = field(default_factory=dict)
    compile: Optional[bool] = None  # torch.compile the compute parts: None = on for cuda, off for cpu
    compile_mode: str = "max-autotune-no-cudagraphs"
    comm_sms: Optional[int] = None  # SMs for communication kernels, for backends that take it (None: its default)
    # Each backend's own options are nodes under its key (nccl.fp8_gemm=rowwise, mok_hopper.forward=recompute), and
    # their aliases top-level keys (fp8_gemm=rowwise): the fields that schema() adds from the backends' declarations
    # (harness/config/backend_options.py)
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
    # one <run>-<point>-<backend>-rank<r>.prof / .txt a rank (harness/measure/setup_profile.py); None: off
    profile_setup_dir: Optional[str] = None


@functools.cache
def schema() -> type:
    """:class:`BenchConfig` with the backends' options (a node per backend that declares any) and their aliases: the
    configuration's schema (Hydra's ``base_config``), and the type of a point's typed configuration."""
    from harness.config.backend_options import schema_fields

    fields = [("workload", workload_schema(), dataclasses.field(default=MISSING)), *schema_fields()]
    cls = dataclasses.make_dataclass("MokbenchConfig", fields, bases=(BenchConfig,), kw_only=True)
    # importable as harness.config.schema.MokbenchConfig (module __getattr__ below): a composed config pickled into a
    # sweep's job and back (submitit's cloudpickle) then refers to this class instead of copying it, since a copied
    # dataclass loses dataclasses.MISSING and OmegaConf can no longer read its defaults
    cls.__module__, cls.__qualname__ = __name__, "MokbenchConfig"
    return cls


def __getattr__(name: str) -> Any:
    if name == "MokbenchConfig":
        return schema()
    if name == "WorkloadConfig":
        return workload_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=schema())
    cs.store(group="shape", name="base_shape", node=ShapeConfig)
    cs.store(group="workload", name="base_workload", node=workload_schema())
    cs.store(group="precision", name="base_precision", node=PrecisionConfig)
    cs.store(group="timing", name="base_timing", node=TimingConfig)
    # backend=<key> for every key of the registry (harness/core/backends.py), no file per backend: the same as
    # backends=[<key>]
    from harness.core.backends import BACKENDS

    for key in BACKENDS:
        cs.store(group="backend", name=key, node={"backends": [key]}, package="_global_")


def load_group_option(group: str, name: str) -> DictConfig:
    """Load ``configs/<group>/<name>.yaml`` merged onto its schema (used to resolve ``auto`` choices)."""
    schema = {
        "shape": ShapeConfig,
        "workload": workload_schema(),
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


def timing_label(timing: TimingConfig) -> str:
    """What a row's ``timing_preset`` says: the preset's name while the timing is that preset's, else ``custom``
    (e.g. ``timing=published timing.num_warmup=20 timing.num_iters=50`` is not the published 500 / 100 timing;
    the ``num_warmup`` / ``num_iters`` columns say what ran)."""
    name = timing.name
    if not (CONFIG_DIR / "timing" / f"{name}.yaml").exists() or name == "auto":
        return str(name)
    preset = load_group_option("timing", str(name))
    return str(name) if all(getattr(timing, k) == preset[k] for k in TIMING_PRESET_FIELDS) else "custom"


def to_container(cfg: Any) -> dict:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return dict(cfg)



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


def gpus_needed(ranks: int, ranks_per_gpu: int = 1) -> int:
    """The GPUs ``ranks`` ranks take, ``ranks_per_gpu`` of them to a GPU (consecutive ranks share one)."""
    return -(-ranks // ranks_per_gpu)


# Fields that identify a measurement, not the run that made it (compare matches rows on this hash).
_HASH_EXCLUDE = {"run_id", "append", "dist_timeout_s", "watchdog_s", "setup_timeout_s", "profile_setup_dir",
                 "results_dir", "results_format", "print_table", "timing", "check", "calibrate", "time_reference",
                 "backends", "directions", "backend_order", "own_process", "own_pythonpath"}


def point_config(c: dict) -> dict:
    """What of the resolved configuration ``c`` identifies the point: all but how the run went (``_HASH_EXCLUDE``).
    Rows record it (``point_config``, JSON); with the row's ``ep_size`` and ``device`` it gives back the point's
    ``Case`` and ``config_hash``."""
    return {k: v for k, v in c.items() if k not in _HASH_EXCLUDE}


def config_hash(c: Any, case: Case) -> str:
    """The point's identity: the resolved configuration ``c`` and its ``case``, without what only says how the run
    went (``_HASH_EXCLUDE``) or how a shape is shown, and with the backends' options where they can change a
    measurement (:func:`harness.config.backend_options.hash_entries`). ``c``: the typed configuration, or its plain
    values (a row's stored ``point_config``): the hash reads plain values. Points measured before an option existed
    keep their hashes (tests/test_config_hash.py recomputes the committed rows' hashes)."""
    from harness.config.backend_options import HASH_KEY, config_keys, hash_entries
    from harness.config.routing import hash_workload

    if isinstance(c, BenchConfig):
        c = dataclasses.asdict(c)
    kept = {k: v for k, v in point_config(c).items() if k not in config_keys()}
    if kept.get("ranks_per_gpu", 1) == 1:
        kept.pop("ranks_per_gpu", None)  # one rank per GPU: the points keep the hashes they had before the option
    if isinstance(kept.get("shape"), dict):  # how a shape is shown is not what ran
        kept["shape"] = {k: v for k, v in kept["shape"].items() if k not in SHAPE_DISPLAY_FIELDS}
    kept["case"] = dataclasses.asdict(case)
    # what came after the first routing models: only where not at its default; a trace's folder never (its digest is
    # its identity)
    if isinstance(kept.get("workload"), dict):
        kept["workload"] = dict(kept["workload"])
        hash_workload(kept["workload"], kept["case"])
    else:
        hash_workload({}, kept["case"])
    by_alias, scoped = hash_entries(c, case.precision)
    kept["case"].update(by_alias)
    if scoped:
        kept[HASH_KEY] = scoped
    blob = OmegaConf.to_yaml(OmegaConf.create(kept), sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]
