"""The routing models' table and what the harness asks of it.

:data:`MODELS` is the one table of routing models (key -> class, :mod:`harness.config.routing_models`); each has a YAML
preset or more under ``configs/workload/``. Adding a model is one class there (or anywhere, through
:func:`register`) and one YAML file. The configuration's ``workload`` schema takes every model's parameters
(:func:`param_defaults`); the parameters that came after the first four models (``zipf_exponent``,
``hot_fraction``, ``hot_ratio``, ``hot_rank``, which are fields of the Case) ride in ``Case.routing_params`` and
enter a point's hash only where they are not at their default (:func:`hash_workload`), so every point measured
before they existed keeps its hash. So does ``workload.steps`` at 1. A model's ``unhashed`` parameters never enter
it: a replayed trace (``trace``) is identified by its digest, which its model adds to ``Case.routing_params``, not by
its folder.

``workload.steps`` = N draws N routings per rank (step s seeded ``seed + rank + s * STEP_SEED_STRIDE``; step 0 is
the one routing of N = 1), which the runner cycles through warmup and timing (harness/measure/runner.py).
"""

from __future__ import annotations

from typing import Any, Optional

from contract.case import Case
from harness.config import routing_models as rm
from harness.core.errors import ConfigError

MODELS: dict[str, type[rm.RoutingModel]] = {m.name: m for m in (
    rm.Uniform, rm.Zipf, rm.HotExperts, rm.HotRank, rm.RoundRobin, rm.HotSet, rm.Rotating, rm.Burst, rm.Incast,
    rm.Ragged, rm.Trace)}

# workload keys that are fields of the Case and always in a point's hash (the first four models' parameters)
CASE_PARAMS = ("zipf_exponent", "hot_fraction", "hot_ratio", "hot_rank")
# workload.steps: routings per rank, cycled through warmup and timing (1: one routing for the whole run)
STEPS_DEFAULT = 1


def register(model: type[rm.RoutingModel]) -> None:
    """Add ``model`` to the table (a plug-in model: its YAML preset sets ``routing: <its name>``). Its new parameters
    enter the configuration's schema when that is next built (:func:`harness.config.schema.rebuild_schemas`)."""
    for p, d in model.params.items():
        have = param_defaults().get(p, d)
        if have != d:
            raise ValueError(f"{model.name}: parameter {p} has default {d!r}, another model's is {have!r}")
    MODELS[model.name] = model


def param_defaults() -> dict[str, Any]:
    """Every model's parameters (workload keys) and their defaults, in table order."""
    out: dict[str, Any] = {}
    for m in MODELS.values():
        for p, d in m.params.items():
            out.setdefault(p, d)
    return out


def param_types() -> dict[str, Any]:
    """Every model's parameters and their schema types (a model's ``param_types``, else its default's type)."""
    out: dict[str, Any] = {}
    for m in MODELS.values():
        for p, d in m.params.items():
            out.setdefault(p, m.param_types.get(p, type(d)))
    return out


def unhashed() -> set[str]:
    """The parameters no point's hash holds (a trace's folder: its digest stands for it)."""
    return {p for m in MODELS.values() for p in m.unhashed}


def model(name: str) -> type[rm.RoutingModel]:
    if name not in MODELS:
        raise ConfigError(f"unknown workload.routing '{name}'; choose one of: {', '.join(MODELS)}")
    return MODELS[name]


def model_of(case: Case) -> type[rm.RoutingModel]:
    return model(case.routing)


def case_routing_params(wl: Any) -> tuple[tuple[str, Any], ...]:
    """What ``Case.routing_params`` holds for the workload ``wl`` (the typed workload,
    :func:`harness.config.schema.workload_schema`): the selected model's parameters beyond ``CASE_PARAMS``, as the
    model resolves them (:meth:`~harness.config.routing_models.RoutingModel.resolve`), sorted. Raises
    :class:`~harness.core.errors.ConfigError`."""
    m = MODELS.get(wl.routing)
    if m is None:
        return ()
    return tuple(sorted(m.resolve({p: getattr(wl, p, d) for p, d in m.params.items() if p not in CASE_PARAMS})
                        .items()))


