"""Run a backend once on the shared inputs and compare it with the reference (output and all 8 gradients)."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from contract import LayerInputs
from harness.core.backends import WEIGHT_GRAD_NAMES

TENSOR_NAMES = ("out", "d_x", "d_topk_w", *(f"d_{n}" for n in WEIGHT_GRAD_NAMES))


def leaves(inputs: LayerInputs, need_grads: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (inputs.x_TH.detach().requires_grad_(need_grads), inputs.topk_w_TK.detach().requires_grad_(need_grads))


def run_once(backend: Any, inputs: LayerInputs, need_grads: bool) -> dict[str, Optional[torch.Tensor]]:
    """Output and (when asked) the 8 gradients, in the harness layout."""
    backend.zero_grad()
    x, w = leaves(inputs, need_grads)
    out = backend.forward(x, inputs.topk_idx_TK, w)
    res: dict[str, Optional[torch.Tensor]] = {"out": out.detach()}
    if need_grads:
        out.backward(inputs.grad_out_TH)
        res["d_x"], res["d_topk_w"] = x.grad, w.grad
        res.update({f"d_{k}": v for k, v in backend.weight_grads().items()})
        backend.zero_grad()
    return res


CHUNK_ELEMS = 1 << 26  # elements of one compared slice: 256 MB of fp32 per temporary


def slices(t: torch.Tensor, chunk_elems: int = CHUNK_ELEMS) -> Iterator[tuple]:
    """Indices that cut ``t`` into pieces of at most ``chunk_elems`` elements, in order, covering it once: runs of
    whole rows along dim 0, or, where one row is larger than a chunk, each row cut the same way along its own dims.
    Indexing makes views only, whatever the strides (a ``reshape`` of a strided view could copy it whole)."""
    if t.dim() == 0 or t.numel() <= chunk_elems:
        yield ()
        return
    row = t.numel() // t.shape[0]
    if row <= chunk_elems or t.dim() == 1:
        step = max(1, chunk_elems // max(1, row))
        for i in range(0, t.shape[0], step):
            yield (slice(i, i + step),)
        return
    for i in range(t.shape[0]):
        for rest in slices(t[i], chunk_elems):
            yield (i, *rest)


def errors(got: torch.Tensor, ref: torch.Tensor, chunk_elems: int = CHUNK_ELEMS) -> tuple[float, float]:
    """abs-max and relative L1 error, in fp32, a slice of at most ``chunk_elems`` elements at a time: expert weight
    gradients reach tens of GB, and ``ref`` waits in host memory (:mod:`harness.measure.runner`), so each slice of it is
    moved to ``got``'s device and no temporary is larger than a slice (4 bytes an element)."""
    if got.numel() == 0:
        return 0.0, 0.0
    amax = torch.zeros((), dtype=torch.float64, device=got.device)
    l1 = torch.zeros((), dtype=torch.float64, device=got.device)
    norm = torch.zeros((), dtype=torch.float64, device=got.device)
    for idx in slices(got, chunk_elems):
        r = ref[idx].to(got.device).float()
        d = (got[idx].float() - r).abs()
        amax = torch.maximum(amax, d.max().double())
        l1 += d.sum(dtype=torch.float64)
        norm += r.abs().sum(dtype=torch.float64)
    return float(amax), float(l1 / norm.clamp(min=1e-30))


def compare(got: dict[str, Optional[torch.Tensor]], ref: dict[str, Optional[torch.Tensor]], group) -> dict[str, Any]:
    """Worst abs-max error and worst relative L1 error over every tensor the reference has and over all ranks.

    A tensor the reference produced but the backend did not is reported as missing (an infinite error).
    ``worst_tensor`` names the tensor of the worst relative error, ``abs_tensor`` that of the worst abs-max (this
    rank's; the two often differ: large weight gradients reach the abs-max tolerance at a small relative error)."""
    worst_abs, worst_rel, worst_name, abs_name, missing = 0.0, 0.0, "", "", []
    for name in TENSOR_NAMES:
        r = ref.get(name)
        if r is None:
            continue
        g = got.get(name)
        if g is None or g.shape != r.shape:
            missing.append(name)
            continue
        a, rel = errors(g, r)
        if not (a == a and rel == rel):  # NaN never passes
            a, rel = float("inf"), float("inf")
        if rel > worst_rel or not worst_name:
            worst_name = name  # the tensor with the worst relative error
        if a > worst_abs or not abs_name:
            abs_name = name
        worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
    flag = torch.tensor([worst_abs, worst_rel, float(len(missing))], dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return {"max_abs_err": float(flag[0]), "rel_err": float(flag[1]), "worst_tensor": worst_name,
            "abs_tensor": abs_name, "missing": missing, "any_missing": bool(flag[2] > 0)}
