"""The tile and pipeline variants gpu_check's sweep runs against the default tile (kernel-specific: each is a set of
:class:`~mok_kernels.mok_hopper.tiles.TileConfig` overrides and layer options). ``aot_check --sweep`` compiles their
GEMM kernels for sm_90; ``mok_tools/mok_hopper/gpu_check.py`` runs and times them on the GPU."""

from __future__ import annotations

# the row-major weights with the gate/up MMA fused through one [up_n, 2, up_k] TMA box (up_stacked; no tails)
STACKED = dict(w_tiled=False, up_fused=False, up_stacked=True, tail_rows=0)
SWEEP = [  # (label, overrides of the base tile, layer options); tiles checked by aot_check to fit on sm_90
    # the default itself, as a second layer: its ratio is what a sweep reads when nothing changes (A/A control)
    ("default again (A/A control)", {}, {}),
    # the training forward the harness's fwd rows time (the up GEMM also writes the pre-SwiGLU H for the backward)
    ("training forward (save_h)", {}, dict(save_h=True)),
    # the same with the saved H leaving the up GEMM as TMA block stores (save_h_tma; off)
    ("training forward (save_h), H by TMA stores", dict(save_h_tma=True), dict(save_h=True)),
    # the expert weights row-major, as given, instead of in TMA block order (w_tiled, the default from v10)
    ("row-major weights (v9)", dict(w_tiled=False, up_fused=False), {}),
    # the weights row-major with the gate/up MMA still fused: the gate and up blocks as one [up_n, 2, up_k] TMA box
    # of W13 seen as [L, I, 2, H] (up_stacked; off, no tails): the harness's plain weights (no copy) with the fused MMA
    ("row-major weights, stacked gate/up MMA", STACKED, {}),
    ("row-major weights, stacked gate/up MMA, training forward (save_h)", STACKED, dict(save_h=True)),
    # the row-major weights' TMA blocks 256 B a row instead of 128 (half as many rows a byte, the same bytes in
    # flight in fewer stages): the harness's plain weights against the tiled copy's contiguous blocks
    ("row-major weights, up BK 128 x 2 stages", dict(w_tiled=False, up_fused=False, up_k=128, up_stages=2), {}),
    ("row-major weights, down BK 128 x 3 stages", dict(w_tiled=False, up_fused=False, flat_down=False, down_n=128,
                                                       down_k=128, down_stages=3), {}),
    # one up-GEMM MMA of N = 2 x up_n over gate and up weight rows interleaved (up_fused; the default on glm_5_2
    # from v11), here on any shape
    ("fused gate/up MMA", dict(up_fused=True), {}),
    # with the down GEMM 256 wide, 4 stages, not flattened (v11's glm_5_2 tiles, on any shape)
    ("fused gate/up MMA + 256-wide down", dict(up_fused=True, flat_down=False, down_n=256,
                                             down_stages=4), {}),
    # two up-GEMM MMAs, gate and up blocks apart (v10; with "down v5" below, glm_5_2's v10 GEMMs)
    ("unfused gate/up MMAs (v10)", dict(up_fused=False), {}),
    ("v3 layout (full tiles, events, 3/4 stages, torch schedule)",  # the reference point of lab/perf-notes.md v3
     dict(half_tiles=False, ready_flags=False, up_stages=3, down_stages=4, pull_rows=2, pull_warps=8,
          pull_programs=48, shared_sms=0, tail_rows=0), dict(schedule="torch")),
    ("pull 48 x 8 warps x 2 rows", dict(pull_programs=48, pull_warps=8, pull_rows=2), {}),
    ("pull 48 x 16 warps x 4 rows", dict(pull_programs=48), {}),
    ("pull 24 x 16 warps x 8 rows", dict(pull_rows=8), {}),
    ("comm 16", dict(comm_sms=16), {}),
    ("shared last", dict(shared_last=True, shared_sms=0), {}),
    ("no ready flags", dict(ready_flags=False), {}),
    ("down v5 (128 wide, 6 stages, not flat)", dict(flat_down=False, down_n=128, down_stages=6), {}),
    ("down flat 256 wide x 4 stages", dict(flat_down=True, down_n=256, down_stages=4, tail_rows=0), {}),
    ("down flat 128 wide x 6 stages", dict(flat_down=True, down_n=128, down_stages=6, tail_rows=0), {}),
    ("down 256 wide x 4 stages, not flat", dict(flat_down=False, down_n=256, down_stages=4), {}),
    ("down BK 128 x 3 stages, not flat", dict(flat_down=False, down_n=128, down_k=128, down_stages=3), {}),
    # an expert's last rows as a second MMA with the rows in N, off the same weight tiles (tail_rows; lab/perf-notes.md
    # v9)
    ("tails of 16 rows (swapped MMA, 128 wide x 6, not flat)",
     dict(tail_rows=16, flat_down=False, down_n=128, down_stages=6), {}),
    ("tails of 32 rows (swapped MMA, 128 wide x 6, not flat)",
     dict(tail_rows=32, flat_down=False, down_n=128, down_stages=6), {}),
    ("up + down flat, no ready flags", dict(flat_up=True, flat_down=True, ready_flags=False, tail_rows=0), {}),
    ("shared before up, beside the pull (v7)", dict(shared_sms=0), {}),
    ("shared beside up on 16 SMs", dict(shared_sms=16), {}),
    ("shared beside up on 24 SMs", dict(shared_sms=24), {}),
    ("shared beside up on 32 SMs", dict(shared_sms=32), {}),
    ("shared beside up on 40 SMs", dict(shared_sms=40), {}),
    # fp8 only (the label's "fp8:"): the up GEMM as two MMAs (gate, up), each waited for before its promotion:
    # the fp8 default before v14, which fuses them into one MMA over interleaved rows (lab/perf-notes.md v14)
    ("fp8: separate gate/up MMAs (v13)", dict(fp8_up_fused=False), {}),
    # fp8 only: the down GEMM one 1 x 64 hidden block a loop step (fp8_down_pair off: the fp8 default to v14)
    ("fp8: down one hidden block a step (v14)", dict(fp8_down_pair=False), {}),
    # the paired down GEMM (the default since v15) with 5 and 6 stages of two blocks (for_fp8 halves
    # down_stages + 2 of a 128-wide bf16 tile): more weight bytes in flight
    ("fp8: down two hidden blocks a step, 5 stages", dict(down_n=128, down_stages=8), {}),
    ("fp8: down two hidden blocks a step, 6 stages", dict(down_n=128, down_stages=10), {}),
    # fp8 only: the up GEMM's loop steps two 1 x 128 x blocks too (fp8_up_pair; off)
    ("fp8: up and down two blocks a step", dict(fp8_up_pair=True), {}),
    # fp8 only: the paired down GEMM in the flattened loop (the next item's loads beside this item's epilogue;
    # every tile BM rows)
    ("fp8: down flat, two blocks a step", dict(fp8_flat_down=True), {}),
    # fp8 only: two down-GEMM programs an SM (4 warps each, 64 output columns an item), so that one program's promotion
    # runs beside the other's MMAs (lab/diagnostics/2026-12-03-s22/); and the 64-wide items alone, one program an SM, to
    # tell the two changes apart (128 wide at 4 warps spills 184-192 B: not a variant)
    ("fp8: down 64 wide, 4 warps, two programs an SM", dict(fp8_down_n=64, down_warps=4, down_per_sm=2), {}),
    ("fp8: down 64 wide, one program an SM", dict(fp8_down_n=64), {}),
    # fp8 only: two programs an SM at 128-wide items, each row tile run as 64-row items (down_halves: a full tile as
    # two, its weights read twice), which fit 4 warps without spilling (fp8_down_halves, v16's default
    # on qwen3_5_397b and kimi_k2_7); and the 64-row items alone, one program of 8 warps an SM, to tell the two
    # changes apart
    ("fp8: down 64-row items, 4 warps, two programs an SM", dict(fp8_down_halves=True), {}),
    ("fp8: down 64-row items, one program an SM",
     dict(fp8_down_halves=False, down_halves=True, flat_down=False, tail_rows=0), {}),
    # bf16 (no "fp8:"): the same two programs an SM over 64-row items, 128 wide with 4 stages and 256
    # wide with 2 (two programs' stages must fit one SM's shared memory)
    ("down 64-row items, 4 warps, two programs an SM, 128 wide x 4",
     dict(down_halves=True, down_warps=4, down_per_sm=2, flat_down=False, tail_rows=0, down_n=128, down_stages=4), {}),
    ("down 64-row items, 4 warps, two programs an SM, 256 wide x 2",
     dict(down_halves=True, down_warps=4, down_per_sm=2, flat_down=False, tail_rows=0, down_n=256, down_stages=2), {}),
    # fp8 only: the down GEMM as before v16, one program of 8 warps an SM over whole tiles, where v16's default runs
    # it as 64-row items at two programs an SM (fp8_down_halves; on glm_5_2 an A/A)
    ("fp8: down whole tiles, one program an SM (v15)", dict(fp8_down_halves=False), {}),
    # fp8 only (for glm_5_2): whole 128-row tiles 64 columns wide at two programs of 8 warps an SM, the
    # down GEMM compiled for 128 registers a thread (16 B of spill) so that two fit: no full tile's weights read
    # twice (as v16's 64-row items do), each program's promotion beside the other's MMAs. Measured: the
    # forward x1.096 (glm_5_2) and x1.213 (qwen3_5_397b) of the default (lab/diagnostics/2026-12-04-s29/); off
    ("fp8: 128-register down 64 wide, 8 warps, two programs an SM",
     dict(fp8_down_halves=False, fp8_down_n=64, down_warps=8, down_per_sm=2, down_maxnreg=128), {}),
    # fp8 only: the up GEMM's counterpart (v17's default): every row tile as 64-row items at 4 warps and 4 stages, two
    # programs an SM in each up launch (fp8_up_halves); in the inference and the training forward (save_h), with the
    # shared expert before the up GEMM too (then no side stream takes SMs while two up programs share one); and the
    # 64-row items alone at one program of 8 warps an SM, to tell the two changes apart
    ("fp8: up 64-row items, 4 warps, two programs an SM", dict(fp8_up_halves=True), {}),
    ("fp8: up 64-row items, two programs an SM, training forward (save_h)", dict(fp8_up_halves=True),
     dict(save_h=True)),
    ("fp8: up 64-row items, two programs an SM, shared before up", dict(fp8_up_halves=True, shared_sms=0), {}),
    ("fp8: up 64-row items, one program an SM", dict(up_halves=True, tail_rows=0), {}),
    # with two up programs an SM the pull (a latency-bound loop: one BR-row step of loads, stores, a barrier and a
    # release at a time) gates the up GEMM (timelines: lab/diagnostics/2026-12-04-s27/): longer pull steps, alone and
    # with it
    ("fp8: pull 16 rows a step", dict(pull_rows=16), {}),
    ("fp8: up 64-row items, two programs an SM, pull 8 rows a step", dict(fp8_up_halves=True, pull_rows=8), {}),
    ("fp8: up 64-row items, two programs an SM, pull 16 rows a step", dict(fp8_up_halves=True, pull_rows=16), {}),
    ("fp8: up 64-row items, two programs an SM, pull 16 rows a step, shared before up",
     dict(fp8_up_halves=True, pull_rows=16, shared_sms=0), {}),
    # fp8 only: v16's up GEMM and pull (one program of 8 warps an SM over whole tiles, 4-row pull steps) where v17's
    # default runs two up programs an SM over 64-row items and 16-row pull steps
    ("fp8: up whole tiles, pull 4 rows a step (v16)", dict(fp8_up_halves=False, fp8_pull_rows=0), {}),
    # every expert's rows right after the previous expert's, no tile padding (packed_rows; off): R = the routed rows
    # instead of T K + 63 L; a tile's MMA runs into the next expert's rows (lab/2026-12-07-packed-rows.md). Tails
    # off (packed rows refuse them: on glm_5_2, whose default has tails, compare with "no tails" too)
    ("packed rows (no tile padding)", dict(packed_rows=True, tail_rows=0), {}),
    ("packed rows, training forward (save_h)", dict(packed_rows=True, tail_rows=0), dict(save_h=True)),
    ("no tails", dict(tail_rows=0), {}),
]
# the variants without "fp8:" that an fp8 sweep runs too (every "fp8:" one runs in fp8 only: :func:`runs_at`)
SWEEP_FP8 = (
    "default again (A/A control)",
    "pull 24 x 16 warps x 8 rows",
    "shared last",
    "shared before up, beside the pull (v7)",
    "shared beside up on 16 SMs",
    "shared beside up on 24 SMs",
    "shared beside up on 32 SMs",
    "shared beside up on 40 SMs",
    "training forward (save_h)",
    "training forward (save_h), H by TMA stores",
    "packed rows (no tile padding)",
    "packed rows, training forward (save_h)")


def runs_at(label: str, precision: str) -> bool:
    """Whether gpu_check's sweep at ``precision`` runs the variant ``label``: an "fp8:" variant in fp8 only, one of
    :data:`SWEEP_FP8` in both, any other in bf16 only. (The "fp8:" prefix alone decides, so no "fp8:" variant can
    be left out of an fp8 sweep by a second list of names.)"""
    if precision == "fp8":
        return label.startswith("fp8:") or label in SWEEP_FP8
    return not label.startswith("fp8:")


TIMELINE_VARIANTS = ("v3 layout (full tiles, events, 3/4 stages, torch schedule)",  # these also get a timeline
                     # where two up programs an SM leave the shared expert and the pull their SMs (v17)
                     "fp8: up 64-row items, 4 warps, two programs an SM",
                     "fp8: up 64-row items, two programs an SM, shared before up",
                     "shared before up, beside the pull (v7)",
                     "fp8: up 64-row items, two programs an SM, pull 16 rows a step",
                     "fp8: up 64-row items, two programs an SM, pull 16 rows a step, shared before up")
