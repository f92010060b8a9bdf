"""The MoE layer a PyTorch user writes: no communication library, no fused kernel, no host sync.

Two registry keys, one class each: ``torch`` runs the layer eagerly; ``torch_compiled`` runs the whole layer under one
``torch.compile(fullgraph=True)`` in the point's ``compile_mode`` (``published`` means ``max-autotune`` here, as for
``nccl``), with the documented fallback of ``baselines.compile_modes`` where a mode fails to compile; the row's
``compile_mode`` says which mode ran. Both ignore the point's ``compile`` switch (the key says whether it compiles).

The routed experts, option ``impl`` (``torch.impl=`` / ``torch_compiled.impl=``; baselines/options.py):

* ``plain``: the layer in about 30 lines: argsort of the flattened top-k ids, ``index_select`` of the token rows,
  two ``torch._grouped_mm`` with device offsets (gate and up in one [L, 2I, H] GEMM, then down), SwiGLU,
  ``index_select`` back through the inverse permutation (a scatter, not a second argsort), and one ``bmm`` of each
  token's K expert rows with its router weights (bf16 operands, fp32 accumulation). On a CPU, or a GPU without
  ``torch._grouped_mm``, the per-expert loop of ``baselines.common`` replaces the grouped GEMM (it reads the group
  sizes on the host).
* ``torchtitan``: torchtitan's ``RoutedExperts`` (``torchtitan.models.common.moe``: ``LocalTokenDispatcher`` and
  ``GroupedExperts``, three ``torch._grouped_mm`` with separate gate and up weights, router weights applied in fp32 and
  the combine as a deterministic bf16 ``scatter_add``), on the harness's weights as they are: its ``w1`` / ``w3`` /
  ``w2`` parameters are views of the harness's gate rows, up rows and down weights (no copy). An optional package
  (docs/backends.md, 'PyTorch-native layer (torch, torch_compiled)'); not for the clamped SwiGLU
  (``shape.swiglu_limit``) or fp8.
* ``auto`` (default): both where both run, each timed at setup (forward and backward, after a warm call), the faster
  kept; the notes give both times. Elsewhere the one that runs.

fp8 (``precision=fp8``): the plain layer with real fp8 grouped GEMMs in the forward and the backward, the rowwise path
of ``baselines.fp8_gemm`` (``torch._scaled_grouped_mm``, per-row / per-channel scales; torchao's MoE training recipe).
Here ``fp8_gemm=auto`` means rowwise on a GPU (emulated, accuracy only, on a CPU); the blockwise paths need the
group sizes on the host, so the compiled layer refuses them.

The shared expert is the PyTorch baselines' dense SwiGLU, added in fp32 (inside the compiled graph for
``torch_compiled``). A single-GPU layer: at EP >= 2 the ``nccl`` baseline is this layer behind the published
all-to-all dispatch, so these keys give an ``unsupported`` row there.

Legend: T tokens, K top-k, N = T*K routed rows, L local experts (= all experts at EP=1), H hidden, I expert ffn.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable, Optional

import torch

from baselines import fp8_gemm
from baselines.common import (ExpertLeaves, PUBLISHED_COMPILE_MODE, dense_mlp, emulated_fp8_weights, expert_mlp,
                              fake_quant, inverse_permutation, precision_unsupported, straight_through, swiglu,
                              use_grouped_mm, warm_forward_backward)
from baselines.compile_modes import EAGER, CompileOutcome, compile_with_fallback, drop_compiled_state, step_begin
from baselines.options import TorchNativeOptions
from contract import Case, LayerInputs

TORCHTITAN_HINT = ("python3 -m pip install --no-deps -r requirements-torchtitan.txt in the mokbench folder "
                   "(docs/backends.md, 'PyTorch-native layer (torch, torch_compiled)')")
PUBLISHED_MODE = "max-autotune"  # compile_mode=published: as the published nccl script compiles
IMPL_ITERS = 3  # impl=auto: timed forward + backward calls per implementation at setup (after one untimed)


def torchtitan_unavailable() -> Optional[str]:
    """Why torchtitan's MoE blocks cannot be imported here (None: they can)."""
    if importlib.util.find_spec("torchtitan") is None:
        return f"torchtitan is not installed: {TORCHTITAN_HINT}"
    try:
        from torchtitan.models.common import moe  # noqa: F401
    except Exception as e:  # noqa: BLE001 (a missing dependency of its --no-deps install, or an API change)
        return f"torchtitan.models.common.moe does not import ({type(e).__name__}: {e}); {TORCHTITAN_HINT}"
    return None