def hash_workload(workload: dict, case: dict) -> None:
    """Drop, in place, from a point's hashed workload and case dicts what is at its default among what came after the
    first routing models: ``steps`` / ``routing_steps`` at 1, the new parameters at their defaults; and the
    parameters no hash holds (:func:`unhashed`)."""
    defaults, never = param_defaults(), unhashed()
    for p, d in defaults.items():
        if p not in CASE_PARAMS and (p in never or workload.get(p, d) == d):
            workload.pop(p, None)
    if workload.get("steps", STEPS_DEFAULT) == STEPS_DEFAULT:
        workload.pop("steps", None)
    if case.get("routing_steps", STEPS_DEFAULT) == STEPS_DEFAULT:
        case.pop("routing_steps", None)
    kept = [(p, v) for p, v in case.get("routing_params", ()) if p not in never and v != defaults.get(p)]
    if kept:
        case["routing_params"] = [list(pv) for pv in kept]
    else:
        case.pop("routing_params", None)


def label(case: Case) -> str:
    """The row's ``routing``: the model's label, with ``+<N>steps`` where N > 1 routings cycle."""
    base = model_of(case).label(case)
    return base if case.routing_steps == 1 else f"{base}+{case.routing_steps}steps"


def check(case: Case) -> None:
    """The model's checks and the steps' (raise :class:`~harness.core.errors.ConfigError`)."""
    m = model_of(case)
    if case.routing_steps < 1:
        raise ConfigError(f"workload.steps must be >= 1 (got {case.routing_steps})")
    m.check(case)


def unsupported(case: Case) -> Optional[str]:
    return model_of(case).unsupported(case)


def make_routing(case: Case, rank: int, step: int = 0):
    """Top-k expert ids [T, K] (int64) and router weights [T, K] (fp32) of ``rank`` at ``step``, on the CPU."""
    import torch

    idx, w = model_of(case).route(case, rank, step)
    assert idx.shape == w.shape == (case.tokens_per_gpu, case.topk), (case.routing, idx.shape, w.shape)
    return idx.to(torch.int64), w.to(torch.float32)


def make_steps(case: Case, rank: int):
    """Every step's routing of ``rank``: ids [N, T, K] and weights [N, T, K], on the CPU."""
    import torch

    parts = [make_routing(case, rank, s) for s in range(case.routing_steps)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def expert_popularity(case: Case, step: int = 0):
    """The model's popularity per global expert at ``step`` (None: it routes without one, as ``uniform`` does)."""
    return model_of(case).popularity(case, step)


def load_stats(topk_idx_all, case: Case) -> dict[str, float]:
    """Routing balance over all ranks' top-k ids: max/mean routed rows per expert and per destination rank."""
    import torch

    counts = torch.bincount(topk_idx_all.flatten().cpu(), minlength=case.num_experts).double()
    per_rank = counts.view(case.ep_size, case.local_experts).sum(1)
    return {
        "expert_load_max_over_mean": float(counts.max() / counts.mean()),
        "rank_load_max_over_mean": float(per_rank.max() / per_rank.mean()),
        "empty_experts": int((counts == 0).sum()),
    }


STAT_COLUMNS = ("expert_load_max_over_mean", "rank_load_max_over_mean", "empty_experts")


def step_stats(per_step: list[dict[str, float]]) -> dict[str, Any]:
    """A row's balance columns over N routings: each column the median over the steps (N = 1: the one routing's
    value) and, for N > 1, ``<column>_min`` / ``<column>_max``."""
    import statistics

    out: dict[str, Any] = {}
    for c in STAT_COLUMNS:
        vals = [s[c] for s in per_step]
        med = statistics.median_low(vals) if c == "empty_experts" else statistics.median(vals)
        out[c] = med
        if len(vals) > 1:
            out[f"{c}_min"], out[f"{c}_max"] = min(vals), max(vals)
    return out


def checked_steps(per_step: list[dict[str, float]], device: str) -> list[int]:
    """The routing steps the correctness check covers, step 0 last (the backends' last checked forward is on the
    routing of N = 1): every step on the CPU; on a GPU step 0 and the most imbalanced other step (by expert load),
    else step 1."""
    n = len(per_step)
    if n == 1:
        return [0]
    if device == "cpu":
        return [*range(1, n), 0]
    worst = max(range(1, n), key=lambda s: per_step[s]["expert_load_max_over_mean"])
    return [worst, 0]
