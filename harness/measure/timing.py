"""The one timing path (the published method).

Per iteration: an optional untimed ``step`` that changes the inputs (the routing of that step, copied into the same
tensors), an optional untimed ``pre`` (the forward, when timing the backward alone), an optional L2 flush,
an aligning collective on the device stream, then a start/end event pair around ``fn``. One synchronisation at
the end. Each iteration's latency is the max over ranks; the reported figures are the median and p20/p80/min/max
of those maxima. On the CPU a host clock replaces the events and a barrier aligns the ranks. On CUDA the timed
iterations also get the GPUs' SM clock, power and power / thermal limit time from NVML (``gpu_clocks``: the
driver's records read before and after, and the SM clock read every 10 ms by one thread), the slowest clock and
the largest power and limit share over ranks, and the device memory of the window (``harness.measure.memory``: the
allocator's peak, the device's used memory before and after), the largest over ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from contract import comm
from harness.measure import gpu_clocks, memory

L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass
class Stats:
    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    max_ms: float
    num_warmup: int
    num_iters: int
    clocks: dict = field(default_factory=dict)  # gpu_clocks.FIELDS over the timed iterations (CUDA only)
    memory: dict = field(default_factory=dict)  # memory.WINDOW over the timed iterations (CUDA only)
    # cycle > 1 (the inputs change every iteration): each step's median, their mean and max (None otherwise)
    step_mean_ms: Optional[float] = None
    step_max_ms: Optional[float] = None

    @classmethod
    def from_samples(cls, samples_ms: torch.Tensor, num_warmup: int, cycle: int = 1) -> "Stats":
        """The figures of the timed samples; ``cycle`` > 1: timed iteration j ran step (num_warmup + j) % cycle,
        and the steps' medians give ``step_mean_ms`` / ``step_max_ms``."""
        s = samples_ms.double()
        q = torch.quantile(s, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
        out = cls(float(q[0]), float(q[1]), float(q[2]), float(s.min()), float(s.max()), num_warmup, len(s))
        if cycle > 1:
            which = (torch.arange(len(s)) + num_warmup) % cycle
            medians = [float(s[which == k].median()) for k in range(cycle) if bool((which == k).any())]
            out.step_mean_ms, out.step_max_ms = sum(medians) / len(medians), max(medians)
        return out


class Timer:
    def __init__(self, device: torch.device, group, *, align: str = "barrier", l2_flush: bool = False) -> None:
        self.device, self.group, self.align = device, group, align
        self.cuda = device.type == "cuda"
        self._flush_buf = (torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
                           if l2_flush and self.cuda else None)
        self._align_buf = torch.zeros(1, device=device)
        self._watch = gpu_clocks.ClockWatch(gpu_clocks.device_ids(device)) if self.cuda else None
        self._memory = memory.Window(memory.Probe.of(device))
        self.probe = self._memory.probe

    def own_base(self, allocated: Optional[int]) -> None:
        """Allocated bytes when the backend now timed began its setup: the windows' ``mem_peak_own_bytes`` are their
        peaks less this (None: not measured)."""
        self._memory.set_base(allocated)

    def _align(self) -> None:
        if self.align == "none" or dist.get_world_size(self.group) == 1:
            return
        if self.cuda:
            comm.all_reduce(self._align_buf, group=self.group)  # enqueued on the stream: aligns the devices
        else:
            dist.barrier(group=self.group)

    def run(self, fn: Callable[[], object], *, num_warmup: int, num_iters: int,
            pre: Optional[Callable[[], object]] = None, step: Optional[Callable[[int], object]] = None,
            cycle: int = 1) -> Stats:
        """Time ``fn``; ``step(i)``: called before iteration i (warmup and timed counted together), outside the timed
        span, to change the inputs (the routing of step i % ``cycle``)."""
        for i in range(num_warmup):
            if step is not None:
                step(i)
            if pre is not None:
                pre()
            self._align()
            fn()
        clocks = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._memory.open()
            self._watch.start()
            try:
                local = self._cuda_samples(fn, num_iters, pre, step, num_warmup)  # ends with a synchronize
            finally:  # a failing backend leaves no clock thread behind
                window = self._watch.stop()
            window.update(self._memory.close())
            clocks = torch.tensor([window[f] for f in (*gpu_clocks.FIELDS, *memory.WINDOW)], dtype=torch.float64,
                                  device=self.device)
        else:
            local = self._host_samples(fn, num_iters, pre, step, num_warmup)
        n = dist.get_world_size(self.group)
        if n > 1:
            parts = [torch.empty_like(local) for _ in range(n)]
            comm.all_gather(parts, local, group=self.group)
            local = torch.stack(parts).amax(0)
            if clocks is not None:
                cparts = [torch.empty_like(clocks) for _ in range(n)]
                comm.all_gather(cparts, clocks, group=self.group)
                clocks = torch.stack(cparts)
        stats = Stats.from_samples(local.cpu(), num_warmup, cycle if step is not None else 1)
        if clocks is not None:
            per_rank = clocks.reshape(-1, len(gpu_clocks.FIELDS) + len(memory.WINDOW)).cpu().tolist()
            stats.clocks = combine_clocks([r[:len(gpu_clocks.FIELDS)] for r in per_rank])
            stats.memory = combine_memory([r[len(gpu_clocks.FIELDS):] for r in per_rank])
        return stats

    def _cuda_samples(self, fn, num_iters, pre, step, first) -> torch.Tensor:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_iters)]
        for i in range(num_iters):
            if step is not None:
                step(first + i)
            if pre is not None:
                pre()
            if self._flush_buf is not None:
                self._flush_buf.zero_()
            self._align()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(self.device)
        return torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64,
                            device=self.device)

    def _host_samples(self, fn, num_iters, pre, step, first) -> torch.Tensor:
        out = []
        for i in range(num_iters):
            if step is not None:
                step(first + i)
            if pre is not None:
                pre()
            self._align()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return torch.tensor(out, dtype=torch.float64)


def combine_clocks(per_rank: list[list[float]]) -> dict[str, float]:
    """One row's clock fields from every rank's (ordered as ``gpu_clocks.FIELDS``): the slowest clock, the largest
    power and limit share (NaN readings ignored; NaN where no rank has one)."""
    out = {}
    for i, f in enumerate(gpu_clocks.FIELDS):
        vals = [r[i] for r in per_rank if r[i] == r[i]]
        out[f] = (min(vals) if f.startswith("sm_clock") else max(vals)) if vals else float("nan")
    return out


def combine_memory(per_rank: list[list[float]]) -> dict[str, float]:
    """One row's memory fields from every rank's (ordered as ``memory.WINDOW``): the largest (NaN where no rank has
    one)."""
    out = {}
    for i, f in enumerate(memory.WINDOW):
        vals = [r[i] for r in per_rank if r[i] == r[i]]
        out[f] = max(vals) if vals else float("nan")
    return out