def impl_unsupported(case: Case, impl: str) -> Optional[str]:
    """Why ``impl`` (plain / torchtitan) cannot run ``case`` (None: it can)."""
    if impl != "torchtitan":
        return None
    if case.precision != "bf16":
        return "torchtitan's RoutedExperts runs bf16 here (its fp8 is torchao's module swap); use torch.impl=plain"
    if case.swiglu_limit is not None:
        return "torchtitan's GroupedExperts has no clamped SwiGLU (shape.swiglu_limit); use torch.impl=plain"
    return torchtitan_unavailable()


def fp8_path(case: Case, option: str) -> tuple[str, Optional[str]]:
    """The fp8 GEMM path of the native layer for ``fp8_gemm=option`` (auto: rowwise on a GPU), and why not."""
    if case.precision != "fp8":
        return "none", None
    if option == "auto":
        option = "rowwise" if case.device == "cuda" else "emulated"
    return fp8_gemm.resolve(case, option)


# ---- the plain layer ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on ``device`` (SM90+ GPUs; CPUs on recent torch)."""
    if device.type == "cuda":
        return use_grouped_mm(torch.empty(0, device=device))
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(2, 16, 8, dtype=torch.bfloat16, requires_grad=True)
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([1, 4], dtype=torch.int32))
        y.backward(torch.ones_like(y))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class PlainExperts:
    """The routed experts of the plain layer on rows sorted by expert: bf16 ``torch._grouped_mm`` (the per-expert
    loop where it is missing), emulated fp8, or the real rowwise fp8 GEMMs."""

    def __init__(self, case: Case, leaves: ExpertLeaves, path: str) -> None:
        self.case, self.leaves, self.path = case, leaves, path
        self.grouped = grouped_mm_runs(leaves.w13.device)
        self.fp8 = fp8_gemm.Fp8Experts(path, leaves.w13, leaves.w2) if path in fp8_gemm.FP8_GEMM_PATHS else None
        self.quantized = (emulated_fp8_weights((leaves.w13, leaves.w2), case.weight_block) if path == "emulated"
                          else None)

    def tensors(self) -> list[torch.Tensor]:
        return (self.fp8.tensors() if self.fp8 else []) + (self.quantized or [])

    def __call__(self, x_NH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        w13, w2, limit = self.leaves.w13, self.leaves.w2, self.case.swiglu_limit
        if self.fp8 is not None:
            return self.fp8(x_NH, w13, w2, counts_L, swiglu, limit)
        quantized = tuple(self.quantized) if self.quantized is not None else None
        if quantized is not None:
            x_NH = fake_quant(x_NH, 1, self.case.act_block)
        offs = torch.cumsum(counts_L, 0).to(torch.int32)
        if not self.grouped:  # the per-expert loop of the other baselines (it reads the group sizes on the host)
            return expert_mlp(x_NH, w13, w2, offs, counts_L.tolist(), limit, quantized)
        if quantized is not None:
            w13, w2 = straight_through(w13, quantized[0]), straight_through(w2, quantized[1])
        gate, up = torch._grouped_mm(x_NH, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(swiglu(gate, up, limit), w2.transpose(-2, -1), offs=offs)


def plain_routed(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], num_local: int) -> torch.Tensor:
    """The routed part of the plain layer: [T, H] bf16, every token's K expert rows weighted and summed."""
    T, K = topk_idx_TK.shape
    flat_N = topk_idx_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    counts_L = torch.zeros(num_local, dtype=torch.int64, device=flat_N.device).scatter_add_(
        0, flat_N, torch.ones_like(flat_N))
    y_NH = experts(x_TH.index_select(0, order_N // K), counts_L)
    y_TKH = y_NH.index_select(0, inverse_permutation(order_N)).view(T, K, -1)
    return torch.bmm(topk_w_TK.unsqueeze(1).to(y_TKH.dtype), y_TKH).squeeze(1)


# ---- torchtitan ----------------------------------------------------------------------------------------------


class TitanExperts:
    """torchtitan's RoutedExperts on the harness's weights: its parameters are views of them (no copy)."""

    def __init__(self, case: Case, leaves: ExpertLeaves) -> None:
        from torchtitan.models.common import moe

        L, I, H, K = case.local_experts, case.ffn, case.hidden, case.topk
        cfg = moe.RoutedExperts.Config(
            inner_experts=moe.GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=L),
            token_dispatcher=moe.LocalTokenDispatcher.Config(num_experts=L, top_k=K))
        with torch.device("meta"):  # its own empty weights would take as much memory as the harness's
            self.module = cfg.build()
        inner = self.module.inner_experts
        w13 = leaves.w13.detach()
        # the parameters alias the harness's weights; their gradients land in w1.grad / w3.grad / w2.grad
        inner.w1_EFD = torch.nn.Parameter(w13[:, :I])
        inner.w3_EFD = torch.nn.Parameter(w13[:, I:])
        inner.w2_EDF = torch.nn.Parameter(leaves.w2.detach())
        self.num_local = L

    def params(self) -> list[torch.nn.Parameter]:
        inner = self.module.inner_experts
        return [inner.w1_EFD, inner.w3_EFD, inner.w2_EDF]

    def __call__(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        counts_L = torch.zeros(self.num_local, dtype=torch.int64, device=x_TH.device).scatter_add_(
            0, topk_idx_TK.reshape(-1), torch.ones_like(topk_idx_TK.reshape(-1)))
        T, H = x_TH.shape
        out = self.module(x_TH.view(1, T, H), topk_w_TK.unsqueeze(0), topk_idx_TK.unsqueeze(0), counts_L)
        return out.view(T, H)


# ---- the backend ---------------------------------------------------------------------------------------------


class TorchNativeBackend:
    """``torch``: the PyTorch-native layer, eager."""

    name = "torch"
    directions = ("fwd", "bwd", "fwd_bwd")
    compiled = False

    @classmethod
    def unsupported_reason(cls, case: Case, options: Optional[TorchNativeOptions] = None) -> Optional[str]:
        options = options or TorchNativeOptions()
        why = precision_unsupported(case.precision, torch.device(case.device))
        if why:
            return why
        if case.precision == "mxfp8":
            return "the PyTorch-native layer's mxfp8 path is not implemented; use precision=bf16 or fp8"
        if case.ep_size > 1:
            return (f"{cls.name} is a single-GPU layer (no dispatch); at EP={case.ep_size} the nccl baseline is this "
                    f"layer behind the published all-to-all dispatch: run {cls.name} at ep_size=1, or nccl")
        path, why = fp8_path(case, options.fp8_gemm)
        if why:
            return why
        if cls.compiled and path in ("blockwise", "blockwise_loop"):
            return (f"fp8_gemm={path} reads the group sizes on the host, which one fullgraph torch.compile cannot "
                    f"hold: use {cls.name}.fp8_gemm=rowwise, or the eager key torch")
        if options.impl != "auto":
            return impl_unsupported(case, options.impl)
        return None

    def __init__(self, case: Case, group: Any, options: Optional[TorchNativeOptions] = None) -> None:
        self.case, self.group = case, group
        self.options = options or TorchNativeOptions()
        self.fp8_path = fp8_path(case, self.options.fp8_gemm)[0]
        self.outcome = CompileOutcome(EAGER)
        self.impl = ""
        self.impl_times: dict[str, float] = {}
        self._fn: Optional[Callable[..., torch.Tensor]] = None

    # -- setup

    def setup(self, inputs: LayerInputs) -> None:
        self.leaves = ExpertLeaves(self.case, inputs)
        self.plain = PlainExperts(self.case, self.leaves, self.fp8_path)
        self.titan = None
        candidates = [self.options.impl] if self.options.impl != "auto" else \
            [i for i in ("plain", "torchtitan") if impl_unsupported(self.case, i) is None]
        if "torchtitan" in candidates:
            self.titan = TitanExperts(self.case, self.leaves)
        if len(candidates) > 1:
            for impl in candidates:
                self.impl_times[impl] = self._time_impl(impl, inputs)
            self.impl = min(candidates, key=lambda i: self.impl_times[i])
        else:
            self.impl = candidates[0]
        if self.impl != "torchtitan":
            self.titan = None
        self._fn = self._build(inputs)

    def _build(self, inputs: LayerInputs) -> Callable[..., torch.Tensor]:
        """The layer the timed calls run (eager here; the compiled key compiles it)."""
        return self.layer_fn(self.impl)

    def layer_fn(self, impl: str) -> Callable[..., torch.Tensor]:
        """The whole layer (routed experts of ``impl`` plus the shared expert) as one function of
        (x, topk_idx, topk_w): what the compiled key hands to torch.compile."""
        routed = self.titan if impl == "torchtitan" else (
            lambda x, idx, w: plain_routed(x, idx, w, self.plain, self.case.local_experts))
        shared, limit = self.leaves.shared, self.case.swiglu_limit

        def layer(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
            out = routed(x_TH, topk_idx_TK, topk_w_TK).float()
            if shared is not None:
                out = out + dense_mlp(x_TH, *shared, limit).float()
            return out.to(torch.bfloat16)

        return layer

    def _time_impl(self, impl: str, inputs: LayerInputs) -> float:
        """Median ms of ``impl``'s eager forward + backward on the point's inputs (after one untimed call)."""
        fn = self.layer_fn(impl)
        warm_forward_backward(fn, inputs, self)
        times = sorted(warm_forward_backward(fn, inputs, self) * 1e3 for _ in range(IMPL_ITERS))
        return times[len(times) // 2]

    # -- the protocol

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        return self._fn(x_TH, topk_idx_TK, topk_w_TK)

    def zero_grad(self) -> None:
        self.leaves.zero_grad()
        if self.titan is not None:
            for p in self.titan.params():
                p.grad = None

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        g = self.leaves.grads()
        if self.titan is not None:
            w1, w3, w2 = (p.grad for p in self.titan.params())
            g.update(w_gate=w1, w_up=w3, w_down=w2)
        return g

    def traffic(self) -> dict[str, Any]:
        return {}  # no dispatch: one GPU

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def info(self) -> dict[str, Any]:
        c = self.case
        what = ("torchtitan RoutedExperts (GroupedExperts + LocalTokenDispatcher)" if self.impl == "torchtitan" else
                "plain layer (argsort, index_select, " +
                ("torch._grouped_mm" if self.plain.grouped else "per-expert loop") + ", bmm combine)")
        notes = [f"impl={self.impl}: {what}"]
        if self.impl_times:
            notes.append("impl=auto setup times (eager fwd+bwd, median ms): " +
                         ", ".join(f"{k} {v:.3g}" for k, v in self.impl_times.items()))
        notes += [self.outcome.note, "no host sync"]
        scaling = fp8_gemm.scaling_label(self.fp8_path, c, "none (one GPU)") if c.precision == "fp8" else "none"
        return {"scaling": scaling, "compiled": self.compiled,
                "compile_mode": self.outcome.mode if self.compiled else "",
                "notes": "; ".join(filter(None, notes))}

    def teardown(self) -> None:
        self._fn = self.titan = None
        drop_compiled_state()


class TorchCompiledBackend(TorchNativeBackend):
    """``torch_compiled``: the same layer under one ``torch.compile(fullgraph=True)``."""

    name = "torch_compiled"
    compiled = True

    def _build(self, inputs: LayerInputs) -> Callable[..., torch.Tensor]:
        mode = PUBLISHED_MODE if self.case.compile_mode == PUBLISHED_COMPILE_MODE else self.case.compile_mode
        eager = self.layer_fn(self.impl)
        if self.case.device == "cuda":
            for t in [self.leaves.w13, self.leaves.w2, *(self.leaves.shared or []), *self.plain.tensors()]:
                torch._dynamo.mark_static_address(t)  # the weights are the same tensors every call (as nccl's)

        def build(m: str) -> Callable[..., torch.Tensor]:
            return eager if m == EAGER else torch.compile(eager, mode=m, fullgraph=True, dynamic=False)

        def warm(fn: Callable[..., torch.Tensor]) -> None:
            try:
                for _ in range(2):  # the second call: CUDA graph trees record on it
                    self.zero_grad()  # a failed try's gradients are outputs of its graphs: never accumulated into
                    step_begin(self._trying, inputs.x_TH.is_cuda)
                    warm_forward_backward(fn, inputs, self)
            finally:
                self.zero_grad()

        def build_and_note(m: str) -> Callable[..., torch.Tensor]:
            self._trying = m
            return build(m)

        fn, self.outcome = compile_with_fallback(mode, build_and_note, warm)
        return fn

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        step_begin(self.outcome.mode, x_TH.is_cuda)
        return self._fn(x_TH, topk_idx_TK, topk_w_TK)

