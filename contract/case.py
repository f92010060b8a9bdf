"""One fully resolved sweep point, as every backend sees it: :class:`Case` (plain values, no OmegaConf). The
harness builds it from the configuration (:func:`harness.point.make_case`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Case:
    """A fully resolved sweep point, as every backend sees it (plain values, no OmegaConf). What one backend alone
    may choose is that backend's options (contract/options.py), never a field here."""

    shape: str
    num_experts: int
    local_experts: int
    hidden: int
    ffn: int
    topk: int
    shared_expert: bool
    swiglu_limit: Optional[float]
    experts_override: bool
    published_local_experts: Optional[int]
    tokens_per_gpu: int
    seed: int
    routing: str
    zipf_exponent: float
    hot_fraction: float
    hot_ratio: float
    hot_rank: int
    precision: str
    act_block: int
    weight_block: int
    atol: float
    rtol: float
    ep_size: int
    device: str
    compile: bool
    compile_mode: str
    comm_sms: Optional[int]
    # routing=trace: the trace folder (absolute), the layer replayed, and the trace's digest (harness/routing_trace.py)
    trace_path: Optional[str] = None
    trace_layer: int = 0
    trace_sha256: Optional[str] = None

    @property
    def routing_label(self) -> str:
        if self.routing == "uniform":
            return "uniform"
        if self.routing == "zipf":
            return f"zipf(s={self.zipf_exponent:g})"
        if self.routing == "hot_experts":
            return f"hot_experts(f={self.hot_fraction:g},x{self.hot_ratio:g})"
        if self.routing == "trace":
            return f"trace({(self.trace_sha256 or '')[:12]},layer={self.trace_layer})"
        return f"hot_rank(r={self.hot_rank},x{self.hot_ratio:g})"

    def flops(self, direction: str) -> float:
        """FLOPs per GPU by the published formula 6*(T + T*topk)*H*I (x2 bwd, x3 fwd_bwd)."""
        t = self.tokens_per_gpu
        rows = t * self.topk + (t if self.shared_expert else 0)
        return 6.0 * rows * self.hidden * self.ffn * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[direction]
