"""Device memory beside speed: what a backend holds, what a forward keeps for its backward, and the peaks of a timed
direction (CUDA only; every field is empty on the CPU).

The row fields (bytes, the largest over the ranks):

* ``mem_setup_bytes``: what the device allocator holds after the backend's construction and ``setup`` beyond what it
  held before (its weight copies, workspaces, buffers; a buffer a backend allocates once for its activations, such
  as ``mok_hopper``'s per-layer H, counts here);
* ``mem_activation_bytes``: what the allocator holds after one untimed training forward (the inputs require grad, the
  output and its autograd graph alive) beyond what it held before that forward, less the output's own bytes: the
  memory a layer keeps from its forward until its backward;
* ``mem_peak_allocated_bytes``: the allocator's peak during the timed iterations of the direction (after the warmup;
  a backward's untimed forwards are inside the window);
* ``mem_peak_own_bytes``: that peak less what was allocated when the backend's setup began, plus
  ``mem_graph_pool_bytes``: the memory of the backend alone (its setup's buffers, its activations, gradients and
  workspaces, the working memory of its CUDA graphs), without the point's inputs, which every backend shares, or
  anything held before it (the reference waits in host memory);
* ``mem_graph_pool_bytes``: the free bytes, at the window's end, of the CUDA graphs' private memory pools created
  since the backend's setup began. A replayed graph allocates nothing: its intermediates live at fixed addresses
  of its pool, which the allocator counts as reserved, not as allocated, so the allocator's peak misses them. What
  the pool holds allocated (a graph's outputs) is in the peak already; its free bytes are the graphs' working
  memory, counted whole (an upper bound: a pool's free blocks need not all be in use at one moment). 0 for a
  backend whose graphs allocate nothing of their own;
* ``mem_device_used_before_bytes`` / ``mem_device_used_peak_bytes``: the device's used memory (``cudaMemGetInfo``:
  total less free, so every allocator, NVSHMEM and symmetric-memory heaps and other processes on the device count)
  just before and just after the timed iterations. The caching allocator keeps the blocks it reserved, so the used
  memory after the window holds the window's peak reservation.

The counters are read through a :class:`Probe` (torch's CUDA calls by default), so the arithmetic is tested on
the CPU with a stand-in: ``MOKBENCH_MEMORY_PROBE=module:function`` (a function of the device returning a
:class:`Probe`) replaces the device's probe in every rank, the CPU's included (the tests' planted backends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from harness.core.results import replays_cuda_graphs

SETUP, ACTIVATION = "mem_setup_bytes", "mem_activation_bytes"
OWN_PEAK = "mem_peak_own_bytes"
GRAPH_POOL = "mem_graph_pool_bytes"
WINDOW = ("mem_peak_allocated_bytes", "mem_device_used_before_bytes", "mem_device_used_peak_bytes", OWN_PEAK,
          GRAPH_POOL)
PROBE_ENV = "MOKBENCH_MEMORY_PROBE"
FIELDS = (SETUP, ACTIVATION, *WINDOW)


GRAPH_BLIND_NOTE = ("mem_peak_allocated_bytes not recorded: the compiled code replays CUDA graphs, whose working "
                    "memory sits in private pools that the allocator's peak does not count; mem_peak_own_bytes "
                    "adds their free bytes (mem_graph_pool_bytes)")


def graph_blind(info: dict[str, Any]) -> tuple[str, ...]:
    """The window fields a row must leave empty because its backend replays CUDA graphs (``info``: the backend's
    ``compiled`` / ``compile_mode`` columns): a replay allocates nothing, so the allocator's peak misses the graphs'
    activations and workspaces. The own peak adds the graphs' pools (:data:`GRAPH_POOL`) and stays."""
    return ("mem_peak_allocated_bytes",) if replays_cuda_graphs(info) else ()


def _cuda_graph_pools(device: torch.device) -> dict[tuple, tuple[int, int]]:
    """(reserved, allocated) bytes of each private memory pool on ``device`` (CUDA graphs' pools; the default pool,
    id (0, 0), left out), from the allocator's segments."""
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # torch before the include_traces argument
        segments = torch.cuda.memory_snapshot()
    index = device.index if device.index is not None else torch.cuda.current_device()
    pools: dict[tuple, tuple[int, int]] = {}
    for seg in segments:
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if seg.get("device", index) != index or pid == (0, 0):
            continue
        r, a = pools.get(pid, (0, 0))
        pools[pid] = (r + int(seg["total_size"]), a + int(seg["allocated_size"]))
    return pools


