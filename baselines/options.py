"""The options of the baselines that take any, declared here (torch-free, so that the harness builds its schema
without importing a backend): :class:`ExpertGemmOptions` for the PyTorch-expert baselines (``nccl``, ``deepep``,
``hybridep``) and :class:`TeOptions` for the Transformer Engine ones (``deepep_te``, ``hybridep_megatron``). Each
backend names its class in its registry line (``harness.core.backends.REGISTRY``); :mod:`contract.options` says how the
harness reads them."""

from __future__ import annotations

from dataclasses import dataclass

from contract.options import option

# fp8 GEMMs of the PyTorch-expert baselines at precision=fp8 (baselines/fp8_gemm.py), the one table of their names.
# Between ``auto`` and ``emulated`` the real fp8 paths, in the order ``auto`` measures them (ties go to the earlier):
# ``blockwise`` = DeepGEMM's grouped GEMMs in the harness format (1x128 / 128x128 e4m3), ``blockwise_loop`` = the same
# format through torch's scaled_mm v2, one GEMM per expert (the fallback where DeepGEMM does not load), ``rowwise`` =
# torch._scaled_grouped_mm with per-row / per-channel scales. ``emulated`` = bf16 GEMMs on e4m3-rounded operands
# (accuracy only). ``auto`` = the fastest real path installed, timed at setup (on a CPU: emulated, labelled as
# accuracy only). Recorded in the rows' ``scaling``.
FP8_GEMMS = ("auto", "blockwise", "blockwise_loop", "rowwise", "emulated")
FP8_GEMM_PATHS = FP8_GEMMS[1:-1]  # the real fp8 paths

# Transformer Engine fp8 recipes at precision=fp8, in Megatron's names: blockwise = Float8BlockScaling (the harness
# format: 1x128 activation, 128x128 weight blocks), tensorwise = Float8CurrentScaling, delayed = DelayedScaling.
# Recorded in the rows' ``scaling``.
TE_FP8_RECIPES = ("blockwise", "tensorwise", "delayed")


@dataclass
class ExpertGemmOptions:
    """Options of the baselines whose experts are PyTorch code."""

    fp8_gemm: str = option("auto", choices=FP8_GEMMS, alias="fp8_gemm", hash_precision="fp8", hash_default=True,
                           help="the fp8 GEMMs at precision=fp8 (baselines/fp8_gemm.py); other precisions ignore it")


@dataclass
class TeOptions:
    """Options of the Transformer Engine baselines."""

    fp8_recipe: str = option("blockwise", choices=TE_FP8_RECIPES, alias="te_fp8_recipe", hash_precision="fp8",
                             help="TE's fp8 recipe at precision=fp8 (Megatron's names); other precisions ignore it")


# How the PyTorch-native layer computes its routed experts (baselines/torch_native.py): ``plain`` = the ~30-line
# layer (argsort, index_select, torch._grouped_mm, SwiGLU, index_select back, bmm with the router weights);
# ``torchtitan`` = torchtitan's RoutedExperts (GroupedExperts + LocalTokenDispatcher); ``auto`` = both where both
# run, timed at setup, the faster kept. The row's notes say which ran.
TORCH_IMPLS = ("auto", "plain", "torchtitan")


@dataclass
class TorchNativeOptions(ExpertGemmOptions):
    """Options of the PyTorch-native layer (``torch``, ``torch_compiled``): the fp8 GEMMs (as the other
    PyTorch-expert baselines; ``auto`` is rowwise here, torchao's recipe) and which implementation runs."""

    # as ExpertGemmOptions.fp8_gemm, except that its default stays out of the hash where the backends' values differ:
    # points that set one of the older backends' fp8_gemm alone keep the hashes they had before these backends
    fp8_gemm: str = option("auto", choices=FP8_GEMMS, alias="fp8_gemm", hash_precision="fp8",
                           help="the fp8 GEMMs at precision=fp8 (auto: rowwise on a GPU); other precisions ignore it")
    impl: str = option("auto", choices=TORCH_IMPLS,
                       help="the routed experts: plain, torchtitan, or auto (the faster of the two where both run)")


# FlashInfer's fused MoE (baselines/flashinfer.py): how its down GEMM's rows are combined, and whether its tactics are
# autotuned in setup. ``fixed_order`` = use_fused_finalize=False (router weights and the top-k sum in fp32, in a fixed
# order); ``fused`` = FlashInfer's default (weighted rows added into the bf16 output with atomics, not reproducible).
FLASHINFER_FINALIZE = ("fixed_order", "fused")
ON_OFF = ("on", "off")


@dataclass
class FlashInferOptions:
    """Options of the FlashInfer anchor (its defaults stay out of every point's hash)."""

    finalize: str = option("fixed_order", choices=FLASHINFER_FINALIZE,
                           help="the combine: fixed_order (use_fused_finalize=False, fp32, reproducible) or fused "
                                "(FlashInfer's default, bf16 atomics)")
    autotune: str = option("on", choices=ON_OFF,
                           help="on: its tactics autotuned in setup (flashinfer.autotune); off: its default tactic")
