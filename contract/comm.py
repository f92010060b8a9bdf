"""The collectives the harness and the baselines run on a layer's tensors, for any process group.

On an NCCL group they are ``torch.distributed``'s own calls. On a gloo group given CUDA tensors (several ranks on
one GPU, ``ranks_per_gpu`` > 1, where NCCL refuses to put two ranks on one device) each call stages its tensors
through the host: copy to the CPU, run the gloo collective there, copy the result back. That path measures no speed;
it exists so that the same layer code checks its results with several ranks on one GPU.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist


def host_staged(group: Any, t: torch.Tensor) -> bool:
    """Whether a collective on ``t`` over ``group`` goes through the host (a gloo group and a tensor that is not on
    the CPU)."""
    return t.device.type != "cpu" and dist.get_backend(group) == "gloo"


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[Sequence[int]] = None,
                      in_splits: Optional[Sequence[int]] = None, group: Any = None) -> None:
    """``dist.all_to_all_single(out, inp, out_splits, in_splits, group)``, host-staged where :func:`host_staged`."""
    if not host_staged(group, inp):
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        return
    got = torch.empty(out.shape, dtype=out.dtype, device="cpu")
    dist.all_to_all_single(got, inp.contiguous().cpu(), out_splits, in_splits, group=group)
    out.copy_(got)


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
    """``dist.all_gather(parts, t, group)``, host-staged where :func:`host_staged`."""
    if not host_staged(group, t):
        dist.all_gather(parts, t, group=group)
        return
    got = [torch.empty(p.shape, dtype=p.dtype, device="cpu") for p in parts]
    dist.all_gather(got, t.contiguous().cpu(), group=group)
    for p, g in zip(parts, got):
        p.copy_(g)


def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
    """``dist.all_reduce(t, op, group)`` in place (sum by default), host-staged where :func:`host_staged`."""
    op = dist.ReduceOp.SUM if op is None else op
    if not host_staged(group, t):
        dist.all_reduce(t, op=op, group=group)
        return
    host = t.detach().cpu()
    dist.all_reduce(host, op=op, group=group)
    t.copy_(host)
