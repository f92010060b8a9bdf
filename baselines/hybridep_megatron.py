"""HybridEP + Megatron baseline (the published ``bench_hybridep_megatron.py`` role): a standalone Megatron-core
``MoELayer``, configured as published, on the harness's inputs.

* ``TransformerConfig`` (megatron-core 0.19 names; older names are mapped or dropped, see ``config_kwargs``):
  ``moe_token_dispatcher_type="flex"``, ``moe_flex_dispatcher_backend="hybridep"``, 20 comm SMs
  (``moe_flex_dispatcher_num_sms``; ``moe_hybridep_num_sms`` before 0.19; ``comm_sms`` overrides), 108
  preprocessing SMs, ``moe_permute_fusion_into_hybridep=True``, ``moe_grouped_gemm=True`` (TEGroupedMLP: one TE
  GroupedLinear for fc1 = [gate; up] and one for fc2), gated SwiGLU (``gated_linear_unit``, ``F.silu``), no bias,
  ``moe_router_dtype="fp32"``, no aux loss (``moe_router_load_balancing_type="none"``, ``moe_aux_loss_coeff=0``), no
  forced balancing, no per-expert capacity (``moe_expert_capacity_factor=None``: nothing is dropped), the shared
  expert through ``moe_shared_expert_intermediate_size`` overlapped with the dispatch as published.
* The published HybridEP rank capacity factor 1.25 (``moe_expert_rank_capacity_factor``) is only accepted by
  megatron-core together with its TE op-fuser grouped MLP (``use_transformer_engine_op_fuser``, CuTe DSL kernels for
  Blackwell). This backend uses TEGroupedMLP, so HybridEP sizes its receive buffer per call (one host sync) and can
  drop nothing; ``notes`` says so. Were the factor set, a forward that drops tokens raises instead of passing.
* The router is replaced by a module returning the harness's top-k as Megatron's ``TopKRouter.routing`` does:
  dense fp32 probs [T, E] (the router weight at the top-k ids, 0 elsewhere) and a bool routing map [T, E].
* Weights are copies of the harness's: expert i's fc1 ``weight{i}`` = w13[i] ([2I, H], gate rows then up rows: the
  order Megatron's GLU splits fc1's output, first half through SiLU), fc2 ``weight{i}`` = w2[i] ([H, I]); the shared
  expert's fc1 = [gate; up], fc2 = down. Gradients are mapped back to the harness layout.
* Parallel state: ``parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)`` over the world group,
  once per process (re-initialized only when a later case has another EP size; kept after teardown).
* Precision: bf16; fp8 / mxfp8 through ``fp8="e4m3"`` + ``fp8_recipe`` (blockwise / tensorwise / delayed by the
  option ``hybridep_megatron.fp8_recipe``, alias ``te_fp8_recipe``; mxfp8 needs compute capability >= 10) and
  Megatron's ``get_fp8_context`` around the forward. The shared expert stays bf16 (its two linears run in a TE autocast
  region with quantization off). HybridEP dispatches bf16 (Megatron rejects fp8 dispatch there). DelayedScaling: one
  untimed step in setup.
* Input [T, H] becomes Megatron's [S, B, H] with B = 1. No per-phase timing: Megatron releases its HybridEP handle
  after the combine.

Legend: T tokens, K top-k, E experts, L local experts, H hidden, I expert ffn.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
from typing import Any, Callable, Collection, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from contract import Case, LayerInputs
from baselines.deepep import import_deep_ep
from baselines.hybridep import dense_routing, hybridep_unsupported, routing_map_traffic
from baselines.options import TeOptions
from baselines.te_common import MXFP8_RECIPE, is_delayed, recipe_name, scaling_label, te_autocast, te_unsupported

MEGATRON_INSTALL_HINT = ("install megatron-core: pip install megatron-core (Python >= 3.12; it uses Transformer "
                         "Engine for the grouped MLP: docs/backends.md, 'Transformer Engine and Megatron-core'; "
                         "offline: scripts/install_te.sh)")
PUBLISHED_COMM_SMS = 20
PREPROCESSING_SMS = 108
RANK_CAPACITY_FACTOR = 1.25
# Megatron's fp8_recipe names for the TE recipes
MEGATRON_FP8_RECIPE = {"Float8BlockScaling": "blockwise", "Float8CurrentScaling": "tensorwise",
                       "DelayedScaling": "delayed", MXFP8_RECIPE: "mxfp8"}
# Without these the layer is not the published one: an older megatron-core is unsupported
REQUIRED_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_token_dispatcher_type",
                   "moe_flex_dispatcher_backend", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
                   "expert_model_parallel_size")


def has_megatron() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def attention_heads(hidden: int) -> int:
    """Any head count that divides H (the layer has no attention; TransformerConfig needs one)."""
    return next(h for h in (64, 32, 16, 8, 4, 2, 1) if hidden % h == 0)


def config_kwargs(case: Case, fields: Collection[str], num_sms: int, op_fuser: bool = False,
                  recipe: str = "blockwise") -> tuple[dict[str, Any], list[str]]:
    """``TransformerConfig`` keyword arguments for the published layer, restricted to the ``fields`` this
    megatron-core has, and notes for the row. Raises ValueError when a field the layer needs is missing."""
    missing = [f for f in REQUIRED_FIELDS if f not in fields]
    if missing:
        raise ValueError(f"this megatron-core has no {', '.join(missing)}; pip install -U megatron-core")
    name = recipe_name(case.precision, recipe)
    overlap = case.shared_expert and case.swiglu_limit is None
    kw: dict[str, Any] = dict(
        num_layers=1, hidden_size=case.hidden, num_attention_heads=attention_heads(case.hidden),
        ffn_hidden_size=case.ffn, num_moe_experts=case.num_experts, moe_ffn_hidden_size=case.ffn,
        moe_router_topk=case.topk, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
        moe_permute_fusion_into_hybridep=True, moe_hybridep_num_sms_preprocessing=PREPROCESSING_SMS,
        moe_grouped_gemm=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_router_force_load_balancing=False, moe_expert_capacity_factor=None,
        moe_shared_expert_intermediate_size=case.ffn if case.shared_expert else None,
        moe_shared_expert_overlap=overlap, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        expert_model_parallel_size=case.ep_size, expert_tensor_parallel_size=1, sequence_parallel=False,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=False, perform_initialization=False,
        gradient_accumulation_fusion=False,
    )
    notes: list[str] = []
    if "moe_flex_dispatcher_num_sms" in fields:
        kw["moe_flex_dispatcher_num_sms"] = num_sms
    else:  # megatron-core < 0.19
        kw["moe_hybridep_num_sms"] = num_sms
    if case.swiglu_limit is not None:
        if "activation_func_clamp_value" not in fields:
            raise ValueError("this megatron-core has no activation_func_clamp_value (the clamped SwiGLU); "
                             "pip install -U megatron-core")
        kw["activation_func_clamp_value"] = case.swiglu_limit
        if case.shared_expert:
            notes.append("shared expert not overlapped (Megatron's overlapped shared expert ignores the SwiGLU clamp)")
    if name is not None:
        kw.update(fp8="e4m3", fp8_recipe=MEGATRON_FP8_RECIPE[name])
    if op_fuser and "moe_expert_rank_capacity_factor" in fields:
        kw.update(use_transformer_engine_op_fuser=True, moe_expert_rank_capacity_factor=RANK_CAPACITY_FACTOR)
    else:
        why = ("megatron-core takes it only with its TE op-fuser grouped MLP" if "moe_expert_rank_capacity_factor"
               in fields else "this megatron-core has no moe_expert_rank_capacity_factor")
        notes.append(f"HybridEP rank capacity factor {RANK_CAPACITY_FACTOR} (published) not set: {why}; HybridEP "
                     "sizes the receive buffer per call (host sync), no token is dropped")
    dropped = sorted(k for k in kw if k not in fields)
    if dropped:
        notes.append(f"this megatron-core has no {', '.join(dropped)} (left at its default)")
    return {k: v for k, v in kw.items() if k in fields}, notes


def build_config(config_cls: Callable, kw: dict[str, Any], notes: list[str]) -> Any:
    """``TransformerConfig(**kw)``; megatron-core before 0.19 overlaps the shared expert only with the alltoall
    dispatcher, so there it runs without the overlap (noted)."""
    try:
        return config_cls(**kw)
    except ValueError as e:
        if not kw.get("moe_shared_expert_overlap") or "moe_shared_expert_overlap" not in str(e):
            raise
    notes.append("shared expert not overlapped: this megatron-core overlaps it only with the alltoall dispatcher")
    return config_cls(**{**kw, "moe_shared_expert_overlap": False})


SharedWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [I, H], up [I, H], down [H, I]


def megatron_weights(w13_LIH: torch.Tensor, w2_LHI: torch.Tensor,
                     shared: Optional[SharedWeights] = None) -> dict[str, torch.Tensor]:
    """The harness weights under the MoELayer parameter names they are copied into (views except the shared fc1)."""
    L = w13_LIH.shape[0]
    out = {f"experts.linear_fc1.weight{i}": w13_LIH[i] for i in range(L)}  # [2I, H]: gate rows, then up rows
    out.update({f"experts.linear_fc2.weight{i}": w2_LHI[i] for i in range(L)})  # [H, I]
    if shared is not None:
        gate_IH, up_IH, down_HI = shared
        out["shared_experts.linear_fc1.weight"] = torch.cat([gate_IH, up_IH])
        out["shared_experts.linear_fc2.weight"] = down_HI
    return out


def harness_grads(params: Mapping[str, torch.Tensor], num_local: int, ffn: int,
                  shared: bool) -> dict[str, Optional[torch.Tensor]]:
    """Gradients of the MoELayer parameters (by the names of :func:`megatron_weights`) in the harness layout:
    gate/up [L, I, H], down [L, H, I], shared gate/up [I, H], down [H, I]. A parameter without a gradient (an
    expert that got no rows) counts as zero."""

    def grad(name: str) -> torch.Tensor:
        p = params[name]
        return torch.zeros_like(p) if p.grad is None else p.grad

    fc1 = torch.stack([grad(f"experts.linear_fc1.weight{i}") for i in range(num_local)])
    fc2 = torch.stack([grad(f"experts.linear_fc2.weight{i}") for i in range(num_local)])
    out: dict[str, Optional[torch.Tensor]] = {"w_gate": fc1[:, :ffn], "w_up": fc1[:, ffn:], "w_down": fc2,
                                              "ws_gate": None, "ws_up": None, "ws_down": None}
    if shared:
        s1 = grad("shared_experts.linear_fc1.weight")
        out.update(ws_gate=s1[:ffn], ws_up=s1[ffn:], ws_down=grad("shared_experts.linear_fc2.weight"))
    return out


class PrecomputedRouter(torch.nn.Module):
    """Stands in for Megatron's ``TopKRouter``: returns the harness's top-k for the tokens of the next forward as
    (probs [T, E] fp32, routing_map [T, E] bool), the pair ``TopKRouter.routing`` returns. No aux loss, no jitter."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.layer_number: Optional[int] = None
        self._topk: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.last_map: Optional[torch.Tensor] = None

    def set_topk(self, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> None:
        self._topk = (topk_idx_TK, topk_w_TK)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        assert self._topk is not None, "set_topk before the forward"
        idx, w = self._topk
        assert idx.shape[0] == hidden_states.numel() // hidden_states.shape[-1], "one top-k row per token"
        probs, routing_map = dense_routing(idx, w, self.num_experts)
        self.last_map = routing_map
        return probs, routing_map

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number


def ensure_model_parallel(parallel_state: Any, ep: int) -> None:
    """Megatron's process groups for EP = ``ep`` (TP = PP = 1), made once per process."""
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_expert_model_parallel_world_size() == ep:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=ep)


