"""A sweep point, resolved: :func:`resolve` makes the composed configuration's ``auto`` choices for this machine and
types it, once (every check after reads the typed configuration), :func:`world_size_for` gives its rank count,
:class:`Point` carries it from the configuration to the runner, to every rank and into every row; :func:`make_case`
builds the :class:`~contract.case.Case` every backend sees, checked (:mod:`harness.config.validate`). Torch is
imported only where CUDA is asked about."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

from omegaconf import OmegaConf

from contract.case import Case
from contract.options import options_text
from harness.config import routing, validate
from harness.config.backend_options import apply_aliases, options_class
from harness.config.schema import (BenchConfig, PrecisionConfig, ShapeConfig, config_hash, load_group_option,
                                   point_config, schema, timing_label, to_container, workload_schema)


def resolve(cfg: Any) -> BenchConfig:
    """The composed configuration ``cfg`` (a DictConfig) as the typed configuration, once: the ``auto`` choices made
    for this machine on its plain values, then typed (:func:`typed_config`), checked
    (:func:`harness.config.validate.validate_run_options`) and its aliases put into the backends' options."""
    import torch

    c = to_container(cfg)
    device = c.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    validate.check_device(device, torch.cuda.is_available())
    c["device"] = device
    for group, on_gpu, on_cpu in (("shape", "kimi_k2_7", "tiny"), ("timing", "published", "quick")):
        if c[group].get("name") == "auto":
            chosen = to_container(load_group_option(group, on_gpu if device == "cuda" else on_cpu))
            # keep what the command line set; fill what `auto` left open
            c[group] = {k: (v if c[group].get(k, "???") in ("???", None) else c[group][k]) for k, v in chosen.items()}
            c[group]["name"] = chosen["name"]
    validate.check_complete(c)  # what typing needs: every value given
    config = typed_config(c)
    validate.validate_run_options(config)
    apply_aliases(config)
    config.timing.name = timing_label(config.timing)  # a preset's name only while its counts are the ones run
    return config


def world_size_for(config: BenchConfig, launched: Optional[int] = None) -> int:
    """The rank count of the configuration: ``launched`` where torchrun or Slurm set the ranks up; else ``ep_size``,
    or on a GPU every visible GPU times ``ranks_per_gpu`` (checked), or 2 ranks on a CPU."""
    if launched is not None:
        return launched
    if config.device == "cuda":
        import torch

        n, rpg = torch.cuda.device_count(), config.ranks_per_gpu
        ws = config.ep_size or n * rpg
        validate.check_gpus(ws, rpg, n)
        return ws
    return config.ep_size or 2


def make_case(config: Any, *, ep_size: int, device: str) -> Case:
    """The :class:`Case` of a configuration on ``ep_size`` ranks of ``device``, checked (raises
    :class:`~harness.core.errors.ConfigError`). ``config``: the typed configuration (:func:`resolve`, a
    :class:`Point`'s), read as it is; or plain values (a row's stored ``point_config``, a tool's composed config),
    whose shape, workload and precision are typed first."""
    if not isinstance(config, BenchConfig):
        config = _typed_parts(config)
    shape, wl, prec = config.shape, config.workload, config.precision
    validate.check_local_experts(shape)
    local = shape.local_experts
    num_experts = local * ep_size if local else shape.num_experts
    compile_ = config.compile
    if compile_ is None:
        compile_ = device == "cuda"
    case = Case(
        shape=shape.name + (f"@{local}epg" if local else ""),
        num_experts=num_experts,
        local_experts=num_experts // ep_size if ep_size > 0 else 0,
        hidden=shape.hidden,
        ffn=shape.ffn,
        topk=shape.topk,
        shared_expert=bool(shape.shared_expert),
        swiglu_limit=shape.swiglu_limit,
        experts_override=bool(local),
        published_local_experts=shape.published_local_experts,
        tokens_per_gpu=wl.tokens_per_gpu,
        seed=wl.seed,
        routing=wl.routing,
        zipf_exponent=wl.zipf_exponent,
        hot_fraction=wl.hot_fraction,
        hot_ratio=wl.hot_ratio,
        hot_rank=wl.hot_rank,
        routing_params=routing.case_routing_params(wl),
        routing_steps=wl.steps,
        precision=prec.name,
        act_block=prec.act_block,
        weight_block=prec.weight_block,
        atol=prec.atol,
        rtol=prec.rtol,
        ep_size=ep_size,
        device=device,
        compile=bool(compile_),
        compile_mode=config.compile_mode,
        comm_sms=config.comm_sms,
    )
    validate.validate_case(case)
    return case


