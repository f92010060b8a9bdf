"""The one backend interface, and the registry from backend key to implementation.

Backends live in ``baselines/`` and ``mok_kernels/`` and never import the harness: they fit :class:`Backend`
structurally and are imported lazily from the registry (:data:`REGISTRY`: key -> import target, label, role and
colour, the one table of backend names, which reports and charts read too), so a backend whose library is missing
costs nothing until it is asked for (and then becomes an ``unsupported`` row).

Lifecycle, per sweep point (every rank runs the same calls):

1. ``cls.unsupported_reason(case)`` -> None, or "why; how to fix" (missing package, GPU too old, topology).
2. ``b = cls(case, group)``; ``b.setup(inputs)``: buffers, weight layouts, JIT, compilation. Untimed.
   A backend that declares options (its registry line's ``options``; contract/options.py) gets them as one more
   argument here and in step 1: ``unsupported_reason(case, options)``, ``cls(case, group, options)``.
3. ``out = b.forward(x, topk_idx, topk_w)``: one layer forward. ``x`` [T,H] bf16 and ``topk_w`` [T,K] fp32 are
   leaves owned by the harness; for backward the harness calls ``out.backward(grad_out)`` and reads ``x.grad``,
   ``topk_w.grad`` and ``b.weight_grads()`` (gate/up [L,I,H], down [L,H,I], shared gate/up [I,H], down [H,I]).
4. ``b.zero_grad()`` between iterations; ``b.traffic()`` and ``b.phases()`` for byte counts and per-phase
   bandwidth; ``b.info()`` for extra row columns (``scaling``, ``compiled``, ``comm_sms``, ``notes``, ...).
5. ``b.teardown()``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass

from contract.backend import WEIGHT_GRAD_NAMES, Backend, check_backend  # noqa: F401 (re-exported)

ROLES = ("reference", "published baseline", "baseline", "anchor", "contender")
"""What a backend is in a comparison:

* ``reference``: the ground truth, never a contender;
* ``published baseline``: a baseline of the published figure (PyTorch+NCCL, DeepEP+PyTorch, DeepEP+TE,
  HybridEP+Megatron); the published-claim verdicts are computed against these;
* ``baseline``: a baseline that the published figure does not have (HybridEP+PyTorch); counted with the published
  baselines (the fastest baseline of a cell is the fastest of both), so out-of-tree backends default to it;
* ``anchor``: a fused MoE layer a user would pick instead of the contender (Liger-Kernel, SonicMoE, LigerCute,
  DeepGEMM MegaMoE, FlashInfer); shown in every table and chart, marked as an anchor, never counted as a baseline;
* ``contender``: a fused kernel whose speedup the reports compute (MoK, this project's mok_hopper)."""


@dataclass(frozen=True)
class BackendSpec:
    """One registry entry: the import target (``package.module:Class``, empty for a name that only reports use),
    the label reports print, its role (:data:`ROLES`), its colour in charts and, for a backend that takes options,
    the import target of its options dataclass (``package.module:Class``, a torch-free module; contract/options.py)."""

    target: str
    label: str
    role: str
    color: str
    options: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)} (got {self.role!r})")


_EXPERT_GEMM = "baselines.options:ExpertGemmOptions"  # the options of the PyTorch-expert baselines
_TE = "baselines.options:TeOptions"  # the options of the Transformer Engine baselines
_TORCH = "baselines.options:TorchNativeOptions"  # the options of the PyTorch-native layer

