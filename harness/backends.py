"""The one backend interface, and the registry from backend key to implementation.

Backends live in ``baselines/`` and ``kernels/`` and never import the harness: they fit :class:`Backend`
structurally and are imported lazily from this table, so a backend whose library is missing costs nothing until it
is asked for (and then becomes an ``unsupported`` row).

Lifecycle, per sweep point (every rank runs the same calls):

1. ``cls.unsupported_reason(case)`` -> None, or "why; how to fix" (missing package, GPU too old, topology).
2. ``b = cls(case, group)``; ``b.setup(inputs)``: buffers, weight layouts, JIT, compilation. Untimed.
3. ``out = b.forward(x, topk_idx, topk_w)``: one layer forward. ``x`` [T,H] bf16 and ``topk_w`` [T,K] fp32 are
   leaves owned by the harness; for backward the harness calls ``out.backward(grad_out)`` and reads ``x.grad``,
   ``topk_w.grad`` and ``b.weight_grads()`` (gate/up [L,I,H], down [L,H,I], shared gate/up [I,H], down [H,I]).
4. ``b.zero_grad()`` between iterations; ``b.traffic()`` and ``b.phases()`` for byte counts and per-phase
   bandwidth; ``b.info()`` for extra row columns (``scaling``, ``compiled``, ``comm_sms``, ``notes``, ...).
5. ``b.teardown()``.
"""

from __future__ import annotations

import importlib
import os

from contract.backend import WEIGHT_GRAD_NAMES, Backend, check_backend  # noqa: F401 (re-exported)

BACKENDS: dict[str, str] = {
    "reference": "harness.reference:ReferenceBackend",
    "nccl": "baselines.nccl:NcclBackend",
    "deepep": "baselines.deepep:DeepEPBackend",
    "hybridep": "baselines.hybridep:HybridEPBackend",
    "deepep_te": "baselines.deepep_te:DeepEPTEBackend",
    "hybridep_megatron": "baselines.hybridep_megatron:HybridEPMegatronBackend",
    "mok_hopper": "kernels.mok_hopper.backend:MokHopperBackend",
    "mok": "kernels.mok_upstream:MokBackend",
}

# Out-of-tree backends: MOKBENCH_EXTRA_BACKENDS="name=package.module:Class,other=pkg.mod:Cls". Read at import, so
# ranks spawned by the harness (which inherit the environment) see them too.
for _item in filter(None, os.environ.get("MOKBENCH_EXTRA_BACKENDS", "").split(",")):
    _key, _, _target = _item.partition("=")
    if _key.strip() and ":" in _target:
        BACKENDS[_key.strip()] = _target.strip()


class BackendImportError(RuntimeError):
    pass


def load_backend(name: str) -> type:
    """Import the class behind a backend key (a KeyError for unknown keys is a config error raised earlier)."""
    module, _, attr = BACKENDS[name].partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:  # an adapter module whose optional dependency is absent at import time
        raise BackendImportError(f"{name}: {e}") from e
    check_backend(cls, name)
    return cls
