"""Transformer Engine pieces shared by the TE-based baselines (``deepep_te``, ``hybridep_megatron``).

Everything here imports TE lazily, inside functions, so the pure-torch helpers (recipe choice, per-expert padding,
weight layouts and their gradients) run and are tested on machines without TE or a GPU.

Legend: R received rows on this rank, K top-k, L local experts, H hidden, I expert ffn, M routed rows.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Optional, Sequence

import torch

from contract import Case
from baselines.common import device_capability

TE_INSTALL_HINT = ("install Transformer Engine with its PyTorch extension: pip install --no-build-isolation "
                   "'transformer_engine[pytorch]' (docs/backends.md, 'Transformer Engine and Megatron-core'; "
                   "offline: scripts/install_te.sh)")

# precision=fp8 recipes by the TE backends' option ``fp8_recipe`` (baselines/options.py; Megatron's names).
# blockwise is the harness's fp8 format (1x128 activation / 128x128 weight blocks, e4m3). All fp8 recipes use e4m3
# for every tensor.
FP8_RECIPES = {"blockwise": "Float8BlockScaling", "tensorwise": "Float8CurrentScaling", "delayed": "DelayedScaling"}
MXFP8_RECIPE = "MXFP8BlockScaling"
# Per-expert row alignment TE's grouped GEMMs need for quantized inputs (TE's get_align_size_for_quantization).
RECIPE_ALIGN = {MXFP8_RECIPE: 32, "Float8BlockScaling": 16, "Float8CurrentScaling": 16, "DelayedScaling": 16}
# Compute capability each recipe needs (TE's support checks: block scaling also needs CUDA >= 12.9).
RECIPE_MIN_CAP = {MXFP8_RECIPE: (10, 0), "Float8BlockScaling": (9, 0), "Float8CurrentScaling": (8, 9),
                  "DelayedScaling": (8, 9)}
RECIPE_LABEL = {
    "Float8BlockScaling": "TE Float8BlockScaling e4m3, 1x128 activation / 128x128 weight blocks",
    "Float8CurrentScaling": "TE Float8CurrentScaling e4m3, per-tensor current scaling",
    "DelayedScaling": "TE DelayedScaling e4m3, per-tensor delayed scaling (amax history)",
    MXFP8_RECIPE: "TE MXFP8BlockScaling, 1x32 e8m0 blocks",
}


def recipe_name(precision: str, option: str = "blockwise") -> Optional[str]:
    """The TE recipe class name for a harness precision (None: bf16, no quantization)."""
    if precision == "bf16":
        return None
    if precision == "mxfp8":
        return MXFP8_RECIPE
    if precision == "fp8":
        if option not in FP8_RECIPES:
            raise ValueError(f"unknown fp8 recipe '{option}'; choose one of: {', '.join(FP8_RECIPES)}")
        return FP8_RECIPES[option]
    raise ValueError(f"unknown precision '{precision}'")


def recipe_unsupported(name: Optional[str], cap: tuple[int, int]) -> Optional[str]:
    """Why a GPU of compute capability ``cap`` cannot run the recipe (None: it can)."""
    if name is None or cap >= RECIPE_MIN_CAP[name]:
        return None
    need = RECIPE_MIN_CAP[name]
    this = f"SM{cap[0]}{cap[1]}"
    if name == MXFP8_RECIPE:
        return (f"TE's MXFP8BlockScaling needs compute capability >= 10.0 (Blackwell), this is {this}; "
                "use precision=fp8 (Float8BlockScaling on Hopper)")
    fix = "use te_fp8_recipe=tensorwise or delayed, or precision=bf16" if name == "Float8BlockScaling" else \
        "use precision=bf16"
    return f"TE's {name} needs compute capability >= {need[0]}.{need[1]}, this is {this}; {fix}"


def align_size(name: Optional[str]) -> int:
    """Rows per expert must be a multiple of this for TE's grouped GEMMs (1: no padding, bf16)."""
    return 1 if name is None else RECIPE_ALIGN[name]


