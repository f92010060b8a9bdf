"""torch.compile with a documented fallback: the mode a point asks for, then the next ones, down to eager.

A compiled baseline compiles and autotunes on its first call. Where that fails (on glm_5_2 at EP=1, one H100,
inductor's ``max-autotune`` ran out of memory autotuning the weight-gradient ``_grouped_mm``, every Triton choice
then failed in the autotuning subprocess, and the compile ended in ``NoValidChoicesError``), the baseline falls back
in this order, starting at the mode asked for: :data:`FALLBACK_ORDER` (``max-autotune``, ``max-autotune-no-cudagraphs``,
``default``, then eager). Between two tries everything the failed one left is dropped: dynamo's and inductor's
in-process caches (``torch.compiler.reset``), inductor's autotuning subprocesses, the allocator's cached blocks, and
the on-disk inductor cache (each try gets a fresh ``TORCHINDUCTOR_CACHE_DIR`` under the one in force, so a failed
try's cached artifacts cannot make the next one fail the same way in seconds). The ranks of a group agree on the
outcome of each try (the worst rank's), so every rank runs the same mode. The row's ``compile_mode`` records the mode
that ran (``eager`` where none compiled) and its ``notes`` each failure (:attr:`CompileOutcome.note`).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from contract.case import CUDAGRAPH_MODES
from contract.compiled import drop_compiled_state

EAGER = "eager"
FALLBACK_ORDER = ("max-autotune", "max-autotune-no-cudagraphs", "default", EAGER)




def step_begin(mode: str, device_is_cuda: bool) -> None:
    """Before each call of compiled code that replays CUDA graphs (cudagraph trees): a new step begins, so that the
    outputs of the last call, which the next replay overwrites, are no longer read (torch's
    ``cudagraph_mark_step_begin``, as a training loop calls it once per iteration)."""
    if device_is_cuda and mode in CUDAGRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()


def modes_from(mode: str) -> tuple[str, ...]:
    """The modes to try for a requested ``mode``: itself, then the fallback order after it (a mode outside the
    order, e.g. ``reduce-overhead``, is tried first, then the whole order)."""
    if mode in FALLBACK_ORDER:
        return FALLBACK_ORDER[FALLBACK_ORDER.index(mode):]
    return (mode, *FALLBACK_ORDER)


@dataclass
class CompileOutcome:
    """Which mode ran (``mode``; :data:`EAGER` where every compiled mode failed) and why each earlier one failed."""

    mode: str
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def note(self) -> str:
        """The notes entry of a fallback ('' where the first mode ran)."""
        if not self.failures:
            return ""
        tried = "; ".join(f"{m}: {why}" for m, why in self.failures)
        return f"compile fell back to {self.mode} ({tried})"


def fresh_inductor_cache(mode: str) -> str:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` at a new folder for one try (under the one in force, or the temp folder)."""
    parent = os.environ.get("MOKBENCH_INDUCTOR_CACHE_PARENT") or os.environ.get("TORCHINDUCTOR_CACHE_DIR") \
        or tempfile.gettempdir()
    os.environ.setdefault("MOKBENCH_INDUCTOR_CACHE_PARENT", parent)
    os.makedirs(parent, exist_ok=True)
    path = tempfile.mkdtemp(prefix=f"mokbench-{mode}-", dir=parent)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def compile_with_fallback(mode: str, build: Callable[[str], Any], warm: Callable[[Any], None],
                          agree: Optional[Callable[[bool], bool]] = None) -> tuple[Any, CompileOutcome]:
    """``build(mode)`` -> the callable for ``mode`` (``build(EAGER)``: the uncompiled one); ``warm(fn)`` runs it once
    (forward and backward), which compiles and autotunes. Tries :func:`modes_from` ``(mode)`` in turn and returns the
    first callable that warmed, with the outcome. ``agree(failed_here) -> failed_anywhere`` makes every rank of a
    group take the same branch (None: one process). Eager is the last resort; its failure is raised."""
    outcome = CompileOutcome(mode)
    for m in modes_from(mode):
        if m != EAGER:
            fresh_inductor_cache(m)
        err: Optional[BaseException] = None
        fn = None
        try:
            fn = build(m)
            warm(fn)
        except Exception as e:  # noqa: BLE001 (a failed compile or autotuning: try the next mode)
            if m == EAGER:
                raise
            err = e
        failed = err is not None
        if agree is not None:
            failed = agree(failed)
        if not failed:
            outcome.mode = m
            return fn, outcome
        outcome.failures.append((m, first_line(err) if err is not None else "failed on another rank"))
        err = fn = None
        drop_compiled_state()
    raise AssertionError("unreachable: eager either runs or raises")


def group_agree(group: Any, device: torch.device) -> Optional[Callable[[bool], bool]]:
    """An ``agree`` for :func:`compile_with_fallback` over ``group`` (None where the group has one rank)."""
    import torch.distributed as dist

    from contract import comm

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None

    def agree(failed: bool) -> bool:
        flag = torch.tensor([1.0 if failed else 0.0], device=device)
        comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    return agree
