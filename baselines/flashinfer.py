"""FlashInfer's Hopper bf16 fused MoE as an anchor: ``cute_dsl_fused_moe_bf16`` (``flashinfer-python`` 0.7.2.post1;
FlashInfer PR #4878), three kernels per layer (a routing sort, a gather + grouped GEMM + SwiGLU, a grouped GEMM +
finalize) for pre-routed tokens on SM90. An inference forward: it saves nothing for a backward and has none.

Its Python API, as read from the 0.7.2.post1 wheel (public names only): ``flashinfer.cute_dsl_fused_moe_bf16(x,
token_selected_experts, token_final_scales, w1_weight, w2_weight, num_experts, top_k, ..., use_fused_finalize=True,
..., swiglu_limit=...)`` with x [T, H] bf16, token_selected_experts [T, K] int32 (global expert ids),
token_final_scales [T, K] fp32 (applied as given; the caller normalises them), w1_weight [L, 2I, H] with up and gate
interleaved in 32-row blocks (``[up 0:32 | gate 0:32 | up 32:64 | ...]``), w2_weight [L, H, I]; it returns [T, H]
in x's dtype. It is SM90 only (a decorator and a host check refuse other GPUs), takes I % 32 == 0 and H % 8 == 0,
and picks its tiles through FlashInfer's autotuner: under ``with flashinfer.autotune(True)`` every tactic is profiled
for the token bucket and the winner cached; outside it the cached winner (or a fixed default tactic) runs.

On the harness's inputs:

* weights: ``w13`` [L, 2I, H] (gate rows, then up rows) is copied once in ``setup`` (untimed) into the 32-row
  up/gate interleave (:func:`interleave_up_gate`, tested on the CPU against the kernel's contract); ``w2`` [L, H, I]
  is used as it is. The interleaved copy stays for the backend's life (its memory is in the rows' setup columns);
* routing: the harness's top-k ids cast to int32 and its fp32 router weights, in the timed forward;
* combine: ``use_fused_finalize=False`` (option ``flashinfer.finalize=fixed_order``, the default): the down GEMM
  writes each (token, k) row unscaled and a separate kernel applies the router weights and sums the K rows in fp32
  in a fixed order, one rounding to bf16 (the harness's reference sums in fp32). FlashInfer's own default (``fused``)
  adds the weighted rows into the bf16 output with atomics: one bf16 rounding per row, not bitwise reproducible;
* SwiGLU: ``shape.swiglu_limit`` goes to its ``swiglu_limit`` (its clamp is the harness's: silu(min(gate, c)) *
  clamp(up, -c, c)); the GEMM1 output is rounded to bf16 before the down GEMM, as in any bf16 pipeline;
* the shared expert: the PyTorch baselines' dense SwiGLU (``baselines.common``, compiled like theirs), added to
  FlashInfer's bf16 output in fp32, the sum cast to bf16.

Setup (untimed, in ``setup_s``): the weight interleave, then one forward under ``autotune(True)`` (option
``flashinfer.autotune=on``, the default; ``off`` keeps FlashInfer's fixed default tactic), which also JIT-builds its
routing module and compiles its CuTe DSL kernels, then one plain forward. Their seconds are in ``notes``.

Environment: ``flashinfer-python`` 0.7.2.post1 requires ``nvidia-cutlass-dsl>=4.6.2a0``, ``apache-tvm-ffi<0.2``,
``cuda-python``, ``cuda-tile``, ``nccl4py``, ``nvidia-cudnn-frontend`` and more; SonicMoE 0.1.2 needs
``nvidia-cutlass-dsl==4.4.2``, so the two cannot share a process. Install it into a folder of its own (``pip install
--target DIR``) and run it in processes of its own: ``own_process=[flashinfer] +own_pythonpath.flashinfer=DIR``, or
``MOKBENCH_FLASHINFER_SITE=DIR`` with ``+experiment=hopper_anchors``
(docs/backends.md, 'Anchor: FlashInfer fused MoE'). Its routing module is built at first use (``nvcc`` from
``CUDA_HOME``; headers from FlashInfer's artifact cache ``FLASHINFER_CUBIN_DIR``, which it downloads where they are
missing: on a machine without network, fetch them elsewhere and copy the folder).

Not supported, as ``unsupported`` rows: bwd and fwd_bwd (an inference forward); precisions other than bf16 (its fp8
and fp4 MoE paths are other entry points); EP >= 2 (the tokens of this GPU only, no dispatch); I not a multiple of 32
or H not a multiple of 8; GPUs other than SM90; a package that is missing or does not import (the error and the
install line).

Legend: T tokens, K top-k, E = L experts (EP = 1), H hidden, I expert ffn.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from contract import Case, LayerInputs
from baselines.common import ExpertParams, device_capability, package_version
from baselines.options import FlashInferOptions

DIST = "flashinfer-python"  # the distribution whose version the rows name

VERSION = "0.7.2.post1"  # the flashinfer-python release whose API this adapter was written against
BLOCK = 32  # rows per up / gate block of its w1 interleave
SITE_ENV = "MOKBENCH_FLASHINFER_SITE"  # where +experiment=hopper_anchors finds its own install (own_pythonpath)
INSTALL_HINT = (f"in a folder of its own: python3 -m pip install --no-deps --target DIR flashinfer-python=={VERSION} "
                "and its dependencies in one call (the wheels scripts/anchor_wheels.py fetches: nvidia-cutlass-dsl "
                "4.8.1 with its -libs-base, -libs-core and -libs-cu13, which SonicMoE's 4.4.2 conflicts with, "
                "cuda-python, ...), then run it as own_process=[flashinfer] +own_pythonpath.flashinfer=DIR (or "
                f"{SITE_ENV}=DIR with +experiment=hopper_anchors); docs/backends.md, 'Anchor: FlashInfer fused MoE'")


def load() -> SimpleNamespace:
    """FlashInfer's fused MoE entry and its autotune context; raises where they do not import (FlashInfer exports
    ``cute_dsl_fused_moe_bf16`` only where its CuTe DSL stack imports)."""
    import flashinfer

    if not hasattr(flashinfer, "cute_dsl_fused_moe_bf16"):
        try:  # FlashInfer swallowed the error of its CuTe DSL MoE's import: the same import, for its message
            from flashinfer.fused_moe.cute_dsl.sm90_fused_moe import cute_dsl_fused_moe_bf16  # noqa: F401
            why = "its CuTe DSL stack did not import"
        except Exception as e:  # noqa: BLE001 (nvidia-cutlass-dsl missing, incomplete or of another version)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise ImportError(f"flashinfer {package_version(DIST)} has no cute_dsl_fused_moe_bf16 ({why})")
    return SimpleNamespace(moe=flashinfer.cute_dsl_fused_moe_bf16, autotune=flashinfer.autotune)


def interleave_up_gate(w13_LIH: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The harness's gate-first [L, 2I, H] (gate rows 0:I, up rows I:2I) as FlashInfer's SM90 w1: [L, 2I, H] with
    ``block``-row up and gate blocks alternating, up first (``[up 0:32 | gate 0:32 | up 32:64 | gate 32:64 | ...]``).
    A new contiguous tensor, written expert by expert (no scratch beyond the result)."""
    L, I2, H = w13_LIH.shape
    I = I2 // 2
    if I2 % 2 or I % block:
        raise ValueError(f"the expert ffn ({I}) must be a multiple of {block} for FlashInfer's up/gate interleave")
    out = torch.empty(L, I2, H, dtype=w13_LIH.dtype, device=w13_LIH.device)
    blocks = out.view(L, I // block, 2, block, H)  # [L, blocks, (up, gate), block rows, H]
    for e in range(L):
        blocks[e, :, 0].copy_(w13_LIH[e, I:].reshape(I // block, block, H))
        blocks[e, :, 1].copy_(w13_LIH[e, :I].reshape(I // block, block, H))
    return out


def routing(topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The harness's top-k as FlashInfer takes it: (int32 expert ids [T, K], fp32 router weights [T, K]),
    contiguous."""
    return (topk_idx_TK.to(torch.int32).contiguous(),
            topk_w_TK.detach().to(torch.float32).contiguous())


class FlashInferBackend:
    name = "flashinfer"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def direction_unsupported(cls, case: Case, direction: str, options: Optional[FlashInferOptions] = None
                              ) -> Optional[str]:
        if direction == "fwd":
            return None
        return ("FlashInfer's cute_dsl_fused_moe_bf16 is an inference forward: it saves nothing for a backward and "
                "has none; time direction=fwd (beside mok_hopper.forward=inference)")

    @classmethod
    def unsupported_reason(cls, case: Case, options: Optional[FlashInferOptions] = None) -> Optional[str]:
        if importlib.util.find_spec("flashinfer") is None:
            return f"flashinfer-python is not installed in this process; {INSTALL_HINT}"
        if case.precision != "bf16":
            return ("FlashInfer's cute_dsl_fused_moe_bf16 is bf16 only (its fp8 / fp4 MoE are other entry points); "
                    "use precision=bf16")
        if case.ep_size != 1:
            return ("FlashInfer's fused MoE here takes the tokens of this GPU only (no dispatch): run it at "
                    "ep_size=1")
        if case.ffn % BLOCK or case.hidden % 8:
            return (f"FlashInfer's SM90 fused MoE needs the expert ffn a multiple of {BLOCK} and hidden a multiple "
                    f"of 8 (got {case.ffn}, {case.hidden}); pick another shape")
        cap = device_capability(torch.device(case.device))
        if cap != (9, 0):
            where = "the CPU" if case.device != "cuda" else f"SM{cap[0]}{cap[1]}"
            return f"FlashInfer's cute_dsl_fused_moe_bf16 needs a Hopper GPU (SM90); this is {where}"
        try:
            load()
        except Exception as e:  # noqa: BLE001 (its CuTe DSL / CUDA Python stack may not load with this torch)
            first = str(e).splitlines()[0] if str(e) else ""
            return f"flashinfer does not import ({type(e).__name__}: {first}); {INSTALL_HINT}"
        return None

    def __init__(self, case: Case, group: Any, options: Optional[FlashInferOptions] = None) -> None:
        self.case, self.group = case, group
        self.options = options or FlashInferOptions()
        self.fi: Optional[SimpleNamespace] = None
        self.params: Optional[ExpertParams] = None
        self.w1: Optional[torch.Tensor] = None
        self.w2: Optional[torch.Tensor] = None
        self.convert_s = self.tune_s = self.warm_s = 0.0

    @property
    def fused_finalize(self) -> bool:
        return self.options.finalize == "fused"

    def setup(self, inputs: LayerInputs) -> None:
        self.fi = load()
        self.params = ExpertParams(self.case, inputs)  # the shared expert as the PyTorch baselines have it
        t0 = time.perf_counter()
        self.w1 = interleave_up_gate(inputs.w13_LIH.detach())
        w2 = inputs.w2_LHI.detach()
        self.w2 = w2 if w2.is_contiguous() else w2.contiguous()
        self._sync(inputs.x_TH)
        self.convert_s = time.perf_counter() - t0
        x, idx, w = inputs.x_TH.detach(), inputs.topk_idx_TK, inputs.topk_w_TK
        t0 = time.perf_counter()
        # its tactic profiling (every tactic compiled and timed for this token bucket) and its JIT builds, untimed
        with self.fi.autotune(True) if self.options.autotune == "on" else contextlib.nullcontext():
            self.forward(x, idx, w)
        self._sync(x)
        self.tune_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.forward(x, idx, w)  # the cached winner, as the timed calls run it
        self._sync(x)
        self.warm_s = time.perf_counter() - t0

    @staticmethod
    def _sync(x: torch.Tensor) -> None:
        if x.is_cuda:
            torch.cuda.synchronize()

    def routed(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        """FlashInfer's routed experts on the harness's top-k: [T, H] in x's dtype."""
        c = self.case
        ids, scales = routing(topk_idx_TK, topk_w_TK)
        kw = {} if c.swiglu_limit is None else {"swiglu_limit": float(c.swiglu_limit)}
        return self.fi.moe(x_TH, ids, scales, self.w1, self.w2, c.num_experts, c.topk,
                           use_fused_finalize=self.fused_finalize, **kw)

    @torch.no_grad()
    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        return self.params.add_shared(self.routed(x_TH.detach(), topk_idx_TK, topk_w_TK), x_TH.detach())

    def zero_grad(self) -> None:
        pass  # nothing is trained

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return {}

    def traffic(self) -> dict[str, Any]:
        return {}  # EP = 1: no token leaves the GPU

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def info(self) -> dict[str, Any]:
        combine = ("use_fused_finalize=True (FlashInfer's default: weighted rows added into the bf16 output with "
                   "atomics, one bf16 rounding per row, not bitwise reproducible)" if self.fused_finalize else
                   "use_fused_finalize=False (unscaled rows, then router weights and the top-k sum in fp32 in a fixed "
                   "order, one bf16 rounding)")
        tune = ("tactics autotuned in setup under flashinfer.autotune(True)" if self.options.autotune == "on" else
                "FlashInfer's default tactic (flashinfer.autotune=off)")
        w1_gib = self.w1.numel() * self.w1.element_size() / 2**30 if self.w1 is not None else 0.0
        notes = [f"FlashInfer {package_version(DIST)} cute_dsl_fused_moe_bf16 (SM90 CuTe DSL): inference forward "
                 "(saves nothing for a backward); routing sort, gather + grouped GEMM + SwiGLU, grouped GEMM + "
                 "finalize; the harness's top-k ids as int32 and fp32 router weights",
                 f"combine: {combine}",
                 f"w13 copied once in setup into its 32-row up/gate interleave ({self.convert_s:.1f} s, "
                 f"{w1_gib:.2f} GiB held); w2 as it is",
                 f"{tune}: {self.tune_s:.1f} s with its JIT builds, then one more forward {self.warm_s:.1f} s",
                 "shared expert: the PyTorch baselines' dense SwiGLU, added in fp32 to FlashInfer's bf16 output",
                 "EP=1 only"]
        cols = self.params.columns() if self.params is not None else {"scaling": "none", "compiled": False}
        return {**cols, "forward_kind": "inference", "notes": "; ".join(notes)}

    def teardown(self) -> None:
        self.params = self.w1 = self.w2 = self.fi = None