def padded_splits(counts: Sequence[int], align: int) -> list[int]:
    """Each expert's row count rounded up to ``align`` (the m_splits TE's GroupedLinear gets after padding)."""
    return [-(-int(n) // align) * align for n in counts]


def scaling_label(name: Optional[str], dispatch: str) -> str:
    """The ``scaling`` row column: the recipe that quantizes the expert GEMMs, and the dispatch payload format."""
    if name is None:
        return "none"
    return f"{RECIPE_LABEL[name]}; dispatch {dispatch}"


def te_unsupported(case: Case, recipe: str = "blockwise") -> Optional[str]:
    """Reasons shared by the TE-based backends (None: TE itself can run this case with the fp8 recipe option
    ``recipe``). Off CUDA, only whether TE is installed is checked: the caller's device check says why a CPU run
    cannot work."""
    if importlib.util.find_spec("transformer_engine") is None:
        return f"Transformer Engine is not installed; {TE_INSTALL_HINT}"
    if case.device != "cuda":
        return None
    try:
        name = recipe_name(case.precision, recipe)
    except ValueError as e:
        return str(e)
    why = recipe_unsupported(name, device_capability(torch.device("cuda")))
    if why:
        return why
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # a missing or mismatched torch extension: ImportError, FileNotFoundError, AssertionError
        return f"Transformer Engine's PyTorch extension does not load ({type(e).__name__}: {e}); {TE_INSTALL_HINT}"
    return None


def make_recipe(name: Optional[str]) -> Any:
    """A TE recipe object (fp8 recipes in e4m3, the harness's fp8 format); None for bf16."""
    if name is None:
        return None
    from transformer_engine.common import recipe as te_recipe

    cls = getattr(te_recipe, name)
    if name == MXFP8_RECIPE:
        return cls()
    return cls(fp8_format=te_recipe.Format.E4M3)


def te_autocast(recipe: Any, amax_group: Any = None, enabled: Optional[bool] = None) -> Any:
    """TE's quantization context (``autocast`` in TE 2.x, ``fp8_autocast`` before it). ``recipe`` None: no context
    (bf16). ``enabled=False`` with the outer recipe: a bf16 region inside a quantized one."""
    if recipe is None and enabled is None:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te

    on = recipe is not None if enabled is None else enabled
    if hasattr(te, "autocast"):
        return te.autocast(enabled=on, recipe=recipe, amax_reduction_group=amax_group)
    return te.fp8_autocast(enabled=on, fp8_recipe=recipe, fp8_group=amax_group)


def is_delayed(recipe: Any) -> bool:
    return type(recipe).__name__ == "DelayedScaling"


# ---- weight layouts and gradients (pure torch) ----------------------------------------------------------------


def grouped_weights(w13_LIH: torch.Tensor, w2_LHI: torch.Tensor) -> dict[str, torch.Tensor]:
    """The harness's routed weights as three per-expert weight stacks for three TE GroupedLinear modules (gate and
    up: [L, I, H], out x in; down: [L, H, I]). Views, no copy: w13 holds gate rows [:I] then up rows [I:]."""
    I = w13_LIH.shape[1] // 2
    return {"gate": w13_LIH[:, :I], "up": w13_LIH[:, I:], "down": w2_LHI}


def load_grouped(module: torch.nn.Module, w_LNK: torch.Tensor) -> None:
    """Copy per-expert weights into a GroupedLinear-style module (parameters ``weight0`` .. ``weight{L-1}``)."""
    with torch.no_grad():
        for i in range(w_LNK.shape[0]):
            getattr(module, f"weight{i}").copy_(w_LNK[i])


def stack_grads(grads: Sequence[Optional[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """Per-expert gradients stacked to [L, N, K] (``like``: one expert's weight). An expert that got no rows may
    have no gradient: it is zero, as in the reference."""
    return torch.stack([torch.zeros_like(like) if g is None else g for g in grads])


def module_grads(module: torch.nn.Module, num: int) -> torch.Tensor:
    """[L, out, in] gradients of a GroupedLinear-style module's ``weight{i}`` parameters."""
    ws = [getattr(module, f"weight{i}") for i in range(num)]
    return stack_grads([w.grad for w in ws], ws[0])


def local_routing(local_RK: torch.Tensor, recv_w_RK: torch.Tensor,
                  num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Received (token, k) slots as TE's mask-map permute takes them: an int32 routing map [R, L] (1 where row r goes
    to local expert l) and fp32 merging probs [R, L] (the router weight there, 0 elsewhere; differentiable in
    ``recv_w_RK``). ``local_RK`` is -1 for slots that belong to another rank."""
    valid = local_RK >= 0
    idx = local_RK.clamp_min(0)
    R = local_RK.shape[0]
    routing = torch.zeros(R, num_local, dtype=torch.int32, device=local_RK.device)
    routing.scatter_add_(1, idx, valid.to(torch.int32))
    probs = torch.zeros(R, num_local, dtype=torch.float32, device=local_RK.device)
    probs = probs.scatter_add(1, idx, recv_w_RK.float() * valid)
    return routing, probs
