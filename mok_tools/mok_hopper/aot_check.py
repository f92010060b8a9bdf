"""Compile every kernel variant of mok_hopper for a GPU architecture without a GPU (Triton ahead of time, with
the ptxas shipped in the Triton wheel) and report registers, spills and shared memory.

    python -m mok_tools.mok_hopper.aot_check            # sm_90 (H100/H200)
    python -m mok_tools.mok_hopper.aot_check --arch 100  # sm_100 (B200)

This catches what the CPU interpreter cannot: lowering errors, shared memory over the limit, register spills.
It does not run anything. Must run without TRITON_INTERPRET. The forward's launches are listed here, the
backward's in :mod:`mok_tools.mok_hopper.aot_bwd`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Optional

from mok_tools.mok_hopper.aot_variant import Variant

SMEM_LIMIT = {90: 232448, 100: 232448}  # bytes of dynamic shared memory per block (opt-in maximum)
# where the kernels live, by stage
KERNEL_MODULES = ("schedule_kernels", "pull", "up_gemm", "down_gemm", "bwd_gemm", "bwd_wgrad", "bwd_fused",
                  "bwd_fp8")
# Stack bytes a variant may spill, by a part of its label; any other spill is a problem. The training forward's up GEMMs
# (save H) add two to four stores to an epilogue that sits at the 255-register cap already (the inference kernels use
# 240-254): they spill 0-48 B on Triton 3.8 and 0-56 B on 3.6 (the journal, lab/perf-notes.md: save_h). The backward's
# dgate GEMM at 64 x 128 (its epilogue holds about ten fp32 tiles) spills 24-32 B on Triton 3.6 and none on 3.8; on the
# H200 (Triton 3.6) it ran 1.4x faster than the spill-free 64 x 64 (the bf16 backward v2's sweep:
# lab/diagnostics/2026-12-01-s13/). The budget keeps those from growing unnoticed. Backward v5 (run
# mok_hopper-bf16-fwd-bwd_h200x1_20261202): dgate with paired row blocks (the second block's accumulator live through
# the first's epilogue) spills 96 B on Triton 3.8 and 144 B on 3.6, where it ran glm_5_2's dgate in 2.18 against 3.06
# ms; the resident weight gradients over 128 rows (P held in registers beside a 128 x 64 accumulator, 4 warps), compiled
# with ``K`` of unknown divisibility, spill 16 B on 3.8 and 8 B on 3.6, and ran dW13 + dW2 in 7.88 against 9.32 ms,
# where the spill-free 8-warp build took 8.45 ms.
# The fp8 backward (run mok_hopper-fp8-fwd-bwd_h200x1_20261204; the journal: fp8 backward v0): dgate's epilogue also
# quantises dH (two more fp32 tiles and their row maxima beside the SwiGLU's): at v2 40 / 104 B (plain / clamped) on
# Triton 3.8, 72 / 112 B on 3.6, in the epilogue only (once a 64 x 128 tile, after its H / 128 K steps).
# Every variant is compiled as launched: each i32 size divisible by 16 as the launch sees it, except those in
# ``Variant.plain`` (in the backward's kernels ``K`` is a hidden size; compiled otherwise, their loads and stores are
# not those that run). So compiled, the 128-row resident weight gradients above do not spill (210-218 registers), and
# three kernels spill on the H200's Triton 3.6 and were timed so: the resident weight gradients at 128 x 128 by TMA
# (dW2's launch on the 64-row path) 40 B, the Q-resident ones (an option) 40 B, the fp8 dgate with the clamp 160 B
# (184 B on 3.8). v10's dW13 by pointer stores (128 x 128, 64-row steps) spills 8 B on 3.8 and 176 B on 3.6, where
# it ran the dW13 stage 1-3% faster than by TMA (the journal: v10, dW13 by pointer stores). The sweep's fp8 down GEMM
# capped at 128 registers (``TileConfig.down_maxnreg``, so that two 8-warp programs fit an SM) spills 16 B under both
# Tritons (10-21% slower than the default: lab/diagnostics/2026-12-04-s29/). The 64-row resident weight gradients
# with strips over 32 + 16 rows for the experts that have that few (bwd_check's sweep) spill 64-96 B by TMA under
# Triton 3.6 (none under 3.8), 160-168 B by pointers (16 B under 3.8); the 64-row launch whose experts of up to 96
# rows run 64 + 32 (glm_5_2 at 128 x 128 blocks) by pointers 176 B at 3 stages (v10's 64-row launch: the same) and
# 48 B at 2. (A label takes the largest budget of the parts it contains.)
SPILL_BUDGET = ((" save H", 64), ("bwd dgate", 64), ("bwd dgate pair", 144), ("bwd fp8 dgate", 128),
                ("bwd fp8 dgate clamp", 192), ("bwd wgrad P resident", 40), ("bwd wgrad Q resident", 40),
                ("bwd wgrad P resident pointers", 176), ("down fp8 x w 128 registers", 16),
                ("bwd wgrad P resident, 32 + 16-row strips", 96))


def kernel(name: str) -> Any:
    """The ``@triton.jit`` kernel called ``name`` in one of :data:`KERNEL_MODULES`."""
    import importlib

    for module in KERNEL_MODULES:
        fn = getattr(importlib.import_module(f"mok_kernels.mok_hopper.ops.{module}"), name, None)
        if fn is not None:
            return fn
    raise KeyError(f"no kernel {name!r} in mok_kernels.mok_hopper.ops.{{{', '.join(KERNEL_MODULES)}}}")


def variants(cfg: Any = None, hidden: int = 7168, ffn: int = 2048, extras: bool = True,
             save_h: bool = False) -> list[Variant]:
    """The launches one forward makes (routed and shared GEMMs, bf16 and fp8), at the given tile config (by default
    the CUDA default's: TMA operands over tiled weights, fp8's up GEMM as one gate/up MMA). With ``extras``, for a
    plain tile also the GEMMs of the other default tiles (tails, the fused gate/up MMA, 256-wide down), the
    row-major TMA GEMMs, and the training forward's bf16 up GEMMs that save H (``save_h``: labels "... save H ...";
    with ``save_h`` the up launches include them)."""
    from dataclasses import replace

    from contract.fp8 import FP8_MAX
    from mok_kernels.mok_hopper.ops.schedule_kernels import DeviceScheduler
    from mok_kernels.mok_hopper.ops.up_gemm import weight_layout
    from mok_kernels.mok_hopper.tiles import TileConfig, h_save_by_tma, ready_granule

    cfg = cfg or TileConfig(w_tiled=True, fp8_up_fused=True, fp8_down_pair=True)  # default_tile's GEMM kernels
    nprog = 108
    pk = {"PACKED": True} if cfg.packed_rows else {}  # (the launchers pass PACKED only when it is on)
    out: list[Variant] = []
    out.append(Variant("quant x 1x128", "_quant_rows_kernel",
                       dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", H="i32"),
                       dict(ROWS=8, BLOCK=128, FP8_MAX_=FP8_MAX), 4))
    out.append(Variant("gather idx", "_gather_i32_kernel",
                       dict(ref_ptr="*i32", delta_table="*i64", out_ptr="*i32", N="i32"), dict(BLOCK=1024), 4))
    sb, lp = DeviceScheduler.SB, 256  # the schedule at 192 local experts (kimi_k2_7 at EP=2)
    out.append(Variant("schedule hist", "_sched_hist_kernel",
                       dict(idx_ref="*i32", idx_delta="*i64", idx_all="*i32", hist_ptr="*i32", rank_ptr="*i32",
                            S="i32", TK="i32", e_lo="i32", L="i32"), dict(SB=sb, LP=lp), 4))
    out.append(Variant("schedule scan", "_sched_scan_kernel",
                       dict(hist_ptr="*i32", off_ptr="*i32", count_ptr="*i32", NB="i32"),
                       dict(NBP=256, LP=lp, EB=16), 8))
    out.append(Variant("schedule layout", "_sched_layout_kernel",
                       dict(count_ptr="*i32", lay_ptr="*i32", counts_out="*i32", num_tiles_ptr="*i32",
                            chunk_ptr="*i32", overflow_ptr="*i32", ready_ptr="*i32", work_ptr="*i32", L="i32",
                            R="i32", n_ready="i32", n_work="i32"),
                       dict(BM=cfg.block_m, HALF=cfg.half_tiles, LP=lp, CP=2, NC=1, RP=1024, ZERO=True,
                            TAIL=cfg.tail_rows, **pk), 4))
    out.append(Variant("schedule tiles", "_sched_tiles_kernel",
                       dict(lay_ptr="*i32", tile_expert_ptr="*i32", tile_row_ptr="*i32", codes_ptr="*i32", M="i32",
                            L="i32", R="i32"), dict(BM=cfg.block_m, LP=lp, MB=64, CB=2048), 4))
    out.append(Variant("schedule place", "_sched_place_kernel",
                       dict(idx_all="*i32", rank_ptr="*i32", off_ptr="*i32", lay_ptr="*i32", codes_ptr="*i32",
                            overflow_ptr="*i32", overflow_total_ptr="*i32", S="i32", e_lo="i32", L="i32", R="i32"),
                       dict(SB=sb, LP=lp), 4))
    out.append(Variant("timeline stamp", "_stamp_kernel", dict(ptr="*i64", i="i32"), {}, 1))
    hp = 1 << (hidden - 1).bit_length()
    for fp8, pull_w in ((False, True), (False, False), (True, True)):
        xt = "*fp8e4nv" if fp8 else "*bf16"
        hs = hidden // 128 if fp8 else 1
        out.append(Variant(f"pull {'fp8' if fp8 else 'bf16'}{' +w' if pull_w else ''}", "_pull_rows_kernel",
                           dict(code_ptr="*i32", chunk_ptr="*i32", tile_row_ptr="*i32", ready_ptr="*i32",
                                x_ref=xt, x_delta="*i64",
                                xs_ref="*fp32" if fp8 else xt, xs_delta="*i64", w_ref="*fp32", w_delta="*i64",
                                x_out=xt, xs_out="*fp32" if fp8 else xt, w_out="*fp32", TK="i32", K="i32",
                                H="i32", HS="i32"),
                           dict(BR=cfg.pull_rows, BH=hp, HSP=1 << (hs - 1).bit_length(), FP8=fp8,
                                PULL_W=pull_w, NUM_PROGS=48, READY=cfg.ready_flags, GRAN=ready_granule(cfg), **pk),
                           cfg.pull_warps, plain=("K", "HS")))
    def operand(t: str, block: list[int], tma: bool) -> str:  # a pointer, or a TMA descriptor with its block
        return f"tensordesc<{t[1:]}[{block[0]}, {block[1]}]>" if tma else t

    for tma in (False, True):  # pointer loads, and the default TMA descriptors
        path = " tma" if tma else ""
        # fp8: the tile the layer runs on this operand path (for_fp8 decides what needs TMA: the paired steps)
        f8 = replace(cfg, tma=True).for_fp8() if tma else replace(cfg, tma=False, w_tiled=False, up_fused=False,
                                                                   up_stacked=False).for_fp8()
        saves = ((False, False, True), (False, True, True), (True, False, True), (True, True, True)) if save_h else ()
        for fp8, limit, save in ((False, False, False), (False, True, False), (True, False, False)) + saves:
            c = f8 if fp8 else cfg
            t = "*fp8e4nv" if fp8 else "*bf16"
            # the saved H and clamp decisions: pointers with SAVE_H, else None (constexprs: no kernel parameter)
            sv = dict(hsv_ptr="*bf16", clip_ptr="*u8") if save and limit else dict(hsv_ptr="*bf16") if save else {}
            hsv_tma = save and tma and h_save_by_tma(c)  # (as up_swiglu decides, on this operand path)
            if hsv_tma:  # the saved H through TMA descriptors of [BM, BN] and [BM/2, BN] blocks
                sv.update(hsv_ptr=operand("*bf16", [c.block_m, c.up_n], True),
                          hsv_half=operand("*bf16", [c.block_m // 2, c.up_n], True))
            sv_c = {k: None for k in ("hsv_ptr", "clip_ptr", "hsv_half") if k not in sv}
            label = f"up {'fp8' if fp8 else 'bf16'}{' clamp' if limit else ''}{' save H' if save else ''}{path}"
            out.append(Variant(label, "_up_swiglu_kernel",
                               dict(a_ptr=operand(t, [c.block_m, c.up_k], tma),
                                    a_half=operand(t, [c.block_m // 2, c.up_k], tma and c.half_tiles),
                                    a_tail=operand(t, [c.tail_rows, c.up_k], tma and c.tail_rows > 0), as_ptr="*fp32",
                                    w_ptr=(f"tensordesc<{t[1:]}[1, {c.up_n}, 2, {c.up_k}]>" if tma and c.up_stacked
                                           else operand(t, [c.up_n * (2 if c.up_fused else 1), c.up_k], tma)),
                                    ws_ptr="*fp32", h_ptr=t, hs_ptr="*fp32",
                                    tile_expert_ptr="*i32", tile_row_ptr="*i32", chunk_ptr="*i32", ready_ptr="*i32",
                                    work_ptr="*i32", n_rows="i32", H="i32", I="i32", limit="fp32", **sv),
                               dict(BM=c.block_m, BN=c.up_n, BK=c.up_k, FP8=fp8, HAS_LIMIT=limit, NUM_PROGS=nprog,
                                    UPCAST=False, STAGES=c.up_stages, FP8_MAX_=FP8_MAX, GROUP_M=c.group_m, TMA=tma,
                                    HALF=c.half_tiles, READY=c.ready_flags, GRAN=ready_granule(c), SPIN=True,
                                    DYN=c.ready_flags, WB=128, FLAT=c.flat_up, TAIL=c.tail_rows,
                                    WT=weight_layout(c) if tma else False, SAVE_H=save,
                                    PAIR=fp8 and c.fp8_up_pair, SPLIT=c.up_halves, HSV_TMA=hsv_tma, **sv_c, **pk),
                               c.up_warps))
        for fp8, apply_w in ((False, True), (False, False), (True, True)):
            c = f8 if fp8 else cfg
            t = "*fp8e4nv" if fp8 else "*bf16"
            regs = f" {c.down_maxnreg} registers" if c.down_maxnreg else ""  # (a launch capped at maxnreg)
            out.append(Variant(f"down {'fp8' if fp8 else 'bf16'}{' x w' if apply_w else ''}{regs}{path}",
                               "_down_push_kernel",
                               dict(h_ptr=operand(t, [c.block_m, c.down_k], tma),
                                    h_half=operand(t, [c.block_m // 2, c.down_k], tma and c.half_tiles),
                                    h_tail=operand(t, [c.tail_rows, c.down_k], tma and c.tail_rows > 0), hs_ptr="*fp32",
                                    w_ptr=operand(t, [c.down_n, c.down_k], tma), ws_ptr="*fp32",
                                    tile_expert_ptr="*i32", tile_row_ptr="*i32", chunk_ptr="*i32", code_ptr="*i32",
                                    rw_ptr="*fp32", out_ref="*bf16", out_delta="*i64", n_rows="i32", H="i32",
                                    I="i32", TK="i32"),
                               dict(BM=c.block_m, BN=c.down_n, BK=c.down_k, FP8=fp8, APPLY_W=apply_w,
                                    NUM_PROGS=nprog, UPCAST=False, STAGES=c.down_stages, GROUP_M=c.group_m, TMA=tma,
                                    HALF=c.half_tiles, WB=128, FLAT=c.flat_down, TAIL=c.tail_rows,
                                    WT=c.w_tiled and tma, PAIR=fp8 and c.fp8_down_pair, SPLIT=c.down_halves, **pk),
                               c.down_warps, maxnreg=c.down_maxnreg))
    plain = cfg.half_tiles and not (cfg.flat_up or cfg.flat_down or cfg.tail_rows or cfg.up_fused)
    if plain and extras:  # the other default tiles' GEMMs (bf16, TMA): glm_5_2's tails (v9)
        from mok_kernels.mok_hopper.tiles import TAIL_ROWS

        def extra(over: dict[str, Any], labels: tuple[str, ...], rename: Any, save_h: bool = False) -> list[Variant]:
            """The launches ``labels`` of the tile with ``over`` applied, renamed."""
            return [replace(v, label=rename(v.label))
                    for v in variants(replace(cfg, **over), hidden, ffn, extras=False, save_h=save_h)
                    if v.label in labels]

        def tagged(tag: str) -> Any:
            return lambda label: label.replace(" tma", f" {tag} tma")

        out += extra(dict(tail_rows=TAIL_ROWS), ("up bf16 tma", "down bf16 x w tma"), tagged(f"tails {TAIL_ROWS}"))
        if cfg.w_tiled:  # the fused gate/up MMA (up_fused; the default on glm_5_2), with and without tails
            out += extra(dict(up_fused=True), ("up bf16 tma",), tagged("fused"))
            out += extra(dict(up_fused=True, tail_rows=TAIL_ROWS), ("up bf16 tma",), tagged(f"fused tails {TAIL_ROWS}"))
            # the fp8 up GEMM as two MMAs, gate and up (fp8_up_fused off: the fp8 default before v14)
            out += extra(dict(fp8_up_fused=False), ("up fp8 tma",), tagged("unfused"))
            # the fp8 down GEMM with one 1 x 64 hidden block a loop step (fp8_down_pair off: the default to v14)
            out += extra(dict(fp8_down_pair=False), ("down fp8 x w tma",), tagged("single"))
            # the fp8 down GEMM as 64-row items at 4 warps, two programs an SM (fp8_down_halves: the default on
            # qwen3_5_397b and kimi_k2_7 from v16)
            out += extra(dict(fp8_down_halves=True), ("down fp8 x w tma",), tagged("halves"))
            # the fp8 up GEMM as 64-row items at 4 warps and 4 stages, two programs an SM (fp8_up_halves, v17),
            # the inference and the training forward's (save H) kernels
            out += extra(dict(fp8_up_halves=True), ("up fp8 tma",), tagged("halves"))
            out += extra(dict(fp8_up_halves=True), ("up fp8 save H tma", "up fp8 clamp save H tma"),
                         tagged("halves"), save_h=True)
            # the fp8 up GEMM with two 1 x 128 x blocks a loop step (fp8_up_pair; off), fused and not
            out += extra(dict(fp8_up_pair=True), ("up fp8 tma",), tagged("pair"))
            out += extra(dict(fp8_up_pair=True, fp8_up_fused=False), ("up fp8 tma",), tagged("unfused pair"))
            # glm_5_2's 256-wide down GEMM with tails (the CUDA default from v11)
            out += extra(dict(tail_rows=TAIL_ROWS, down_n=256, down_stages=4), ("down bf16 x w tma",),
                         tagged(f"256 tails {TAIL_ROWS}"))
            # the routed GEMMs over row-major weights (w_tiled off, as before v10)
            out += extra(dict(w_tiled=False), ("up bf16 tma", "down bf16 x w tma", "up fp8 tma", "down fp8 x w tma"),
                         lambda label: label + " row-major")
        # the training forward's up GEMMs (MoKHopperLayer(save_h=True)): the epilogue also stores H (and the clamp's
        # decisions), in every item kind: pointers and TMA, tails, the fused MMA with and without tails, row-major
        saves = ("up bf16 save H", "up bf16 clamp save H", "up bf16 save H tma", "up bf16 clamp save H tma",
                 "up fp8 save H", "up fp8 clamp save H", "up fp8 save H tma", "up fp8 clamp save H tma")
        out += [v for v in variants(cfg, hidden, ffn, extras=False, save_h=True) if v.label in saves]
        # the saved H by TMA stores (save_h_tma; off): bf16, fp8, fp8 at 64-row items two programs an SM
        out += extra(dict(save_h_tma=True), ("up bf16 save H tma", "up bf16 clamp save H tma", "up fp8 save H tma"),
                     tagged("H by TMA"), save_h=True)
        if cfg.w_tiled:
            out += extra(dict(save_h_tma=True, fp8_up_halves=True), ("up fp8 save H tma",),
                         tagged("halves H by TMA"), save_h=True)
        clamp_tma = ("up bf16 clamp save H tma",)
        out += extra(dict(tail_rows=TAIL_ROWS), clamp_tma, tagged(f"tails {TAIL_ROWS}"), save_h=True)
        if cfg.w_tiled:
            out += extra(dict(up_fused=True), clamp_tma, tagged("fused"), save_h=True)
            out += extra(dict(up_fused=True, tail_rows=TAIL_ROWS), ("up bf16 save H tma",) + clamp_tma,
                         tagged(f"fused tails {TAIL_ROWS}"), save_h=True)
            out += extra(dict(w_tiled=False), clamp_tma, lambda label: label + " row-major", save_h=True)
            # the fused gate/up MMA over the plain weights (up_stacked: one [up_n, 2, up_k] box a K step, no tails;
            # off), inference and training forward
            stacked = dict(w_tiled=False, up_fused=False, up_stacked=True)
            out += extra(stacked, ("up bf16 tma",), tagged("stacked"))
            out += extra(stacked, ("up bf16 save H tma",) + clamp_tma, tagged("stacked"), save_h=True)
        # packed rows (packed_rows; off): the schedule's layout, the pull and the routed GEMMs with PACKED, the
        # training forward's up GEMM, and fp8's 64-row items
        out += extra(dict(packed_rows=True), ("schedule layout", "pull bf16 +w", "pull fp8 +w", "up bf16 tma",
                                              "down bf16 x w tma", "up fp8 tma", "down fp8 x w tma"),
                     lambda label: label + " packed")
        out += extra(dict(packed_rows=True), ("up bf16 clamp save H tma", "up fp8 clamp save H tma"),
                     lambda label: label + " packed", save_h=True)
        out += extra(dict(packed_rows=True, fp8_up_halves=True, fp8_down_halves=True),
                     ("up fp8 tma", "down fp8 x w tma"), lambda label: label + " halves packed")
    out.append(Variant("epilogue", "_epilogue_kernel",
                       dict(comb_ptr="*bf16", idx_ptr="*i64", rw_ptr="*fp32", shared_ptr="*bf16", out_ptr="*bf16",
                            T="i32", H="i32", K="i32"),
                       dict(BT=2, BH=1024, APPLY_W=False, HAS_SHARED=True), 4, plain=("K",)))
    if extras:  # the backward's GEMMs (aot_bwd.py), at the block sizes train.py launches them with
        from mok_tools.mok_hopper.aot_bwd import backward_variants

        out += backward_variants(cfg, nprog)
    return out


def specialisation(v: Variant, fn: Any) -> tuple[dict[str, str], dict[tuple[int], list], dict[str, Any]]:
    """(signature, attributes, constexprs) of ``fn`` compiled as variant ``v``: every pointer and every i32 not in
    ``v.plain`` divisible by 16, as the launcher's specialisation sees them at the shapes the layer runs."""
    import inspect

    params = inspect.signature(fn.fn).parameters  # (fn.fn: the Python function, jitted or interpreted)
    sig, attrs, constexprs = {}, {}, dict(v.constexprs)
    for i, name in enumerate(fn.arg_names):
        if name not in constexprs and name not in v.types:  # a constexpr the variant leaves at its default
            default = params[name].default
            assert default is not inspect.Parameter.empty, f"{v.label}: no type or value for {name}"
            constexprs[name] = default
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = v.types[name]
        if v.types[name].startswith("*") or (v.types[name] == "i32" and name not in v.plain):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, constexprs