def bf16_region(fn: Callable, recipe: Any) -> Callable:
    """``fn`` with TE quantization off (inside Megatron's fp8 context): keeps the shared expert in bf16."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with te_autocast(recipe, enabled=False):
            return fn(*args, **kwargs)

    return run


class HybridEPMegatronBackend:
    name = "hybridep_megatron"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case, options: Optional[TeOptions] = None) -> Optional[str]:
        options = options or TeOptions()
        if not has_megatron():
            return f"megatron-core is not installed; {MEGATRON_INSTALL_HINT}"
        why = te_unsupported(case, options.fp8_recipe) or hybridep_unsupported(case, mxfp8=True)
        if why:
            return why
        try:
            from megatron.core.transformer.transformer_config import TransformerConfig

            kw, notes = config_kwargs(case, {f.name for f in dataclasses.fields(TransformerConfig)},
                                      PUBLISHED_COMM_SMS, recipe=options.fp8_recipe)
            build_config(TransformerConfig, kw, notes)
        except Exception as e:  # noqa: BLE001 (an import failure or a too-old megatron-core)
            return f"megatron-core cannot build the layer ({type(e).__name__}: {e}); {MEGATRON_INSTALL_HINT}"
        if dist.is_initialized() and dist.get_world_size() != case.ep_size:
            return (f"Megatron's expert-parallel groups span the whole world ({dist.get_world_size()} ranks), not "
                    f"ep_size={case.ep_size}; run with as many ranks as ep_size")
        return None

    def __init__(self, case: Case, group: Any, options: Optional[TeOptions] = None) -> None:
        self.case, self.group = case, group
        self.options = options or TeOptions()
        self.rank, self.ep = dist.get_rank(group), dist.get_world_size(group)
        self.num_sms = case.comm_sms or PUBLISHED_COMM_SMS
        self.recipe_name = recipe_name(case.precision, self.options.fp8_recipe)
        self.notes: list[str] = []
        self.layer: Any = None
        self.permute_fused = False

    def setup(self, inputs: LayerInputs) -> None:
        HybridEPBuffer = import_deep_ep().HybridEPBuffer  # before megatron imports deep_ep itself
        import megatron.core
        from megatron.core import parallel_state
        from megatron.core.fp8_utils import get_fp8_context, get_fp8_recipe
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_config import TransformerConfig

        c = self.case
        ensure_model_parallel(parallel_state, self.ep)
        kw, self.notes = config_kwargs(c, {f.name for f in dataclasses.fields(TransformerConfig)}, self.num_sms,
                                       recipe=self.options.fp8_recipe)
        self.config = build_config(TransformerConfig, kw, self.notes)
        spec = get_moe_module_spec(use_te=True, num_experts=c.num_experts, moe_grouped_gemm=True)
        # megatron-core >= 0.19 returns a partial(MoELayer, submodules=...); earlier versions a ModuleSpec
        if isinstance(spec, functools.partial):
            layer = spec(config=self.config)
        else:
            layer = MoELayer(config=self.config, submodules=spec.submodules)
        self.router = PrecomputedRouter(c.num_experts)
        layer.router = self.router
        if hasattr(layer, "set_layer_number"):
            layer.set_layer_number(1)
        self.layer = layer.cuda()
        shared = (inputs.ws_gate_IH, inputs.ws_up_IH, inputs.ws_down_HI) if c.shared_expert else None
        weights = megatron_weights(inputs.w13_LIH, inputs.w2_LHI, shared)
        self.params = {n: self.layer.get_parameter(n) for n in weights}
        with torch.no_grad():
            for n, w in weights.items():
                self.params[n].copy_(w)
        self._fp8_context = lambda: get_fp8_context(self.config)
        self.recipe = get_fp8_recipe(self.config) if self.config.fp8 else None
        if self.recipe is not None and self.layer.shared_experts is not None:
            for lin in (self.layer.shared_experts.linear_fc1, self.layer.shared_experts.linear_fc2):
                lin.forward = bf16_region(lin.forward, self.recipe)
        self.version = getattr(megatron.core, "__version__", "?")
        # Megatron falls back to the unfused dispatch (with a warning) when DeepEP lacks the fused permute
        self.permute_fused = bool(getattr(self.config, "moe_permute_fusion_into_hybridep", False)) and (
            "fuse_permute_dispatch" in inspect.signature(HybridEPBuffer.dispatch_with_permute).parameters)
        if is_delayed(self.recipe):
            x = inputs.x_TH.detach().requires_grad_()
            w = inputs.topk_w_TK.detach().requires_grad_()
            self.forward(x, inputs.topk_idx_TK, w).backward(inputs.grad_out_TH)
            self.zero_grad()

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        self.router.set_topk(topk_idx_TK, topk_w_TK)
        with self._fp8_context():
            out_SBH, _ = self.layer(x_TH.unsqueeze(1))
        if getattr(self.config, "moe_expert_rank_capacity_factor", None) is not None:
            dropped = self.layer.token_dispatcher.check_over_budget()  # accumulated over forwards (host sync)
            if dropped is not None and bool(dropped.any()):
                raise RuntimeError(f"HybridEP dropped tokens: a rank received more rows than the rank capacity "
                                   f"factor {RANK_CAPACITY_FACTOR} allows")
        return out_SBH.squeeze(1)

    def zero_grad(self) -> None:
        for p in self.layer.parameters():
            p.grad = None

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return harness_grads(self.params, self.case.local_experts, self.case.ffn, self.case.shared_expert)

    def traffic(self) -> dict[str, Any]:
        return routing_map_traffic(self.router.last_map, self.ep, self.case.local_experts, self.case.hidden,
                                   self.group)

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def info(self) -> dict[str, Any]:
        cfg = self.config
        fused = "permute fused into HybridEP" if self.permute_fused else "permute not fused into HybridEP"
        notes = [f"Megatron-core {self.version} MoELayer, flex dispatcher hybridep, {self.num_sms} comm SMs, "
                 f"{PREPROCESSING_SMS} preprocessing SMs, {fused}, bf16 dispatch",
                 "TEGroupedMLP (TE GroupedLinear fc1 [gate; up], fc2); router replaced by the harness's top-k",
                 "shared expert bf16" + (", overlapped with the dispatch" if cfg.moe_shared_expert_overlap else ""),
                 *self.notes]
        if is_delayed(self.recipe):
            notes.append("DelayedScaling: one untimed forward+backward in setup fills the amax history")
        return {"scaling": scaling_label(self.recipe_name, "bf16"), "compiled": False, "compile_mode": "",
                "comm_sms": self.num_sms, "notes": "; ".join(notes)}

    def teardown(self) -> None:
        if self.layer is None:
            return
        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        from megatron.core.transformer.moe import fused_a2a

        if hasattr(fused_a2a, "reset_hybrid_ep_buffer"):  # Megatron keeps one HybridEP buffer per process
            fused_a2a.reset_hybrid_ep_buffer()
        self.layer = None
