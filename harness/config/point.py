"""A sweep point, resolved: :func:`resolve` makes the configuration's ``auto`` choices for this machine and checks it,
:func:`world_size_for` gives its rank count, :class:`Point` carries it from the configuration to the runner and into
every row; :func:`make_case` builds the :class:`~contract.case.Case` every backend sees, checked
(:mod:`harness.config.validate`). Torch is imported only where CUDA is asked about."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf

from contract.case import Case
from contract.options import options_text
from harness.config import routing, validate
from harness.config.backend_options import apply_aliases, options_class
from harness.config.schema import config_hash, load_group_option, point_config, schema, timing_label, to_container


def resolve(cfg: Any) -> dict:
    """Plain dict of the config with the ``auto`` choices made for this machine, validated."""
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
    validate.validate_run_options(c)
    apply_aliases(c)
    c["timing"]["name"] = timing_label(c["timing"])  # a preset's name only while its counts are the ones run
    return c


def world_size_for(c: dict, launched: Optional[int] = None) -> int:
    """The rank count of the resolved config ``c``: ``launched`` where torchrun or Slurm set the ranks up; else
    ``ep_size``, or on a GPU every visible GPU times ``ranks_per_gpu`` (checked), or 2 ranks on a CPU."""
    if launched is not None:
        return launched
    if c["device"] == "cuda":
        import torch

        n, rpg = torch.cuda.device_count(), c.get("ranks_per_gpu", 1)
        ws = c.get("ep_size") or n * rpg
        validate.check_gpus(ws, rpg, n)
        return ws
    return c.get("ep_size") or 2


def make_case(cfg: Any, *, ep_size: int, device: str) -> Case:
    """Resolve a composed config into a :class:`Case` and validate it (raises :class:`~harness.core.errors.ConfigError`)."""
    c = to_container(cfg)
    shape, wl, prec = c["shape"], c["workload"], c["precision"]
    validate.check_local_experts(shape)
    local = shape.get("local_experts")
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
        routing_params=routing.case_routing_params(wl),
        routing_steps=wl.get("steps", routing.STEPS_DEFAULT),
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
    )
    validate.validate_case(case)
    return case


def typed_config(c: dict) -> Any:
    """The resolved configuration ``c`` as an instance of the configuration's schema (:func:`harness.config.schema.schema`:
    nested dataclasses, the backends' options among them), its values checked against the schema's types."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema()), c))


# Case fields that the row does not take from the point: the routing's parameters are in its label (`routing`; a
# trace's folder is in `point_config`), the scale blocks in `scaling`, and `device`, `compile` and `compile_mode` are
# columns the environment or the backend fills (what ran, not what was asked)
_CASE_NOT_IN_ROWS = ("zipf_exponent", "hot_fraction", "hot_ratio", "hot_rank", "routing_params", "act_block",
                     "weight_block", "device", "compile", "compile_mode", "routing")


@dataclass(frozen=True)
class Point:
    """One sweep point, resolved and checked: what the runner runs and what every row of it records.

    ``config``: the configuration, typed (an instance of :func:`harness.config.schema.schema`; the runner reads
    ``point.config.timing.num_iters``, ``point.config.backends``, ...); ``case``: what every backend sees;
    ``config_hash``: the point's identity (:func:`harness.config.schema.config_hash`)."""

    config: Any
    case: Case
    config_hash: str

    @classmethod
    def build(cls, c: dict, *, ep_size: int, device: str) -> "Point":
        """The point of the resolved configuration ``c`` (``harness.config.point.resolve``) on ``ep_size`` ranks of
        ``device``. Raises :class:`~harness.core.errors.ConfigError`."""
        case = make_case(c, ep_size=ep_size, device=device)
        return cls(typed_config(c), case, config_hash(c, case))

    def as_dict(self) -> dict:
        """The configuration as plain values (what ranks and plans carry, and what the hash reads)."""
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
                   align=cfg.timing.align, appended=bool(cfg.append),
                   point_config=json.dumps(point_config(self.as_dict()), sort_keys=True, separators=(",", ":")))
        if self.ranks_per_gpu > 1:  # a correctness check, kept out of every speed table
            out.update(shared_gpu=True, ranks_per_gpu=self.ranks_per_gpu)
        return out