def compile_variant(v: Variant, arch: int = 90, sass: bool = False, fn: Any = None) -> dict[str, Any]:
    """Compile one variant; registers / spills from cuobjdump's resource usage of the cubin. With ``sass``, also
    its machine code as ``res["sass"]``: one instruction a line, without addresses or encodings, so that two
    builds (two Triton versions, or code before and after a refactor) compare line by line. ``fn``: a
    ``@triton.jit`` function to compile instead of ``v.kernel`` of ``KERNEL_MODULES`` (probes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = fn if fn is not None else kernel(v.kernel)
    sig, attrs, constexprs = specialisation(v, fn)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    k = triton.compile(src, target=target,
                       options={"num_warps": v.num_warps, **({"maxnreg": v.maxnreg} if v.maxnreg else {})})
    res = {"label": v.label, "shared": int(k.metadata.shared), "regs": None, "stack": None, "local": None}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        if sass:
            dump = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
            res["sass"] = "\n".join(_sass_lines(dump))
    for line in text.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":") for item in line.split() if ":" in item)
            res.update(regs=int(fields["REG"]), stack=int(fields["STACK"]), local=int(fields["LOCAL"]))
    return res


def _sass_lines(dump: str) -> list[str]:
    """The instructions of a cuobjdump SASS listing: ``/*0040*/  IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;`` ->
    ``IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;`` (encoding-only lines and headers dropped)."""
    out = []
    for line in dump.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*(/\*.*\*/)?\s*$", line)
        if m and m.group(1):
            out.append(m.group(1))
    return out


def problems(res: dict[str, Any], arch: int = 90) -> Optional[str]:
    if res["shared"] > SMEM_LIMIT.get(arch, 232448):
        return f"shared memory {res['shared']} B over the limit"
    budget = max((b for part, b in SPILL_BUDGET if part in res["label"]), default=0)
    if (res["local"] or 0) or (res["stack"] or 0) > budget:
        return f"register spills (stack {res['stack']} B, local {res['local']} B)" + (
            f" over the {budget} B budget" if budget else "")
    return None


def note(res: dict[str, Any]) -> str:
    """A spill inside its variant's budget (:data:`SPILL_BUDGET`), said so."""
    return f"spills {res['stack']} B (budget)" if res["stack"] else ""


