"""The contract between the harness, the baselines and the kernels: what a sweep point is (:class:`Case`), the
inputs of one layer call (:class:`LayerInputs`), the backend interface (:class:`Backend`), the expert weights as
autograd leaves (:class:`ExpertLeaves`) and the fp8 block format (:mod:`contract.fp8`). It imports none of
``harness``, ``baselines`` or ``kernels``; they all import it."""

from contract.backend import WEIGHT_GRAD_NAMES, Backend, check_backend
from contract.case import Case
from contract.fp8 import FP8_MAX, dequantize_blocks, quantize_blocks
from contract.inputs import LayerInputs
from contract.weights import ExpertLeaves

__all__ = ["WEIGHT_GRAD_NAMES", "Backend", "Case", "ExpertLeaves", "FP8_MAX", "LayerInputs", "check_backend",
           "dequantize_blocks", "quantize_blocks"]
