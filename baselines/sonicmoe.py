"""SonicMoE (Dao-AILab, ``sonic-moe``) as an anchor: the strongest published fused MoE forward + backward on Hopper.

SonicMoE's layer (``sonicmoe.MoE``) routes with its own softmax top-k router. The harness instead gives every
backend the same precomputed top-k, so this adapter calls SonicMoE's public functional entry for precomputed routing,
``sonicmoe.moe_general_routing_inputs`` (the one ``MoE`` uses after its router), as the Megatron adapter replaces
Megatron's router with the harness's top-k:

* routing as SonicMoE's flat lists: ``token_indices`` (int32, ascending, as it requires: token t repeated K times),
  ``expert_indices`` (the harness's top-k ids, int32) and ``router_scores`` (the harness's fp32 router weights,
  flattened: a view, so their gradient is the harness leaf's);
* weights: SonicMoE wants ``w1`` of shape (2I, H, E) with stride order (2, 0, 1) and ``w2`` (H, I, E) with the same
  order, which are exactly ``w13.permute(1, 2, 0)`` and ``w2.permute(1, 2, 0)`` of the harness's [E, 2I, H] and
  [E, H, I] tensors: views, no copy; ``concat_layout=True`` says gate rows come before up rows (the harness's order;
  SonicMoE's default interleaves them); no biases; ``ActivationType.SWIGLU``;
* the shared expert: the PyTorch baselines' dense SwiGLU (``baselines.common``), added to SonicMoE's output.

Environment: ``sonic-moe`` 0.1.2.post1 requires torch <= 2.9.1, ``nvidia-cutlass-dsl == 4.4.2`` (about 150 MB of
libraries) and ``quack-kernels``; its GEMMs are CuTe DSL kernels for SM90 / SM100. Where it does not import (not
installed, or its CuTe DSL stack does not load with this torch) the rows are ``unsupported`` with the error and the
environment it runs in (docs/backends.md, 'Anchors: Liger-Kernel and SonicMoE'). With another torch than its pin it is
tried as installed, and ``notes`` says so: on the GPU image's torch 2.11.0+cu130, installed with ``--no-deps``
(``nvidia-cutlass-dsl-libs-cu13``), it imports, QuACK compiles, runs and autotunes its GEMMs
(lab/diagnostics/2026-12-04-s30/), and its forward and backward rows on qwen3_5_397b pass the reference check (run
mok_hopper-bf16-fwd-bwd-qwen3_5_397b_h200x1_20261204-2). FlashInfer needs nvidia-cutlass-dsl >= 4.6.2a0: where both run,
SonicMoE is installed into a folder of its own (``pip install --no-deps --target DIR``) and runs in processes of its
own, ``own_process=[sonicmoe] +own_pythonpath.sonicmoe=DIR`` (``+experiment=hopper_anchors`` takes DIR from
``MOKBENCH_SONICMOE_SITE``).

QuACK autotunes each GEMM on first use, compiling every config (9-22 a GEMM on SM90, one to two CPU-minutes
each; on 16 CPUs the first two of its six GEMMs took 220 s, and the third had not finished 175 s later). Setup runs
one untimed forward and backward, so that this lands in ``setup_s``; ``mok_tools.sonic_precompile`` does the
compiles once, ahead, into ``QUACK_CACHE_DIR`` (the kept kernels do not depend on the problem's sizes), and the rows'
notes cite that.

Not supported, as ``unsupported`` rows: precisions other than bf16 (its fp8 is an open pull request); the clamped
SwiGLU (SonicMoE's SWIGLU has no clamp); EP >= 2 (SonicMoE 0.1.2 is a single-GPU layer; expert parallelism is open
work upstream, through DeepEP and through sentinel experts); GPUs other than Hopper / Blackwell.

Legend: T tokens, K top-k, E = L experts (EP = 1), H hidden, I expert ffn.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Optional

import torch

from contract import Case, LayerInputs
from baselines.common import (ExpertParams, cache_record, device_capability, package_version,
                              warm_forward_backward)

DIST = "sonic-moe"  # the distribution whose version the rows name

PRECOMPILE_RECORD = "mokbench-sonic-precompile.json"  # what mok_tools.sonic_precompile wrote to QUACK_CACHE_DIR
PINNED_TORCH = "2.9.1"  # sonic-moe 0.1.2.post1: torch>=2.7.1,<=2.9.1
SITE_ENV = "MOKBENCH_SONICMOE_SITE"  # where +experiment=hopper_anchors finds its own install (own_pythonpath)
INSTALL_HINT = (f"SonicMoE 0.1.2.post1 pins torch<={PINNED_TORCH} and nvidia-cutlass-dsl==4.4.2: in a Python 3.12 "
                f"environment with torch {PINNED_TORCH} (CUDA 12.8 or 13.0 build), pip install sonic-moe==0.1.2.post1 "
                "(docs/backends.md, 'Anchors: Liger-Kernel and SonicMoE'); beside FlashInfer (nvidia-cutlass-dsl "
                "4.6+), install it with --target DIR and run it as own_process=[sonicmoe] "
                f"+own_pythonpath.sonicmoe=DIR (or {SITE_ENV}=DIR with +experiment=hopper_anchors)")


def torch_within_pin(version: str = torch.__version__) -> bool:
    """Whether this torch satisfies sonic-moe's pin (torch <= 2.9.1; local tags such as +cu130 ignored)."""
    nums = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        nums.append(int(digits) if digits else 0)
    return tuple(nums) <= tuple(int(p) for p in PINNED_TORCH.split("."))


