"""DeepGEMM's SM90 FP8 MegaMoE as an anchor: dispatch, both fp8 expert GEMMs with the SwiGLU between them, and the
combine in one kernel (``fp8_mega_moe``) on Hopper. An inference forward: it saves nothing for a backward.

The Python API and host checks used here were read on two DeepGEMM pull-request heads (DeepGEMM's release of
2026-09, PR #432, documents the same SM90 entry points in its README, so a build of its main may serve too; not yet
run here):

* DeepGEMM #323, head ``8ddf7f9``: ``bash build_sgl_deep_gemm.sh`` builds the ``sgl-deep-gemm`` wheel, whose import
  name is ``deep_gemm`` (its own imports are relative, so it may also be installed under the folder name
  ``sgl_deep_gemm``, beside an upstream ``deep_gemm``; not tried here): ``get_symm_buffer_for_sm90_mega_moe``,
  ``transform_weights_for_mega_moe_sm90``, ``fp8_mega_moe`` and ``mega_moe_pre_dispatch_sm90`` (one kernel: x
  quantised into the buffer with the top-k);
* DeepGEMM #352, head ``bdb4395``: the package ``deep_gemm`` (``./install.sh``): ``get_symm_buffer_for_mega_moe``,
  ``transform_weights_for_mega_moe_sm90`` and ``fp8_mega_moe`` (no pre-dispatch kernel).

``sgl_deep_gemm`` is imported first, else ``deep_gemm`` where it has ``fp8_mega_moe``; either API is used as found.
Where the build has DeepGEMM's determinism opt-in (``use_deterministic_algorithms``, off by default since that
release), it is switched on when the module loads, and ``notes`` names the mode.

Setup (untimed): the weights quantised by the harness's quantiser (``contract.fp8``: w13 [L, 2I, H], gate rows then
up rows; w2 [L, H, I]), then ``transform_weights_for_mega_moe_sm90`` (gate and up rows interleaved in groups of 8,
scales unchanged); the symmetric buffer (torch symmetric memory, a rendezvous over the group, for T tokens per rank);
one warm-up forward (its kernels are JIT-compiled on first use; the seconds are in ``notes``).

Per call (timed, under ``torch.no_grad()``): x quantised to e4m3 1x128 and copied with the top-k ids and the fp32
router weights into the buffer (``mega_moe_pre_dispatch_sm90`` where the package has it and H <= 8192, else the
harness's quantiser and four copies); ``fp8_mega_moe`` with ``activation_clamp`` = the shape's ``swiglu_limit`` (its
clamp is the harness's: silu(min(gate, c)) * clamp(up, -c, c)) and ``fast_math=True`` (its default); the shared expert
(the PyTorch baselines' dense SwiGLU in bf16) added in fp32 and the sum cast to bf16.

Its fp8 format against the harness's (``contract/fp8.py``: e4m3, 1x128 activation / 128x128 weight blocks, fp32
scales ``max(amax, 1e-12) / 448``):

* weights: the same 128x128 blocks and fp32 scales (made by the harness's code);
* x: 1x128 blocks with fp32 scales, the same layout; the pre-dispatch kernel floors amax at 1e-10 and multiplies by
  the scale's reciprocal where the harness divides, so an element may round to the neighbouring e4m3 value;
* the down GEMM's input differs: the router weight multiplies the SwiGLU output before it is quantised, in 1x64
  blocks (the harness's are 1x128) with power-of-two scales (2^ceil(log2(amax / 448)));
* each (token, expert) output is rounded to bf16 before the top-k sum (accumulated in fp32, rounded to bf16); the
  harness's reference sums in fp32;
* SiLU in fast math (``__expf`` and an approximate reciprocal).

It is compared with ``mok_hopper``'s inference forward at fp8, in one run: ``backends=[deepgemm_megamoe,mok_hopper]
precision=fp8 mok_hopper.forward=inference direction=fwd``.

Not supported, as ``unsupported`` rows: bwd and fwd_bwd (nothing is saved for a backward); precisions other than
fp8; GPUs other than SM90 (its host checks assert arch 9); H or I not a multiple of 128, I > 4096 (one bit per 64
columns in a 64-bit mask), top-k > 32; no package with ``fp8_mega_moe``; a torch without symmetric memory. EP >= 2 runs
only with ``MOKBENCH_DEEPGEMM_MEGAMOE_EP=1`` (not validated by this harness yet), which ``notes`` records.

Legend: T tokens per rank, K top-k, E experts, L local experts, H hidden, I expert ffn.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Optional

import torch

from contract import Case, LayerInputs
from contract.fp8 import quantize_blocks
from baselines.common import dense_mlp, device_capability, ep_note, ep_unsupported
from baselines.fp8_gemm import deep_gemm_ref, determinism_mode, enable_determinism

MODULES = ("sgl_deep_gemm", "deep_gemm")  # where SM90 MegaMoE is looked for, in this order
NEEDS = ("fp8_mega_moe", "transform_weights_for_mega_moe_sm90")
BUFFER_GETTERS = ("get_symm_buffer_for_sm90_mega_moe", "get_symm_buffer_for_mega_moe")  # the first one present
PRE_DISPATCH = "mega_moe_pre_dispatch_sm90"
PRE_DISPATCH_MAX_H = 8192  # its pre-dispatch kernel: one block of at most 1024 threads per token, 8 elements each
MAX_FFN = 4096
MAX_TOPK = 32
BLOCK = 128
EP_ENV = "MOKBENCH_DEEPGEMM_MEGAMOE_EP"  # 1: run at EP >= 2 (not validated by this harness)
BUILD_HINT = ("build DeepGEMM's SM90 MegaMoE from source, at DeepGEMM #352's head (git fetch origin pull/352/head, "
              "bdb4395; ./install.sh) or #323's (pull/323/head, 8ddf7f9; bash build_sgl_deep_gemm.sh and install its "
              "wheel: import name deep_gemm, or sgl_deep_gemm when installed under that folder name), with the CUDA "
              "toolkit, CUDA_HOME and a C++20 compiler (docs/backends.md, 'Anchors: LigerCute and DeepGEMM MegaMoE')")


def load_megamoe() -> tuple[Optional[Any], str]:
    """(the module with SM90 MegaMoE, "") or (None, why none of ``MODULES`` has it)."""
    whys = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                whys.append(f"no {name}")
                continue
            whys.append(f"{name} does not import (ModuleNotFoundError: {e})")
            continue
        except Exception as e:  # noqa: BLE001 (an ABI mismatch of its extension raises OSError / RuntimeError)
            whys.append(f"{name} does not import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            continue
        missing = [a for a in NEEDS if not hasattr(mod, a)]
        if not any(hasattr(mod, g) for g in BUFFER_GETTERS):
            missing.append(" or ".join(BUFFER_GETTERS))
        if missing:
            whys.append(f"{name} {getattr(mod, '__version__', '?')} has no {', '.join(missing)}")
            continue
        why = enable_determinism(mod)
        if why:
            whys.append(f"{name}: {why}")
            continue
        return mod, ""
    return None, "; ".join(whys)


def quantize_experts(w_GNK: torch.Tensor, step: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [G, N, K] and fp32 scales [G, N/128, K/128] in the harness's 128x128 blocks, ``step`` experts at a time
    (bounded fp32 scratch)."""
    w = w_GNK.detach()
    G, N, K = w.shape
    q = torch.empty(G, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(G, N // BLOCK, K // BLOCK, dtype=torch.float32, device=w.device)
    for lo in range(0, G, step):
        q[lo:lo + step], s[lo:lo + step] = quantize_blocks(w[lo:lo + step], BLOCK, BLOCK)
    return q, s


class DeepGemmMegaMoEBackend:
    name = "deepgemm_megamoe"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def direction_unsupported(cls, case: Case, direction: str) -> Optional[str]:
        if direction == "fwd":
            return None
        return ("DeepGEMM's fp8_mega_moe is an inference forward: it saves nothing for a backward and has none; "
                "time direction=fwd")

    @classmethod
    def unsupported_reason(cls, case: Case) -> Optional[str]:
        if case.precision != "fp8":
            return ("DeepGEMM's SM90 MegaMoE is fp8 only (e4m3, 1x128 activation and 128x128 weight blocks); use "
                    "precision=fp8")
        why = ep_unsupported("DeepGEMM's MegaMoE", case, EP_ENV)
        if why:
            return why
        cap = device_capability(torch.device(case.device))
        if cap != (9, 0):
            where = "the CPU" if case.device != "cuda" else f"SM{cap[0]}{cap[1]}"
            return f"DeepGEMM's fp8_mega_moe (SM90 path) needs a Hopper GPU (SM90); this is {where}"
        if case.hidden % BLOCK or case.ffn % BLOCK or case.ffn > MAX_FFN:
            return (f"DeepGEMM's SM90 MegaMoE needs hidden and ffn multiples of {BLOCK} and ffn <= {MAX_FFN} (got "
                    f"{case.hidden}, {case.ffn}); pick another shape")
        if case.topk > MAX_TOPK:
            return f"DeepGEMM's SM90 MegaMoE takes top-k <= {MAX_TOPK} (got {case.topk}); pick another shape"
        try:
            importlib.import_module("torch.distributed._symmetric_memory")  # what its buffer is made of
        except Exception as e:  # noqa: BLE001
            return f"DeepGEMM's MegaMoE needs torch symmetric memory, which this torch lacks ({type(e).__name__}: {e})"
        mod, why = load_megamoe()
        if mod is None:
            return f"no DeepGEMM with SM90 MegaMoE here ({why}); {BUILD_HINT}"
        return None

    def __init__(self, case: Case, group: Any) -> None:
        self.case, self.group = case, group
        self.dg: Any = None
        self.buf: Any = None
        self.pre: Optional[Callable[..., Any]] = None
        self.l1: Any = None
        self.l2: Any = None
        self.shared: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self.warm_s = 0.0

    def setup(self, inputs: LayerInputs) -> None:
        c = self.case
        self.dg, why = load_megamoe()
        if self.dg is None:
            raise RuntimeError(f"no DeepGEMM with SM90 MegaMoE here ({why}); {BUILD_HINT}")
        # 128x128 e4m3 blocks of the harness's weights, then MegaMoE's gate/up interleave (weights made once)
        self.l1, self.l2 = self.dg.transform_weights_for_mega_moe_sm90(quantize_experts(inputs.w13_LIH),
                                                                       quantize_experts(inputs.w2_LHI))
        getter = next(getattr(self.dg, g) for g in BUFFER_GETTERS if hasattr(self.dg, g))
        self.buf = getter(self.group, c.num_experts, c.tokens_per_gpu, c.topk, c.hidden, c.ffn)
        self.pre = getattr(self.dg, PRE_DISPATCH, None) if c.hidden <= PRE_DISPATCH_MAX_H else None
        if c.shared_expert:
            self.shared = (inputs.ws_gate_IH, inputs.ws_up_IH, inputs.ws_down_HI)
        t0 = time.perf_counter()
        self.forward(inputs.x_TH, inputs.topk_idx_TK, inputs.topk_w_TK)  # JIT compiles, untimed
        if inputs.x_TH.is_cuda:
            torch.cuda.synchronize()
        self.warm_s = time.perf_counter() - t0

    @torch.no_grad()
    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        c, buf = self.case, self.buf
        T = x_TH.shape[0]
        if self.pre is not None:
            self.pre(x_TH, topk_idx_TK.to(torch.int32), topk_w_TK, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, T)
        else:
            q, s = quantize_blocks(x_TH, 1, BLOCK)
            buf.x[:T].copy_(q)
            buf.x_sf[:T].copy_(s)
            buf.topk_idx[:T].copy_(topk_idx_TK)
            buf.topk_weights[:T].copy_(topk_w_TK)
        y = torch.empty(T, c.hidden, dtype=torch.bfloat16, device=x_TH.device)
        self.dg.fp8_mega_moe(y, self.l1, self.l2, buf, recipe=(BLOCK, BLOCK, BLOCK), activation="swiglu",
                             activation_clamp=c.swiglu_limit, fast_math=True)
        if self.shared is not None:
            y = (y.float() + dense_mlp(x_TH, *self.shared, c.swiglu_limit).float()).to(torch.bfloat16)
        return y

    def zero_grad(self) -> None:
        pass  # nothing is trained

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return {}

    def traffic(self) -> dict[str, Any]:
        return {}  # the kernel moves the rows itself and does not report them

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def build(self) -> str:
        """Which package and build ran (version, commit where known, MOKBENCH_DEEPGEMM_REF) and its determinism mode."""
        if self.dg is None:
            return "?"
        extra = "; ".join(filter(None, [deep_gemm_ref(self.dg), determinism_mode(self.dg)]))
        return f"{self.dg.__name__} {getattr(self.dg, '__version__', '?')}{f' ({extra})' if extra else ''}"

    def info(self) -> dict[str, Any]:
        c = self.case
        scaling = ("e4m3, DeepGEMM fp8_mega_moe: x 1x128 and weights 128x128 with fp32 scales (the harness's blocks); "
                   "the down GEMM's input 1x64 with power-of-two scales, router weight applied before it; each "
                   "(token, expert) output rounded to bf16 before the top-k sum; fast-math SiLU; shared expert bf16")
        quant = (f"{PRE_DISPATCH} (one kernel)" if self.pre is not None else
                 "the harness's quantiser and copies (no pre-dispatch kernel in this package)")
        notes = [f"DeepGEMM SM90 MegaMoE, {self.build()}: inference forward (saves nothing for a backward), "
                 "dispatch + L1 GEMM + SwiGLU + L2 GEMM + combine in one kernel, torch symmetric memory",
                 f"x quantised and copied into its buffer inside the timed forward by {quant}; weights quantised and "
                 "interleaved in setup",
                 f"setup warm-up forward (JIT compiles) {self.warm_s:.1f} s",
                 "shared expert: the PyTorch baselines' dense SwiGLU in bf16, eager, added in fp32", ep_note(c, EP_ENV)]
        return {"scaling": scaling, "compiled": False, "compile_mode": "", "notes": "; ".join(notes)}

    def teardown(self) -> None:
        if self.buf is not None and hasattr(self.buf, "destroy"):
            self.buf.destroy()
        self.buf = self.l1 = self.l2 = self.shared = self.pre = None
