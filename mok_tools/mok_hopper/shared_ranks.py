"""P ranks of mok_hopper in one process on one device (:class:`Ranks`), what
:mod:`mok_tools.mok_hopper.shared_gpu_check` runs: one layer per rank over linked local workspaces
(``workspace.link_local``: plain device pointers, no symmetric memory), one CUDA stream per rank, and a training step
(forward: ``stage``, ``compute``, ``finish``; backward: ``backward_stage``, ``backward_compute``,
``backward_finish``) in one of two modes:

* ``lockstep``: each phase for every rank in turn, each rank's work finished before the next rank's starts. The
  order satisfies every cross-rank barrier: deadlock-free, and it never has two ranks in flight (the CPU runs this,
  under the Triton interpreter);
* ``concurrent`` (CUDA): every rank's phase in flight together on its own stream; each cross-rank barrier is an event
  wait of every rank's stream on every other rank's (the layer's ``ws.barrier`` is a no-op without a symmetric
  handle, so the kernels compile to what they always do). The last rank starts every phase ``skew_ms`` late (a
  device sleep on its stream), so that a missing wait shows up as a wrong result instead of a race the GPU may win.

The faults :data:`BREAKS` are host-side injections applied to the ranks (see :meth:`Ranks.__init__`), and
:func:`spinning_cap` is the grid-cap rule under which the concurrent mode may keep the layer's ready counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from mok_kernels.mok_hopper.api import MoKHopperLayer
from mok_kernels.mok_hopper.tiles import TileConfig
from mok_kernels.mok_hopper.train import backward_compute, backward_finish, backward_stage
from mok_kernels.mok_hopper.workspace import Workspace, link_local

MODES = ("lockstep", "concurrent")
# fault injection -> what it breaks (and where it can be seen)
BREAKS = {
    "wrong-peer-offset": "rank 0's peer offset table names its own buffer for rank 1 (pulls and pushes go astray): "
                         "lockstep and concurrent",
    "skip-flag-reset": "the schedule no longer zeroes the ready counters and the up GEMM's work queue between "
                       "forwards (a forward after another computes nothing): lockstep, or concurrent with ready flags",
    "missing-fence": "rank 0's epilogue does not wait for the other ranks' pushes (the forward's barrier 1): "
                     "concurrent only (lockstep's order makes every barrier moot)",
}


# ---------------------------------------------------------------------------------------------------------------
# the grid-cap rule: when may P concurrent ranks keep the ready counters (GEMM programs spinning on the pull)?


@dataclass(frozen=True)
class SMLimits:
    """What one SM holds (H100 / H200, sm_90): registers, shared memory (with the runtime's reserve per program),
    warps, programs; registers are given to a warp in units of ``reg_unit``."""

    regs: int = 65536
    smem: int = 233472
    smem_reserved: int = 1024
    warps: int = 64
    programs: int = 32
    reg_unit: int = 256


HOPPER = SMLimits()


@dataclass(frozen=True)
class KernelUse:
    """One program of a kernel: registers a thread, bytes of shared memory, warps (``aot_check`` reports the first
    two; Triton's compiled kernels carry all three)."""

    regs: int
    smem: int
    warps: int


def fits(programs: Sequence[tuple[int, KernelUse]], sm: SMLimits = HOPPER) -> bool:
    """Whether these (count, kernel) programs fit on one SM together."""
    regs = sum(n * k.warps * (-(-k.regs * 32 // sm.reg_unit) * sm.reg_unit) for n, k in programs)
    smem = sum(n * (k.smem + sm.smem_reserved) for n, k in programs)
    warps = sum(n * k.warps for n, k in programs)
    return regs <= sm.regs and smem <= sm.smem and warps <= sm.warps and sum(n for n, _ in programs) <= sm.programs


def programs_per_sm(k: KernelUse, sm: SMLimits = HOPPER) -> int:
    """How many programs of ``k`` one SM holds (its occupancy)."""
    n = 0
    while fits([(n + 1, k)], sm):
        n += 1
    return n


def spinning_cap(n_sm: int, ranks: int, spin: KernelUse, pull: KernelUse, sm: SMLimits = HOPPER) -> Optional[int]:
    """The most programs that may spin at once per rank (the up GEMM's, waiting on its rows' ready counters) when
    ``ranks`` ranks run concurrently on one GPU of ``n_sm`` SMs; None where any number may.

    Derivation. Of a training step's programs only the up GEMM's may wait on another program: with ready counters
    each of its programs spins until the pull (the rank's comm stream) has written its rows. Every other program
    (schedule, pull, shared expert, down GEMM, the up launch that follows the pull on the comm stream, epilogue, the
    backward's GEMMs) finishes on its own and frees its SM. So the step cannot deadlock as long as some SM always
    keeps room for a pull program once its finishing programs have left, i.e. as long as the spinning programs alone
    never fill every SM. Let ``k`` be the most spinning programs an SM holds with one pull program beside them
    (:func:`fits`: registers, shared memory, warps, programs) and ``m`` the most it holds at all
    (:func:`programs_per_sm`). If ``m <= k`` no SM can be filled by spinning programs: no cap. Otherwise an SM
    refuses a pull only with ``k + 1`` or more spinning programs on it; the block scheduler places programs where it
    likes, so count the worst placement: with ``S`` spinning programs in all, at most ``S // (k + 1)`` SMs are so
    full, and some SM keeps room while ``S < (k + 1) n_sm``. The ranks spin at once, so each rank may launch
    ``((k + 1) n_sm - 1) // ranks``. (The pulls must also be able to start: each rank's streams need hardware queues
    of their own, ``CUDA_DEVICE_MAX_CONNECTIONS``; the check sets it to 32.)

    Example: the bf16 up GEMM at 8 warps and 255 registers fills an SM's registers (``m = 1``, ``k = 0``): 132 SMs,
    2 ranks: 65 programs a rank; the fp8 one at 4 warps (``up_halves``) leaves room for a 16-warp pull at 58
    registers beside one (``m = 2``, ``k = 1``): 131 a rank."""
    if not fits([(1, pull)], sm):
        raise ValueError(f"a pull program ({pull}) does not fit on one SM")
    m = programs_per_sm(spin, sm)
    k = 0
    while k < m and fits([(k + 1, spin), (1, pull)], sm):
        k += 1
    if m <= k:
        return None
    cap = ((k + 1) * n_sm - 1) // ranks
    if cap < 1:
        raise ValueError(f"{ranks} ranks on {n_sm} SMs leave no spinning program room (k={k})")
    return cap


def compiled_use(fn: Any) -> KernelUse:
    """The largest registers, shared memory and warps over the compiled specialisations of a ``@triton.jit`` kernel
    that has run on this GPU (Triton's compiled metadata: conservative over every launch made so far)."""
    use = None
    for entry in getattr(fn, "device_caches", {}).values():
        for k in entry[0].values():
            k._init_handles()  # (loads the binary: registers are known from then on)
            u = KernelUse(int(k.n_regs), int(k.metadata.shared), int(k.metadata.num_warps))
            use = u if use is None else KernelUse(max(use.regs, u.regs), max(use.smem, u.smem),
                                                  max(use.warps, u.warps))
    if use is None:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} has not been compiled on this GPU yet")
    return use


# ---------------------------------------------------------------------------------------------------------------
# the ranks


class CheckTimeout(RuntimeError):
    """A concurrent step did not finish within its time limit (a hang: the GPU still runs it)."""


@dataclass
class Weights:
    """Every rank's expert weights (bf16, on the device) and the shared expert's (gate, up, down)."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Ranks:
    """P layers (one per rank) over linked local workspaces on one device, and their training step.

    ``breaks``: names of :data:`BREAKS` to inject: ``wrong-peer-offset`` rewrites rank 0's peer offset tables here,
    ``skip-flag-reset`` wraps every rank's scheduler to drop the counters it zeroes, ``missing-fence`` makes
    :meth:`step` skip rank 0's wait at the forward's barrier 1."""

    def __init__(self, weights: Weights, *, tokens: int, topk: int, precision: str, save_h: bool, tile: TileConfig,
                 mode: str = "lockstep", skew_ms: float = 0.0, breaks: Sequence[str] = ()) -> None:
        self.P = len(weights.w13)
        self.dev = weights.w13[0].device
        self.cuda = self.dev.type == "cuda"
        assert mode in MODES and (self.cuda or mode == "lockstep"), "concurrent ranks need CUDA streams"
        self.mode, self.breaks, self.weights = mode, tuple(breaks), weights
        H = weights.w13[0].shape[2]
        self.wss = link_local([Workspace(rank=r, world=self.P, device=self.dev, tokens=tokens, hidden=H, topk=topk,
                                         fp8=precision == "fp8", symmetric=False) for r in range(self.P)])
        self.layers = [MoKHopperLayer(weights.w13[r], weights.w2[r], topk=topk, tokens=tokens, shared=weights.shared,
                                      precision=precision, rank=r, world=self.P, workspace=self.wss[r], tile=tile,
                                      save_h=save_h, train=True, cuda_graph=False) for r in range(self.P)]
        if "wrong-peer-offset" in self.breaks:  # rank 0 finds rank 1 where its own buffer is
            for table in self.wss[0].tables.values():
                table[1] = table[0]
        if "skip-flag-reset" in self.breaks:
            for layer in self.layers:
                layer.scheduler = _without_resets(layer.scheduler)
        self.streams = [torch.cuda.Stream(device=self.dev) for _ in range(self.P)] if self.cuda else []
        self._events: list[Any] = []
        self.skew_cycles = _cycles_per_ms(self.dev) * skew_ms if mode == "concurrent" and skew_ms > 0 else 0

    def _phase(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(r)`` for every rank: in turn, each finished before the next (lockstep), or all in flight on the
        ranks' streams, each followed by an event the barriers wait on (concurrent)."""
        out = []
        if self.mode == "lockstep":
            for r in range(self.P):
                if self.cuda:
                    with torch.cuda.stream(self.streams[r]):
                        out.append(fn(r))
                    torch.cuda.synchronize(self.dev)
                else:
                    out.append(fn(r))
            return out
        self._events = []
        for r in range(self.P):
            with torch.cuda.stream(self.streams[r]):
                if r == self.P - 1 and self.skew_cycles:
                    torch.cuda._sleep(int(self.skew_cycles))
                out.append(fn(r))
                ev = torch.cuda.Event()
                ev.record(self.streams[r])
                self._events.append(ev)
        return out

    def _barrier(self, skip: Sequence[int] = ()) -> None:
        """Every rank (except ``skip``) waits until every other rank has finished its last phase."""
        if self.mode != "concurrent":
            return  # (lockstep: each phase ran to its end on every rank before this)
        for r in range(self.P):
            if r not in skip:
                for q in range(self.P):
                    if q != r:
                        self.streams[r].wait_event(self._events[q])

    def step(self, inp: dict[str, list[torch.Tensor]], timeout_s: float = 120.0) -> dict[str, list[Any]]:
        """One forward and backward of every rank on ``inp`` (per rank: ``x``, ``idx``, ``w``, ``dO``); returns the
        outputs and gradients on the host: ``out`` [r], ``grads`` [r] (dict: x, topk_w, w13, w2, shared)."""
        L, w = self.layers, self.weights
        if self.cuda:
            torch.cuda.synchronize(self.dev)  # the inputs, made on the default stream
        self._phase(lambda r: L[r].stage(inp["x"][r], inp["idx"][r], inp["w"][r]))
        self._barrier()
        self._phase(lambda r: L[r].compute(inp["x"][r]))
        self._barrier(skip=(0,) if "missing-fence" in self.breaks else ())
        outs = self._phase(lambda r: L[r].finish())
        self._phase(lambda r: backward_stage(L[r], inp["dO"][r]))
        self._barrier()
        parts = self._phase(lambda r: backward_compute(L[r], inp["x"][r], w.w13[r], w.w2[r], w.shared,
                                                       dO_TH=inp["dO"][r]))
        self._barrier()
        grads = self._phase(lambda r: backward_finish(L[r], inp["idx"][r], parts[r]))
        if self.mode == "concurrent":
            wait_all(self._events, timeout_s)
        return {"out": [o.cpu() for o in outs], "grads": [_host(g) for g in grads]}


def wait_all(events: Sequence[Any], timeout_s: float) -> None:
    """Wait (polling) until every CUDA event has completed; :class:`CheckTimeout` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not all(ev.query() for ev in events):
        if time.monotonic() > deadline:
            raise CheckTimeout(f"the ranks did not finish within {timeout_s:.0f} s (a hang)")
        time.sleep(0.001)


def _host(g: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu() for k, v in g.items()}


def _without_resets(scheduler: Any) -> Callable[..., Any]:
    """A scheduler that no longer zeroes the ready counters and work queue it is given (the fault)."""

    def schedule(*args: Any, ready: Any = None, work: Any = None, **kw: Any) -> Any:
        return scheduler(*args, **kw)

    return schedule


def _cycles_per_ms(dev: torch.device) -> float:
    """The GPU's clock cycles per millisecond, timed on a device sleep (for the concurrent mode's skew)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(dev)
    return cycles / max(start.elapsed_time(end), 1e-3)
