"""The backward's launches as :mod:`mok_tools.mok_hopper.aot_check` compiles them (a file of their own, by what they
are: that file holds the forward's launches and the compile and check): the GEMMs of bwd_gemm.py,
bwd_wgrad.py, bwd_fused.py and bwd_fp8.py at the block sizes train.py launches them with, and the candidates of
bwd_check's sweep."""

from __future__ import annotations

from typing import Any

from mok_tools.mok_hopper.aot_variant import Variant


def backward_variants(cfg: Any, nprog: int) -> list[Variant]:
    """The backward's launches; ``cfg`` the forward's tile (the tiled layout's blocks), ``nprog`` programs a launch."""
    out: list[Variant] = []
    rows_t = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", h_ptr="*bf16", clip_ptr="*u8", s_ptr="*fp32",
                  sa_ptr="*bf16", ds_ptr="*fp32", code_ptr="*i32", delta_ptr="*i64", tile_expert_ptr="*i32",
                  tile_row_ptr="*i32", chunk_ptr="*i32", n_rows="i32", K="i32", N="i32", TK="i32",
                  stride_we="i32", stride_wk="i32", stride_wn="i32", limit="fp32")
    rows_c = dict(BK=64, NUM_PROGS=nprog, UPCAST=False, GROUP_M=4, STAGES=3, SAVE_H=False, HAS_LIMIT=False,
                  DGATE=False, WTMA=True, PUSH=False, TBN=0, TBK=0, GU=False, RK=True, PAIR=False)
    for label, over, warps in (("bwd dgate pair", dict(DGATE=True, BM=64, BN=128, STAGES=4, PAIR=True), 8),
                               # v12 (EP=1): dO's rows read by token (code // K, here K = 8)
                               ("bwd dgate pair, dO gathered",
                                dict(DGATE=True, BM=64, BN=128, STAGES=4, PAIR=True, A_GATHER=8), 8),
                               ("bwd dgate clamp, dO gathered",
                                dict(DGATE=True, HAS_LIMIT=True, BM=64, BN=128, A_GATHER=8), 8),
                               ("bwd dgate", dict(DGATE=True, BM=64, BN=128, STAGES=4), 8),
                               ("bwd dgate clamp", dict(DGATE=True, HAS_LIMIT=True, BM=64, BN=128), 8),
                               ("bwd dx push", dict(BM=128, BN=256, PUSH=True, STAGES=3), 8),
                               ("bwd recompute H", dict(BM=128, BN=64, SAVE_H=True, WTMA=False), 8)):
        c = {**rows_c, **over}
        t = dict(rows_t, w_ptr=f"tensordesc<bf16[{c['BK']}, {c['BN']}]>") if c["WTMA"] else rows_t
        out.append(Variant(label, "_bwd_rows_kernel", t, c, warps))
    # dgate's epilogue alone, after a G = dO @ W2 by torch._grouped_mm (an option), with and without the clamp
    ep_t = dict(g_ptr="*bf16", out_ptr="*bf16", h_ptr="*bf16", clip_ptr="*u8", s_ptr="*fp32", sa_ptr="*bf16",
                ds_ptr="*fp32", end_ptr="*i32", R="i32", N="i32", limit="fp32")
    for label, lim in (("bwd dgate epilogue", False), ("bwd dgate epilogue clamp", True)):
        out.append(Variant(label, "_dgate_epilogue_kernel", ep_t, dict(BM=32, BN=128, HAS_LIMIT=lim), 8))
    wg_t = dict(p_ptr="*bf16", q_ptr="*bf16", dw_ptr="tensordesc<bf16[128, 128]>", code_ptr="*i32",
                expert_row_ptr="*i32", N="i32", K="i32", L="i32")
    wg_c = dict(BN=128, BK=128, BR=64, NUM_PROGS=2 * nprog, UPCAST=False, STAGES=3, TMA_STORE=True, TBN=0, TBK=0,
                GU=False)
    out.append(Variant("bwd wgrad", "_bwd_wgrad_kernel", wg_t, dict(wg_c, STAGES=4), 4))  # over 128 rows
    out.append(Variant("bwd wgrad P resident", "_bwd_wgrad_resident_kernel", wg_t, wg_c, 4))
    # candidates (bwd_check's sweep): the Q-resident order, by TMA and by pointers at 8 warps
    out.append(Variant("bwd wgrad Q resident", "_bwd_wgrad_resident_kernel", wg_t, dict(wg_c, Q_RESIDENT=True),
                       4))
    out.append(Variant("bwd wgrad Q resident pointers", "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr="*bf16"),
                       dict(wg_c, Q_RESIDENT=True, TMA_STORE=False), 8))
    # experts of 48-128 rows on average (glm_5_2 at EP=1): 128-row steps, 128 x 64 output blocks
    out.append(Variant("bwd wgrad P resident 128 rows", "_bwd_wgrad_resident_kernel",
                       dict(wg_t, dw_ptr="tensordesc<bf16[128, 64]>"), dict(wg_c, BK=64, BR=128), 4))
    # v10: dW13 on the resident path by pointer stores (dW2 keeps the TMA launches above)
    out.append(Variant("bwd wgrad P resident pointers", "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr="*bf16"),
                       dict(wg_c, TMA_STORE=False), 4))
    out.append(Variant("bwd wgrad P resident 128 rows pointers", "_bwd_wgrad_resident_kernel",
                       dict(wg_t, dw_ptr="*bf16"), dict(wg_c, BK=64, BR=128, TMA_STORE=False), 4))
    # v11 and bwd_check's sweep: an expert's strips over fewer rows where it has fewer (BR_SMALL, then
    # BR_SMALL + BR_TAIL as two row blocks): glm_5_2's 128-row launches with 64 and 64 + 32, the 64-row ones
    # with 32 + 16
    for label, over, dw in (
            ("bwd wgrad P resident 128 rows, 64 + 32-row strips", dict(BK=64, BR=128, BR_SMALL=64, BR_TAIL=32),
             "tensordesc<bf16[128, 64]>"),
            ("bwd wgrad P resident 128 rows pointers, 64 + 32-row strips",
             dict(BK=64, BR=128, BR_SMALL=64, BR_TAIL=32, TMA_STORE=False), "*bf16"),
            ("bwd wgrad P resident, 32 + 16-row strips", dict(BR_SMALL=32, BR_TAIL=16), wg_t["dw_ptr"]),
            ("bwd wgrad P resident pointers, 32 + 16-row strips", dict(BR_SMALL=32, BR_TAIL=16, TMA_STORE=False),
             "*bf16"),
            # (bwd_check's 128 x 128 launches for glm_5_2: 64-row, experts of up to 96 rows as 64 + 32)
            ("bwd wgrad P resident pointers, 64 + 32-row strips", dict(BR_SMALL=64, BR_TAIL=32, TMA_STORE=False),
             "*bf16"),
            ("bwd wgrad P resident pointers, 64 + 32-row strips, 2 stages",
             dict(BR_SMALL=64, BR_TAIL=32, TMA_STORE=False, STAGES=2), "*bf16"),
            ("bwd wgrad P resident, 64 + 32-row strips, 2 stages", dict(BR_SMALL=64, BR_TAIL=32, STAGES=2),
             wg_t["dw_ptr"])):
        out.append(Variant(label, "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr=dw), dict(wg_c, **over), 4))
    # v12 (EP=1): dW2's P (dO) read by token: the 64-row launch by TMA, glm_5_2's 128-row one by pointers
    out.append(Variant("bwd wgrad P resident, dO gathered", "_bwd_wgrad_resident_kernel", wg_t,
                       dict(wg_c, P_GATHER=8), 4))
    out.append(Variant("bwd wgrad P resident 128 rows pointers, 64 + 32-row strips, dO gathered",
                       "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr="*bf16"),
                       dict(wg_c, BK=64, BR=128, BR_SMALL=64, BR_TAIL=32, TMA_STORE=False, P_GATHER=8), 4))
    # an option (``split`` in train._wgrad): glm_5_2's experts of at most 64 rows in the 64-row
    # launch at 128 x 128 (qwen3_5_397b's, ROWS_MAX), the others in v12's 128-row launch at 128 x 64 (ROWS_MIN)
    for label, over, dw in (
            ("bwd wgrad P resident pointers, experts up to 64 rows", dict(TMA_STORE=False, ROWS_MAX=64), "*bf16"),
            ("bwd wgrad P resident, experts up to 64 rows, dO gathered", dict(ROWS_MAX=64, P_GATHER=8),
             wg_t["dw_ptr"]),
            ("bwd wgrad P resident 128 rows pointers, 64 + 32-row strips, experts over 64 rows",
             dict(BK=64, BR=128, BR_SMALL=64, BR_TAIL=32, TMA_STORE=False, ROWS_MIN=64), "*bf16"),
            ("bwd wgrad P resident 128 rows pointers, 64 + 32-row strips, experts over 64 rows, dO gathered",
             dict(BK=64, BR=128, BR_SMALL=64, BR_TAIL=32, TMA_STORE=False, ROWS_MIN=64, P_GATHER=8), "*bf16")):
        out.append(Variant(label, "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr=dw), dict(wg_c, **over), 4))
    # bwd_check's sweep (not yet timed): the split's first launch with strips 256 wide and 64 deep at 8 warps, two
    # programs an SM (the row bound drops the reloaded-P path: about 104 registers)
    for label, over, dw in (
            ("bwd wgrad P resident pointers 256 x 64, 8 warps, experts up to 64 rows",
             dict(BN=256, BK=64, TMA_STORE=False, ROWS_MAX=64), "*bf16"),
            ("bwd wgrad P resident 256 x 64, 8 warps, experts up to 64 rows, dO gathered",
             dict(BN=256, BK=64, ROWS_MAX=64, P_GATHER=8), "tensordesc<bf16[256, 64]>")):
        out.append(Variant(label, "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr=dw), dict(wg_c, **over), 8))
    # and the split's second launch (glm_5_2's experts of 65-96 rows) at 128 x 128 blocks, 8 warps, one program
    # an SM (at 4 warps it spills 224 B under Triton 3.6, the 64-row launch with 64 + 32-row strips above 176 B)
    for label, gather in (("", 0), (", dO gathered", 8)):
        out.append(Variant(f"bwd wgrad P resident 128 rows pointers 128 x 128, 8 warps, 64 + 32-row strips, "
                           f"experts over 64 rows{label}", "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr="*bf16"),
                           dict(wg_c, BR=128, BR_SMALL=64, BR_TAIL=32, TMA_STORE=False, ROWS_MIN=64, NUM_PROGS=nprog,
                                **({"P_GATHER": gather} if gather else {})), 8))
        # (the same launch where the experts average at most 64 rows: qwen3_5_397b's, kimi_k2_7's outliers)
        out.append(Variant(f"bwd wgrad P resident 128 x 128, 8 warps, experts over 64 rows{label}",
                           "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr="*bf16") if not gather else wg_t,
                           dict(wg_c, ROWS_MIN=64, NUM_PROGS=nprog, TMA_STORE=bool(gather),
                                **({"P_GATHER": gather} if gather else {})), 8))
    # the fused stages (bwd_fused.py, an option; train.py's launches: 64-row blocks where the experts average at
    # most 48 rows, else 128) and bwd_check's sweep launches (4 warps, two programs per SM)
    dg_t = dict(do_ptr="*bf16", h_ptr="*bf16", clip_ptr="*u8", s_ptr="*fp32", dh_ptr="*bf16", ds_ptr="*fp32",
                code_ptr="*i32", expert_row_ptr="*i32", H="i32", I="i32", L="i32", limit="fp32")
    dx_t = dict(dh_ptr="*bf16", x_ptr="*bf16", out_ptr="*bf16", code_ptr="*i32", delta_ptr="*i64",
                expert_row_ptr="*i32", H="i32", N="i32", L="i32", TK="i32")
    fz_c = dict(NUM_PROGS=nprog, UPCAST=False, STAGES=3, WTMA=True, TMA_STORE=True)
    for label, br, bh, bi, lim, warps in (("bwd dgate+dW2 64 rows", 64, 128, 64, False, 8),
                                          ("bwd dgate+dW2 64 rows clamp", 64, 128, 64, True, 8),
                                          ("bwd dgate+dW2 128 rows", 128, 64, 64, False, 8),
                                          ("bwd dgate+dW2 64 rows 64x64 4 warps", 64, 64, 64, False, 4)):
        desc = f"tensordesc<bf16[{bh}, {bi}]>"
        out.append(Variant(label, "_dgate_dw2_kernel", dict(dg_t, w2_ptr=desc, dw2_ptr=desc),
                           dict(fz_c, BR=br, BH=bh, BI=bi, HAS_LIMIT=lim), warps))
    out.append(Variant("bwd dX+dW13 64 rows pointer stores", "_dx_dw13_kernel",  # v8 as tried
                       dict(dx_t, w13_ptr="tensordesc<bf16[128, 128]>", dw13_ptr="*bf16"),
                       dict(fz_c, BR=64, BN=128, BK=128, TMA_STORE=False), 8))
    for label, br, bn, bk, warps in (("bwd dX+dW13 64 rows", 64, 128, 128, 8),
                                     ("bwd dX+dW13 128 rows", 128, 128, 64, 8),
                                     ("bwd dX+dW13 64 rows 64x64 4 warps", 64, 64, 64, 4),
                                     ("bwd dX+dW13 128 rows 64x64 4 warps", 128, 64, 64, 4)):
        desc = f"tensordesc<bf16[{bn}, {bk}]>"
        out.append(Variant(label, "_dx_dw13_kernel", dict(dx_t, w13_ptr=desc, dw13_ptr=desc),
                           dict(fz_c, BR=br, BN=bn, BK=bk), warps))
    # the fp8 backward (bwd_fp8.py), at its launches: dgrad GEMMs over the e4m3 W^T by TMA (dgate with
    # dH quantised in its epilogue, clamped too; dX pushed), the token-axis quantisation of the weight gradients'
    # operands (from bf16 and from e4m3 rows) and their K-major e4m3 GEMM
    f8_t = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="tensordesc<fp8e4nv[128, 128]>", ws_ptr="*fp32",
                out_ptr="*bf16", h_ptr="*bf16", clip_ptr="*u8", s_ptr="*fp32", sa_ptr="*bf16", ds_ptr="*fp32",
                dhq_ptr="*fp8e4nv", dhs_ptr="*fp32", code_ptr="*i32", delta_ptr="*i64", tile_expert_ptr="*i32",
                tile_row_ptr="*i32", chunk_ptr="*i32", n_rows="i32", K="i32", N="i32", TK="i32", limit="fp32")
    f8_c = dict(BN=128, BK=128, NUM_PROGS=nprog, UPCAST=False, GROUP_M=4, STAGES=3, DGATE=False, HAS_LIMIT=False,
                WTMA=True, PUSH=False)
    for label, over in (("bwd fp8 dgate", dict(DGATE=True, BM=64)),
                        ("bwd fp8 dgate clamp", dict(DGATE=True, HAS_LIMIT=True, BM=64)),
                        ("bwd fp8 dx push", dict(PUSH=True, BM=128))):
        out.append(Variant(label, "_fp8_rows_kernel", f8_t, {**f8_c, **over}, 8))
    fw_t = dict(pt_ptr="*fp8e4nv", ps_ptr="*fp32", qt_ptr="*fp8e4nv", qs_ptr="*fp32",
                dw_ptr="tensordesc<bf16[128, 128]>", expert_row_ptr="*i32", block_base_ptr="*i32", RP="i32",
                N="i32", K="i32", L="i32")
    fw_t.update(pt_ptr="tensordesc<fp8e4nv[128, 128]>", qt_ptr="tensordesc<fp8e4nv[128, 128]>")
    for label, res in (("bwd fp8 wgrad", False), ("bwd fp8 wgrad P resident", True)):
        out.append(Variant(label, "_fp8_wgrad_kernel", fw_t,
                           dict(BN=128, BK=128, BR=128, NUM_PROGS=nprog, UPCAST=False, STAGES=3, TMA=True,
                                TMA_STORE=True, RESIDENT=res), 8))
    tq_t = dict(srcs_ptr="*fp32", dst_ptr="*fp8e4nv", dsts_ptr="*fp32", code_ptr="*i32", expert_row_ptr="*i32",
                block_base_ptr="*i32", C="i32", RP="i32", L="i32")
    for label, src in (("bwd fp8 token quant bf16", "*bf16"), ("bwd fp8 token quant e4m3", "*fp8e4nv")):
        out.append(Variant(label, "_tok_quant_t_kernel", dict(tq_t, src_ptr=src),
                           dict(BR=128, BC=64, FP8=src != "*bf16", NUM_PROGS=nprog), 8))
    # a module whose parameters are in the forward's TMA block order (MoKHopperMoE(layout="tiled"); blocks of
    # the glm_5_2 default: W13 gate/up interleaved up_n x up_k, W2 down_n x down_k), read and written by pointers
    up_t, dn_t = dict(TBN=cfg.up_n, TBK=cfg.up_k, GU=True), dict(TBN=cfg.down_n, TBK=cfg.down_k)
    for label, over, warps in (("bwd dgate tiled", dict(DGATE=True, BM=64, BN=128, STAGES=4, **dn_t), 8),
                               ("bwd dx push tiled gate/up", dict(BM=128, BN=128, PUSH=True, STAGES=4, **up_t), 8),
                               ("bwd recompute H tiled gate/up", dict(BM=128, BN=64, SAVE_H=True, RK=False,
                                                                      **up_t), 8)):
        out.append(Variant(label, "_bwd_rows_kernel", rows_t, {**rows_c, "WTMA": False, **over}, warps))
    out.append(Variant("bwd wgrad tiled gate/up", "_bwd_wgrad_kernel", dict(wg_t, dw_ptr="*bf16"),
                       dict(wg_c, TMA_STORE=False, BK=64, STAGES=4, **up_t), 4))
    for label, over, warps in (("bwd wgrad P resident tiled gate/up", {}, 8),
                               ("bwd wgrad P resident 128 rows tiled gate/up", dict(BR=128), 4)):
        out.append(Variant(label, "_bwd_wgrad_resident_kernel", dict(wg_t, dw_ptr="*bf16"),
                           dict(wg_c, TMA_STORE=False, BK=64, **up_t, **over), warps))
    return out
