"""A trainable drop-in MoE layer over mok_hopper: :class:`MoKHopperMoE`, an ``nn.Module`` whose routed and shared expert
weights are ``nn.Parameter``s that the kernels read in place (no second copy), and the ``torch.library`` custom ops it
calls (``mokbench::mok_hopper_moe`` and its backward), with fake implementations so that ``torch.compile`` can trace a
model that uses it.

EP = 1, bf16 (the backward of :mod:`mok_kernels.mok_hopper.train`). The op reaches its layer (non-tensor state: the
schedule, the pulled X rows, the workspace) through an int handle, the key of a registry of live modules.

Token counts may vary between calls up to ``max_tokens``: the layer is built for ``max_tokens``; a call with fewer
pads x with zero rows whose top-k ids are -1 (masked: no routed row, nothing pushed) and slices the output. The
padding's gradients are exactly zero (its x rows are zero and its upstream gradient is zero), so nothing leaks.

Layouts (``layout``): "plain" (the tile with ``w_tiled=False, up_fused=False``; parameters [L, 2I, H] / [L, H, I]),
"tiled" (the parameters themselves in the kernels' TMA block order, ``tile_weights`` / ``tile_weights_gu``: what
the default CUDA tile reads). ``state_dict()`` / ``load_state_dict()`` use the plain layout in both.

Legend: T tokens, K top-k, H hidden, I ffn, L experts.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from dataclasses import replace
from typing import Any, Iterator, Optional, Sequence

import torch

from mok_kernels.mok_hopper.api import MoKHopperLayer
from mok_kernels.mok_hopper.ops.gemm_common import (layout_shapes, tile_weights, tile_weights_gu, untile_weights,
                                          untile_weights_gu)
from mok_kernels.mok_hopper.tiles import TileConfig, default_tile
from mok_kernels.mok_hopper.train import layer_backward
from mok_kernels.mok_hopper.workspace import get_workspace

LAYOUTS = ("plain", "tiled")
_MODULES: "weakref.WeakValueDictionary[int, MoKHopperMoE]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def _module(handle: int) -> "MoKHopperMoE":
    m = _MODULES.get(handle)
    if m is None:
        raise RuntimeError(f"mokbench::mok_hopper_moe: no live MoKHopperMoE with handle {handle}")
    return m


def _traced(t: torch.Tensor) -> bool:
    """True while torch.compile / AOTAutograd traces (fake or functional tensors), False for real tensors."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter)


