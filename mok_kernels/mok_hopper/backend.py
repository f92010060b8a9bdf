"""The harness backend ``mok_hopper``: :class:`~mok_kernels.mok_hopper.api.MoKHopperLayer` behind the backend
protocol (fits ``harness.core.backends.Backend`` structurally; imports nothing from the harness).

On CUDA it runs the Triton kernels. On the CPU (the harness's gloo test runs) it runs the pure-torch twin of the
same pipeline (:class:`~mok_kernels.mok_hopper.twin.ranks.DistributedTwin`, forward and backward), and
``info()['notes']`` says so: those rows check the schedule / combine logic and the backend plumbing, they time nothing
about the kernel.

The forward is a training forward (autograd records it, as the baselines' forwards are recorded) unless its option
``forward`` (``mok_hopper.forward=``, alias ``mok_hopper_forward=``; :mod:`mok_kernels.mok_hopper.options`) is
``inference``: ``save_h`` (default) keeps X and the pre-SwiGLU H, ``recompute`` keeps X and
the backward recomputes H (:mod:`mok_kernels.mok_hopper.train`). The backward runs at any EP, bf16 and fp8 (across
ranks: the expert owners pull the dO rows and push the dX rows back; fp8: :mod:`mok_kernels.mok_hopper.ops.bwd_fp8`).

Its option ``weights`` (``mok_hopper.weights=``, alias ``mok_hopper_weights=``) says which routed bf16 weights the CUDA
kernels read: ``plain`` (default) the harness's tensors in place (:func:`~mok_kernels.mok_hopper.tiles.plain_weights`),
``tiled`` the layer's own copy in TMA block order, ``owned`` the harness's tensors rewritten in place into TMA block
order until :meth:`MokHopperBackend.teardown` (:mod:`mok_kernels.mok_hopper.owned`). In fp8 the forward reads the
layer's own e4m3 copy in any case; it is in TMA block order whatever the option. Its option ``rows``
(``mok_hopper.rows=``, alias ``mok_hopper_rows=``): ``packed`` (default) packs each expert's rows right after the
previous expert's, with no padding (:func:`~mok_kernels.mok_hopper.tiles.packed_rows`; CUDA only: the CPU twin has
one layout), ``padded`` pads them to each expert's last tile.

Legend: T tokens per rank, K top-k, H hidden, I ffn, L local experts, P ranks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from contract import Case, ExpertLeaves, LayerInputs
from mok_kernels.mok_hopper.options import MokHopperOptions


class _TwinTrain(torch.autograd.Function):
    """The CPU twin as an autograd function: its forward, and its backward on the same ranks."""

    @staticmethod
    def forward(ctx, twin, x_TH, topk_idx_TK, topk_w_TK, w13, w2, *shared):  # type: ignore[override]
        ctx.twin, ctx.n_shared = twin, len(shared)
        ctx.save_for_backward(x_TH, topk_idx_TK, topk_w_TK)
        return twin.forward(x_TH, topk_idx_TK, topk_w_TK)

    @staticmethod
    def backward(ctx, dO_TH):  # type: ignore[override]
        x, idx, w = ctx.saved_tensors
        g = ctx.twin.backward(x, idx, w, dO_TH)
        sh = list(g["shared"]) if ctx.n_shared else []
        return (None, g["x"], None, g["topk_w"].to(w.dtype), g["w13"], g["w2"], *sh)


class MokHopperBackend:
    name = "mok_hopper"
    directions = ("fwd", "bwd", "fwd_bwd")
    # several ranks on one GPU (ranks_per_gpu > 1, a gloo group): the kernel's workspaces over CUDA IPC
    # (mok_kernels.mok_hopper.ipc), the CPU twin's collectives through the process group
    runs_shared_gpu = True

    @classmethod
    def shared_gpu_unsupported(cls, case: Case) -> Optional[str]:
        if case.device != "cuda":
            return None
        from mok_kernels.mok_hopper.ipc import unavailable

        why = unavailable()
        return None if why is None else (
            f"several ranks of the kernel on one GPU exchange their workspaces by CUDA IPC, and here {why}; torch "
            f"symmetric memory refuses ranks in several processes on one device. Check several ranks of it on one "
            f"GPU in one process instead: python -m mok_tools.mok_hopper.shared_gpu_check --out DIR")

    @classmethod
    def direction_unsupported(cls, case: Case, direction: str,
                              options: Optional[MokHopperOptions] = None) -> Optional[str]:
        if direction == "fwd":
            return None
        if (options or MokHopperOptions()).forward == "inference":
            return ("mok_hopper_forward=inference saves nothing for a backward; use mok_hopper_forward=save_h "
                    "(default) or recompute")
        return None

    @classmethod
    def unsupported_reason(cls, case: Case, options: Optional[MokHopperOptions] = None) -> Optional[str]:
        if case.precision == "mxfp8":
            return ("mxfp8 (1x32 e8m0 scales) is Blackwell's format: use the `mok` backend on Blackwell; this Hopper "
                    "kernel runs bf16 and fp8 (precision=fp8: e4m3 with 1x128 / 128x128 block scales)")
        if case.device != "cuda":
            return None  # the CPU twin (pure torch) runs anywhere
        from mok_kernels.mok_hopper import TRITON_SPEC, triton_unsupported

        try:
            import triton
        except ImportError:
            return f"needs Triton for its CUDA kernels: pip install 'triton{TRITON_SPEC}'"
        if (why := triton_unsupported(triton.__version__)) is not None:
            return why
        cap = torch.cuda.get_device_capability()
        if cap < (8, 0):
            return f"needs a CUDA GPU with Triton, SM80+ (built for SM90 Hopper); this is SM{cap[0]}{cap[1]}"
        if case.precision == "fp8" and cap < (8, 9):
            return f"fp8 needs compute capability 8.9+ (Ada/Hopper), this is SM{cap[0]}{cap[1]}; use precision=bf16"
        if case.hidden % 128 or case.ffn % 128:
            return (f"hidden ({case.hidden}) and ffn ({case.ffn}) must be multiples of 128 (the kernel's tiles); "
                    f"pick another shape")
        return None

    def __init__(self, case: Case, group: Any, options: Optional[MokHopperOptions] = None) -> None:
        self.case, self.group = case, group
        self.rank = dist.get_rank(group)
        self.ep = dist.get_world_size(group)
        self.impl: Any = None
        self._first_forward = True
        self._tile: Any = None
        self.tile_overrides: dict[str, Any] = {}  # TileConfig fields over the default tile (CUDA; bwd_check --tile)
        self.params: Optional[ExpertLeaves] = None
        self.mode = (options or MokHopperOptions()).forward
        self.weights = (options or MokHopperOptions()).weights
        self.rows = (options or MokHopperOptions()).rows
        self.owned: Any = None  # weights=owned in bf16 on CUDA: the harness's weights in TMA block order, in place
        self._plain_grads: Any = None  # weak references to the gradients weight_grads put into the plain order

    def setup(self, inputs: LayerInputs) -> None:
        c = self.case
        shared = (inputs.ws_gate_IH, inputs.ws_up_IH, inputs.ws_down_HI) if c.shared_expert else None
        if self.mode != "inference":
            self.params = ExpertLeaves(c, inputs)
        if c.device != "cuda":
            from mok_kernels.mok_hopper.twin.ranks import DistributedTwin

            self.impl = DistributedTwin(inputs.w13_LIH, inputs.w2_LHI, group=self.group, topk=c.topk, shared=shared,
                                        swiglu_limit=c.swiglu_limit, precision=c.precision)
            return
        from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile
        from mok_kernels.mok_hopper.tiles import num_sms, packed_rows, plain_weights

        dev = inputs.x_TH.device
        tile = default_tile(precision=c.precision, device=dev, comm_sms=c.comm_sms,
                            rows_per_expert=c.ep_size * c.tokens_per_gpu * c.topk / c.num_experts, n_sm=num_sms(dev))
        if self.weights == "plain" and c.precision == "bf16":  # the harness's weights themselves: no copy
            tile = plain_weights(tile)
        if self.rows == "packed":  # no tile padding in the row buffers
            tile = packed_rows(tile)
        self._tile = replace(tile, **self.tile_overrides)
        w13, w2 = inputs.w13_LIH, inputs.w2_LHI
        if self.weights == "owned" and c.precision == "bf16" and self._tile.w_tiled:
            from mok_kernels.mok_hopper.owned import OwnedWeights

            self.owned = OwnedWeights(w13, w2, self._tile)  # (restored by teardown, which runs after a failure too)
            w13, w2 = self.owned.views()
        self.impl = MoKHopperLayer(w13, w2, topk=c.topk, tokens=c.tokens_per_gpu,
                                   shared=shared, swiglu_limit=c.swiglu_limit, precision=c.precision,
                                   group=self.group, tile=self._tile,
                                   save_h=self.params is not None and self.mode == "save_h",
                                   train=self.params is not None, adopt_routed=self.owned is not None)
        # Untimed warm-up: compiles every kernel variant (all ranks run setup together, so barriers pair up).
        self.impl(inputs.x_TH, inputs.topk_idx_TK, inputs.topk_w_TK)
        torch.cuda.synchronize()
        self.impl.check_no_overflow()

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p is None:  # the inference forward: nothing recorded
            out = self.impl.forward(x_TH, topk_idx_TK, topk_w_TK)
        elif self.case.device != "cuda":
            out = _TwinTrain.apply(self.impl, x_TH, topk_idx_TK, topk_w_TK, p.w13, p.w2, *(p.shared or ()))
        else:
            from mok_kernels.mok_hopper.train import mok_hopper_train

            w13, w2 = p.w13, p.w2
            if self.owned is not None:  # the leaves' storage is tiled: the backward reads it so, and writes so
                if self._grads_plain():  # gradients handed out in the plain order and kept: back for accumulation
                    self.owned.tiled_grad_(p.w13.grad, p.w2.grad)
                    self._plain_grads = None
                w13, w2 = w13.view(self.owned.shape13), w2.view(self.owned.shape2)
            out = mok_hopper_train(self.impl, x_TH, topk_idx_TK, topk_w_TK, w13, w2, p.shared)
        if self._first_forward and self.case.device == "cuda":
            # The first forward is the harness's (untimed) correctness check: make capacity overflow loud there.
            self._first_forward = False
            self.impl.check_no_overflow()
        return out

    def zero_grad(self) -> None:
        if self.params is not None:
            self.params.zero_grad()

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        if self.params is None:
            return {}
        g13, g2 = self.params.w13.grad, self.params.w2.grad
        if self.owned is not None and g13 is not None and g2 is not None and not self._grads_plain():
            import weakref  # gradients in the tiled order: into the plain order, in place, once each

            self.owned.plain_grad_(g13, g2)
            self._plain_grads = (weakref.ref(g13), weakref.ref(g2))
        return self.params.grads()

    def _grads_plain(self) -> bool:
        """Whether the weight gradients now held are the ones :meth:`weight_grads` put into the plain order."""
        done, p = self._plain_grads, self.params
        return bool(done and p is not None and p.w13.grad is not None and done[0]() is p.w13.grad
                    and done[1]() is p.w2.grad)

    def traffic(self) -> dict[str, Any]:
        """Rows of this rank's tokens pulled by each rank (dispatch) and rows pushed back to each rank (combine),
        from the last forward (host sync, outside timing). fp8 pulls e4m3 rows plus one fp32 scale per 128."""
        if self.case.device == "cuda":
            self.impl.check_no_overflow()
        d, cmb = self.impl.rows_per_peer()
        H = self.case.hidden
        d_bytes = H + 4 * (H // 128) if self.case.precision == "fp8" else 2 * H
        return {"dispatch_rows_to": d, "combine_rows_to": cmb, "dispatch_row_bytes": d_bytes,
                "combine_row_bytes": 2 * H}

    def phases(self) -> dict[str, Callable[[], Any]]:
        """The pull kernels alone, on the last forward's schedule (the push is fused into the down GEMM)."""
        if self.case.device != "cuda":
            return {}
        layer = self.impl

        def dispatch() -> None:
            for c in range(layer.cfg.num_chunks):
                layer.pull(c)

        return {"dispatch": dispatch}

    def info(self) -> dict[str, Any]:
        c = self.case
        scaling = "none"
        if c.precision == "fp8":
            scaling = ("block 1x128 act (1x64 hidden) / 128x128 weight, e4m3 GEMMs (Triton), fp32 accumulation; "
                       "activations quantised at the source, before the pull; backward: dgrad e4m3 (dO 1x128 at the "
                       "source, dH 1x128 in dgate's epilogue, the forward's 128x128 weights as e4m3 W^T), wgrad e4m3 "
                       "with 128-row token blocks (operands quantised and transposed in a pass before the GEMM); "
                       "shared expert bf16")
        saves = {"save_h": "training forward (saves X and H)", "recompute": "training forward (saves X; the backward "
                 "recomputes H)"}.get(self.mode, "inference forward (saves nothing)") if self.params is not None \
            else "inference forward (saves nothing)"
        if c.device != "cuda":
            return {"scaling": scaling, "compiled": False,
                    "notes": f"CPU twin (pure torch, gloo), not the Triton kernel: checks schedule and combine logic; "
                             f"{saves}" + ("; rows=packed acts on the CUDA kernels only (the twin has one row "
                                           "layout)" if self.rows == "packed" else "")}
        t, layer = self._tile, self.impl
        weights = (" (weights in TMA block order: the harness's, re-laid in place)" if self.owned is not None else
                   " (weights in TMA block order)" if t.w_tiled else " (plain weights)" if t.tma else "")
        return {"scaling": scaling, "compiled": True, "comm_sms": t.comm_sms,
                "notes": (f"{saves}; Triton, {'TMA' if t.tma else 'pointer'} GEMM operands"
                          f"{weights}; "
                          f"BM={t.block_m} "
                          f"{'+ BM/2 half tiles ' if t.half_tiles else ''}"
                          f"{'+ packed rows (no tile padding) ' if t.packed_rows else ''}"
                          f"{f'+ {t.tail_rows}-row swapped tails ' if t.tail_rows else ''}"
                          f"{'(flat down) ' if t.flat_down else ''}"
                          f"up {t.up_n}x{t.up_k}x{t.up_stages} stages"
                          f"{f' as {t.block_m // 2}-row items' if t.up_halves else ''}"
                          f"{f' x{t.up_per_sm} programs an SM' if t.up_per_sm > 1 else ''}, "
                          f"down {t.down_n}x{t.down_k}x{t.down_stages}"
                          f"{f' as {t.block_m // 2}-row items' if t.down_halves else ''}"
                          f"{f' x{t.down_per_sm} programs an SM' if t.down_per_sm > 1 else ''}; "
                          f"{t.num_chunks} chunk(s), pull -> up "
                          f"{'ready counters' if layer.ready is not None else 'stream events'}; programs: "
                          f"{layer.up_programs}+{layer.up_helper_programs} up, {layer.gemm_programs} down, "
                          f"{layer.pull_programs} pull"
                          + (f", shared expert on {layer.side_programs} of its own (+ up after it)"
                             if layer.side_programs else "") + "; "
                          f"{'Triton' if layer.scheduler is not None else 'torch'} "
                          f"schedule; capacity {layer.R} rows; "
                          f"{'workspaces over CUDA IPC' if layer.ws.transport == 'ipc' else 'symmetric memory'}, "
                          f"no multicast; "
                          + ("replayed as one CUDA graph" if layer.use_graph else
                             f"launched from Python (CUDA graph capture failed: {layer.graph_error})"
                             if layer.graph_error else "launched from Python"))}

    def teardown(self) -> None:
        self.impl = None
        if self.owned is not None:  # the harness's weights back in the plain order (checked) for the next backend
            owned, self.owned = self.owned, None
            owned.restore()
        if self.case.device == "cuda":
            from mok_kernels.mok_hopper.workspace import clear_workspace_cache

            clear_workspace_cache()