def sweep_variants() -> list[Variant]:
    """The GEMM kernels (TMA operands) of gpu_check's sweep tiles that the default tile does not already build."""
    from dataclasses import replace

    from mok_tools.mok_hopper.variants import SWEEP
    from mok_kernels.mok_hopper.tiles import default_tile

    def key(v: Variant) -> tuple:
        return v.kernel, tuple(sorted(v.constexprs.items())), v.num_warps, v.maxnreg

    seen = {key(v) for v in variants()}
    out = []
    base = default_tile()  # the CUDA default the sweep varies (gpu_check's base without a shape's row count)
    for label, over, _ in SWEEP:
        for v in variants(replace(base, **over), extras=False):
            if label.startswith("fp8:") and " fp8 " not in v.label:
                continue  # gpu_check runs an "fp8:" variant in fp8 only (its bf16 tile may not fit)
            if v.label.startswith(("up ", "down ")) and v.label.endswith(" tma") and key(v) not in seen:
                seen.add(key(v))
                out.append(replace(v, label=f"{v.label} [{label[:18]}]"))
    return out


# (hidden, ffn, routed rows an expert gets) of the points whose default tiles plain_weight_variants compiles: the
# published shapes at EP=1 and 2048 tokens (T K / E rows an expert), and glm_5_2 with 16 experts (its compute-bound
# point, 1024 rows an expert)
PLAIN_POINTS = {"kimi_k2_7": (7168, 2048, 2048 * 8 / 384), "glm_5_2": (6144, 2048, 2048 * 8 / 256),
                "qwen3_5_397b": (4096, 1024, 2048 * 10 / 512), "deepseek_v4_pro": (7168, 3072, 2048 * 6 / 384),
                "glm_5_2@16": (6144, 2048, 2048 * 8 / 16)}