@dataclass
class Probe:
    """The device's memory counters: allocated bytes now, the allocator's peak since the last reset, (free, total)."""

    allocated: Callable[[], int]
    peak: Callable[[], int]
    reset_peak: Callable[[], None]
    free_total: Callable[[], tuple[int, int]]
    sync: Callable[[], None]
    # pool id -> (reserved, allocated) bytes of every private (CUDA graph) pool; none by default
    graph_pools: Callable[[], dict[tuple, tuple[int, int]]] = dict

    @classmethod
    def cuda(cls, device: torch.device) -> "Probe":
        return cls(allocated=lambda: torch.cuda.memory_allocated(device),
                   peak=lambda: torch.cuda.max_memory_allocated(device),
                   reset_peak=lambda: torch.cuda.reset_peak_memory_stats(device),
                   free_total=lambda: torch.cuda.mem_get_info(device),
                   sync=lambda: torch.cuda.synchronize(device),
                   graph_pools=lambda: _cuda_graph_pools(device))

    @classmethod
    def of(cls, device: torch.device) -> Optional["Probe"]:
        """The probe of ``device``; None on a CPU (no memory fields); the stand-in of ``MOKBENCH_MEMORY_PROBE``
        where that is set."""
        import os

        stand_in = os.environ.get(PROBE_ENV)
        if stand_in:
            import importlib

            module, _, fn = stand_in.partition(":")
            return getattr(importlib.import_module(module), fn)(device)
        return cls.cuda(device) if device.type == "cuda" else None

    def used(self) -> int:
        free, total = self.free_total()
        return int(total) - int(free)


class Window:
    """The timed iterations' memory: :meth:`open` after the warmup, :meth:`close` after the last iteration."""

    def __init__(self, probe: Optional[Probe]) -> None:
        self.probe = probe
        self._before = math.nan
        self.base: Optional[int] = None  # allocated bytes when the backend's setup began (OWN_PEAK)
        self.pools_before: frozenset = frozenset()  # the private pools that existed then (not the backend's)

    def set_base(self, allocated: Optional[int]) -> None:
        """The backend's setup begins: what is allocated now, and the CUDA graph pools that exist now, are not its."""
        self.base = allocated
        self.pools_before = frozenset(self.probe.graph_pools()) if self.probe is not None and allocated is not None \
            else frozenset()

    def open(self) -> None:
        if self.probe is None:
            return
        self.probe.sync()
        self.probe.reset_peak()
        self._before = float(self.probe.used())

    def close(self) -> dict[str, float]:
        """The :data:`WINDOW` fields (NaN on a CPU)."""
        if self.probe is None:
            return dict.fromkeys(WINDOW, math.nan)
        self.probe.sync()
        peak = float(self.probe.peak())
        pool = math.nan
        if self.base is not None:
            pool = float(sum(r - a for pid, (r, a) in self.probe.graph_pools().items() if pid not in self.pools_before))
        own = peak - self.base + pool if self.base is not None else math.nan
        return dict(zip(WINDOW, (peak, self._before, float(self.probe.used()), own, pool)))


def held_since(probe: Optional[Probe], before: Optional[int]) -> float:
    """Allocated bytes now beyond ``before`` (NaN on a CPU)."""
    if probe is None or before is None:
        return math.nan
    probe.sync()
    return float(probe.allocated() - before)


def allocated(probe: Optional[Probe]) -> Optional[int]:
    if probe is None:
        return None
    probe.sync()
    return int(probe.allocated())


def activation_bytes(probe: Optional[Probe], forward: Callable[[], Any]) -> float:
    """What one training forward keeps until its backward (:data:`ACTIVATION`): allocated bytes after ``forward()``
    with its output alive, beyond those before it, less the output's bytes; the output and its graph are dropped
    before returning. NaN on a CPU."""
    if probe is None:
        return math.nan
    before = allocated(probe)
    out = forward()
    probe.sync()
    after = int(probe.allocated())
    own = out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
    del out
    return float(after - before - own)


def max_over_ranks(fields: dict[str, float], device: torch.device, group: Any) -> dict[str, float]:
    """Each field's largest value over the ranks of ``group`` (NaN where no rank has one)."""
    import torch.distributed as dist

    from contract import comm

    if not fields or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(fields)
    names = list(fields)
    vals = torch.tensor([fields[k] if fields[k] == fields[k] else -math.inf for k in names], dtype=torch.float64,
                        device=device)
    comm.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    return {k: (float(v) if v != -math.inf else math.nan) for k, v in zip(names, vals.tolist())}