def _typed_parts(values: Any) -> SimpleNamespace:
    """What :func:`make_case` reads of plain configuration values (a dict or DictConfig, possibly partial: a row's
    stored ``point_config`` holds no timing): the shape, workload and precision as their schemas' instances (a
    workload stored before a parameter existed gets its default), and the top-level keys a Case takes."""
    c = to_container(values)

    def typed(cls: type, node: dict) -> Any:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in node.items() if k in known})

    return SimpleNamespace(shape=typed(ShapeConfig, c["shape"]), workload=typed(workload_schema(), c["workload"]),
                           precision=typed(PrecisionConfig, c["precision"]), compile=c.get("compile"),
                           compile_mode=c.get("compile_mode", "default"), comm_sms=c.get("comm_sms"))


def typed_config(c: dict) -> BenchConfig:
    """The resolved configuration ``c`` as an instance of the configuration's schema
    (:func:`harness.config.schema.schema`: nested dataclasses, the backends' options among them), its values checked
    against the schema's types."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema()), c))


# Case fields that the row does not take from the point: the routing's parameters are in its label (`routing`; a
# trace's folder is in `point_config`), the scale blocks in `scaling`, and `device`, `compile` and `compile_mode` are
# columns the environment or the backend fills (what ran, not what was asked)
_CASE_NOT_IN_ROWS = ("zipf_exponent", "hot_fraction", "hot_ratio", "hot_rank", "routing_params", "act_block",
                     "weight_block", "device", "compile", "compile_mode", "routing")


@dataclass(frozen=True)
class Point:
    """One sweep point, resolved and checked: what the runner runs, what its ranks get (it pickles: the typed
    configuration's classes are importable, :func:`harness.config.schema.schema`) and what every row of it records.

    ``config``: the configuration, typed (an instance of :func:`harness.config.schema.schema`; the runner reads
    ``point.config.timing.num_iters``, ``point.config.backends``, ...); ``case``: what every backend sees;
    ``config_hash``: the point's identity (:func:`harness.config.schema.config_hash`); ``point_config``: what every
    row records of the configuration (:func:`harness.config.schema.point_config`, JSON). The hash and the rows read
    the configuration's plain values, taken once, when the point is built."""

    config: BenchConfig
    case: Case
    config_hash: str
    point_config: str

    @classmethod
    def build(cls, config: Any, *, ep_size: int, device: str) -> "Point":
        """The point of the configuration ``config`` on ``ep_size`` ranks of ``device``: the typed configuration
        (:func:`resolve`), taken as it is, or the plain values of a resolved one (a Slurm plan's point file), typed
        first. Raises :class:`~harness.core.errors.ConfigError`."""
        if not isinstance(config, BenchConfig):
            config = typed_config(to_container(config))
        case = make_case(config, ep_size=ep_size, device=device)
        values = dataclasses.asdict(config)
        return cls(config, case, config_hash(values, case),
                   json.dumps(point_config(values), sort_keys=True, separators=(",", ":")))

    def as_dict(self) -> dict:
        """The configuration as plain values (what a Slurm plan's point file and a row's ``point_config`` hold)."""
        return dataclasses.asdict(self.config)

    def options(self, backend: str) -> Any:
        """The options ``backend`` runs with, as the typed configuration holds them (None: it declares none)."""
        return getattr(self.config, backend) if options_class(backend) is not None else None

    def options_text(self, backend: str) -> Optional[str]:
        """What a row of ``backend`` records in ``backend_options`` (None: it takes no options)."""
        options = self.options(backend)
        return None if options is None else options_text(options)

    @property
    def ranks_per_gpu(self) -> int:
        """Ranks that share each GPU (above 1 on CUDA only: harness.config.validate refuses it elsewhere)."""
        return self.config.ranks_per_gpu

    def columns(self) -> dict[str, Any]:
        """The columns every row of the point shares, from the point alone: the case's fields under their own names
        (but ``_CASE_NOT_IN_ROWS``), the routing's label, the timing preset, the point's configuration, and what
        marks a row of ranks that shared a GPU or of an appended run."""
        case, cfg = self.case, self.config
        out = {f.name: getattr(case, f.name) for f in dataclasses.fields(case) if f.name not in _CASE_NOT_IN_ROWS}
        out.update(routing=routing.label(case), timing_preset=cfg.timing.name, l2_flush=cfg.timing.l2_flush,
                   align=cfg.timing.align, appended=bool(cfg.append), point_config=self.point_config)
        if self.ranks_per_gpu > 1:  # a correctness check, kept out of every speed table
            out.update(shared_gpu=True, ranks_per_gpu=self.ranks_per_gpu)
        return out
