"""The one backend interface (:class:`Backend`), and the check a registry runs on a class it loads.

Lifecycle, per sweep point (every rank runs the same calls): ``cls.unsupported_reason(case)``; ``b = cls(case,
group)``; ``b.setup(inputs)``; ``out = b.forward(x, topk_idx, topk_w)`` (for backward the harness calls
``out.backward(grad_out)`` and reads ``x.grad``, ``topk_w.grad`` and ``b.weight_grads()``, keyed by
:data:`WEIGHT_GRAD_NAMES`); ``b.zero_grad()``, ``b.traffic()``, ``b.phases()``, ``b.info()``; ``b.teardown()``.
:mod:`harness.core.backends` says what each step is for.

A backend that can run with several ranks on one GPU (``ranks_per_gpu`` > 1: a gloo group, collectives through
:mod:`contract.comm`, correctness checks only) says so with a class attribute ``runs_shared_gpu = True``, and where
that holds only for some cases, why not in an optional classmethod ``shared_gpu_unsupported(case)``; the harness
gives every other backend an ``unsupported`` row there (:func:`shared_gpu_unsupported`).

A backend that implements a direction only for some cases (a backward at one precision, or at one EP size) says why
not in an optional classmethod ``direction_unsupported(case, direction) -> Optional[str]``; the harness asks
:func:`direction_unsupported`, which also covers the directions a backend does not list at all.

A backend that takes options (:mod:`contract.options`) gets them as one more argument of each of those calls:
``unsupported_reason(case, options)``, ``cls(case, group, options)``, ``direction_unsupported(case, direction,
options)``. Its tools and tests may leave ``options`` out for the defaults.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Protocol

if TYPE_CHECKING:  # annotations only: the registry and reports load the contract without torch
    import torch

from contract.case import Case
from contract.inputs import LayerInputs

WEIGHT_GRAD_NAMES = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
METHODS = ("setup", "forward", "zero_grad", "weight_grads", "traffic", "phases", "info", "teardown")


class Backend(Protocol):
    name: ClassVar[str]
    directions: ClassVar[tuple[str, ...]]  # which of fwd / bwd / fwd_bwd it implements

    @classmethod
    def unsupported_reason(cls, case: Case) -> Optional[str]: ...

    def __init__(self, case: Case, group: Any) -> None: ...

    def setup(self, inputs: LayerInputs) -> None: ...

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor: ...

    def zero_grad(self) -> None: ...

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]: ...

    def traffic(self) -> dict[str, Any]: ...

    def phases(self) -> dict[str, Callable[[], Any]]: ...

    def info(self) -> dict[str, Any]: ...

    def teardown(self) -> None: ...


def direction_unsupported(cls: Any, case: Case, direction: str, options: Any = None) -> Optional[str]:
    """Why ``cls`` cannot run ``direction`` on ``case`` (None: it can): a direction it does not list, or its own
    optional ``direction_unsupported(case, direction[, options])`` (``options``: the backend's, where it takes any)."""
    if direction not in cls.directions:
        return f"{cls.name} implements {', '.join(cls.directions)} only"
    hook = getattr(cls, "direction_unsupported", None)
    if hook is None:
        return None
    return hook(case, direction) if options is None else hook(case, direction, options)


def shared_gpu_unsupported(cls: Any, case: Case, key: str, ranks_per_gpu: int) -> Optional[str]:
    """Why ``cls`` cannot run ``case`` with ``ranks_per_gpu`` ranks on each GPU (None: it can)."""
    if not getattr(cls, "runs_shared_gpu", False):
        return (f"{key} runs one rank per GPU (ranks_per_gpu={ranks_per_gpu} puts several on one, talking over gloo "
                f"through the host, which its communication does not use): drop ranks_per_gpu to run it")
    hook = getattr(cls, "shared_gpu_unsupported", None)
    return hook(case) if hook is not None else None


def check_backend(cls: Any, key: str = "", takes_options: bool = False) -> None:
    """Raise TypeError unless ``cls`` fits :class:`Backend`: a ``name``, ``directions`` drawn from
    :data:`DIRECTIONS`, a classmethod ``unsupported_reason(case)``, a constructor taking ``(case, group)`` and
    every method of the lifecycle; with ``takes_options`` (it declares options) the constructor and
    ``unsupported_reason`` take ``options`` too. Run when the registry loads a backend, so a broken adapter fails by
    name before any rank starts, not halfway through a sweep."""
    who = f"backend {key or getattr(cls, '__name__', cls)!r} ({getattr(cls, '__module__', '?')})"
    problems = []
    if not isinstance(getattr(cls, "name", None), str):
        problems.append("no class attribute `name`")
    dirs = getattr(cls, "directions", None)
    if not isinstance(dirs, tuple) or not dirs or not set(dirs) <= set(DIRECTIONS):
        problems.append(f"`directions` must be a non-empty tuple drawn from {DIRECTIONS}, got {dirs!r}")
    reason = inspect.getattr_static(cls, "unsupported_reason", None)
    if not isinstance(reason, classmethod):
        problems.append("`unsupported_reason` must be a classmethod taking the case")
    hook = inspect.getattr_static(cls, "direction_unsupported", None)
    if hook is not None and not isinstance(hook, classmethod):
        problems.append("`direction_unsupported`, where given, must be a classmethod taking (case, direction)")
    hook = inspect.getattr_static(cls, "shared_gpu_unsupported", None)
    if hook is not None and not isinstance(hook, classmethod):
        problems.append("`shared_gpu_unsupported`, where given, must be a classmethod taking the case")
    args = (None, None, None) if takes_options else (None, None)
    try:
        inspect.signature(cls).bind(*args)
    except (TypeError, ValueError):
        problems.append(f"the constructor must take (case, group{', options' if takes_options else ''})")
    if takes_options and isinstance(reason, classmethod):
        try:
            inspect.signature(cls.unsupported_reason).bind(None, None)
        except (TypeError, ValueError):
            problems.append("`unsupported_reason` must take (case, options): the backend declares options")
    for m in METHODS:
        if not callable(getattr(cls, m, None)):
            problems.append(f"no method `{m}`")
    if problems:
        raise TypeError(f"{who} does not fit the Backend protocol: " + "; ".join(problems))
