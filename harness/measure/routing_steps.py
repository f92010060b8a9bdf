"""A point's routings on one rank (``workload.steps`` = N of them) and how the runner switches between them.

Every step's top-k ids and router weights wait on the device ([N, T, K]); :meth:`RoutingSteps.select` copies one
into the point's own input tensors (``LayerInputs.topk_idx_TK`` / ``topk_w_TK``), so every backend keeps reading
the same storage, as a training loop's allocator would hand it the router's output. The timer calls it before
each iteration, outside the timed span (harness/measure/timing.py); step 0 is the routing of N = 1 and the one the
inputs hold between uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from contract import comm
from contract.case import Case
from contract.inputs import LayerInputs
from harness.config import routing


@dataclass
class RoutingSteps:
    """``idx_NTK`` / ``w_NTK``: every step's routing on the device (None for one routing: the inputs hold it);
    ``per_step``: each step's balance over all ranks (:func:`harness.config.routing.load_stats`); ``checked``: the steps
    the correctness check covers (:func:`harness.config.routing.checked_steps`, step 0 last)."""

    n: int
    idx_NTK: Optional[torch.Tensor]
    w_NTK: Optional[torch.Tensor]
    per_step: list[dict[str, Any]]
    checked: list[int]

    @classmethod
    def build(cls, case: Case, rank: int, inputs: LayerInputs, group) -> "RoutingSteps":
        """This rank's routings (step 0 is the one ``inputs`` holds) and every step's balance, all-gathered."""
        n = case.routing_steps
        ws = torch.distributed.get_world_size(group)
        dev = inputs.topk_idx_TK.device
        idx = w = None
        if n > 1:
            idx, w = routing.make_steps(case, rank)
            idx, w = idx.to(dev), w.to(dev)
            assert torch.equal(idx[0], inputs.topk_idx_TK), "step 0 must be the inputs' routing"
        per_step = []
        for s in range(n):
            mine = inputs.topk_idx_TK if idx is None else idx[s]
            parts = [torch.empty_like(mine) for _ in range(ws)]
            comm.all_gather(parts, mine, group=group)
            per_step.append(routing.load_stats(torch.cat(parts), case))
        return cls(n, idx, w, per_step, routing.checked_steps(per_step, case.device))

    def stats(self) -> dict[str, Any]:
        """The row's balance columns (:func:`harness.config.routing.step_stats`)."""
        return routing.step_stats(self.per_step)

    def select(self, inputs: LayerInputs, step: int) -> None:
        """Copy step ``step % n``'s routing into the inputs' tensors (no-op for one routing)."""
        if self.idx_NTK is None:
            return
        s = step % self.n
        with torch.no_grad():
            inputs.topk_idx_TK.copy_(self.idx_NTK[s])
            inputs.topk_w_TK.copy_(self.w_NTK[s])

    def stepper(self, inputs: LayerInputs) -> Optional[Callable[[int], None]]:
        """What the timer calls before iteration i (None for one routing: nothing changes)."""
        return None if self.idx_NTK is None else (lambda i: self.select(inputs, i))


def worst(verdicts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One verdict from those of several routing steps ((step, :func:`harness.measure.correctness.compare`'s dict)): the
    largest errors, each tensor named with its step (``d_x@step3``) where there is more than one."""
    if len(verdicts) == 1:
        return verdicts[0][1]

    def tag(name: Any, s: int) -> Any:
        return f"{name}@step{s}" if name else name

    s_abs, v_abs = max(verdicts, key=lambda sv: sv[1]["max_abs_err"])
    s_rel, v_rel = max(verdicts, key=lambda sv: sv[1]["rel_err"])
    out = dict(v_rel, max_abs_err=v_abs["max_abs_err"], abs_tensor=tag(v_abs.get("abs_tensor"), s_abs),
               worst_tensor=tag(v_rel.get("worst_tensor"), s_rel))
    out["any_missing"] = any(v["any_missing"] for _, v in verdicts)
    out["missing"] = sorted({m for _, v in verdicts for m in v.get("missing", [])})
    return out