# The one table of backend names, in the order reports show them (baselines first, then anchors, then the fused
# contenders). A new backend adds one line here.
REGISTRY: dict[str, BackendSpec] = {
    "nccl": BackendSpec("baselines.nccl:NcclBackend", "NCCL+PyTorch", "published baseline", "#8c8c8c", _EXPERT_GEMM),
    "deepep": BackendSpec("baselines.deepep:DeepEPBackend", "DeepEP+PyTorch", "published baseline", "#1f77b4",
                          _EXPERT_GEMM),
    "deepep_te": BackendSpec("baselines.deepep_te:DeepEPTEBackend", "DeepEP+TE", "published baseline", "#9467bd",
                             _TE),
    "hybridep_megatron": BackendSpec("baselines.hybridep_megatron:HybridEPMegatronBackend", "HybridEP+Megatron",
                                     "published baseline", "#2ca02c", _TE),
    "hybridep": BackendSpec("baselines.hybridep:HybridEPBackend", "HybridEP", "baseline", "#17becf", _EXPERT_GEMM),
    "torch": BackendSpec("baselines.torch_native:TorchNativeBackend", "PyTorch layer (eager)", "baseline", "#c49c94",
                         _TORCH),
    "torch_compiled": BackendSpec("baselines.torch_native:TorchCompiledBackend", "PyTorch layer (torch.compile)",
                                  "baseline", "#8c6d31", _TORCH),
    "liger": BackendSpec("baselines.liger:LigerBackend", "Liger fused MoE (anchor)", "anchor", "#bcbd22"),
    "sonicmoe": BackendSpec("baselines.sonicmoe:SonicMoEBackend", "SonicMoE (anchor)", "anchor", "#e377c2"),
    "liger_cute": BackendSpec("baselines.liger_cute:LigerCuteBackend", "LigerCute fused EP MoE (anchor)", "anchor",
                              "#dbdb8d"),
    "deepgemm_megamoe": BackendSpec("baselines.deepgemm_megamoe:DeepGemmMegaMoEBackend",
                                    "DeepGEMM MegaMoE fp8 inference (anchor)", "anchor", "#393b79"),
    "flashinfer": BackendSpec("baselines.flashinfer:FlashInferBackend", "FlashInfer fused MoE inference (anchor)",
                              "anchor", "#637939", "baselines.options:FlashInferOptions"),
    "mok": BackendSpec("mok_kernels.mok_upstream:MokBackend", "MoK", "contender", "#d62728"),
    "mok_hopper": BackendSpec("mok_kernels.mok_hopper.backend:MokHopperBackend", "MoK Hopper (ours)", "contender",
                              "#ff7f0e", "mok_kernels.mok_hopper.options:MokHopperOptions"),
    # mok_hopper rows timed on the CPU ran its pure-torch twin (mok_kernels/mok_hopper/twin/): reports rename them
    # to this name, so that no table or chart draws them as the kernel (not a backend of its own: no target)
    "mok_hopper_cpu_twin": BackendSpec("", "MoK Hopper CPU twin (pure torch, not the kernel)", "contender",
                                       "#ffbb78"),
    "reference": BackendSpec("harness.measure.reference:ReferenceBackend", "reference", "reference", "#000000"),
}

# backend key -> import target, for every backend that can run (``backends=[...]`` takes these keys)
BACKENDS: dict[str, str] = {k: s.target for k, s in REGISTRY.items() if s.target}

_FALLBACK_COLORS = ("#8c564b", "#7f7f7f", "#aec7e8", "#98df8a")
DEFAULT_ROLE = "baseline"  # an out-of-tree or unknown backend: counted with the baselines, as before the roles

# Out-of-tree backends: MOKBENCH_EXTRA_BACKENDS="name=package.module:Class,other=pkg.mod:Cls". Read at import, so
# ranks spawned by the harness (which inherit the environment) see them too. They get the default label (their
# key), role (``baseline``) and a colour of their own (:func:`spec`).
for _item in filter(None, os.environ.get("MOKBENCH_EXTRA_BACKENDS", "").split(",")):
    _key, _, _target = _item.partition("=")
    if _key.strip() and ":" in _target:
        BACKENDS[_key.strip()] = _target.strip()


SERIES_SEP = " · "  # "nccl · rowwise": one backend's rows of one variant, where a run has several (reports only)


def series_name(backend: str, variant: str) -> str:
    """The report name of ``backend``'s rows of one variant (e.g. its fp8 GEMM path), where one run holds rows of
    several: the same registry entry, labelled with the variant."""
    return f"{backend}{SERIES_SEP}{variant}"


def series_parts(name: str) -> tuple[str, str]:
    """``series_name``'s inverse: (backend key, variant); a plain key is (itself, "")."""
    base, _, variant = str(name).partition(SERIES_SEP)
    return base, variant


def base_name(name: str) -> str:
    """The backend key of a report name (a plain key is its own)."""
    return series_parts(name)[0]


def spec(name: str) -> BackendSpec:
    """The registry entry of a backend key; for a key the registry does not know (an out-of-tree backend, a name
    in an old result file) a default one: its key as label, role ``baseline``, a fallback colour fixed by the
    name. A ``series_name`` gets its backend's entry, labelled with the variant."""
    if name in REGISTRY:
        return REGISTRY[name]
    base, variant = series_parts(name)
    if variant:
        s = spec(base)
        return dataclasses.replace(s, label=f"{s.label} ({variant})")
    return BackendSpec(BACKENDS.get(name, ""), str(name), DEFAULT_ROLE,
                       _FALLBACK_COLORS[sum(map(ord, str(name))) % len(_FALLBACK_COLORS)])


def role(name: str) -> str:
    return spec(name).role


def names_with_role(*roles: str) -> tuple[str, ...]:
    """Registry keys with one of ``roles``, in registry (display) order."""
    return tuple(k for k, s in REGISTRY.items() if s.role in roles)


class BackendImportError(RuntimeError):
    pass


def load_backend(name: str) -> type:
    """Import the class behind a backend key (a KeyError for unknown keys is a config error raised earlier)."""
    module, _, attr = BACKENDS[name].partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:  # an adapter module whose optional dependency is absent at import time
        raise BackendImportError(f"{name}: {e}") from e
    check_backend(cls, name, takes_options=bool(REGISTRY[name].options) if name in REGISTRY else False)
    return cls