def plain_weight_variants() -> list[Variant]:
    """The routed GEMMs (TMA, inference and training forward, bf16 and fp8) of each point's default tile with the
    weights read in the caller's plain layout (``mok_hopper.weights=plain``: ``tiles.plain_weights``) that
    :func:`variants` does not already build."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import default_tile, plain_weights

    def key(v: Variant) -> tuple:
        return v.kernel, tuple(sorted(v.constexprs.items())), v.num_warps, v.maxnreg

    seen = {key(v) for v in variants()}
    out = []
    for point, (hidden, ffn, rows) in PLAIN_POINTS.items():
        tile = plain_weights(default_tile(hidden=hidden, ffn=ffn, rows_per_expert=rows))
        for v in variants(tile, hidden, ffn, extras=False, save_h=True):
            if v.label.startswith(("up ", "down ")) and v.label.endswith(" tma") and key(v) not in seen:
                seen.add(key(v))
                out.append(replace(v, label=f"{v.label} [plain {point}]"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles for the GPU", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sweep", action="store_true", help="also the GEMM kernels of gpu_check's sweep tiles")
    ap.add_argument("--sass", metavar="DIR", help="write each variant's SASS (instructions only) to DIR/<label>.sass "
                    "and print its hash, to compare two builds with diff -r")
    args = ap.parse_args(argv)
    import triton

    print(f"Triton {triton.__version__}, sm_{args.arch}")
    bad = 0
    print(f"{'variant':<44} {'regs':>5} {'spill':>6} {'smem KB':>8}")
    for v in variants() + plain_weight_variants() + (sweep_variants() if args.sweep else []):
        r = compile_variant(v, args.arch, sass=bool(args.sass))
        why = problems(r, args.arch)
        bad += why is not None
        digest = ""
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, re.sub(r"[^A-Za-z0-9_.-]+", "_", r["label"]) + ".sass"), "w") as f:
                f.write(r["sass"] + "\n")
            digest = hashlib.sha256(r["sass"].encode()).hexdigest()[:12]
        print(f"{r['label']:<44} {r['regs']!s:>5} {(r['stack'] or 0) + (r['local'] or 0):>6} "
              f"{r['shared'] / 1024:8.1f}  {digest}{'  ' if digest else ''}{why or note(r)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
