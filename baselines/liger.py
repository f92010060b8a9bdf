"""Liger-Kernel's fused MoE as an anchor: what a Hopper user could pick instead of a fused EP layer.

Liger-Kernel (``liger-kernel``, tested 0.8.5) ships ``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``: a Triton
autograd op for the routed experts of one GPU, forward and backward, bf16. This adapter calls it on the harness's
inputs, as they are:

* weights: its ``gate_up_proj`` [E, 2I, H] is the harness's ``w13`` [L, 2I, H] (gate rows, then up rows: Liger
  reads the up rows at ``I`` past the gate rows) and its ``down_proj`` [E, H, I] the harness's ``w2``; both are the
  harness's tensors as autograd leaves (no copy), and the gradients Liger returns are the harness's layout;
* routing: the harness's top-k ids (cast to int32, the dtype Liger's routing kernels read) and fp32 router weights
  (a leaf; Liger applies them in its weighted gather-sum and returns their gradient);
* the shared expert: the PyTorch baselines' dense SwiGLU (``baselines.common``, torch.compile'd like theirs), added
  to Liger's bf16 output.

What Liger does per call (its own design, recorded in ``notes``): three routing kernels and one host sync (``.item()``
for the tile count) per forward, a gather + grouped GEMM + SwiGLU kernel, a down-projection kernel and a weighted
gather-sum; a backward that recomputes ``dO @ W2^T`` instead of keeping the expert outputs.

Autotuning: every GEMM kernel autotunes over 32 configs (the weight-gradient kernels 16, the gather-sum 40) keyed on
(H, I), about 240 compiles per shape. ``setup`` runs one untimed forward + backward on the harness's inputs so that
all of it happens there (it is in ``setup_s``, and the seconds it took are in ``notes``); ``LIGER_FUSED_MOE_AUTOTUNE=0``
pins one config per kernel (Liger's own switch). Where the user sets ``TRITON_CACHE_DIR``, Triton's compiled kernels
are reused from it, and the autotuning results too (``TRITON_CACHE_AUTOTUNING=1`` is set for Liger's autotuners
unless the user set it). The compiles, not the benchmarks, are most of the autotuning's time (on one H200 one
shape's did not finish within 600 s: lab/diagnostics/2026-12-01-s12/): ``python -m mok_tools.liger_precompile``
compiles every config ahead, in parallel, into that cache; setup then only benchmarks, and the notes cite the
precompile's record (``PRECOMPILE_RECORD`` in the cache folder).

Not supported, as ``unsupported`` rows: precisions other than bf16; the clamped SwiGLU (``shape.swiglu_limit``: Liger
has no clamp); EP >= 2 (below); a machine without a CUDA GPU (Triton's CPU interpreter runs Liger's kernels
correctly in fp32 only, which is how the CPU tests check this adapter: its bf16 outputs are wrong, and its backward
has no bf16 atomics).

Why no EP >= 2: the op is a single-GPU layer. It takes every expert's weights and routes each token's top-k over
them itself; there is no dispatch. Behind a dispatch (DeepEP) the received rows carry -1 for the experts of other
ranks, which Liger's routing kernels index without a bounds check; re-expressing them as one row per local
(token, k) with a new top-k of 1 would no longer be Liger's layer (its gather and weighted sum degenerate). Liger's
expert-parallel op, ``LigerExpertParallelFusedMoEFunction``, is a CuTe DSL kernel of the separate
``liger_cute_kernels`` package on NVSHMEM, not this one.

Legend: T tokens, K top-k, E = L experts (EP = 1), H hidden, I expert ffn.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Optional

import torch

from contract import Case, LayerInputs
from baselines.common import ExpertParams, cache_record, package_version, warm_forward_backward

DIST = "liger-kernel"  # the distribution whose version the rows name

INSTALL_HINT = "pip install liger-kernel (0.8.5 tested; docs/backends.md, 'Anchors: Liger-Kernel and SonicMoE')"
AUTOTUNE_ENV = "LIGER_FUSED_MOE_AUTOTUNE"  # Liger's switch: 0 pins one config per kernel (read at import)
PRECOMPILE_RECORD = "mokbench-liger-precompile.json"  # what mok_tools.liger_precompile wrote to the Triton cache


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def prepare_environment(device: str) -> None:
    """Before the first ``import liger_kernel`` (its autotuners read these when they are built): cache the
    autotuning results next to the compiled kernels where the user set ``TRITON_CACHE_DIR``; in Triton's CPU
    interpreter pin one config per kernel (the interpreter cannot benchmark configs)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if device == "cpu":
        os.environ.setdefault(AUTOTUNE_ENV, "0")


def autotune_pinned() -> bool:
    """Liger's switch as Liger reads it: ``LIGER_FUSED_MOE_AUTOTUNE`` 0 / false / no pins one config per kernel."""
    return os.environ.get(AUTOTUNE_ENV, "1").lower() in ("0", "false", "no")


