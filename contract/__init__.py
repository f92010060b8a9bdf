"""The contract between the harness, the baselines and the kernels: what a sweep point is (:class:`Case`), the
inputs of one layer call (:class:`LayerInputs`), the backend interface (:class:`Backend`), the expert weights as
autograd leaves (:class:`ExpertLeaves`) and the fp8 block format (:mod:`contract.fp8`). It imports none of
``harness``, ``baselines`` or ``mok_kernels``; they all import it. Names are loaded on first use, so that reading the
backend registry or a report needs no torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"WEIGHT_GRAD_NAMES": "backend", "Backend": "backend", "check_backend": "backend",
          "direction_unsupported": "backend", "Case": "case",
          "FP8_MAX": "fp8", "dequantize_blocks": "fp8", "quantize_blocks": "fp8", "LayerInputs": "inputs",
          "ExpertLeaves": "weights"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"contract.{_WHERE[name]}"), name)
    raise AttributeError(name)
