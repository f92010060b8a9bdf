"""DeepEP + Transformer Engine baseline (the published ``bench_deepep_te.py`` role).

* Dispatch / combine: DeepEP V1 ``Buffer`` exactly as the ``deepep`` backend (this class reuses its ``dispatch`` and
  ``combine``, including the coarse expert ids for more than 128 local experts and the cached-mode backward), with
  32 comm SMs as published (``comm_sms`` overrides). Tokens travel in bf16 at every precision, as published (TE
  quantizes inside the GEMMs), so ``scaling`` says ``dispatch bf16``.
* Experts: three ``transformer_engine.pytorch.GroupedLinear`` modules (gate, up, down; ``num_gemms`` = local
  experts, no bias, bf16 parameters holding copies of the harness weights), SwiGLU between them. The received
  rows are grouped by local expert with TE's ``moe_permute`` (mask map) and summed back per received token with
  ``moe_unpermute`` weighted by the router weights, as published. ``m_splits`` are host ints (one host sync).
* Quantization: ``precision=fp8`` runs the GEMMs under TE's autocast with ``Float8BlockScaling`` (the harness's
  fp8 format: e4m3, 1x128 activation / 128x128 weight blocks); ``deepep_te.fp8_recipe=tensorwise`` / ``delayed`` select
  ``Float8CurrentScaling`` / ``DelayedScaling`` (all e4m3). ``mxfp8`` uses ``MXFP8BlockScaling`` (compute capability
  >= 10 only). Quantized grouped GEMMs need each expert's rows padded to a multiple of 16 (32 for mxfp8): done by
  TE's ``moe_permute_and_pad_with_probs`` (zero rows, removed again by ``moe_unpermute``); ``notes`` says so.
  DelayedScaling starts with unit scales, so ``setup`` runs one untimed forward + backward to fill the amax history.
* Shared expert: bf16, the same PyTorch dense SwiGLU as every baseline, not compiled.
* No torch.compile (the published script disables it for this baseline; ``compiled`` is False).
* Known difference from the published script: it used TE's op-fuser ``transformer_engine.pytorch.ops.GroupedLinear``
  (``num_groups=``, ``dtype=``); this uses the module ``transformer_engine.pytorch.GroupedLinear`` (``num_gemms=``,
  ``params_dtype=``). Both take (rows, m_splits) and hold ``weight{i}`` per expert.

Legend: T tokens, R received rows, K top-k, L local experts, H hidden, I expert ffn.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Optional

import torch

from contract import Case, LayerInputs
from baselines.common import ExpertParams, swiglu
from baselines.deepep import DeepEPBackend, deepep_unsupported
from baselines.options import TeOptions
from baselines.te_common import (align_size, grouped_weights, is_delayed, load_grouped, local_routing, make_recipe,
                                 module_grads, padded_splits, recipe_name, scaling_label, te_autocast, te_unsupported)

PUBLISHED_COMM_SMS = 32  # bench_deepep_te.py: 32 comm SMs for bf16 and mxfp8


def bf16_eager(case: Case) -> Any:
    """The case as the shared expert sees it: bf16 and not compiled (no fp8 weight copies, no torch.compile)."""
    if dataclasses.is_dataclass(case):
        return dataclasses.replace(case, precision="bf16", compile=False)
    return types.SimpleNamespace(**{**vars(case), "precision": "bf16", "compile": False})


class DeepEPTEBackend(DeepEPBackend):
    name = "deepep_te"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case,  # type: ignore[override]
                           options: Optional[TeOptions] = None) -> Optional[str]:
        return te_unsupported(case, (options or TeOptions()).fp8_recipe) or deepep_unsupported(case, mxfp8=True)

    def __init__(self, case: Case, group: Any, options: Optional[TeOptions] = None) -> None:  # type: ignore[override]
        super().__init__(case, group)
        self.te_options = options or TeOptions()
        self.num_sms = case.comm_sms or PUBLISHED_COMM_SMS
        self.fp8_dispatch = False  # bf16 on the wire, as published
        self.recipe_name = recipe_name(case.precision, self.te_options.fp8_recipe)
        self.align = align_size(self.recipe_name)
        self.recipe: Any = None
        self.linears: dict[str, torch.nn.Module] = {}

    def setup(self, inputs: LayerInputs) -> None:
        import transformer_engine.pytorch as te

        self._te = te
        self.setup_buffer()
        c = self.case
        self.params = ExpertParams(bf16_eager(c), inputs)  # the shared expert (its routed leaves go unused)
        self.recipe = make_recipe(self.recipe_name)
        self.amax_group = self.group if is_delayed(self.recipe) else None
        weights = grouped_weights(inputs.w13_LIH, inputs.w2_LHI)
        dims = {"gate": (c.hidden, c.ffn), "up": (c.hidden, c.ffn), "down": (c.ffn, c.hidden)}
        for key, (n_in, n_out) in dims.items():
            m = te.GroupedLinear(c.local_experts, n_in, n_out, bias=False, params_dtype=torch.bfloat16,
                                 device=inputs.w13_LIH.device)
            load_grouped(m, weights[key])
            self.linears[key] = m
        if is_delayed(self.recipe):
            self._fill_amax_history(inputs)

    def _fill_amax_history(self, inputs: LayerInputs) -> None:
        """DelayedScaling quantizes with the scales of earlier iterations: one untimed step gives it real ones."""
        x = inputs.x_TH.detach().requires_grad_()
        w = inputs.topk_w_TK.detach().requires_grad_()
        self.forward(x, inputs.topk_idx_TK, w).backward(inputs.grad_out_TH)
        self.zero_grad()

    def routed_experts(self, recv_x_RH: torch.Tensor, recv_w_RK: torch.Tensor,
                       local_RK: torch.Tensor) -> torch.Tensor:
        """Router-weighted sum of the local experts' outputs per received row [R, H] (bf16)."""
        te, L = self._te, self.case.local_experts
        routing_RL, probs_RL = local_routing(local_RK, recv_w_RK, L)
        counts_L = routing_RL.sum(0)
        counts = counts_L.tolist()  # host sync: GroupedLinear takes the splits on the host
        n = sum(counts)
        if n == 0:  # nothing routed here (TE's mask permute needs at least one row)
            return recv_x_RH * 0
        if self.align > 1:
            rows, _, row_map, pad_offsets, _ = te.moe_permute_and_pad_with_probs(recv_x_RH, probs_RL, routing_RL,
                                                                                 counts_L, self.align)
            m_splits = padded_splits(counts, self.align)
        else:
            rows, row_map = te.moe_permute(recv_x_RH, routing_RL, n, map_type="mask")
            pad_offsets, m_splits = None, counts
        lin = self.linears
        with te_autocast(self.recipe, self.amax_group):
            h = swiglu(lin["gate"](rows, m_splits), lin["up"](rows, m_splits), self.case.swiglu_limit)
            y = lin["down"](h, m_splits)
        return te.moe_unpermute(y, row_map, merging_probs=probs_RL, restore_shape=recv_x_RH.shape, map_type="mask",
                                pad_offsets=pad_offsets)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        recv_x, recv_w, local = self.dispatch(x_TH, topk_idx_TK, topk_w_TK)
        out = self.combine(self.routed_experts(recv_x, recv_w, local).contiguous())
        return self.params.add_shared(out.float(), x_TH)

    def zero_grad(self) -> None:
        self.params.zero_grad()
        for m in self.linears.values():
            for p in m.parameters():
                p.grad = None

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        g = self.params.grads()  # the shared expert's
        L = self.case.local_experts
        g.update(w_gate=module_grads(self.linears["gate"], L), w_up=module_grads(self.linears["up"], L),
                 w_down=module_grads(self.linears["down"], L))
        return g

    def info(self) -> dict[str, Any]:
        try:  # transformer_engine.pytorch has no __version__; the distribution's metadata has it
            from importlib.metadata import version

            te_version = version("transformer_engine")
        except Exception:  # noqa: BLE001 - only the notes text depends on it
            te_version = "?"
        notes = [f"DeepEP V1 Buffer (hybrid-ep branch), {self.num_sms} comm SMs, bf16 dispatch, no deterministic "
                 "mode in V1",
                 f"experts: 3 TE {te_version} GroupedLinear modules (gate, up, down), TE moe_permute/moe_unpermute"]
        if self.align > 1:
            notes.append(f"rows padded per expert to a multiple of {self.align} for TE's quantized grouped GEMMs "
                         "(moe_permute_and_pad_with_probs)")
        if is_delayed(self.recipe):
            notes.append("DelayedScaling: one untimed forward+backward in setup fills the amax history")
        if self.coarse:
            notes.append(f"expert ids coarsened to {self.groups} groups/rank for DeepEP's layout; true experts "
                         "recovered from an all-gathered top-k table")
        notes.append("shared expert bf16 PyTorch; no torch.compile (as published)")
        return {"scaling": scaling_label(self.recipe_name, "bf16"), "compiled": False, "compile_mode": "",
                "comm_sms": self.num_sms, "notes": "; ".join(notes)}

    def teardown(self) -> None:
        super().teardown()
        self.linears = {}
