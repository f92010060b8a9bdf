"""The training step through mok_hopper (bf16 and fp8): :func:`mok_hopper_train` runs the fused
forward and records a backward, :func:`layer_backward`, made of the backward GEMMs
(:mod:`mok_kernels.mok_hopper.ops.bwd_gemm`, :mod:`mok_kernels.mok_hopper.ops.bwd_wgrad`):
H from the forward (``MoKHopperLayer(save_h=True)``) or recomputed from the layer's X rows, dgate (dO rows x W2,
SwiGLU's derivative and the router-weight gradient in its epilogue), dX (each row pushed into its token slot and
summed per token by the forward's epilogue kernel), the weight gradients (each expert's rows in schedule order:
no split-K, no atomics, bitwise deterministic); the shared expert through the same stages, as one expert over the
T tokens. No host synchronisation. At EP >= 2 the expert owners pull the dO rows from their source ranks (the
forward's pull kernel and schedule) and push the dX rows and router-weight gradients back into the source ranks'
workspaces, which sum them in the forward's fixed order. Checked against torch autograd under the Triton
interpreter, 1, 2 and 4 ranks (simulated in one process; tests/test_mok_hopper_bwd.py), and at EP=1 against the
harness's reference on one H200 (mok_tools/mok_hopper/bwd_check.py; run mok_hopper-bf16-fwd-bwd_h200x1_20261201);
not yet run on several GPUs. The trainable module and custom ops over it (EP=1) are in
:mod:`mok_kernels.mok_hopper.module`.

fp8 (a layer built with ``precision="fp8", train=True``): the same dataflow at every EP through the
three phases below (dO quantised 1 x 128 at its source, pulled as e4m3), the routed stages of
:mod:`mok_kernels.mok_hopper.ops.bwd_fp8` (e4m3 GEMMs over the forward's quantised weights, transposed), the shared
expert in bf16 as in the forward. Checked against its twin (``twin_bwd.expert_backward_fp8``) under the interpreter.

Legend: T tokens, K top-k, H hidden, I ffn, L local experts, R capacity rows.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from mok_kernels.mok_hopper.api import MoKHopperLayer
from mok_kernels.mok_hopper.ops import bwd_fp8, bwd_fused, bwd_gemm, bwd_wgrad, pull, up_gemm
from mok_kernels.mok_hopper.ops.pull import combine_epilogue
from mok_kernels.mok_hopper.tiles import num_sms
from mok_kernels.mok_hopper.twin import backward as twin_bwd


def _blocks(n: int, cap: int) -> int:
    return next(b for b in (cap, 128, 64, 32, 16) if b <= cap and n % b == 0)


BWD_STAGES = ("gather", "recompute_h", "dgate", "dx", "dw13", "dw2", "dgate_dw2", "dx_dw13", "shared",
              "dx_sum")  # ``marks`` names (the fused option's stages replace dgate + dW2 and dX + dW13)


def _tiles(H: int, I: int, cuda: bool, clamped: bool = False, rows_per_expert: float = 0.0, tiled: bool = False
           ) -> dict[str, dict[str, Any]]:
    """Launch parameters of the bf16 backward's GEMMs, by stage, for hidden size ``H``, expert width ``I`` and the
    experts' average rows (``rows_per_expert``); ``tiled``: the weights in the forward's TMA block order (read and
    written by pointers); ``clamped``: a clamped SwiGLU. On the CPU (interpreter) the same, the blocks capped at what
    divides the toy shapes.

    * ``dgate``: 64-row blocks over 128 columns of ``I``, 4 stages (3 with a clamped SwiGLU), two 64-row blocks paired
      (one W2 block load for up to 128 rows) unless clamped or tiled; dgate's G by ``torch._grouped_mm`` where the
      experts average over 128 rows.
    * ``dx``: 128-row blocks, 256 columns at 3 stages (plain weights), 128 at 4 stages (tiled).
    * ``recompute``: H recomputed in 128 x 64 x 64 blocks.
    * ``dw13`` / ``dw2``, the weight gradients: 4 warps, two programs per SM (tiled, resident and over 64-row steps:
      8 warps, one per SM); P resident (one P load per strip of output blocks) where the experts average at most 128
      rows, stepping over 128 rows above 48 rows an expert (strips of 64, and 64 + a 32-row tail, where an expert has
      at most 64 or 96; plain weights) and over 64 rows otherwise; 3 stages resident, 4 reloaded; ``torch._grouped_mm``
      where the experts average over 128 rows. They leave by TMA stores on CUDA only where not resident (dW13) or
      without the 64-row strips (dW2), by pointer stores otherwise.
    * ``dgate_dw2`` / ``dx_dw13``: the fused stages, off by default (options; plain weights only): 64-row blocks where
      the experts average at most 48 rows, else 128; 8 warps, one program per SM.

    ``tiled``: the weights in the forward's TMA block order, read and written by pointers: 128 x 64 weight-gradient
    blocks (the resident kernel spilled 144 B at 128 x 128) and unpaired dgate blocks (paired, it spilled 104 B
    under Triton 3.6).

    Each choice's measurements (which launches were timed against which, and aot_check's spill budgets): the journal,
    lab/2026-12-07-kernel-changelog.md and lab/perf-notes.md."""
    wide = 48 < rows_per_expert <= 128  # (the shared expert's T rows, and 1024-row experts, keep the 64-row steps)
    resident = wide or 0 < rows_per_expert <= 64
    two = dict(num_warps=4, programs_per_sm=2, resident=resident, block_r=128 if wide else 64,
               stages=3 if resident else 4)
    if tiled and resident and not wide:  # at 4 warps Triton 3.6 spills 264 B here (3.8 none); 8 warps fit one per SM
        two.update(num_warps=8, programs_per_sm=1)
    wk = 64 if wide or tiled else 128
    dx = dict(block_n=_blocks(H, 128), stages=4) if tiled else dict(block_n=_blocks(H, 256), stages=3)
    br = 64 if rows_per_expert <= 48 else 128  # the fused stages (options, off): their row blocks
    # the weight gradients and dgate's G by torch._grouped_mm where the experts average over 128 rows (faster there; on
    # 32-64-row experts slower or even)
    grouped = rows_per_expert > 128
    two["grouped_mm"] = grouped
    # dW13 by pointer stores on the resident path (the same bits; faster than TMA's there)
    dw13_tma = cuda and not resident
    # 48-128 rows an expert: strips over 64 rows where an expert has at most 64, over 64 + 32 where at most 96, and dW2
    # by pointer stores (faster than TMA's at this launch)
    small = dict(block_r_small=64, block_r_tail=32) if wide and not tiled else {}
    dw2_tma = cuda and not small
    return {"dgate_dw2": dict(on=False, block_r=br, block_h=_blocks(H, 128 if br == 64 else 64),
                              block_i=_blocks(I, 64), stages=3, num_warps=8, programs_per_sm=1, tma_store=cuda),
            "dx_dw13": dict(on=False, block_r=br, block_n=_blocks(2 * I, 128),
                            block_k=_blocks(H, 128 if br == 64 else 64), stages=3, num_warps=8, programs_per_sm=1,
                            tma_store=cuda),
            "dgate": dict(block_m=64, block_n=_blocks(I, 128), block_k=_blocks(H, 64), stages=3 if clamped else 4,
                          pair=not (clamped or tiled), grouped_mm=grouped),
            "dx": dict(block_m=128, block_k=_blocks(2 * I, 64), **dx),
            "recompute": dict(block_m=128, block_n=_blocks(2 * I, 64), block_k=_blocks(H, 64)),
            "dw13": dict(block_n=_blocks(2 * I, 128), block_k=_blocks(H, wk), tma_store=dw13_tma, **two, **small),
            "dw2": dict(block_n=_blocks(H, 128), block_k=_blocks(I, wk), tma_store=dw2_tma, **two, **small)}


def _weight_layout(layer: MoKHopperLayer, w13: torch.Tensor) -> Optional[dict[str, Any]]:
    """How the routed weights given to the backward are laid out: None for plain [L, 2I, H] / [L, H, I]; for the
    layer's TMA block order (a module whose parameters are tiled, ``MoKHopperMoE(layout="tiled")``) the blocks of
    W13 (up_n x up_k, gate/up interleaved with ``up_fused``) and of W2 (down_n x down_k)."""
    if w13.dim() == 3:
        return None
    c = layer.cfg
    assert c.w_tiled and w13.dim() == 5, "tiled weights must be in the layer's own TMA block order"
    return {"L": layer.L, "I": layer.I, "w13": (c.up_n, c.up_k, c.up_fused), "w2": (c.down_n, c.down_k, False)}


def _expert_backward(x_rows: torch.Tensor, dO_rows: torch.Tensor, s_rows: torch.Tensor, h: Optional[torch.Tensor],
                     clip: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor, code_R: torch.Tensor,
                     tile_expert: torch.Tensor, tile_row: torch.Tensor, chunk: torch.Tensor, starts: torch.Tensor,
                     dx_slots: torch.Tensor, *, limit: Optional[float], programs: int, rows_per_expert: float,
                     mark: Callable[[str], None], tiles: Optional[dict[str, dict[str, Any]]] = None,
                     push: Optional[tuple[torch.Tensor, int]] = None, layout: Optional[dict[str, Any]] = None,
                     dO_gather_k: int = 0, sa_out: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four stages over rows grouped by expert (the routed experts, or the shared one): dX rows pushed into
    ``dx_slots`` by their code, and (dW13, dW2, the router-weight gradient of every row). ``h`` None: recompute H
    (and the clamp's decisions) from the X rows first. ``push`` (every rank's offset from ``dx_slots``, T K): the
    dX rows go to their source ranks' copies of ``dx_slots``. ``layout`` (:func:`_weight_layout`): the weights,
    and the weight gradients returned, in the forward's TMA block order. ``rows_per_expert``: the rows an expert
    gets on average (the layer's ``rows_per_expert``; not ``x_rows``' length, which is the capacity, tile padding
    included), which picks the weight-gradient launch. ``dO_gather_k`` (the top-k K): ``dO_rows`` is the output
    gradient per token ([T, H]), and dgate and dW2 read row r's from token ``code_R[r] // K`` themselves (v12,
    :data:`GATHER_DO`); where a launch cannot (the fused dgate + dW2, torch._grouped_mm, the reloaded-P weight
    gradients) the rows are gathered here first. ``sa_out``: a bf16 [R, I] buffer for dgate's s * SwiGLU(H) (the
    layer's ``h_rows``, which only the forward's down GEMM reads) instead of a new one."""
    R, H = x_rows.shape
    if layout is None:
        I = w13.shape[1] // 2
        r13 = w13k = w2k = dw13k = dw2k = {}
    else:
        I = layout["I"]
        r13 = dict(w_tiles=(*layout["w13"], False), w_dims=(2 * I, H))  # recompute H: W13 transposed
        w13k = dict(w_tiles=(*layout["w13"], True), w_dims=(2 * I, H))
        w2k = dict(w_tiles=(*layout["w2"], True), w_dims=(H, I))
        dw13k, dw2k = dict(dw_tiles=layout["w13"]), dict(dw_tiles=layout["w2"])
    dev = x_rows.device
    t = _tiles(H, I, dev.type == "cuda", clamped=limit is not None, rows_per_expert=rows_per_expert,
               tiled=layout is not None)
    for stage, over in (tiles or {}).items():  # launch overrides (sweeps); programs_per_sm scales ``programs``
        if stage not in ("shared_bwd", "gather_dO"):  # (not launches: :func:`_shared`, :data:`GATHER_DO`)
            t[stage] = {**t[stage], **over}
    progs = {k: programs * v.pop("programs_per_sm", 1) for k, v in t.items()}
    for k in ("dw13", "dw2"):  # a split weight gradient's first launch: its own programs an SM
        if t[k].get("split"):
            sp = dict(t[k]["split"])
            t[k] = dict(t[k], split=dict(sp, programs=programs * sp.pop("programs_per_sm", 1)))
    if dO_gather_k and (t["dgate_dw2"]["on"] or t["dgate"]["grouped_mm"] or t["dw2"]["grouped_mm"]
                        or not t["dw2"]["resident"] or t["dw2"].get("q_resident")):
        c = torch.where(code_R >= 0, code_R, torch.zeros_like(code_R)).long()
        dO_rows, dO_gather_k = dO_rows.index_select(0, c // dO_gather_k), 0
    a_gather = dict(a_code=code_R, a_gather_k=dO_gather_k) if dO_gather_k else {}
    if h is None:
        h = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=dev)
        clip = torch.zeros(R, 2 * I, dtype=torch.uint8, device=dev) if limit is not None else None
        bwd_gemm.bwd_rows(x_rows, w13 if layout else w13.transpose(1, 2), h, tile_expert, tile_row, chunk,
                          programs=progs["recompute"], limit=limit, save_clip=clip, **t["recompute"], **r13)
    mark("recompute_h")
    dH = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=dev)
    dW13 = dW2 = None  # (allocated where a stage writes them: :func:`_wgrad` may return its own)
    fuse_dg = t["dgate_dw2"].pop("on") and layout is None  # (the tiled layout keeps the separate stages)
    fuse_dx = t["dx_dw13"].pop("on") and layout is None
    if fuse_dg:  # dgate and dW2 in one pass over W2 (s*A stays in the kernel)
        dW2 = torch.empty_like(w2)
        ds_parts = torch.empty(R, I // t["dgate_dw2"]["block_i"], dtype=torch.float32, device=dev)
        bwd_fused.dgate_dw2(dO_rows, w2, dW2, h, clip, s_rows, dH, ds_parts, code_R, starts,
                            programs=progs["dgate_dw2"], limit=limit, **t["dgate_dw2"])
        mark("dgate_dw2")
    else:
        if sa_out is not None:
            assert sa_out.shape == (R, I) and sa_out.dtype == torch.bfloat16, "sa_out: bf16 [R, I]"
        sA = sa_out if sa_out is not None else torch.empty(R, I, dtype=torch.bfloat16, device=dev)
        ds_parts = torch.empty(R, I // t["dgate"]["block_n"], dtype=torch.float32, device=dev)
        dg = dict(h=h, clip=clip, s=s_rows, sa=sA, ds=ds_parts)
        if t["dgate"].pop("grouped_mm") and layout is None:  # (an option: G by torch._grouped_mm, then the epilogue)
            bwd_gemm.dgate_grouped_mm(dO_rows, w2, dH, starts, dgate=dg, limit=limit, block_n=t["dgate"]["block_n"])
        else:
            bwd_gemm.bwd_rows(dO_rows, w2, dH, tile_expert, tile_row, chunk, programs=progs["dgate"], dgate=dg,
                              limit=limit, **t["dgate"], **w2k, **a_gather)
        mark("dgate")
    pushed = dict(push_delta=push[0] if push else None, slots_per_rank=push[1] if push else None)
    if fuse_dx:  # dX and dW13 in one pass over W13
        dW13 = torch.empty_like(w13)
        bwd_fused.dx_dw13(dH, x_rows, w13, dW13, dx_slots, code_R, starts, programs=progs["dx_dw13"], **pushed,
                          **t["dx_dw13"])
        mark("dx_dw13")
    else:
        bwd_gemm.bwd_rows(dH, w13, dx_slots, tile_expert, tile_row, chunk, programs=progs["dx"], push_code=code_R,
                          **pushed, **t["dx"], **w13k)
        mark("dx")
    ds = bwd_gemm.router_grad(ds_parts)
    if not fuse_dx:
        dW13 = _wgrad(dH, x_rows, w13, code_R, starts, progs["dw13"], t["dw13"], dw13k)
        mark("dw13")
    if not fuse_dg:
        dW2 = _wgrad(dO_rows, sA, w2, code_R, starts, progs["dw2"], dict(t["dw2"], p_gather_k=dO_gather_k), dw2k)
        mark("dw2")
    return dW13, dW2, ds


def _wgrad(p_RN: torch.Tensor, q_RK: torch.Tensor, w: torch.Tensor, code_R: torch.Tensor, starts: torch.Tensor,
           programs: int, t: dict[str, Any], layout: dict[str, Any]) -> torch.Tensor:
    """A weight gradient (shaped like ``w``): dW[e] = P_e^T Q_e over expert e's rows ``starts[e]:starts[e+1]``.
    By :func:`~mok_kernels.mok_hopper.ops.bwd_wgrad.bwd_wgrad`, or with ``t["grouped_mm"]`` (plain layout only) by
    ``torch._grouped_mm`` with the experts' row ranges as the groups of its reduction (CUTLASS's grouped GEMM on
    sm90: no split-K, the same sums on every run). That path adds the padding rows (code < 0) instead of skipping
    them: they are zero in dH and s*A (router weight 0, zero X rows: the pull writes zeros there), so they add
    only zeros, and it needs the first expert's rows to start at row 0 (the schedule's tiles start there).
    ``t["split"]`` (an option): dict(rows, programs, and launch overrides such as block_k, block_r,
    num_warps, stages, tma_store): the experts of at most ``rows`` rows in a launch of their own (blocks and strips
    over ``block_r`` rows, no smaller strips), then the others in ``t``'s launch; the same sums."""
    t = dict(t)
    split = t.pop("split", None)
    if t.pop("grouped_mm") and not layout:
        assert not t.get("p_gather_k"), "torch._grouped_mm takes P's rows as they are"
        return torch._grouped_mm(p_RN.t(), q_RK, offs=starts[1:])
    dw = torch.empty_like(w)
    if split:  # the experts of at most split["rows"] rows in a launch of their own blocks, then the others
        s = dict(split)
        rows, progs1 = s.pop("rows"), s.pop("programs")
        first = {**t, "block_r_small": 0, "block_r_tail": 0, **s}
        bwd_wgrad.bwd_wgrad(p_RN, q_RK, dw, code_R, starts, programs=progs1, rows_max=rows, **first, **layout)
        bwd_wgrad.bwd_wgrad(p_RN, q_RK, dw, code_R, starts, programs=programs, rows_min=rows, **t, **layout)
        return dw
    bwd_wgrad.bwd_wgrad(p_RN, q_RK, dw, code_R, starts, programs=programs, **t, **layout)
    return dw


def layer_backward(layer: MoKHopperLayer, dO_TH: torch.Tensor, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor,
                   topk_w_TK: torch.Tensor, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor,
                   shared: Optional[Sequence[torch.Tensor]], marks: Optional[Callable[[str], None]] = None,
                   tiles: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    """The gradients of the layer's last forward: x (bf16 [T, H]), topk_w (fp32 [T, K]), w13 (bf16 [L, 2I, H]), w2
    (bf16 [L, H, I]) and, with a shared expert, its (gate, up, down) gradients. H comes from the forward
    (``layer.save_h``) or is recomputed here from the layer's X rows. At EP >= 2 (and in fp8 at any EP) every rank
    of the group calls this (autograd does, in the backward of each rank's forward): :func:`backward_stage`, a
    barrier, :func:`backward_compute`, a barrier, :func:`backward_finish`. ``marks(stage)`` is called after
    each stage of :data:`BWD_STAGES` (diagnostics: a stage timer records an event there). ``tiles``: launch
    overrides per GEMM (``_tiles``' keys; sweeps). No host synchronisation.

    Rows of the schedule that hold no token (padding, code < 0) go through the GEMMs with router weight 0 and are
    left out of every sum: the weight gradients skip them, their dX rows are pushed nowhere."""
    if layer.world > 1 or layer.fp8:  # (fp8 at EP=1 too: dO is quantised at its source and pulled as e4m3)
        backward_stage(layer, dO_TH)
        layer.ws.barrier(0)
        part = backward_compute(layer, x_TH, w13_LIH, w2_LHI, shared, marks=marks, tiles=tiles, dO_TH=dO_TH)
        layer.ws.barrier(1)
        return backward_finish(layer, topk_idx_TK, part, marks=marks)
    mark = marks or (lambda name: None)
    T, K, H, L = layer.T, layer.K, layer.H, layer.L
    s = layer.sched
    dev = dO_TH.device
    code = s.row_code_R
    valid = code >= 0
    c = torch.where(valid, code, torch.zeros_like(code)).long()
    dO = dO_TH.detach().to(torch.bfloat16).contiguous()
    gather_k = K if {**GATHER_DO, **(tiles or {}).get("gather_dO", {})}["in_kernels"] else 0
    # (v12: dgate and dW2 read dO's rows by token themselves; else gathered here, padding rows getting token 0's,
    # which router weight 0 and the sums' skip leave out)
    dO_rows = dO if gather_k else dO.index_select(0, c // K)
    s_rows = torch.where(valid, topk_w_TK.detach().reshape(-1).float().index_select(0, c),
                         torch.zeros((), device=dev))
    mark("gather")
    progs = num_sms(dev)
    chunk = torch.stack([torch.zeros_like(s.num_tiles.reshape(())), s.num_tiles.reshape(())]).to(torch.int32)
    limit = layer.limit
    h = clip = None
    if getattr(layer, "save_h", False):  # saved by the forward's up GEMM
        h, clip = layer.h_save, (layer.clip_save if limit is not None else None)
    slots = torch.empty(T * K, H, dtype=torch.bfloat16, device=dev)  # masked slots stay unwritten, and unread
    starts = bwd_wgrad.expert_rows(s.tile_expert_M, s.tile_row_M1, L)
    dW13, dW2, ds = _expert_backward(layer.x_rows, dO_rows, s_rows, h, clip, w13_LIH, w2_LHI, code,
                                     s.tile_expert_M, s.tile_row_M1, chunk, starts, slots, limit=limit,
                                     programs=progs, rows_per_expert=layer.rows_per_expert, mark=mark,
                                     tiles=tiles, layout=_weight_layout(layer, w13_LIH), dO_gather_k=gather_k,
                                     sa_out=layer.h_rows)  # (the forward's SwiGLU rows: free until the next forward)
    dtopk = torch.zeros(T * K + 1, dtype=torch.float32, device=dev)  # the last: where padding rows' values go
    dtopk.scatter_(0, torch.where(valid, c, torch.full_like(c, T * K)), ds)
    out: dict[str, Any] = {"w13": dW13, "w2": dW2, "topk_w": dtopk[: T * K].view(T, K) * (topk_idx_TK >= 0)}
    sh_dx = None
    if shared is not None:
        out["shared"], sh_dx = _shared(layer, x_TH, dO, shared, programs=progs, tiles=tiles)
    mark("shared")
    out["x"] = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    combine_epilogue(slots, topk_idx_TK, None, sh_dx, out["x"])  # the forward's fixed-order sum (k ascending)
    mark("dx_sum")
    return out


def _shared(layer: MoKHopperLayer, x_TH: torch.Tensor, dO_TH: torch.Tensor, shared: Sequence[torch.Tensor], *,
            programs: int, tiles: Optional[dict[str, dict[str, Any]]]) -> tuple[tuple, torch.Tensor]:
    """The shared expert's (gate, up, down) gradients and its dx: the same stages, one expert over this rank's T
    tokens in order, router weight 1, H recomputed (the forward's shared expert saves nothing)."""
    T, H, I, dev = layer.T, layer.H, layer.I, dO_TH.device
    g_w, u_w, d_w = shared
    x = x_TH.detach().to(torch.bfloat16).contiguous()
    dO = dO_TH.detach().to(torch.bfloat16).contiguous()
    if {**SHARED_BWD, **(tiles or {}).get("shared_bwd", {})}["torch"] and layer.limit is None:
        return _shared_torch(x, dO, g_w, u_w, d_w)
    sh_dx = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    sW13, sW2, _ = _expert_backward(
        x, dO, torch.ones(T, dtype=torch.float32, device=dev), None, None, torch.cat([g_w, u_w]).unsqueeze(0),
        d_w.unsqueeze(0), layer.sh_code, layer.sh_tiles, layer.sh_rows, layer.sh_chunk,
        torch.tensor([0, T], dtype=torch.int32, device=dev), sh_dx, limit=layer.limit, programs=programs,
        rows_per_expert=T, mark=lambda name: None, tiles=tiles)
    return (sW13[0, :I], sW13[0, I:], sW2[0]), sh_dx


# How the shared expert's backward runs (``tiles["shared_bwd"]`` overrides): ``torch`` True, as torch GEMMs
# (cuBLAS: bitwise repeatable on one GPU model and toolkit) where the SwiGLU is not clamped (a clamp must be decided
# on the fp32 accumulators, as the forward decides it: the kernels' recompute does that); else the routed kernels.
# v6: torch by default (the kernels ran the one 2048-row expert at 22-37% of the GEMM rate: 1.49 -> 0.85 ms on
# glm_5_2 in bwd_check's sweep, lab/diagnostics/2026-12-02-s16/).
SHARED_BWD = dict(torch=True)
# Where the routed backward's output-gradient rows come from at EP=1 (``tiles["gather_dO"]`` overrides):
# ``in_kernels`` True (v12, run mok_hopper-bf16-fwd-bwd_h200x1_20261204-4), dgate and dW2 load each row's dO from its
# token (``code // K``) as they go, instead of a gathered copy of dO's T K rows written and read back (the "gather"
# stage: 0.21-0.34 ms on the published shapes); False, the copy (v11).
GATHER_DO = dict(in_kernels=True)


def _shared_torch(x: torch.Tensor, dO: torch.Tensor, g_w: torch.Tensor, u_w: torch.Tensor, d_w: torch.Tensor
                  ) -> tuple[tuple, torch.Tensor]:
    """The shared expert's gradients by torch GEMMs (bf16 operands, fp32 accumulation, bf16 results), H recomputed:
    the stages of :func:`_expert_backward` with router weight 1 and no clamp."""
    I = g_w.shape[0]
    w13 = torch.cat([g_w, u_w])  # [2I, H]
    h = x @ w13.T
    A, dg, du = twin_bwd.swiglu_grads(h[:, :I], h[:, I:], dO @ d_w, None)
    dH = torch.cat([dg, du], dim=1).to(torch.bfloat16)
    dW13 = dH.T @ x
    return (dW13[:I], dW13[I:], dO.T @ A.to(torch.bfloat16)), dH @ w13


# ---- the backward across ranks (EP >= 2), in three phases (a test runs the phases of simulated ranks in lockstep);
# between them every rank must have got there (``layer.ws.barrier``): :func:`layer_backward` does that ----


def backward_stage(layer: MoKHopperLayer, dO_TH: torch.Tensor) -> None:
    """This rank's output gradient into its workspace's ``x`` region, where the expert owners pull it from (the
    forward is done with that region once every rank has passed its last barrier); fp8: quantised on the way, 1 x
    128 (the forward's stage kernel), into ``x`` and ``xs``."""
    assert layer.weights_in_expert, \
        "the backward covers the router weight applied in the expert (the default router_weight_in)"
    if layer.fp8:
        assert layer.w13_bwd is not None, "the fp8 backward needs a layer built with train=True (its e4m3 W^T)"
        pull.quantize_rows(dO_TH.detach().to(torch.bfloat16).contiguous(), layer.ws.x, layer.ws.xs)
    else:
        layer.ws.x.copy_(dO_TH.detach())


def backward_compute(layer: MoKHopperLayer, x_TH: torch.Tensor, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor,
                     shared: Optional[Sequence[torch.Tensor]], *, marks: Optional[Callable[[str], None]] = None,
                     tiles: Optional[dict[str, dict[str, Any]]] = None,
                     dO_TH: Optional[torch.Tensor] = None) -> dict[str, Any]:
    """After every rank's stage: pull the dO rows of this rank's experts from their source ranks (the forward's
    pull kernel and schedule), run the four stages, push each dX row into its source rank's ``comb`` slot and each
    row's router-weight gradient into its ``w`` slot; this rank's weight gradients and shared expert locally.
    fp8 (:func:`_fp8_compute`): the dO rows arrive as e4m3 and the stages are
    :mod:`mok_kernels.mok_hopper.ops.bwd_fp8`'s; ``dO_TH`` (this rank's bf16 output gradient) is then needed for the
    shared expert, which stays bf16."""
    mark = marks or (lambda name: None)
    T, K, H, L = layer.T, layer.K, layer.H, layer.L
    s, ws = layer.sched, layer.ws
    dev = x_TH.device
    TK = T * K
    chunk = torch.stack([s.chunk_tiles_C1[0], s.chunk_tiles_C1[-1]]).to(torch.int32)
    if layer.fp8:
        return _fp8_compute(layer, x_TH, dO_TH, shared, chunk, mark, tiles)
    dO_rows = torch.empty(layer.R, H, dtype=torch.bfloat16, device=dev)
    pull.pull_rows(s.row_code_R, chunk, s.tile_row_M1, ws.x, ws.tables["x"], None, None, None, None, dO_rows, None,
                   None, tokens=T, topk=K, cfg=layer.cfg, programs=layer.pull_programs)
    mark("gather")
    progs = num_sms(dev)
    limit = layer.limit
    h = clip = None
    if getattr(layer, "save_h", False):
        h, clip = layer.h_save, (layer.clip_save if limit is not None else None)
    starts = bwd_wgrad.expert_rows(s.tile_expert_M, s.tile_row_M1, L)
    dW13, dW2, ds = _expert_backward(layer.x_rows, dO_rows, layer.rw_rows, h, clip, w13_LIH, w2_LHI, s.row_code_R,
                                     s.tile_expert_M, s.tile_row_M1, chunk, starts, ws.comb, limit=limit,
                                     programs=progs, rows_per_expert=layer.rows_per_expert, mark=mark,
                                     tiles=tiles,
                                     push=(ws.tables["comb"], TK), layout=_weight_layout(layer, w13_LIH),
                                     sa_out=layer.h_rows)  # (the forward's SwiGLU rows: free until the next forward)
    bwd_gemm.push_scalars(s.row_code_R, ds, ws.w, ws.tables["w"], TK)
    out: dict[str, Any] = {"w13": dW13, "w2": dW2, "sh_dx": None}
    if shared is not None:
        out["shared"], out["sh_dx"] = _shared(layer, x_TH, ws.x, shared, programs=progs, tiles=tiles)
    mark("shared")
    return out


def _fp8_compute(layer: MoKHopperLayer, x_TH: torch.Tensor, dO_TH: Optional[torch.Tensor],
                 shared: Optional[Sequence[torch.Tensor]], chunk: torch.Tensor, mark: Callable[[str], None],
                 tiles: Optional[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """:func:`backward_compute` in fp8: pull the e4m3 dO rows and their scales, H from the forward (``save_h``) or
    recomputed by the forward's own up GEMM (its epilogue's ``h_save``; the hidden rows it also writes are the
    layer's scratch), the four stages of :func:`mok_kernels.mok_hopper.ops.bwd_fp8.expert_backward` over the layer's
    e4m3 W^T, the pushes, and the shared expert in bf16."""
    assert shared is None or dO_TH is not None, "fp8 with a shared expert: pass dO_TH (its backward is bf16)"
    T, K, H = layer.T, layer.K, layer.H
    s, ws, dev = layer.sched, layer.ws, x_TH.device
    dO_rows = torch.empty(layer.R, H, dtype=torch.float8_e4m3fn, device=dev)
    dOs_rows = torch.empty(layer.R, H // 128, dtype=torch.float32, device=dev)
    pull.pull_rows(s.row_code_R, chunk, s.tile_row_M1, ws.x, ws.tables["x"], ws.xs, ws.tables["xs"], None, None,
                   dO_rows, dOs_rows, None, tokens=T, topk=K, cfg=layer.cfg, programs=layer.pull_programs)
    mark("gather")
    progs = num_sms(dev)
    limit = layer.limit
    if getattr(layer, "save_h", False):
        h, clip = layer.h_save, (layer.clip_save if limit is not None else None)
    else:
        h = torch.empty(layer.R, 2 * layer.I, dtype=torch.bfloat16, device=dev)
        clip = torch.empty(layer.R, 2 * layer.I, dtype=torch.uint8, device=dev) if limit is not None else None
        up_gemm.up_swiglu(layer.x_rows, layer.xs_rows, layer.w13, layer.w13_scale, layer.h_rows, layer.hs_rows,
                          s.tile_expert_M, s.tile_row_M1, chunk, limit=limit, cfg=layer.cfg, programs=progs,
                          h_save=h, clip_save=clip)
    mark("recompute_h")
    starts = bwd_wgrad.expert_rows(s.tile_expert_M, s.tile_row_M1, layer.L)
    dW13, dW2, ds = bwd_fp8.expert_backward(
        layer.x_rows, layer.xs_rows, dO_rows, dOs_rows, layer.rw_rows, h, clip, layer.w13_bwd, layer.w13_scale,
        layer.w2_bwd, layer.w2_scale, s.row_code_R, s.tile_expert_M, s.tile_row_M1, chunk, starts, ws.comb,
        limit=limit, programs=progs, mark=mark, push=(ws.tables["comb"], T * K), tiles=tiles,
        rows_per_expert=layer.rows_per_expert)
    bwd_gemm.push_scalars(s.row_code_R, ds, ws.w, ws.tables["w"], T * K)
    out: dict[str, Any] = {"w13": dW13, "w2": dW2, "sh_dx": None}
    if shared is not None:
        out["shared"], out["sh_dx"] = _shared(layer, x_TH, dO_TH, shared, programs=progs, tiles=tiles)
    mark("shared")
    return out


def backward_finish(layer: MoKHopperLayer, topk_idx_TK: torch.Tensor, part: dict[str, Any], *,
                    marks: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """After every rank's pushes: dx summed per token (the forward's epilogue kernel, k ascending, plus the shared
    expert's dx) and the router-weight gradients, from this rank's workspace."""
    T, K, H = layer.T, layer.K, layer.H
    ws = layer.ws
    x = torch.empty(T, H, dtype=torch.bfloat16, device=ws.comb.device)
    combine_epilogue(ws.comb, topk_idx_TK, None, part["sh_dx"], x)
    out = {k: v for k, v in part.items() if k != "sh_dx"}
    out["x"] = x
    out["topk_w"] = ws.w.reshape(T, K) * (topk_idx_TK >= 0)  # a new tensor: the next forward restages ``w``
    (marks or (lambda name: None))("dx_sum")
    return out


class _MoKHopperTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, x_TH, topk_idx_TK, topk_w_TK, w13_LIH, w2_LHI, *shared):  # type: ignore[override]
        out = layer(x_TH, topk_idx_TK, topk_w_TK)
        ctx.layer = layer
        ctx.has_shared = bool(shared)
        ctx.save_for_backward(x_TH, topk_idx_TK, topk_w_TK, w13_LIH, w2_LHI, *shared)
        return out

    @staticmethod
    def backward(ctx, dO_TH):  # type: ignore[override]
        x, idx, w, w13, w2, *shared = ctx.saved_tensors
        g = layer_backward(ctx.layer, dO_TH, x, idx, w, w13, w2, shared if ctx.has_shared else None)
        sh = list(g["shared"]) if ctx.has_shared else []
        return (None, g["x"], None, g["topk_w"].to(w.dtype), g["w13"], g["w2"], *sh)


def mok_hopper_train(layer: MoKHopperLayer, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                     w13_LIH: torch.Tensor, w2_LHI: torch.Tensor,
                     shared: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """The layer's forward, recorded for autograd: gradients flow to ``x_TH``, ``topk_w_TK``, the routed weights
    ``w13_LIH`` / ``w2_LHI`` (the tensors the layer was built from) and the shared expert's (gate, up, down). The
    backward must follow the forward before the layer runs again (it reads the layer's X rows and schedule)."""
    return _MoKHopperTrain.apply(layer, x_TH, topk_idx_TK, topk_w_TK, w13_LIH, w2_LHI, *(shared or ()))