def _backward_weights(layer: MoKHopperLayer, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed weights the backward reads: the forward's, in the layer's layout (plain, or its TMA block order,
    which ``train.layer_backward`` reads by index arithmetic and whose layout its weight gradients come back in)."""
    assert (w13.dim() == 5) == bool(layer.cfg.w_tiled), "the weights must be in the layer's layout"
    return w13, w2


# ---- the custom ops ----

@torch.library.custom_op("mokbench::mok_hopper_moe", mutates_args=())
def mok_hopper_moe(handle: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, shared: list[torch.Tensor]) -> torch.Tensor:
    """bf16 [T, H]: the fused forward of module ``handle`` (T <= its max_tokens) with these weights (in the
    module's layout). They are the module's parameters, which the layer reads in place (and replays as a CUDA
    graph); other tensors (opcheck's copies) run eagerly through the layer, without the graph."""
    m = _module(handle)
    T = x.shape[0]
    with m._operands(w13, w2, shared):
        out = m.layer(*m._padded(x, topk_idx, topk_w))
    m._forwards += 1
    return out[:T].clone() if T < m.max_tokens else out


@mok_hopper_moe.register_fake
def _(handle, x, topk_idx, topk_w, w13, w2, shared):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape, dtype=torch.bfloat16)


@torch.library.custom_op("mokbench::mok_hopper_moe_backward", mutates_args=())
def mok_hopper_moe_backward(handle: int, dO: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            shared: list[torch.Tensor]) -> list[torch.Tensor]:
    """[dx, dtopk_w, dw13, dw2, *dshared] of the module's last forward (each in its input's dtype and layout)."""
    m = _module(handle)
    T = x.shape[0]
    xp, ip, wp = m._padded(x, topk_idx, topk_w)
    dOp = dO.new_zeros(m.max_tokens, dO.shape[1]) if T < m.max_tokens else dO
    if T < m.max_tokens:
        dOp[:T] = dO
    b13, b2 = _backward_weights(m.layer, w13, w2)
    g = layer_backward(m.layer, dOp.contiguous(), xp, ip, wp, b13, b2, tuple(shared) if shared else None)
    out = [g["x"][:T].to(x.dtype), g["topk_w"][:T].to(topk_w.dtype), g["w13"], g["w2"]]
    out += [t.to(s.dtype) for t, s in zip(g.get("shared", ()), shared)]
    return [t.clone() if t._base is not None else t for t in out]  # (the op's outputs may alias nothing)


@mok_hopper_moe_backward.register_fake
def _(handle, dO, x, topk_idx, topk_w, w13, w2, shared):  # type: ignore[no-untyped-def]
    return [torch.empty_like(t) for t in (x, topk_w, w13, w2, *shared)]


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    handle, x, topk_idx, topk_w, w13, w2, shared = inputs
    ctx.handle = handle
    ctx.n_shared = len(shared)
    ctx.forward_id = None if _traced(x) else _module(handle)._forwards  # (eager: checked by the backward)
    ctx.save_for_backward(x, topk_idx, topk_w, w13, w2, *shared)


def _backward(ctx: Any, dO: torch.Tensor) -> tuple:
    x, topk_idx, topk_w, w13, w2, *shared = ctx.saved_tensors
    m = _module(ctx.handle)
    if ctx.forward_id is not None and ctx.forward_id != m._forwards:
        raise RuntimeError("MoKHopperMoE: another forward of this module ran before this backward (the layer keeps "
                           "one forward's rows and schedule): run the backward first, or use one module per call")
    g = mok_hopper_moe_backward(ctx.handle, dO, x, topk_idx, topk_w, w13, w2, shared)
    dw = g[2:]
    if m.main_grad:
        if _traced(dO):
            raise NotImplementedError("MoKHopperMoE(main_grad=True) accumulates into main_grad eagerly; under "
                                      "torch.compile use main_grad=False (gradients in .grad)")
        with torch.no_grad():
            for p, d in zip(m.expert_parameters(), dw):
                p.main_grad.add_(d)  # fp32 += bf16, in call order: deterministic
        dw = [None] * len(dw)
    return None, g[0], None, g[1], dw[0], dw[1], list(dw[2:]) if ctx.n_shared else None


mok_hopper_moe.register_autograd(_backward, setup_context=_setup_context)


# ---- the module ----

class MoKHopperMoE(torch.nn.Module):
    """A trainable MoE layer (EP = 1, bf16): routed experts ``w13`` [L, 2I, H] (gate rows, then up rows), ``w2``
    [L, H, I], and optionally a shared expert ``shared_gate`` [I, H], ``shared_up`` [I, H], ``shared_down`` [H, I].

    ``forward(x [T, H], topk_idx [T, K] (int, -1 = masked), topk_w [T, K])`` -> bf16 [T, H], T <= ``max_tokens``;
    gradients flow to x, topk_w and every parameter. Each forward's backward must run before its next forward.

    Args:
        num_experts, hidden, ffn, topk, max_tokens: L, H, I, K and the largest T of a call.
        shared: with a shared expert. swiglu_limit: the clamped SwiGLU's limit, or None.
        layout: "plain" or "tiled" (the parameters in the kernels' TMA block order, as the default CUDA tile reads
            them; their gradients come in the same layout).
        main_grad: accumulate the parameters' gradients in fp32 into ``p.main_grad`` (Megatron's convention;
            allocated here as zeros when absent; ``.grad`` stays None), eager mode only. Each call's gradient is
            bf16 before it is added (Megatron's fused accumulation adds the wgrad GEMM's fp32 result instead).
        tile: the forward's launch parameters (default: ``default_tile`` for these shapes, set to the layout).
        cuda_graph: the layer replays its forward as a CUDA graph (over the module's own padded input buffers).
        save_h: the forward saves the pre-SwiGLU H for the backward (default); False: the backward recomputes it.
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int, *, topk: int, max_tokens: int, shared: bool = True,
                 swiglu_limit: Optional[float] = None, layout: str = "plain", main_grad: bool = False,
                 tile: Optional[TileConfig] = None, device: Any = None, cuda_graph: bool = True,
                 save_h: bool = True) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} (got {layout!r})")
        dev = torch.device(device if device is not None else "cpu")
        L, H, I = num_experts, hidden, ffn
        self.L, self.H, self.I, self.K, self.max_tokens = L, H, I, topk, max_tokens
        self.layout, self.main_grad = layout, main_grad
        tiled = layout == "tiled"
        if tile is None:
            tile = default_tile(device=dev, hidden=H, ffn=I, rows_per_expert=max_tokens * topk / L)
            tile = replace(tile, tma=tile.tma or tiled, w_tiled=tiled, up_fused=tile.up_fused and tiled)
        elif tile.w_tiled != tiled:
            raise ValueError(f"layout={layout!r} needs a tile with w_tiled={tiled} (got w_tiled={tile.w_tiled})")
        self.tile = tile
        s13, s2 = layout_shapes(L, I, H, tile)
        bf16 = dict(dtype=torch.bfloat16, device=dev)
        self.w13 = torch.nn.Parameter(torch.empty(s13, **bf16))
        self.w2 = torch.nn.Parameter(torch.empty(s2, **bf16))
        self.has_shared = shared
        if shared:  # gate and up: the two halves of one [2I, H] tensor, which the shared up GEMM reads as one
            self._sh13 = torch.empty(2 * I, H, **bf16)
            self.shared_gate = torch.nn.Parameter(self._sh13[:I])
            self.shared_up = torch.nn.Parameter(self._sh13[I:])
            self.shared_down = torch.nn.Parameter(torch.empty(H, I, **bf16))
        self.reset_parameters()
        sh = (self.shared_gate, self.shared_up, self.shared_down) if shared else None
        ws = get_workspace(group=None, rank=0, world=1, device=dev, tokens=max_tokens, hidden=H, topk=topk, fp8=False)
        self.layer = MoKHopperLayer(self.w13.data, self.w2.data, topk=topk, tokens=max_tokens,
                                    shared=None if sh is None else tuple(p.data for p in sh),
                                    swiglu_limit=swiglu_limit, tile=tile, rank=0, world=1, workspace=ws,
                                    cuda_graph=cuda_graph, adopt_weights=True, save_h=save_h)
        # the padded inputs of every call (one set of tensors: the layer's CUDA graph is keyed by their addresses)
        self._x = torch.zeros(max_tokens, H, **bf16)
        self._idx = torch.full((max_tokens, topk), -1, dtype=torch.int64, device=dev)
        self._w = torch.zeros(max_tokens, topk, dtype=torch.float32, device=dev)
        self._forwards = 0
        if main_grad:
            for p in self.expert_parameters():
                if getattr(p, "main_grad", None) is None:
                    p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        self.handle = next(_HANDLES)
        _MODULES[self.handle] = self
        self.register_state_dict_post_hook(_plain_state_dict)
        self.register_load_state_dict_pre_hook(_layout_state_dict)

    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """w13, w2 and (with a shared expert) shared_gate, shared_up, shared_down, in the op's order."""
        sh = [self.shared_gate, self.shared_up, self.shared_down] if self.has_shared else []
        return [self.w13, self.w2, *sh]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each weight uniform in +-1/sqrt(fan_in), nn.Linear's default bound (fan_in H for w13 and the shared gate
        and up, I for the down weights); laid out in the module's layout."""
        g13 = torch.empty(self.L, 2 * self.I, self.H).uniform_(-1, 1) / math.sqrt(self.H)
        g2 = torch.empty(self.L, self.H, self.I).uniform_(-1, 1) / math.sqrt(self.I)
        self.w13.copy_(self._to_layout("w13", g13.bfloat16()))
        self.w2.copy_(self._to_layout("w2", g2.bfloat16()))
        if self.has_shared:
            self._sh13.uniform_(-1, 1).div_(math.sqrt(self.H))
            self.shared_down.uniform_(-1, 1).div_(math.sqrt(self.I))

    @classmethod
    def from_weights(cls, w13: torch.Tensor, w2: torch.Tensor, shared: Optional[Sequence[torch.Tensor]] = None,
                     **kwargs: Any) -> "MoKHopperMoE":
        """A module holding copies of plain weights (w13 [L, 2I, H], w2 [L, H, I], shared (gate, up, down))."""
        L, I2, H = w13.shape
        m = cls(L, H, I2 // 2, shared=shared is not None, device=w13.device, **kwargs)
        sd = {"w13": w13, "w2": w2}
        if shared is not None:
            sd.update(shared_gate=shared[0], shared_up=shared[1], shared_down=shared[2])
        m.load_state_dict(sd)
        return m

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        if (x.dim() != 2 or x.shape[1] != self.H or tuple(topk_idx.shape) != (T, self.K)
                or topk_w.shape != topk_idx.shape):
            raise ValueError(f"MoKHopperMoE wants x [T, {self.H}], topk_idx and topk_w [T, {self.K}]; got "
                             f"{tuple(x.shape)}, {tuple(topk_idx.shape)}, {tuple(topk_w.shape)}")
        if T > self.max_tokens:
            raise ValueError(f"MoKHopperMoE: {T} tokens, more than max_tokens={self.max_tokens}")
        sh = [self.shared_gate, self.shared_up, self.shared_down] if self.has_shared else []
        return mok_hopper_moe(self.handle, x, topk_idx, topk_w, self.w13, self.w2, sh)

    # ---- helpers of the ops and of the state dict ----

    def _padded(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The inputs in the module's [max_tokens] buffers; rows past T: zero x, ids -1, weights 0."""
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"MoKHopperMoE: {T} tokens, more than max_tokens={self.max_tokens}")
        self._x[:T] = x
        self._idx[:T] = idx
        self._w[:T] = w
        if T < self.max_tokens:
            self._x[T:].zero_()
            self._idx[T:] = -1
            self._w[T:].zero_()
        return self._x, self._idx, self._w

    @contextlib.contextmanager
    def _operands(self, w13: torch.Tensor, w2: torch.Tensor, shared: Sequence[torch.Tensor]) -> Iterator[None]:
        """The layer's forward reads these weights: its own (the parameters) as they are, other tensors for the
        duration of one eager forward."""
        lay = self.layer
        mine = [lay.w13, lay.w2, *([lay.sh_w13[0, : self.I], lay.sh_w13[0, self.I :], lay.sh_w2[0]]
                                   if self.has_shared else [])]
        if all(a.data_ptr() == b.data_ptr() for a, b in zip((w13, w2, *shared), mine)):
            yield
            return
        saved = lay.w13, lay.w2, lay.sh_w13 if self.has_shared else None, lay.sh_w2 if self.has_shared else None
        graph = lay.use_graph
        try:
            lay.w13, lay.w2, lay.use_graph = w13.contiguous(), w2.contiguous(), False
            if self.has_shared:
                lay.sh_w13 = torch.cat(list(shared[:2])).unsqueeze(0)
                lay.sh_w2 = shared[2].contiguous().unsqueeze(0)
            yield
        finally:
            lay.w13, lay.w2, lay.use_graph = saved[0], saved[1], graph
            if self.has_shared:
                lay.sh_w13, lay.sh_w2 = saved[2], saved[3]

    def _apply(self, fn: Any, recurse: bool = True) -> "MoKHopperMoE":
        ptrs = [p.data_ptr() for p in self.expert_parameters()]
        out = super()._apply(fn, recurse)
        if [p.data_ptr() for p in self.expert_parameters()] != ptrs:
            raise RuntimeError("MoKHopperMoE: moving or casting the module reallocated its parameters, which the "
                               "kernel layer reads in place; build the module on its device, in bf16")
        return out

    def _to_layout(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if self.layout == "plain":
            return w
        cfg = self.tile
        if name == "w2":
            return tile_weights(w, cfg.down_n, cfg.down_k)
        return (tile_weights_gu if cfg.up_fused else tile_weights)(w, cfg.up_n, cfg.up_k)

    def _to_plain(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if self.layout == "plain":
            return w
        if name == "w2":
            return untile_weights(w)
        return (untile_weights_gu if self.tile.up_fused else untile_weights)(w)


def _plain_state_dict(m: MoKHopperMoE, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name in ("w13", "w2"):
        state_dict[prefix + name] = m._to_plain(name, state_dict[prefix + name])


def _layout_state_dict(m: MoKHopperMoE, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                       missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    plain = {"w13": (m.L, 2 * m.I, m.H), "w2": (m.L, m.H, m.I)}
    for name, shape in plain.items():
        w = state_dict.get(prefix + name)
        if w is None:
            continue
        if tuple(w.shape) != shape:  # a one-line error through load_state_dict's own report
            error_msgs.append(f"{prefix}{name}: the state dict holds {tuple(w.shape)}, MoKHopperMoE wants the plain "
                              f"layout {shape}")
            state_dict.pop(prefix + name)
            continue
        state_dict[prefix + name] = m._to_layout(name, w.to(torch.bfloat16))