def _import_sonic() -> tuple[Callable, Any]:
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    return moe_general_routing_inputs, ActivationType


def sonic_routed(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, w13_EIH: torch.Tensor,
                 w2_EHI: torch.Tensor, token_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SonicMoE's routed experts for the harness's top-k: ``moe_general_routing_inputs`` with the routing as its flat
    lists and the harness's [E, 2I, H] / [E, H, I] weights as its (2I, H, E) / (H, I, E) views (module docstring)."""
    moe, activation = _import_sonic()
    T, K = topk_idx_TK.shape
    if token_indices is None:
        token_indices = torch.arange(T, device=x_TH.device, dtype=torch.int32).repeat_interleave(K)
    stream = torch.cuda.current_stream().cuda_stream if x_TH.is_cuda else 0
    out, _ = moe(x_TH, topk_w_TK.reshape(-1), token_indices, topk_idx_TK.reshape(-1).to(torch.int32),
                 w13_EIH.permute(1, 2, 0), None, w2_EHI.permute(1, 2, 0), None, w13_EIH.shape[0], stream,
                 activation.SWIGLU, False, True)  # is_inference_mode_enabled=False, concat_layout=True
    return out


def precompile_record() -> Optional[dict]:
    """The record ``mok_tools.sonic_precompile`` left in ``QUACK_CACHE_DIR``, if it prepared that cache."""
    return cache_record("QUACK_CACHE_DIR", PRECOMPILE_RECORD)


class SonicMoEBackend:
    name = "sonicmoe"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case) -> Optional[str]:
        if importlib.util.find_spec("sonicmoe") is None:
            return f"sonic-moe is not installed (this is torch {torch.__version__}); {INSTALL_HINT}"
        if case.precision != "bf16":
            return "SonicMoE 0.1.2 is bf16 only (fp8 is an open pull request upstream); use precision=bf16"
        if case.swiglu_limit is not None:
            return "SonicMoE's SwiGLU has no clamp (shape.swiglu_limit); use a shape without swiglu_limit"
        if case.ep_size != 1:
            return ("SonicMoE 0.1.2 is a single-GPU layer (no expert parallelism; EP through DeepEP is open work "
                    "upstream): run it at ep_size=1")
        cap = device_capability(torch.device(case.device))
        if cap[0] not in (9, 10):
            where = "the CPU" if case.device != "cuda" else f"SM{cap[0]}{cap[1]}"
            return f"SonicMoE's CuTe DSL GEMMs need a Hopper (SM90) or Blackwell (SM100) GPU; this is {where}"
        try:
            _import_sonic()
        except Exception as e:  # noqa: BLE001 (its CuTe DSL / QuACK stack may not load with this torch)
            return (f"sonicmoe does not import with torch {torch.__version__} ({type(e).__name__}: {e}); "
                    f"{INSTALL_HINT}")
        return None

    def __init__(self, case: Case, group: Any) -> None:
        self.case, self.group = case, group
        self._tokens: dict[tuple[int, int, str], torch.Tensor] = {}

    def setup(self, inputs: LayerInputs) -> None:
        _import_sonic()
        self.params = ExpertParams(self.case, inputs)  # leaves aliasing the inputs; the shared expert's compile
        # QuACK autotunes each of SonicMoE's GEMMs on first use (CuTe DSL compiles of its configs, in
        # QUACK_COMPILE_WORKERS processes, then benchmarks): one untimed forward and backward here, so that all of it
        # is in setup_s, as for Liger
        self.autotune_s = warm_forward_backward(self.forward, inputs, self.params)

    def token_indices(self, T: int, K: int, device: torch.device) -> torch.Tensor:
        """Token t repeated K times, ascending (what SonicMoE requires); a constant of the shape, made once."""
        key = (T, K, str(device))
        if key not in self._tokens:
            self._tokens[key] = torch.arange(T, device=device, dtype=torch.int32).repeat_interleave(K)
        return self._tokens[key]

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        T, K = topk_idx_TK.shape
        out = sonic_routed(x_TH, topk_idx_TK, topk_w_TK, self.params.w13, self.params.w2,
                           self.token_indices(T, K, x_TH.device))
        return self.params.add_shared(out, x_TH)

    def zero_grad(self) -> None:
        self.params.zero_grad()

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return self.params.grads()

    def traffic(self) -> dict[str, Any]:
        return {}  # EP = 1: no token leaves the GPU

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def info(self) -> dict[str, Any]:
        pin = "" if torch_within_pin() else f" (its pin is torch<={PINNED_TORCH}; run as installed)"
        workers = os.environ.get("QUACK_COMPILE_WORKERS", "8 (its default)")
        pre = precompile_record()
        cache = (f"QuACK's kernel cache {os.environ['QUACK_CACHE_DIR']}" if os.environ.get("QUACK_CACHE_DIR")
                 else "QuACK's default kernel cache")
        where = (pre or {}).get("compiled_on") or {}
        if where.get("mode") == "cpu":
            cache += (f" (compiled ahead without a GPU by mok_tools.sonic_precompile --cpu {where.get('arch')} on "
                      f"{(where.get('host_cpu') or {}).get('model')}, for Python {where.get('fingerprint_python')}, "
                      f"{pre.get('seconds')} s, {pre.get('utc')})")
        elif pre:
            cache += (f" (compiled ahead by mok_tools.sonic_precompile: {pre.get('workers')} workers, "
                      f"{pre.get('seconds')} s, {pre.get('utc')})")
        notes = [f"SonicMoE {package_version(DIST)} moe_general_routing_inputs with the harness's top-k (its router "
                 f"replaced), concat gate/up layout, torch {torch.__version__}{pin}",
                 f"first forward + backward in setup, untimed: {self.autotune_s:.1f} s (QuACK's GEMM autotuning and "
                 f"compiles, QUACK_COMPILE_WORKERS={workers}); {cache}",
                 "shared expert: the PyTorch baselines' dense SwiGLU, added to SonicMoE's output",
                 "EP=1 only (single-GPU layer)"]
        return {**self.params.columns(), "notes": "; ".join(notes)}

    def teardown(self) -> None:
        self.params = None
        self._tokens = {}