def precompile_record() -> Optional[dict]:
    """The record of ``mok_tools.liger_precompile`` in the user's Triton cache, if it prepared that cache."""
    return cache_record("TRITON_CACHE_DIR", PRECOMPILE_RECORD)


def autotuners() -> dict[str, Any]:
    """Liger's autotuned fused-MoE kernels (name -> triton Autotuner)."""
    from liger_kernel.ops import fused_moe_kernels as k

    return {n: getattr(k, n) for n in dir(k) if n.startswith("_") and hasattr(getattr(k, n), "configs")}


class LigerBackend:
    name = "liger"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case) -> Optional[str]:
        if importlib.util.find_spec("liger_kernel") is None:
            return f"liger-kernel is not installed; {INSTALL_HINT}"
        if case.precision != "bf16":
            return "Liger's fused MoE is bf16 only (its Triton GEMMs take bf16 operands); use precision=bf16"
        if case.swiglu_limit is not None:
            return ("Liger's fused MoE has no clamped SwiGLU (shape.swiglu_limit); use a shape without "
                    "swiglu_limit")
        if case.ep_size != 1:
            return ("Liger's fused MoE is a single-GPU op (all experts' weights, its own routing, no dispatch; "
                    "DeepEP's -1 ids for other ranks' experts are not accepted by its routing kernels): run it at "
                    "ep_size=1 (baselines/liger.py says why)")
        if case.device != "cuda":
            return ("Liger's fused MoE needs a CUDA GPU (Triton kernels; Triton's CPU interpreter runs them in fp32 "
                    "only: its bf16 results are wrong, so the harness's bf16 layer cannot run there)")
        prepare_environment(case.device)
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction  # noqa: F401
        except Exception as e:  # noqa: BLE001 (a broken install or an incompatible Triton)
            return f"liger_kernel.ops.fused_moe does not import ({type(e).__name__}: {e}); {INSTALL_HINT}"
        return None

    def __init__(self, case: Case, group: Any) -> None:
        self.case, self.group = case, group
        self.autotune_s: Optional[float] = None
        self.tuned: dict[str, int] = {}  # kernel -> configs it chose from

    def setup(self, inputs: LayerInputs) -> None:
        prepare_environment(self.case.device)
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        self._op = LigerFusedMoEFunction.apply
        self.params = ExpertParams(self.case, inputs)  # leaves aliasing the inputs; the shared expert's compile
        # Autotuning (and the Triton compiles) of every kernel of the forward and the backward, untimed
        self.autotune_s = warm_forward_backward(self._routed, inputs, self.params)
        self.tuned = {n.strip("_"): len(t.configs) for n, t in autotuners().items() if getattr(t, "cache", None)}

    def _routed(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        return self._op(x_TH, self.params.w13, self.params.w2, topk_idx_TK.to(torch.int32), topk_w_TK)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        return self.params.add_shared(self._routed(x_TH, topk_idx_TK, topk_w_TK), x_TH)

    def zero_grad(self) -> None:
        self.params.zero_grad()

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return self.params.grads()

    def traffic(self) -> dict[str, Any]:
        return {}  # EP = 1: no token leaves the GPU

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def info(self) -> dict[str, Any]:
        pinned = autotune_pinned()
        tune = (f"one config per kernel ({AUTOTUNE_ENV}=0)" if pinned else
                f"autotuned in setup: {len(self.tuned)} kernels over {sum(self.tuned.values())} configs")
        cache = ("Triton cache " + os.environ["TRITON_CACHE_DIR"]
                 + (" with autotuning results" if os.environ.get("TRITON_CACHE_AUTOTUNING") == "1" else "")
                 if os.environ.get("TRITON_CACHE_DIR") else "Triton's default cache")
        pre = precompile_record()
        if pre and not pinned:
            cache += (f" (compiled ahead by mok_tools.liger_precompile for {pre.get('shapes')}: "
                      f"{pre.get('workers')} processes, {pre.get('seconds')} s, {pre.get('utc')})")
        where = "Triton interpreter (CPU)" if _interpreted() else "Triton"
        notes = [f"Liger-Kernel {package_version(DIST)} LigerFusedMoEFunction ({where}): routing kernels with one host "
                 "sync per forward, gather + grouped GEMM + SwiGLU, down GEMM, weighted gather-sum; backward "
                 "recomputes dO @ W2^T (no expert outputs kept)",
                 f"{tune}; setup forward+backward {self.autotune_s or 0:.1f} s; {cache}",
                 "shared expert: the PyTorch baselines' dense SwiGLU, added to Liger's bf16 output",
                 "EP=1 only (single-GPU op)"]
        return {**self.params.columns(), "notes": "; ".join(notes)}

    def teardown(self) -> None:
        self.params = None
