"""One fully resolved sweep point, as every backend sees it: :class:`Case` (plain values, no OmegaConf). The
harness builds it from the configuration (:func:`harness.config.point.make_case`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

CUDAGRAPH_MODES = ("max-autotune", "reduce-overhead")  # the torch.compile modes whose compiled code replays CUDA graphs


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
    # the routing model's parameters beyond the four above, as sorted (name, value) pairs (harness/config/routing.py)
    routing_params: tuple[tuple[str, Any], ...] = ()
    routing_steps: int = 1  # routings per rank, cycled through warmup and timing (workload.steps)

    def flops(self, direction: str) -> float:
        """FLOPs per GPU by the published formula 6*(T + T*topk)*H*I (x2 bwd, x3 fwd_bwd)."""
        t = self.tokens_per_gpu
        rows = t * self.topk + (t if self.shared_expert else 0)
        return 6.0 * rows * self.hidden * self.ffn * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[direction]
