"""GPU check of mok_hopper's backward (bf16, or fp8 with ``--precision fp8``) at EP=1: every gradient against the
harness's reference (in the precision's gate), bitwise determinism over repeats, the backward timed alone and per stage,
and the memory a training step takes.

Run (repository root, one GPU)::

    torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --out DIR
    torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --out DIR --shapes glm_5_2 --modes recompute
    torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --out DIR --precision fp8 --no-nccl
    # launch variants against the default in 4 rounds of D A D B D: each variant's ratio to the default timed just
    # before and after it, which a drift of the board's state does not bias (section sweep_rounds)
    torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --out DIR --shapes glm_5_2 --modes save_h \
        --no-nccl --repeats 2 --sweep --sweep-only "default again,dW13 TMA store" --sweep-rounds 4
    # CPU, Triton interpreter, a tiny shape: checks this script's plumbing, measures nothing
    TRITON_INTERPRET=1 torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.bwd_check --out DIR --smoke

Everything goes through the harness's own pieces: the backend class the harness runs (``MokHopperBackend``, one per
value of its ``forward`` option), its inputs (``harness.measure.inputs``: the harness's seed), its reference and
comparison (``harness.measure.correctness``), its timing path (``harness.measure.runner.time_direction``: the bwd row
times the backward after an untimed forward, as published). What is kept here: per-gradient errors, the repeat check,
the stage timer (CUDA events between the stages of :func:`mok_kernels.mok_hopper.train.layer_backward`) and the memory
figures; ``--sweep`` times launch variants of the backward's GEMMs (``SWEEP``) stage by stage and says whether each
one's gradients are bitwise the default's.

Memory, per mode: ``setup_mb`` (what the backend allocates to exist: the layer's weight copy and scratch), the peak
allocated above that during one forward + backward (``step_peak_mb``), and the same for the harness's reference
and, at EP=1, the ``nccl`` baseline. ``saved_per_token`` is counted, not measured: the bytes per token this design
keeps between forward and backward (X rows, H, clamp masks), beside SonicMoE's (X and H only).

Writes ``DIR/mok_hopper_bwd_check.csv``; exit 1 if a check failed, 2 (one line) for a shape that cannot run here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import torch

from mok_tools.mok_hopper.gpu_check import Ctx, layer_inputs, med, shape_cases, unrunnable, write_csv
from harness.measure.correctness import compare, run_once
from harness.measure.reference import ReferenceBackend
from harness.measure.runner import time_direction
from mok_kernels.mok_hopper.backend import MokHopperBackend
from mok_kernels.mok_hopper.options import MokHopperOptions
from mok_kernels.mok_hopper.tiles import parse_tile_overrides
from mok_kernels.mok_hopper.train import BWD_STAGES, layer_backward
from mok_kernels.mok_hopper.workspace import clear_workspace_cache

MODES = ("save_h", "recompute")
LAYOUT = "layout"  # a SWEEP key that is no launch override: "tiled" runs the backward on the layer's tiled weights
# launch variants of the backward's GEMMs, stage times against the default (``--sweep``): earlier versions' launches
# and candidates (the journal, lab/perf-notes.md: the bf16 backward v0-v4)
# (left out: backward v0-v3's 256-wide, 32-row-step and no-TMA-store weight-gradient launches and its 3-stage dX,
# measured in run mok_hopper-bf16-fwd-bwd_h200x1_20261201; the overlapped schedules, slower, removed with their code in
# 3a7e35f; the resident launches at 8 warps one per SM and 128 x 64 three per SM, slower on both shapes:
# lab/diagnostics/2026-12-02-s16/).
SWEEP: dict[str, dict[str, dict[str, Any]]] = {
    "default again": {},
    "dgate 3 stages (v3.1)": {"dgate": dict(stages=3)},
    "dgate 5 stages": {"dgate": dict(stages=5)},
    "wgrad P reloaded (v3.1)": {"dw13": dict(resident=False), "dw2": dict(resident=False)},
    "wgrad resident, no TMA store": {"dw13": dict(tma_store=False), "dw2": dict(tma_store=False)},
    # v4's launches: glm_5_2's experts average 64 rows, so about half have more and took the reloaded-P path at
    # 64-row steps; dgate ran such an expert's tile as two 64-row blocks, each streaming W2[e]
    "wgrad resident over 128 rows, 8 warps, 1/SM": {"dw13": dict(block_r=128, num_warps=8, programs_per_sm=1),
                                                    "dw2": dict(block_r=128, num_warps=8, programs_per_sm=1)},
    "wgrad resident over 128 rows, 128x64 blocks, 8 warps, 1/SM": {
        "dw13": dict(block_r=128, block_k=64, num_warps=8, programs_per_sm=1),
        "dw2": dict(block_r=128, block_k=64, num_warps=8, programs_per_sm=1)},
    "wgrad resident over 128 rows, 128x64 blocks, 2/SM (spills 16 B)": {"dw13": dict(block_r=128, block_k=64),
                                                                        "dw2": dict(block_r=128, block_k=64)},
    "dgate 64x64 blocks": {"dgate": dict(block_n=64)},
    "dgate pair, 64x64 blocks": {"dgate": dict(block_n=64, pair=True)},
    "dgate pair, 64x64 blocks, 3 stages": {"dgate": dict(block_n=64, pair=True, stages=3)},
    "dgate pair, 64x128 blocks (spills 96 B)": {"dgate": dict(pair=True)},
    "dgate pair 64x64, wgrad resident over 128 rows, 8 warps, 1/SM": {
        "dgate": dict(block_n=64, pair=True), "dw13": dict(block_r=128, num_warps=8, programs_per_sm=1),
        "dw2": dict(block_r=128, num_warps=8, programs_per_sm=1)},
    # beside v5: dW13 stored by pointers (faster on qwen3_5_397b and kimi_k2_7 in v5's sweeps, dW2 slower:
    # lab/diagnostics/2026-12-02-s16/), the shared expert's backward by torch GEMMs (it ran at about a quarter of the
    # GEMM rate)
    "dW13 no TMA store": {"dw13": dict(tma_store=False)},
    # v10 stores dW13 by pointers ("default again"); v9's TMA store, and pointer-store launches at 128 x 64 (no spill
    # where aot_check compiles K as launched) and at 8 warps one an SM (the journal, lab/perf-notes.md: v10, dW13 by
    # pointer stores)
    "dW13 TMA store (v9)": {"dw13": dict(tma_store=True)},
    "dW13 128x64 pointer stores": {"dw13": dict(block_k=64, tma_store=False)},
    "wgrad 128x64 pointer stores": {"dw13": dict(block_k=64, tma_store=False),
                                    "dw2": dict(block_k=64, tma_store=False)},
    "wgrad pointer stores, 8 warps, 1/SM": {"dw13": dict(tma_store=False, num_warps=8, programs_per_sm=1),
                                            "dw2": dict(tma_store=False, num_warps=8, programs_per_sm=1)},
    # every weight-gradient stage measured has taken about its stores at 4.2 TB/s plus its MMA over the padded
    # rows at 790 TFLOP/s; an expert's strips over fewer rows where it has fewer (bwd_wgrad's BR_SMALL / BR_TAIL).
    # v11 runs glm_5_2's 128-row launches (experts of 39-84 rows) with 64 + 32-row strips and dW2 by pointers; these
    # take it back to v10, or to 64-row strips alone, or keep dW2 on TMA; "32 + 16" is for the 64-row launches of
    # qwen3_5_397b and kimi_k2_7 (23-62 rows: it spills there and was 2-4% slower in bracketed rounds,
    # lab/diagnostics/2026-12-04-s29/). A size not under the launch's row block is off (so on qwen3_5_397b and kimi_k2_7
    # the first three are A/As)
    "wgrad small experts off, dW2 by TMA (v10)": {"dw13": dict(block_r_small=0), "dw2": dict(block_r_small=0,
                                                                                         tma_store=True)},
    "wgrad small experts: 64-row strips only": {"dw13": dict(block_r_small=64, block_r_tail=0),
                                                "dw2": dict(block_r_small=64, block_r_tail=0)},
    "wgrad small experts: 64 + 32-row strips, dW2 by TMA": {"dw2": dict(tma_store=True)},
    "wgrad small experts: 32 + 16-row strips": {"dw13": dict(block_r_small=32, block_r_tail=16),
                                                "dw2": dict(block_r_small=32, block_r_tail=16)},
    # glm_5_2's weight gradients at qwen3_5_397b's 128 x 128 blocks (a 64-row launch whose experts of 65-96 rows
    # keep P resident as 64 + 32 rows; wgrad_store_probe: 128 x 128 blocks over 64 rows 3.5-3.9 ms where 128 x 64
    # take 3.7-4.8, lab/diagnostics/2026-12-04-s29/), dW2 by pointers (v11's) or both at 2 stages with dW2 by TMA
    # (no spill under 3.6)
    "wgrad small experts: 128 x 128 blocks, 64-row launch, 64 + 32-row strips": {
        "dw13": dict(block_k=128, block_r=64, block_r_small=64, block_r_tail=32, stages=3),
        "dw2": dict(block_k=128, block_r=64, block_r_small=64, block_r_tail=32, stages=3)},
    "wgrad small experts: 128 x 128 blocks, 64-row launch, 64 + 32-row strips, 2 stages, dW2 by TMA": {
        "dw13": dict(block_k=128, block_r=64, block_r_small=64, block_r_tail=32, stages=2),
        "dw2": dict(block_k=128, block_r=64, block_r_small=64, block_r_tail=32, stages=2, tma_store=True)},
    # train._wgrad's ``split``: the experts of at most 64 rows in a launch of their own, qwen3_5_397b's (128 x 128
    # blocks, 64-row strips; wgrad_store_probe with the MMA over 64 rows and Q loads: 3.86 ms where glm_5_2's 128 x 64
    # take 4.68 for dW13, lab/diagnostics/2026-12-04-s29/), the others in the shape's launch (glm_5_2: v12's 128 x 64,
    # 64 + 32-row strips). Where every expert has at most 64 rows (qwen3_5_397b, kimi_k2_7) it is the default launch
    # with the row bound, which Triton 3.6 builds without a spill (212 / 186 registers against 255 with 176 B of spill /
    # 255), plus a launch with no expert
    "wgrad split at 64 rows": {
        "dw13": dict(split=dict(rows=64, block_k=128, block_r=64, num_warps=4, programs_per_sm=2, stages=3,
                                tma_store=False)),
        "dw2": dict(split=dict(rows=64, block_k=128, block_r=64, num_warps=4, programs_per_sm=2, stages=3,
                               tma_store=True))},
    # built, not yet timed: the split's first launch with strips 256 wide and 64 deep at 8 warps: Q, streamed
    # from L2, is then half the bytes a stored byte of 128 x 128 blocks (BR / BN), at the same 32 KB stored a step,
    # and the row bound lets Triton drop the reloaded-P path (aot_check, Triton 3.6: 104-108 registers, no spill,
    # 72-88 KB of shared memory), so two 8-warp programs fit an SM
    **{f"wgrad split at 64 rows, 256 x 64 strips, 8 warps, {n}/SM": {
        k: dict(split=dict(rows=64, block_n=256, block_k=64, block_r=64, num_warps=8, programs_per_sm=n, stages=3,
                           tma_store=k == "dw2")) for k in ("dw13", "dw2")} for n in (1, 2)},
    # built, not yet timed: and glm_5_2's experts of 65-96 rows (the split's second launch) at 128 x 128 blocks, 8
    # warps, one program an SM (no spill: 235-248 registers under Triton 3.6; at 4 warps 224 B of spill, and the 64-row
    # 128 x 128 launch above with its two-block path at 4 warps was x1.24 of v11): wgrad_store_probe put glm_5_2's open
    # millisecond in the 128 x 64 blocks' steps (lab/diagnostics/2026-12-04-s29/). On qwen3_5_397b and kimi_k2_7 the
    # second launch has no expert
    **{f"wgrad split at 64 rows, {first}, over 64 rows 128 x 128 at 8 warps 1/SM": {
        k: dict(block_k=128, num_warps=8, programs_per_sm=1,
                split=dict(rows=64, block_r=64, stages=3, tma_store=k == "dw2", **over)) for k in ("dw13", "dw2")}
       for first, over in (("128 x 128 at 4 warps 2/SM", dict(block_k=128, num_warps=4, programs_per_sm=2)),
                           ("256 x 64 at 8 warps 2/SM", dict(block_n=256, block_k=64, num_warps=8,
                                                               programs_per_sm=2)))},
    # v12: dgate and dW2 read dO's rows by token; v11 gathered a copy of them first (the "gather" stage)
    "dO rows gathered first (v11)": {"gather_dO": {"in_kernels": False}},
    # v6: the shared expert's backward by torch GEMMs is the default; the kernels' way, for comparison
    "shared expert by the kernels (v5)": {"shared_bwd": {"torch": False}},
    "wgrad 128x64 blocks (64-row steps)": {"dw13": dict(block_k=64), "dw2": dict(block_k=64)},
    # the compute-bound point (1024 rows an expert: the reloaded-P weight gradients, 64-row steps, never tuned)
    "cb wgrad 8 warps 1/SM": {"dw13": dict(num_warps=8, programs_per_sm=1),
                              "dw2": dict(num_warps=8, programs_per_sm=1)},
    "cb wgrad 128x256 8 warps 1/SM": {"dw13": dict(block_k=256, num_warps=8, programs_per_sm=1),
                                      "dw2": dict(block_k=256, num_warps=8, programs_per_sm=1)},
    "cb wgrad 128-row steps 8 warps 1/SM": {"dw13": dict(block_r=128, num_warps=8, programs_per_sm=1),
                                            "dw2": dict(block_r=128, num_warps=8, programs_per_sm=1)},
    "cb wgrad 4 stages": {"dw13": dict(stages=4), "dw2": dict(stages=4)},
    "cb dx 128x256": {"dx": dict(block_n=256)},
    "cb dgate 64x128 unpaired": {"dgate": dict(pair=False)},
    # the compute-bound point's two wins (dX 128 x 256, 4-stage weight gradients; lab/diagnostics/2026-12-02-s17/),
    # together and on the published shapes
    "dx 128x256": {"dx": dict(block_n=256)},
    "dx 128x256 3 stages": {"dx": dict(block_n=256, stages=3)},
    "wgrad 4 stages": {"dw13": dict(stages=4), "dw2": dict(stages=4)},
    "dx 128x256, wgrad 4 stages": {"dx": dict(block_n=256), "dw13": dict(stages=4), "dw2": dict(stages=4)},
    "cb dx 128x256, wgrad 5 stages": {"dx": dict(block_n=256), "dw13": dict(stages=5), "dw2": dict(stages=5)},
    "cb dx 128x256, wgrad 4 stages, dgate 5 stages": {"dx": dict(block_n=256), "dw13": dict(stages=4),
                                                      "dw2": dict(stages=4), "dgate": dict(stages=5)},
    "cb dx 128x256, wgrad 128x256 4 stages 8 warps 1/SM": {
        "dx": dict(block_n=256), "dw13": dict(block_k=256, stages=4, num_warps=8, programs_per_sm=1),
        "dw2": dict(block_k=256, stages=4, num_warps=8, programs_per_sm=1)},
    # wgrad_store_probe: stores into contiguous blocks reach the copy rate, strips of a row-major tensor by TMA 83-87%
    # of it (lab/diagnostics/2026-12-02-s17/). The layer's own weights in TMA block order (what
    # MoKHopperMoE(layout="tiled") trains): the backward reads them there and writes dW13 / dW2 in that order (by
    # pointers); ``same_bits`` compares the gradients untiled with the plain run's (``rel_l1_to_default``: their largest
    # relative L1 difference)
    "tiled layout": {LAYOUT: "tiled"},
    # the fused stages (bwd_fused.py: dgate + dW2, dX + dW13, each one pass over its weights) and their
    # launches (options: v6's separate stages stay the default)
    "fused dX + dW13, pointer stores (v8 as tried)": {"dx_dw13": {"on": True, "tma_store": False}},
    "fused dgate + dW2, dX + dW13": {"dgate_dw2": {"on": True}, "dx_dw13": {"on": True}},
    "fused dgate + dW2 only": {"dgate_dw2": {"on": True}},
    "fused dX + dW13 only": {"dx_dw13": {"on": True}},
    "fused, pointer stores": {"dgate_dw2": dict(on=True, tma_store=False), "dx_dw13": dict(on=True, tma_store=False)},
    "fused dX 64x64, 4 warps, 2/SM": {"dx_dw13": dict(on=True, block_n=64, block_k=64, num_warps=4,
                                                       programs_per_sm=2)},
    "fused dgate 64x64, 4 warps, 2/SM (64-row blocks)": {
        "dgate_dw2": dict(on=True, block_h=64, block_i=64, num_warps=4, programs_per_sm=2)},
    "fused dX 64x128": {"dx_dw13": dict(on=True, block_n=64, block_k=128)},
    # the Q-resident weight gradients (bwd_wgrad._bwd_wgrad_q_resident: programs running together write
    # neighbouring column blocks of the same rows); by pointers at 8 warps they build without a spill on both
    # Triton ends (128 / 178 registers at 128 x 128, 64-row steps), as the P-resident pointer stores do not
    # the GEMMs by torch._grouped_mm (CUTLASS's grouped GEMM on sm90): the weight gradients over the
    # experts' row ranges, dgate's G = dO @ W2 with its epilogue after it (train._wgrad, bwd_gemm.dgate_grouped_mm)
    # (the default since v9 where the experts average over 128 rows; "kernels only" is v8 there)
    "kernels only (v8; no torch._grouped_mm)": {"dgate": dict(grouped_mm=False), "dw13": dict(grouped_mm=False),
                                                "dw2": dict(grouped_mm=False)},
    "wgrad torch._grouped_mm": {"dw13": dict(grouped_mm=True), "dw2": dict(grouped_mm=True)},
    "dgate torch._grouped_mm + epilogue": {"dgate": dict(grouped_mm=True)},
    "dgate and wgrad torch._grouped_mm": {"dgate": dict(grouped_mm=True), "dw13": dict(grouped_mm=True),
                                          "dw2": dict(grouped_mm=True)},
    "wgrad Q resident": {"dw13": dict(q_resident=True), "dw2": dict(q_resident=True)},
    "wgrad Q resident, pointer stores, 8 warps": {"dw13": dict(q_resident=True, tma_store=False, num_warps=8),
                                                  "dw2": dict(q_resident=True, tma_store=False, num_warps=8)},
    "wgrad Q resident, pointer stores, 8 warps, 1/SM": {
        "dw13": dict(q_resident=True, tma_store=False, num_warps=8, programs_per_sm=1),
        "dw2": dict(q_resident=True, tma_store=False, num_warps=8, programs_per_sm=1)},
}
# the fp8 backward's launch variants (bwd_fp8.py's stage keys): P-resident weight gradients, two programs an SM at
# 4 warps
FP8_SWEEP: dict[str, dict[str, dict[str, Any]]] = {
    "default again": {},
    "fp8 wgrad P resident": {"dw13": dict(resident=True), "dw2": dict(resident=True)},  # (v2's default to 128 rows)
    "fp8 wgrad flattened items (v1)": {"dw13": dict(resident=False), "dw2": dict(resident=False)},
    "fp8 wgrad 4 warps 2/SM": {"dw13": dict(num_warps=4, programs_per_sm=2),
                               "dw2": dict(num_warps=4, programs_per_sm=2)},
    "fp8 wgrad P resident 4 warps 2/SM": {"dw13": dict(resident=True, num_warps=4, programs_per_sm=2),
                                          "dw2": dict(resident=True, num_warps=4, programs_per_sm=2)},
}
SMOKE_SHAPE = "tiny"


def _mb(n: float) -> float:
    return round(n / 2**20, 1)


def _sync(ctx: Ctx) -> None:
    if not ctx.smoke:
        torch.cuda.synchronize()


def _alloc(ctx: Ctx) -> int:
    return 0 if ctx.smoke else torch.cuda.memory_allocated()


def step_memory(ctx: Ctx, backend: Any, inp: Any) -> dict[str, float]:
    """Peak allocated above the current level over one forward + backward, and what the forward left allocated
    (its output and what autograd saved) before the backward ran."""
    if ctx.smoke:
        return {}
    x, w = inp.x_TH.detach().requires_grad_(), inp.topk_w_TK.detach().requires_grad_()
    backend.zero_grad()
    _sync(ctx)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = backend.forward(x, inp.topk_idx_TK, w)
    _sync(ctx)
    after_fwd = torch.cuda.memory_allocated() - base
    out.backward(inp.grad_out_TH)
    _sync(ctx)
    peak = torch.cuda.max_memory_allocated() - base
    del out
    backend.zero_grad()
    return {"fwd_kept_mb": _mb(after_fwd), "step_peak_mb": _mb(peak)}


def saved_per_token(case: Any, mode: str) -> dict[str, int]:
    """Bytes per token kept from forward to backward (counted): this design, and SonicMoE's X + H (bf16)."""
    K, H, I = case.topk, case.hidden, case.ffn
    # the gathered X rows (the layer's pulled rows; fp8: e4m3 and a 4-byte scale per 128)
    x_rows = K * (H + 4 * (H // 128)) if case.precision == "fp8" else K * H * 2
    h = K * 2 * I * 2 if mode == "save_h" else 0
    clip = K * 2 * I if (mode == "save_h" and case.swiglu_limit is not None) else 0  # one byte per element today
    return {"saved_bytes_per_token": x_rows + h + clip + H * 2,  # + this rank's X (the input, saved by autograd)
            "sonicmoe_bytes_per_token": H * 2 + K * 2 * I * 2}


def _weights(backend: Any, tiles: Optional[dict[str, Any]]) -> tuple[Any, Any, Optional[dict[str, Any]]]:
    """(w13, w2, launch overrides) for :func:`layer_backward`: the backend's plain parameters, or with ``tiles``'
    :data:`LAYOUT` "tiled" the layer's own weights in TMA block order (its CUDA default tile keeps them so)."""
    p = backend.params
    if (tiles or {}).get(LAYOUT) != "tiled":
        return p.w13, p.w2, tiles
    layer = backend.impl
    if layer.w13.dim() != 5:
        raise ValueError("the layer's weights are plain here (its tile has w_tiled off): no tiled layout to run")
    return layer.w13, layer.w2, {k: v for k, v in tiles.items() if k != LAYOUT}


def _plain(backend: Any, g: dict[str, Any]) -> dict[str, Any]:
    """Gradients of a tiled-layout backward with dW13 / dW2 back in the plain layout."""
    from mok_kernels.mok_hopper.ops.gemm_common import untile_weights, untile_weights_gu

    up = untile_weights_gu if backend.impl.cfg.up_fused else untile_weights
    return {**g, "w13": up(g["w13"]), "w2": untile_weights(g["w2"])}


def stage_times(ctx: Ctx, backend: Any, inp: Any, iters: int,
                tiles: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, float]:
    """Median ms of each backward stage (:data:`BWD_STAGES`), each after an untimed forward; ``tiles``: launch
    overrides (:func:`~mok_kernels.mok_hopper.train.layer_backward`), or the layout (:func:`_weights`)."""
    layer, p = backend.impl, backend.params
    w13, w2, tiles = _weights(backend, tiles)
    samples: dict[str, list[float]] = {s: [] for s in BWD_STAGES}
    x, idx, w = inp.x_TH, inp.topk_idx_TK, inp.topk_w_TK
    for it in range(iters + 2):
        with torch.no_grad():
            layer(x, idx, w)
        evs: list[tuple[str, Any]] = []

        def mark(name: str) -> None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            evs.append((name, ev))

        mark("start")
        with torch.no_grad():
            layer_backward(layer, inp.grad_out_TH, x, idx, w, w13, w2, p.shared, marks=mark, tiles=tiles)
        torch.cuda.synchronize()
        if it >= 2:
            for (_, a), (name, b) in zip(evs, evs[1:]):
                samples[name].append(a.elapsed_time(b))
    return {s: round(med(v), 4) for s, v in samples.items() if v}


def _backward(backend: Any, inp: Any, tiles: Optional[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One forward + ``layer_backward`` with these launch overrides (or layout); dW13 / dW2 in the plain layout."""
    layer, p = backend.impl, backend.params
    w13, w2, over = _weights(backend, tiles)
    x, idx, w = inp.x_TH, inp.topk_idx_TK, inp.topk_w_TK
    with torch.no_grad():
        layer(x, idx, w)
        g = layer_backward(layer, inp.grad_out_TH, x, idx, w, w13, w2, p.shared, tiles=over)
        return _plain(backend, g) if w13 is not p.w13 else g


def backward_bits(backend: Any, inp: Any, tiles: Optional[dict[str, dict[str, Any]]]) -> list:
    """Fingerprints of every gradient of one forward + ``layer_backward`` with these launch overrides."""
    g = _backward(backend, inp, tiles)
    return [fingerprint(t) for k in sorted(g) for t in (g[k] if isinstance(g[k], tuple) else (g[k],))]


def rel_l1_to_default(backend: Any, inp: Any, tiles: dict[str, Any]) -> float:
    """The largest relative L1 difference between this variant's gradients (plain layout) and the default's. The
    default's wait in host memory (kimi_k2_7's weight gradients, the reference's and the layer's weights would not
    fit twice beside each other on one H200); compared a slice of the first dimension at a time."""
    def host(v: Any) -> Any:
        return tuple(host(t) for t in v) if isinstance(v, tuple) else (None if v is None else v.cpu())

    a = {k: host(v) for k, v in _backward(backend, inp, None).items()}
    b = _backward(backend, inp, tiles)
    worst = 0.0
    for k in sorted(a):
        for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (a[k], b[k]))):
            if x is not None:
                d = n = 0.0
                for i in range(0, len(x), 8):
                    xi = x[i:i + 8].to(y.device).float()
                    d += float((xi - y[i:i + 8].float()).abs().sum())
                    n += float(xi.abs().sum())
                worst = max(worst, d / max(n, 1e-30))
    return worst


def interleaved_rounds(measure: Any, labels: list[str], rounds: int) -> dict[Optional[str], list[dict[str, float]]]:
    """``measure(label)`` (stage ms by stage; ``None``: the default) in ``rounds`` rounds of D V1 D V2 ... Vn D: every
    variant bracketed by two timings of the default, so its ratio to their mean (:func:`ratios_to_default`) is not
    biased by a drift of the board's state (clock, power, temperature) that is linear over the bracket, and no label
    runs twice in a row. (Rounds of D A B, B A D, ... run a label twice in a row at each round's end, and an A/A variant
    read x1.02 in them: lab/diagnostics/2026-12-04-s28/.) Returns every label's timings in the order taken; the
    default's has ``1 + rounds * len(labels)``."""
    out: dict[Optional[str], list[dict[str, float]]] = {None: [measure(None)], **{k: [] for k in labels}}
    for _ in range(rounds):  # (a round starts from the last one's closing default timing)
        for k in labels:
            out[k].append(measure(k))
            out[None].append(measure(None))
    return out


def ratios_to_default(samples: dict[Optional[str], list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """For every variant of :func:`interleaved_rounds`' samples: the median over rounds of its stage total over the
    mean of the two default timings around it (``total_ratio``), their range, the same median per stage
    (``stage_<name>_ratio``), and its median stage total (ms)."""
    labels = [k for k in samples if k is not None]
    n = len(labels)
    base = samples[None]
    out = {}
    for i, label in enumerate(labels):
        runs = samples[label]
        around = [(base[r * n + i], base[r * n + i + 1]) for r in range(len(runs))]
        per_round = [sum(v.values()) / ((sum(a.values()) + sum(b.values())) / 2) for v, (a, b) in zip(runs, around)]
        row = {"total_ratio": round(med(per_round), 4), "round_ratio_min": round(min(per_round), 4),
               "round_ratio_max": round(max(per_round), 4),
               "stages_total_ms": round(med([sum(v.values()) for v in runs]), 4)}
        for stage in base[0]:
            rs = [v.get(stage, 0.0) / ((a[stage] + b[stage]) / 2) for v, (a, b) in zip(runs, around)
                  if a[stage] + b[stage] > 0]
            if rs:
                row[f"stage_{stage}_ratio"] = round(med(rs), 4)
        out[label] = row
    return out


def per_tensor_errors(ctx: Ctx, got: dict, ref: dict) -> dict[str, float]:
    out = {}
    for k, r in ref.items():
        if r is None:
            continue
        c = compare({k: got.get(k)}, {k: r}, ctx.ctrl)
        out[f"{k}_abs"], out[f"{k}_rel"] = round(c["max_abs_err"], 5), round(c["rel_err"], 6)
    return out


def fingerprint(t: Optional[torch.Tensor], chunk: int = 1 << 26) -> Optional[tuple[int, int]]:
    """Two position-weighted sums of the tensor's bits (int64, a slice of the first dimension at a time, so a view
    such as the gate half of dW13 is never copied whole): equal for bitwise-equal tensors; a changed bit changes
    them (collisions aside). Copies of the first step's gradients would not fit beside the reference's."""
    if t is None:
        return None
    t = t.detach()
    per = max(1, chunk // max(1, t[0].numel())) if t.dim() > 1 else t.numel()
    a = b = 0
    off = 0
    for i in range(0, t.shape[0] if t.dim() > 1 else 1, per):
        part = (t[i : i + per] if t.dim() > 1 else t).contiguous().view(-1)
        bits = part.view(torch.int16 if t.element_size() == 2 else torch.int32).long()
        pos = torch.arange(off, off + bits.numel(), device=bits.device)
        a += int((bits * (pos % 65521 + 1)).sum())
        b += int((bits * (pos % 1021 + 7)).sum())
        off += bits.numel()
    return a, b


def repeats_identical(ctx: Ctx, backend: Any, inp: Any, first: dict, n: int) -> int:
    """How many of ``n`` more forward + backward steps give every tensor the fingerprint of ``first``."""
    same = 0
    for _ in range(n):
        got = run_once(backend, inp, True)
        same += all(fingerprint(got[k]) == v for k, v in first.items())
        del got
    return same


def check_shape(ctx: Ctx, name: str, args: argparse.Namespace) -> None:
    case = shape_cases(name, ctx.world, "cpu" if ctx.smoke else "cuda", args.tokens, args.precisions)[args.precision]
    inp = layer_inputs(ctx, case)
    t = {"num_warmup": args.warmup, "num_iters": args.iters}
    # the reference: gradients, and its step memory
    ref_b = ReferenceBackend(case, ctx.group)
    ref_b.setup(inp)
    ref_mem = step_memory(ctx, ref_b, inp)
    ref = run_once(ref_b, inp, True)
    ref_b.teardown()
    del ref_b
    ctx.add(section="memory", shape=name, backend="reference", **ref_mem)
    ctx.log(f"{name}: reference done {ref_mem}")
    for mode in args.modes:
        _sync(ctx)
        a0 = _alloc(ctx)
        b = MokHopperBackend(case, ctx.group, MokHopperOptions(forward=mode))
        b.tile_overrides = args.tile_over
        b.setup(inp)
        _sync(ctx)
        setup_mb = _mb(_alloc(ctx) - a0)
        got = run_once(b, inp, True)
        verdict = compare(got, ref, ctx.ctrl)
        ok = verdict["max_abs_err"] <= case.atol and verdict["rel_err"] <= case.rtol and not verdict["any_missing"]
        errs = per_tensor_errors(ctx, got, ref)
        first = {k: fingerprint(v) for k, v in got.items()}
        del got
        same = repeats_identical(ctx, b, inp, first, args.repeats)
        del first
        ok = ok and same == args.repeats
        ctx.failed += not ok
        row: dict[str, Any] = dict(section="backward", shape=name, precision=case.precision, mode=mode, ok=ok,
                                   identical=f"{same}/{args.repeats}",
                                   max_abs_err=round(verdict["max_abs_err"], 5), rel_err=round(verdict["rel_err"], 6),
                                   worst=verdict["worst_tensor"], setup_mb=setup_mb, **saved_per_token(case, mode))
        ctx.log(f"{name} {mode}: {'ok' if ok else 'FAILED'} abs {verdict['max_abs_err']:.4g} rel "
                f"{verdict['rel_err']:.4g} on {verdict['worst_tensor']}; identical {same}/{args.repeats}; {errs}")
        if not ctx.smoke:
            row.update(step_memory(ctx, b, inp))
            for d in ("fwd", "bwd", "fwd_bwd"):
                row[f"{d}_ms"] = round(time_direction(b, inp, d, ctx.timer, t).median_ms, 4)
            stages = stage_times(ctx, b, inp, args.stage_iters)
            row.update({f"stage_{k}_ms": v for k, v in stages.items()})
            ctx.log(f"{name} {mode}: fwd {row['fwd_ms']} bwd {row['bwd_ms']} fwd_bwd {row['fwd_bwd_ms']} ms; "
                    f"stages {stages}; memory setup {setup_mb} MB, step {row.get('step_peak_mb')} MB")
        row.update(errs)
        ctx.add(**row)
        if args.sweep and not ctx.smoke and mode == args.modes[0]:
            base_bits = backward_bits(b, inp, None) if args.sweep_bits else None
            ran: dict[str, dict[str, Any]] = {}  # the variants that built and ran, for the interleaved rounds
            for label, over in (SWEEP if case.precision == "bf16" else FP8_SWEEP).items():
                if args.sweep_only and not any(w in label for w in args.sweep_only):
                    continue
                try:
                    st = stage_times(ctx, b, inp, args.stage_iters, tiles=over)
                    bits = backward_bits(b, inp, over) if base_bits is not None else None
                    same = bits == base_bits if bits is not None else None
                    repeatable = backward_bits(b, inp, over) == bits if bits is not None else None
                    rel = LAYOUT in over or (args.sweep_rel and same is False)
                    extra = {"rel_l1_to_default": round(rel_l1_to_default(b, inp, over), 7)} if rel else {}
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not the end
                    ctx.add(section="sweep", shape=name, variant=label, error=f"{type(e).__name__}: {e}"[:300])
                    ctx.log(f"{name} sweep {label}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                total = round(sum(st.values()), 4)
                ctx.add(section="sweep", shape=name, variant=label, same_bits=same, repeatable=repeatable,
                        stages_total_ms=total, **extra, **{f"stage_{k}_ms": v for k, v in st.items()})
                ctx.log(f"{name} sweep {label}: total {total} ms {st}; gradients bitwise the default's: {same}, "
                        f"the same again: {repeatable} {extra or ''}")
                ran[label] = over
            if args.sweep_rounds > 1 and ran:
                def measure(label: Optional[str]) -> dict[str, float]:
                    return stage_times(ctx, b, inp, args.stage_iters, tiles=None if label is None else ran[label])

                for label, summary in ratios_to_default(interleaved_rounds(measure, list(ran),
                                                                           args.sweep_rounds)).items():
                    ctx.add(section="sweep_rounds", shape=name, variant=label, rounds=args.sweep_rounds, **summary)
                    stages = {k: v for k, v in summary.items() if k.startswith("stage_") and k.endswith("_ratio")}
                    ctx.log(f"{name} sweep rounds {label}: x{summary['total_ratio']} of the default (rounds "
                            f"{summary['round_ratio_min']}-{summary['round_ratio_max']}); {stages}")
        b.teardown()
        del b
        clear_workspace_cache()
        if not ctx.smoke:
            torch.cuda.empty_cache()
    if args.nccl and not ctx.smoke:
        from baselines.nccl import NcclBackend
        from baselines.options import ExpertGemmOptions

        # (fp8: the fastest real path)
        nb = NcclBackend(replace(case, compile=False), ctx.group, ExpertGemmOptions(fp8_gemm="rowwise"))
        nb.setup(inp)
        mem = step_memory(ctx, nb, inp)
        row = dict(section="memory", shape=name, precision=case.precision, backend="nccl (eager)", **mem)
        for d in ("bwd", "fwd_bwd"):
            row[f"{d}_ms"] = round(time_direction(nb, inp, d, ctx.timer, t).median_ms, 4)
        ctx.add(**row)
        ctx.log(f"{name}: nccl eager {row}")
        nb.teardown()
    del ref
    if not ctx.smoke:
        torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="glm_5_2,qwen3_5_397b,kimi_k2_7")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--stage-iters", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-nccl", dest="nccl", action="store_false", help="skip the eager nccl comparison")
    ap.add_argument("--sweep", action="store_true", help="stage times of the launch variants in SWEEP (first mode), "
                    "whether each one's gradients are the default's, and the same twice")
    ap.add_argument("--sweep-only", type=lambda v: [w for w in v.split(",") if w], default=[],
                    help="comma-separated parts of SWEEP labels: only the variants whose label holds one")
    ap.add_argument("--sweep-rounds", type=int, default=1,
                    help="after the sweep, time the variants that ran in this many rounds of D V1 D V2 ... D (each "
                    "variant between two timings of the default) and report each one's stage times as ratios to "
                    "the mean of the two around it, the median over rounds (section sweep_rounds)")
    ap.add_argument("--no-sweep-bits", dest="sweep_bits", action="store_false",
                    help="skip the sweep's check that each variant's gradients are bitwise the default's")
    ap.add_argument("--sweep-rel", action="store_true",
                    help="for each variant whose gradients are not the default's bits: the largest relative L1 "
                    "difference of one gradient from the default's (the default is checked against the reference)")
    ap.add_argument("--precision", default="bf16", help="bf16 or fp8 (the fp8 backward)")
    ap.add_argument("--tile", default="", help="the forward's tile over its default, TileConfig fields as "
                    "name=int (switches 0 / 1), e.g. ready_flags=0 (no spin wait: what Nsight Compute, which runs "
                    "kernels one at a time, needs); CUDA only (the CPU twin has no tiles)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.tile_over = parse_tile_overrides(args.tile)
    except ValueError as e:
        print(f"bwd_check: {e}", file=sys.stderr)
        return 2
    args.modes = [m for m in args.modes.split(",") if m]
    args.precisions = [args.precision]
    shapes = [s for s in args.shapes.split(",") if s]
    if args.smoke:
        shapes, args.tokens, args.repeats = [SMOKE_SHAPE], 32, 2
    bad = [m for m in args.modes if m not in MODES]
    why = f"unknown mode(s) {bad}; choose from {MODES}" if bad else unrunnable(shapes, args)
    if why or int(os.environ.get("WORLD_SIZE", "1")) != 1:
        print(f"bwd_check: {why or 'runs on one rank (EP=1): torchrun --nproc-per-node=1'}", file=sys.stderr)
        return 2
    ctx = Ctx(smoke=args.smoke)
    t0 = time.time()
    ctx.log(f"mok_hopper bwd_check: {'cpu (smoke)' if ctx.smoke else torch.cuda.get_device_name()}, torch "
            f"{torch.__version__}, triton {__import__('triton').__version__}"
            + (f"; the forward's tile with {args.tile_over}" if args.tile_over else ""))
    for name in shapes:
        check_shape(ctx, name, args)
    os.makedirs(args.out, exist_ok=True)
    path = write_csv(ctx.rows, os.path.join(args.out, "mok_hopper_bwd_check.csv"))
    print(f"wrote {path}; {ctx.failed} failed checks; {time.time() - t0:.0f} s", flush=True)
    torch.distributed.destroy_process_group()
    return 1 if ctx.failed else 0


if __name__ == "__main__":
    sys.exit(main())
