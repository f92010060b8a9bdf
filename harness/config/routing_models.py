"""The routing models: one class each, listed in :data:`harness.config.routing.MODELS` (the one table of them).

A model says which parameters it reads (``params``: name -> default; each is a ``workload.<name>`` key), its label
(the row's ``routing`` column), its checks, and its routing for one rank at one step: either an expert popularity
(:meth:`RoutingModel.popularity`; the harness samples each token's top-k from it) or the ids and router weights
themselves (:meth:`RoutingModel.route`). A model that the harness cannot run yet says why (``unsupported``).

The module is torch-free at import (the configuration's schema reads ``params``); the generators import torch.

Shape legend: T tokens on this rank, K top-k, E global experts, L local experts (E / EP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional

from contract.case import Case
from harness.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

# A step's generator seed: seed + rank + step * STEP_SEED_STRIDE (step 0: the published seed + rank)
STEP_SEED_STRIDE = 1_000_033
# Popularity order of the imbalance models: one seeded permutation of the experts, the same on every rank
_ORDER_SEED = (7919, 17)


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def param(case: Case, name: str) -> Any:
    """A routing parameter of ``case``: a field of the Case (the four original models' parameters) or one of
    ``case.routing_params``."""
    if hasattr(case, name):
        return getattr(case, name)
    return dict(case.routing_params)[name]


def generator(case: Case, rank: int, step: int):
    import torch

    return torch.Generator().manual_seed(case.seed + rank + step * STEP_SEED_STRIDE)


def expert_order(case: Case):
    """A seeded permutation of the global experts, the same on every rank (the popularity order)."""
    import torch

    g = torch.Generator().manual_seed(case.seed * _ORDER_SEED[0] + _ORDER_SEED[1])
    return torch.randperm(case.num_experts, generator=g)


def unit_gates(g, t: int, k: int):
    """Router weights ``rand * 0.5 + 0.5``, normalised over the top-k (fp32 [T, K])."""
    import torch

    w = torch.rand(t, k, generator=g, dtype=torch.float32) * 0.5 + 0.5
    return w / w.sum(-1, keepdim=True)


def sample_topk(pop, g, t: int, k: int):
    """[T, K] expert ids, each token's k experts drawn without replacement with probability ~ ``pop`` (Gumbel top-k;
    an expert of popularity 0 is never drawn)."""
    import torch

    u = torch.rand(t, pop.numel(), generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    scores = pop.log().unsqueeze(0) - torch.log(-torch.log(u))
    return scores.topk(k, dim=-1).indices.to(torch.int64)


class RoutingModel:
    """One routing model. ``name``: its key (``workload.routing``); ``params``: the ``workload`` keys it reads and
    their defaults (a key several models read has one default); ``param_types``: the schema type of a parameter whose
    default does not give it (a default of None); ``unhashed``: parameters never in a point's hash (where the model
    stands for them by something :meth:`resolve` adds); ``steps_matter``: its routing depends on the step (beyond
    the random draw), so ``workload.steps`` > 1 changes what it measures."""

    name: ClassVar[str]
    params: ClassVar[dict[str, Any]] = {}
    param_types: ClassVar[dict[str, Any]] = {}
    unhashed: ClassVar[tuple[str, ...]] = ()
    steps_matter: ClassVar[bool] = False

    @classmethod
    def resolve(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters as the Case holds them (``Case.routing_params``), from the workload's: a model may make a
        value absolute or add what identifies it. Raises :class:`~harness.core.errors.ConfigError`."""
        return params

    @classmethod
    def label(cls, case: Case) -> str:
        return cls.name

    @classmethod
    def check(cls, case: Case) -> None:
        """Raise :class:`~harness.core.errors.ConfigError` (one line naming the fix) for a point that can never run."""

    @classmethod
    def unsupported(cls, case: Case) -> Optional[str]:
        """Why this harness cannot run the point yet, and the fix (every backend's row is ``unsupported``); None."""
        return None

    @classmethod
    def popularity(cls, case: Case, step: int) -> Optional["torch.Tensor"]:
        """Relative load per global expert (fp64 [E], sums to 1) at ``step``; None: the model routes itself."""
        return None

    @classmethod
    def route(cls, case: Case, rank: int, step: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Top-k ids [T, K] (int64, global experts) and router weights [T, K] (fp32) of ``rank`` at ``step``, on the
        CPU. The default samples :meth:`popularity` and draws ``rand * 0.5 + 0.5`` gates."""
        g = generator(case, rank, step)
        idx = sample_topk(cls.popularity(case, step), g, case.tokens_per_gpu, case.topk)
        return idx, unit_gates(g, case.tokens_per_gpu, case.topk)


class _Logits(RoutingModel):
    """The original models: per-rank randn logits [T, E]; uniform takes their top-k, the others sample the top-k
    from a popularity (Gumbel top-k) and take the logits at those ids; router weights: softmax over the k values."""

    @classmethod
    def route(cls, case: Case, rank: int, step: int):
        import torch

        g = generator(case, rank, step)
        t, e, k = case.tokens_per_gpu, case.num_experts, case.topk
        logits = torch.randn(t, e, generator=g, dtype=torch.float32)
        pop = cls.popularity(case, step)
        if pop is None:
            vals, idx = logits.topk(k, dim=-1)
        else:
            idx = sample_topk(pop, g, t, k)
            vals = logits.gather(1, idx)
        return idx.to(torch.int64), torch.softmax(vals, dim=-1)


class Uniform(_Logits):
    """Published routing: per-rank randn logits (seed + rank), top-k, softmax over the top-k values."""

    name = "uniform"


class Zipf(_Logits):
    """Expert popularity ~ 1 / rank^s over a seeded global expert order."""

    name = "zipf"
    params = {"zipf_exponent": 1.0}

    @classmethod
    def label(cls, case):
        return f"zipf(s={case.zipf_exponent:g})"

    @classmethod
    def check(cls, case):
        need(case.zipf_exponent >= 0, f"workload.zipf_exponent must be >= 0 (got {case.zipf_exponent})")

    @classmethod
    def popularity(cls, case, step):
        import torch

        e = case.num_experts
        w = torch.ones(e, dtype=torch.float64)
        w[expert_order(case)] = torch.arange(1, e + 1, dtype=torch.float64).pow(-case.zipf_exponent)
        return w / w.sum()


class HotExperts(_Logits):
    """A seeded fraction of the experts receives hot_ratio times the load of the others."""

    name = "hot_experts"
    params = {"hot_fraction": 0.125, "hot_ratio": 4.0}

    @classmethod
    def label(cls, case):
        return f"hot_experts(f={case.hot_fraction:g},x{case.hot_ratio:g})"

    @classmethod
    def check(cls, case):
        need(case.hot_ratio > 0, f"workload.hot_ratio must be > 0 (got {case.hot_ratio})")
        need(0 < case.hot_fraction <= 1, f"workload.hot_fraction must be in (0, 1] (got {case.hot_fraction})")

    @classmethod
    def popularity(cls, case, step):
        import torch

        w = torch.ones(case.num_experts, dtype=torch.float64)
        w[expert_order(case)[: max(1, round(case.hot_fraction * case.num_experts))]] = case.hot_ratio
        return w / w.sum()


class HotRank(_Logits):
    """Every expert on rank hot_rank receives hot_ratio times the load of the others (0: that rank is idle)."""

    name = "hot_rank"
    params = {"hot_rank": 0, "hot_ratio": 4.0}

    @classmethod
    def label(cls, case):
        return f"hot_rank(r={case.hot_rank},x{case.hot_ratio:g})"

    @classmethod
    def check(cls, case):
        need(0 <= case.hot_rank < case.ep_size,
             f"workload.hot_rank={case.hot_rank} is not a rank of ep_size={case.ep_size}: use 0..{case.ep_size - 1}")
        need(case.hot_ratio >= 0, f"workload.hot_ratio must be >= 0 (0: an idle rank) (got {case.hot_ratio})")
        need(case.hot_ratio > 0 or case.topk <= case.num_experts - case.local_experts,
             f"workload.hot_ratio=0 leaves {case.num_experts - case.local_experts} experts to route to, fewer than "
             f"top-{case.topk}: use more ranks or a hot_ratio > 0")

    @classmethod
    def popularity(cls, case, step):
        import torch

        w = torch.ones(case.num_experts, dtype=torch.float64)
        lo = case.hot_rank * case.local_experts
        w[lo : lo + case.local_experts] = case.hot_ratio
        return w / w.sum()


class RoundRobin(RoutingModel):
    """(token, k) slot j of rank r at step s goes to expert (r*T*K + s*K + j) mod E: every expert gets the same load
    (max/mean exactly 1) where EP*T*K is a multiple of E."""

    name = "round_robin"

    @classmethod
    def route(cls, case, rank, step):
        import torch

        t, k, e = case.tokens_per_gpu, case.topk, case.num_experts
        idx = (rank * t * k + step * k + torch.arange(t * k, dtype=torch.int64)).remainder(e).view(t, k)
        return idx, unit_gates(generator(case, rank, step), t, k)


def hot_count(case: Case) -> int:
    return max(1, round(param(case, "hot_fraction") * case.num_experts))


def _share_popularity(case: Case, hot) -> "torch.Tensor":
    """Popularity where the experts ``hot`` (a bool [E] mask) take ``hot_share`` of the load, evenly."""
    import torch

    share = param(case, "hot_share")
    n_hot = int(hot.sum())
    w = torch.zeros(case.num_experts, dtype=torch.float64)
    w[hot] = share / n_hot
    if n_hot < case.num_experts:
        w[~hot] = (1 - share) / (case.num_experts - n_hot)
    return w


def _check_share(case: Case, n_hot: int) -> None:
    share = param(case, "hot_share")
    need(0 < share <= 1, f"workload.hot_share must be in (0, 1] (got {share})")
    need(share < 1 or n_hot >= case.topk,
         f"workload.hot_share=1 routes every token to {n_hot} hot experts, fewer than top-{case.topk}: raise "
         "workload.hot_fraction or lower hot_share")


class HotSet(RoutingModel):
    """A fixed set of hot experts takes ``hot_share`` of the (token, k) slots: ``hot_layout=block``: the contiguous
    experts [0, hot_fraction*E); ``even``: the even-numbered experts. ``hot_share=1``: the others are never chosen."""

    name = "hot_set"
    params = {"hot_layout": "block", "hot_fraction": 0.125, "hot_share": 0.75}

    @classmethod
    def _mask(cls, case):
        import torch

        ids = torch.arange(case.num_experts)
        return ids % 2 == 0 if param(case, "hot_layout") == "even" else ids < hot_count(case)

    @classmethod
    def label(cls, case):
        lay, share = param(case, "hot_layout"), param(case, "hot_share")
        return f"hot_set(even,share={share:g})" if lay == "even" else \
            f"hot_set(block,f={param(case, 'hot_fraction'):g},share={share:g})"

    @classmethod
    def check(cls, case):
        lay = param(case, "hot_layout")
        need(lay in ("block", "even"), f"workload.hot_layout must be block or even (got {lay})")
        need(0 < case.hot_fraction <= 1, f"workload.hot_fraction must be in (0, 1] (got {case.hot_fraction})")
        _check_share(case, case.num_experts - case.num_experts // 2 if lay == "even" else hot_count(case))

    @classmethod
    def popularity(cls, case, step):
        return _share_popularity(case, cls._mask(case))


class Rotating(RoutingModel):
    """A hot window of hot_fraction*E contiguous experts takes ``hot_share`` of the slots and moves on by its own
    width every ``rotate_period`` steps (wrapping around): with ``workload.steps`` = 1 it stays on [0, width)."""

    name = "rotating"
    params = {"hot_fraction": 0.125, "hot_share": 0.75, "rotate_period": 1}
    steps_matter = True

    @classmethod
    def label(cls, case):
        return (f"rotating(f={param(case, 'hot_fraction'):g},share={param(case, 'hot_share'):g},"
                f"every={param(case, 'rotate_period')})")

    @classmethod
    def check(cls, case):
        need(0 < case.hot_fraction <= 1, f"workload.hot_fraction must be in (0, 1] (got {case.hot_fraction})")
        need(param(case, "rotate_period") >= 1,
             f"workload.rotate_period must be >= 1 (got {param(case, 'rotate_period')})")
        _check_share(case, hot_count(case))

    @classmethod
    def popularity(cls, case, step):
        import torch

        width = hot_count(case)
        start = (step // param(case, "rotate_period")) * width
        hot = (torch.arange(case.num_experts) - start).remainder(case.num_experts) < width
        return _share_popularity(case, hot)


class Burst(RoutingModel):
    """Uniform routing (top-k drawn evenly), except on every ``burst_period``-th step (steps 0, p, 2p, ...): there
    every even-numbered token of each rank picks its k experts among the hot block [0, hot_fraction*E). With
    ``workload.steps`` = 1 every step is the burst."""

    name = "burst"
    params = {"hot_fraction": 0.125, "burst_period": 4}
    steps_matter = True

    @classmethod
    def label(cls, case):
        return f"burst(f={param(case, 'hot_fraction'):g},every={param(case, 'burst_period')})"

    @classmethod
    def check(cls, case):
        need(0 < case.hot_fraction <= 1, f"workload.hot_fraction must be in (0, 1] (got {case.hot_fraction})")
        need(param(case, "burst_period") >= 1,
             f"workload.burst_period must be >= 1 (got {param(case, 'burst_period')})")
        need(hot_count(case) >= case.topk, f"a burst sends tokens to {hot_count(case)} hot experts, fewer than "
                                           f"top-{case.topk}: raise workload.hot_fraction")

    @classmethod
    def route(cls, case, rank, step):
        import torch

        g = generator(case, rank, step)
        t, k, e = case.tokens_per_gpu, case.topk, case.num_experts
        idx = sample_topk(torch.full((e,), 1.0 / e, dtype=torch.float64), g, t, k)
        if step % param(case, "burst_period") == 0:
            hot = torch.zeros(e, dtype=torch.float64)
            hot[: hot_count(case)] = 1.0
            idx[0::2] = sample_topk(hot / hot.sum(), g, (t + 1) // 2, k)
        return idx, unit_gates(g, t, k)


class Incast(RoutingModel):
    """Every source rank sends all its tokens to the experts of ranks [0, incast_ranks) (each token's k experts
    drawn evenly among them). At EP=1 it is an even draw over all experts."""

    name = "incast"
    params = {"incast_ranks": 1}

    @classmethod
    def label(cls, case):
        return f"incast(k={param(case, 'incast_ranks')})"

    @classmethod
    def check(cls, case):
        k = param(case, "incast_ranks")
        need(1 <= k <= case.ep_size, f"workload.incast_ranks={k} is not a number of ranks of ep_size={case.ep_size}: "
                                     f"use 1..{case.ep_size}")
        need(k * case.local_experts >= case.topk,
             f"workload.incast_ranks={k} leaves {k * case.local_experts} experts, fewer than top-{case.topk}: raise it")

    @classmethod
    def popularity(cls, case, step):
        import torch

        w = torch.zeros(case.num_experts, dtype=torch.float64)
        w[: param(case, "incast_ranks") * case.local_experts] = 1.0
        return w / w.sum()


class Ragged(RoutingModel):
    """Token counts that differ between source ranks (Megatron-LM PR #7488's W4). Every backend here takes
    ``tokens_per_gpu`` tokens on every rank, so the point is ``unsupported`` until tokens per rank may differ."""

    name = "ragged"

    @classmethod
    def unsupported(cls, case):
        return ("routing 'ragged' needs a different token count on each source rank; the harness gives every rank "
                "workload.tokens_per_gpu tokens (LayerInputs has one T): run it once per-rank token counts exist")

    @classmethod
    def route(cls, case, rank, step):
        raise NotImplementedError(cls.unsupported(case))


class Trace(RoutingModel):
    """Routing replayed from a trace folder (harness/config/routing_trace.py: the format, its checks, each rank's
    share): step s of a run replays the trace's step s mod S (S: the steps it holds), layer ``trace_layer``. The point
    is identified by the trace's digest (``trace_sha256``, added by :meth:`resolve`), never by its folder."""

    name = "trace"
    params = {"trace_path": None, "trace_layer": 0}
    param_types = {"trace_path": Optional[str]}
    unhashed = ("trace_path",)
    steps_matter = True

    @classmethod
    def resolve(cls, params):
        from harness.config import routing_trace

        path, digest = routing_trace.resolve(params.get("trace_path"))
        return {**params, "trace_path": path, "trace_sha256": digest}

    @classmethod
    def label(cls, case):
        return f"trace({param(case, 'trace_sha256')[:12]},layer={param(case, 'trace_layer')})"

    @classmethod
    def check(cls, case):
        from harness.config import routing_trace

        routing_trace.check_case(case)

    @classmethod
    def route(cls, case, rank, step):
        from harness.config import routing_trace

        return routing_trace.trace_routing(case, rank, step)
