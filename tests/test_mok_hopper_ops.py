"""mok_hopper's Triton kernels (``mok_kernels/mok_hopper/ops/``) on the CPU, under the interpreter
(TRITON_INTERPRET=1), with several ranks simulated in one process (ordinary buffers addressing each other through the
same peer-pointer tables the GPU uses), against the torch twin; and their ahead-of-time builds for Hopper.

Legend: P ranks, T tokens per rank, K top-k, E experts, L = E / P local experts, H hidden, I ffn.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton

from conftest import has_nvidia_backend  # noqa: E402
from mok_hopper_layers import check_saved_h, make_layer_inputs, plain_reference, rel_l1, skewed_routing  # noqa: E402
from mok_kernels.mok_hopper.twin import forward as twin  # noqa: E402
from mok_kernels.mok_hopper.fp8 import quantize_blocks  # noqa: E402
from mok_kernels.mok_hopper.schedule import build_schedule  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# the Triton kernels under the interpreter, several ranks in one process

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (it comes with torch on Linux; "
                                                         "pip install -e '.[test]'): the interpreter kernel tests "
                                                         "need it")


def run_kernels(xs, idx, ws, w13, w2, sh, *, precision="bf16", limit=None, rw_in="expert", capacity=None,
                repeats=1, tile=None, save_h=False):
    """Run the kernel pipeline for P simulated ranks, phase by phase (stage all, compute all, finish all). With
    ``save_h`` the layers' saved H starts as NaN and their clamp decisions as 7 (what no forward writes)."""
    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    P, (T, K), H = len(xs), idx[0].shape, xs[0].shape[1]
    cpu = torch.device("cpu")
    tile = tile or default_tile(precision=precision, device=cpu, hidden=H, ffn=w2[0].shape[2])
    wss = link_local([Workspace(rank=r, world=P, device=cpu, tokens=T, hidden=H, topk=K,
                                fp8=precision == "fp8", symmetric=False) for r in range(P)])
    layers = [MoKHopperLayer(w13[r], w2[r], topk=K, tokens=T, shared=sh, swiglu_limit=limit, precision=precision,
                             rank=r, world=P, workspace=wss[r], tile=tile, router_weight_in=rw_in,
                             capacity=capacity, save_h=save_h) for r in range(P)]
    for layer in layers if save_h else ():
        layer.h_save.fill_(float("nan"))
        if layer.clip_save is not None:
            layer.clip_save.fill_(7)
    runs = []
    for _ in range(repeats):
        for r in range(P):
            layers[r].stage(xs[r], idx[r], ws[r])
        for r in range(P):
            layers[r].compute(xs[r])
        runs.append([layers[r].finish() for r in range(P)])
    return runs, layers, tile


@needs_triton
@pytest.mark.parametrize("precision,limit,rw_in", [("bf16", None, "expert"), ("fp8", 0.5, "epilogue")])
def test_kernels_two_ranks_match_the_twin(precision, limit, rw_in):
    xs, idx, ws, w13, w2, sh = make_layer_inputs(2, 24, 2, 8, 256, 128, seed=7)
    runs, layers, tile = run_kernels(xs, idx, ws, w13, w2, sh, precision=precision, limit=limit, rw_in=rw_in,
                                     repeats=2 if precision == "bf16" else 1)
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, limit=limit, fp8=precision == "fp8",
                         block_m=tile.block_m, router_weight_in=rw_in)
    ref = plain_reference(xs, idx, ws, w13, w2, sh, limit)
    for r in range(2):
        # same math, same roundings: equal up to fp32 summation order inside the dots
        assert rel_l1(runs[0][r], want[r]) < 1e-3 and (runs[0][r].float() - want[r].float()).abs().max() < 0.02
        assert rel_l1(runs[0][r], ref[r]) < (0.1 if precision == "fp8" else 0.01)
        assert torch.equal(runs[0][r], runs[-1][r])  # a second forward on the same buffers: identical bits
        assert layers[r].overflow_rows() == 0
    # byte accounting: rows pulled by each rank = rows whose expert it owns
    d0, c0 = layers[0].rows_per_peer()
    d1, c1 = layers[1].rows_per_peer()
    L = 4
    assert d0 == [int((idx[0] // L == p).sum()) for p in range(2)] and c0 == [d0[0], d1[0]] and c1 == [d0[1], d1[1]]


@needs_triton
@pytest.mark.parametrize("mode,K,P", [("empty_expert", 2, 2), ("one_expert", 2, 2), ("one_rank", 2, 2),
                                      ("uniform", 1, 2), ("masked", 3, 2), ("uniform", 2, 1)])
def test_kernels_edge_cases(mode, K, P):
    xs, idx, ws, w13, w2, sh = make_layer_inputs(P, 16, K, 8, 128, 64, seed=11, mode=mode, shared=mode != "masked")
    runs, layers, tile = run_kernels(xs, idx, ws, w13, w2, sh)
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, block_m=tile.block_m)
    for r in range(P):
        assert rel_l1(runs[0][r], want[r]) < 1e-3
        assert layers[r].overflow_rows() == 0


@needs_triton
@pytest.mark.parametrize("precision,layout", [(p, lay) for p in ("bf16", "fp8")
                                              for lay in ("half_tiles+ready", "full_tiles+events", "half_tiles+flat")])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_kernels_with_small_tiles_walk_every_loop(precision, tma, layout):
    """Tiles much smaller than the matrices: several column tiles, several K steps, several tiles per expert and
    per chunk, persistent programs looping, pull steps that straddle chunk ends; four ranks. Both GEMM operand
    paths: pointer loads, and TMA tensor descriptors. Three tile layouts: half tiles with the pull's ready
    counters (every granule of the used rows counted exactly once); full tiles only, without counters; half tiles
    run by the flattened GEMM loops at full height (the rows past a half tile's end, which belong to the next
    tile, must not be stored)."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import TileConfig

    if precision == "fp8":  # fp8 steps follow the scale blocks (up 64 x 128, down 128 x 64): two of each here
        P, T, K, E, H, I = 2, 24, 3, 8, 256, 128
        tile = TileConfig(block_m=16, num_chunks=3, gemm_programs=3, pull_programs=5, pull_rows=4,
                          group_m=3).for_fp8()
    else:
        P, T, K, E, H, I = 4, 16, 3, 16, 128, 64
        tile = TileConfig(block_m=16, up_n=32, up_k=32, down_n=32, down_k=16, num_chunks=3, gemm_programs=3,
                          pull_programs=5, pull_rows=4, group_m=2)
    half, flat = layout.startswith("half"), layout.endswith("flat")
    tile = replace(tile, tma=tma, half_tiles=half, ready_flags=half and not flat, flat_up=flat, flat_down=flat)
    xs, idx, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=13)
    runs, layers, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision=precision, tile=tile, limit=1.0)
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, fp8=precision == "fp8", block_m=16, limit=1.0)
    for r in range(P):
        assert rel_l1(runs[0][r], want[r]) < 1e-3 and (runs[0][r].float() - want[r].float()).abs().max() < 0.02
    assert sum(int(layer.sched.num_tiles) for layer in layers) > 3 * P
    sizes = {b - a for layer in layers
             for a, b in zip(layer.sched.tile_row_M1[: int(layer.sched.num_tiles)].tolist(),
                             layer.sched.tile_row_M1[1 : int(layer.sched.num_tiles) + 1].tolist())}
    assert sizes == ({8, 16} if half else {16})  # both tile kinds ran
    for layer in layers:
        if half and not flat:
            used = int(layer.sched.tile_row_M1[int(layer.sched.num_tiles)]) // 8
            assert layer.ready[:used].tolist() == [8] * used and not layer.ready[used:].any()
        else:
            assert layer.ready is None


@needs_triton
@pytest.mark.parametrize("layout", ["half_tiles+ready", "full_tiles+events", "half_tiles+flat"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_packed_rows_forward_is_the_padded_forward_bit_for_bit(tma, layout):
    """bf16, EP=1: with packed rows (no tile padding; a tile's MMA runs into the next expert's rows, which it
    computes and does not store) every output row is the padded layout's, bit for bit (each row's products depend
    on that row only, and the K steps are the same). Experts of 0 to 2 tiles of rows, tiles of every size, three
    chunks (the pull's steps straddle chunk ends inside a granule); the ready counters end at each granule's rows."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import TileConfig

    P, T, K, E, H, I, BM = 1, 40, 3, 8, 128, 64, 16
    tile = TileConfig(block_m=BM, up_n=32, up_k=32, down_n=32, down_k=16, num_chunks=3, gemm_programs=3,
                      pull_programs=5, pull_rows=4, group_m=2)
    half, flat = layout.startswith("half"), layout.endswith("flat")
    tile = replace(tile, tma=tma, half_tiles=half, ready_flags=half and not flat, flat_up=flat, flat_down=flat)
    xs, _, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=17)
    idx = [skewed_routing(T, K, E, seed=17)]
    padded, _, _ = run_kernels(xs, idx, ws, w13, w2, sh, tile=tile, limit=1.0)
    packed, layers, _ = run_kernels(xs, idx, ws, w13, w2, sh, tile=replace(tile, packed_rows=True), limit=1.0)
    assert torch.equal(packed[0][0], padded[0][0])
    s = layers[0].sched
    n = int(s.num_tiles)
    counts = s.counts_L.tolist()
    rows = s.tile_row_M1[: n + 1].tolist()
    used = rows[-1]
    assert used == sum(counts) == T * K and layers[0].R == -(-T * K // BM) * BM  # no padding row
    sizes = [b - a for a, b in zip(rows[:-1], rows[1:])]
    assert BM in sizes and any(0 < z <= BM // 2 for z in sizes) and any(BM // 2 < z < BM for z in sizes)
    assert 0 in counts and max(counts) > BM  # an empty expert, and one of two tiles or more
    if layers[0].ready is not None:  # each granule counts its rows (the last one's partial), once
        g = 8
        want = [min(g, used - i * g) for i in range(-(-used // g))]
        assert layers[0].ready[: len(want)].tolist() == want and not layers[0].ready[len(want):].any()


@needs_triton
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_kernels_with_tails_match_the_twin(tma):
    """Tails (bf16): tiles of BM/2 + TL and BM + TL rows run their last TL rows as a second MMA with the rows in N
    (W @ A^T) in both GEMMs. Every tile kind occurs, several column tiles and K steps, the pull's ready counters
    in granules of TL rows (each counted once)."""
    from mok_kernels.mok_hopper.tiles import TileConfig

    P, T, K, E, H, I, BM, TL = 2, 64, 4, 8, 128, 64, 64, 16
    tile = TileConfig(block_m=BM, tail_rows=TL, up_n=32, up_k=32, down_n=32, down_k=32, num_chunks=1,
                      gemm_programs=3, pull_programs=5, pull_rows=4, group_m=2, tma=tma)
    xs, _, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=21)
    g = torch.Generator().manual_seed(0)  # uneven expert loads (24-94 rows): every tile kind below occurs
    load = torch.tensor([4.0, 7.0, 2.0, 6.0, 5.0, 7.5, 1.5, 6.0])
    idx = [torch.stack([torch.multinomial(load, K, generator=g) for _ in range(T)]) for _ in range(P)]
    runs, layers, _ = run_kernels(xs, idx, ws, w13, w2, sh, tile=tile, limit=1.0)
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, block_m=16, limit=1.0)
    for r in range(P):
        assert rel_l1(runs[0][r], want[r]) < 1e-3 and (runs[0][r].float() - want[r].float()).abs().max() < 0.02
    sizes = set()
    for layer in layers:
        n = int(layer.sched.num_tiles)
        rows = layer.sched.tile_row_M1[: n + 1].tolist()
        sizes |= {b - a for a, b in zip(rows[:-1], rows[1:])}
        used = rows[n] // TL
        assert layer.ready[:used].tolist() == [TL] * used and not layer.ready[used:].any()
    assert sizes == {BM // 2, BM // 2 + TL, BM, BM + TL}  # tails of both kinds, and plain tiles


def _uneven_routing(P: int, T: int, K: int) -> list[torch.Tensor]:
    """Expert loads of 24-94 rows over 8 experts (P = 2, T = 64, K = 4): with 64-row tiles and 16-row tails every
    tile kind occurs (BM/2, BM/2 + TL, BM, BM + TL)."""
    g = torch.Generator().manual_seed(0)
    load = torch.tensor([4.0, 7.0, 2.0, 6.0, 5.0, 7.5, 1.5, 6.0])
    return [torch.stack([torch.multinomial(load, K, generator=g) for _ in range(T)]) for _ in range(P)]



@needs_triton
@pytest.mark.parametrize("limit", [None, 0.75], ids=["no_limit", "clamped"])
@pytest.mark.parametrize("layout", ["default", "tails+pointers", "fused+tails+tma"])
def test_save_h_stores_the_pre_swiglu_h_and_clamp_decisions(layout, limit):
    """``save_h``: the routed up GEMM's epilogue also stores H (bf16 [R, 2I]) and, clamped, the clamp decisions
    (uint8 [R, 2I]) of every row it computes, as twin_bwd.saved has them, in every item kind: the CPU default tile
    (pointers, half tiles, ready counters, two chunks); tails over pointers (the unfused tail MMAs); and the fused
    gate/up MMA (interleaved accumulator columns) with tails and half tiles over TMA descriptors. The forward's
    output is bitwise that of the layer without save_h."""
    from mok_kernels.mok_hopper.tiles import TileConfig, default_tile

    P, T, K, E, H, I = 2, 64, 4, 8, 128, 64
    xs, _, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=31)
    idx = _uneven_routing(P, T, K)
    if layout == "default":
        tile = default_tile(device=torch.device("cpu"), hidden=H, ffn=I)
    else:
        tma = layout.endswith("tma")
        tile = TileConfig(block_m=64, tail_rows=16, up_n=32, up_k=32, down_n=32, down_k=32, num_chunks=1,
                          gemm_programs=3, pull_programs=5, pull_rows=4, group_m=2, tma=tma, w_tiled=tma,
                          up_fused=tma)
    plain, _, _ = run_kernels(xs, idx, ws, w13, w2, sh, tile=tile, limit=limit)
    runs, layers, _ = run_kernels(xs, idx, ws, w13, w2, sh, tile=tile, limit=limit, save_h=True)
    sizes = set()
    for r in range(P):
        assert torch.equal(runs[0][r], plain[0][r])  # saving H changes no bit of the forward
        seen = check_saved_h(layers[r], w13[r], limit)
        sizes |= seen["sizes"]
        assert seen["rows"] > 0 and seen["inexact"] <= 0.01 * seen["rows"] * 2 * I
        if limit is not None:  # the clamp clipped some of each kind
            assert min(seen["clip_gate"], seen["clip_up_pos"], seen["clip_up_neg"]) > 0
        else:
            assert layers[r].clip_save is None
    # every tile kind ran: half and full tiles, and with tails half + tail and full + tail
    assert sizes == ({16, 32} if layout == "default" else {32, 48, 64, 80})


def test_an_fp8_training_layer_saves_h_and_keeps_its_transposed_weights():
    """fp8 with save_h: the up GEMM's epilogue saves every routed row's pre-SwiGLU H from the e4m3 GEMM
    (the twin's ``saved_fp8``); train=True keeps the e4m3 weights transposed (the forward's values; its scales);
    an inference layer keeps none."""
    from contract.fp8 import quantize_blocks
    from mok_kernels.mok_hopper.twin import backward as twin_bwd
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.fp8 import quantize_expert_weights

    xs, idx, ws, w13, w2, _ = make_layer_inputs(1, 16, 2, 4, 128, 128, seed=1, shared=False)
    layer = MoKHopperLayer(w13[0], w2[0], topk=2, tokens=16, precision="fp8", save_h=True, train=True, rank=0,
                           world=1, cuda_graph=False)
    for got, want in ((layer.w13_bwd, quantize_expert_weights(w13[0])), (layer.w2_bwd, quantize_expert_weights(w2[0]))):
        want_t = want[0].transpose(1, 2).contiguous()  # W^T: the dgrad GEMMs read it K-major
        assert got.shape == want_t.shape and torch.equal(got.view(torch.uint8), want_t.view(torch.uint8))
    assert torch.equal(layer.w13_scale, quantize_expert_weights(w13[0])[1])
    layer(xs[0], idx[0], ws[0])
    s = layer.sched
    codes = s.row_code_R.long()
    valid = (codes >= 0).nonzero().flatten()
    n = int(s.num_tiles)
    expert = torch.repeat_interleave(s.tile_expert_M[:n].long(), s.tile_row_M1[1 : n + 1] - s.tile_row_M1[:n])
    xq, xsc = quantize_blocks(xs[0], 1, 128)
    tok = codes[valid] // 2
    q13, s13 = quantize_expert_weights(w13[0])
    for r, t in zip(valid.tolist(), tok.tolist()):
        h, _ = twin_bwd.saved_fp8(xq[t : t + 1], xsc[t : t + 1], q13[expert[r]], s13[expert[r]], None)
        assert torch.allclose(layer.h_save[r].float(), h[0].float(), rtol=1e-2, atol=1e-2)
    inference = MoKHopperLayer(w13[0], w2[0], topk=2, tokens=16, precision="fp8", rank=0, world=1)
    assert inference.w13_bwd is None and inference.w2_bwd is None and inference.h_save is None


def test_tile_weights_puts_each_tma_block_in_one_run_of_memory():
    from mok_kernels.mok_hopper.ops.gemm_common import tile_weights
    from mok_kernels.mok_hopper.tiles import TileConfig, plain_weights

    w = torch.arange(2 * 8 * 12, dtype=torch.float32).reshape(2, 8, 12)
    t = tile_weights(w, 4, 3)
    assert t.shape == (2, 2, 4, 4, 3) and t.is_contiguous()
    flat = t.reshape(-1, 3)  # the [*, BK] view the kernels' TMA descriptor covers
    for e in range(2):
        for n in range(2):
            for k in range(4):
                row = ((e * 2 + n) * 4 + k) * 4  # where _ld_w loads block (e, n, k) from
                assert torch.equal(flat[row:row + 4], w[e, n * 4:(n + 1) * 4, k * 3:(k + 1) * 3])
    with pytest.raises(AssertionError, match="multiples of the tile"):
        tile_weights(w, 3, 3)
    with pytest.raises(ValueError, match="needs tma=True"):
        TileConfig(tma=False, w_tiled=True)
    with pytest.raises(ValueError, match="up_fused .* needs w_tiled=True"):
        TileConfig(up_fused=True)
    assert not TileConfig(w_tiled=True, up_fused=True).for_fp8().up_fused  # bf16's switch
    assert TileConfig(w_tiled=True, fp8_up_fused=True).for_fp8().up_fused  # fp8's
    assert not TileConfig(fp8_up_fused=True).for_fp8().up_fused  # (needs the tiled weights)
    for over in (dict(w_tiled=True), dict(tma=False), dict(tail_rows=16)):
        with pytest.raises(ValueError, match="up_stacked .* needs tma=True, w_tiled=False .* and tail_rows=0"):
            TileConfig(up_stacked=True, **over)
    assert not TileConfig(up_stacked=True).for_fp8().up_stacked  # bf16's
    fused = TileConfig(block_m=64, w_tiled=True, up_fused=True, tail_rows=16)
    stacked = plain_weights(fused, stacked=True)  # the fused MMA kept, the tails dropped (both GEMMs)
    assert stacked.up_stacked and not stacked.tail_rows and not stacked.w_tiled and not stacked.up_fused
    assert plain_weights(fused).tail_rows == 16 and not plain_weights(fused).up_stacked
    assert not plain_weights(TileConfig(w_tiled=True), stacked=True).up_stacked  # nothing fused to keep


def test_tile_weights_gu_interleaves_gate_and_up_rows_in_each_block():
    from mok_kernels.mok_hopper.ops.gemm_common import tile_weights_gu

    L, I, H, bn, bk = 2, 8, 12, 4, 3
    w13 = torch.arange(L * 2 * I * H, dtype=torch.float32).reshape(L, 2 * I, H)
    t = tile_weights_gu(w13, bn, bk)
    assert t.shape == (L, I // bn, H // bk, 2 * bn, bk) and t.is_contiguous()
    for e in range(L):
        for n in range(I // bn):
            for k in range(H // bk):
                blk = t[e, n, k]
                cols = slice(k * bk, (k + 1) * bk)
                assert torch.equal(blk[0::2], w13[e, n * bn:(n + 1) * bn, cols])  # gate rows at 2j
                assert torch.equal(blk[1::2], w13[e, I + n * bn:I + (n + 1) * bn, cols])  # up rows at 2j + 1


def test_tile_overrides_from_the_command_line():
    """gpu_check's and bwd_check's ``--tile``: TileConfig fields, integers, the switches as bools; anything else
    a ValueError that names it."""
    from mok_kernels.mok_hopper.tiles import TileConfig, parse_tile_overrides

    got = parse_tile_overrides("ready_flags=0,tma=1,block_m=64")
    assert got == {"ready_flags": False, "tma": True, "block_m": 64} and got["ready_flags"] is False
    assert TileConfig(**got).ready_flags is False and parse_tile_overrides("") == {}
    with pytest.raises(ValueError, match="'ready_flag' is not a TileConfig field"):
        parse_tile_overrides("ready_flag=0")
    with pytest.raises(ValueError, match="block_m='64.5' is not an integer"):
        parse_tile_overrides("block_m=64.5")


def test_default_tile_tiles_the_weights_on_cuda_only():
    from mok_kernels.mok_hopper.tiles import default_tile

    for precision in ("bf16", "fp8"):
        for rows in (64, 85, 128):
            assert default_tile(precision=precision, rows_per_expert=rows).w_tiled
    cpu = default_tile(device=torch.device("cpu"), hidden=256, ffn=128)
    assert not cpu.tma and not cpu.w_tiled  # (pointer loads under the interpreter)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("layout", ["tails", "flat", "fp8", "fused", "fused+tails", "fp8 fused", "stacked"])
def test_tiled_weights_change_no_bit(layout):
    """The weights in TMA block order (w_tiled) feed the same blocks to the same MMAs as row-major weights: both
    GEMMs, every item kind (tails, the flattened loops, fp8's scaled steps) give identical bits. The fused
    gate/up MMA (up_fused: one N = 2 x up_n MMA over interleaved gate and up rows, split after the loop; in fp8
    each column promoted by its own weight scale) too, on the interpreter, whose dot sums each output element
    alone; and its form over the plain weights (up_stacked: the interleaved gate and up block as one [up_n, 2, up_k]
    box of W13 seen as [L, I, 2, H], no copy of the weights)."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import TileConfig

    P, T, K, E, H, I = 2, 48, 4, 8, 256, 128
    precision = "fp8" if layout.startswith("fp8") else "bf16"
    tile = TileConfig(block_m=32, up_n=32, up_k=32, down_n=64, down_k=32, num_chunks=1, gemm_programs=3,
                      pull_programs=5, pull_rows=4, group_m=2, tma=True)
    tile = {"tails": replace(tile, block_m=64, tail_rows=16),
            "flat": replace(tile, flat_up=True, flat_down=True, ready_flags=False), "fp8": tile.for_fp8(),
            "fused": tile, "fused+tails": replace(tile, block_m=64, tail_rows=16), "fp8 fused": tile.for_fp8(),
            "stacked": tile}[layout]
    stacked = layout.startswith("stacked")
    tiled_tile = (replace(tile, up_stacked=True) if stacked else
                  replace(tile, w_tiled=True, up_fused=layout.startswith("fused") or layout == "fp8 fused"))
    xs, idx, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=23)
    row_major, _, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision=precision, tile=tile, limit=1.0)
    tiled, layers, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision=precision, tile=tiled_tile, limit=1.0)
    dims = 3 if stacked else 5  # the layer's own copy is tiled; up_stacked reads the weights as given
    assert layers[0].w13.dim() == dims and layers[0].w2.dim() == dims
    for r in range(P):
        assert torch.equal(tiled[0][r], row_major[0][r])
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, fp8=precision == "fp8", block_m=16, limit=1.0)
    assert all(rel_l1(tiled[0][r], want[r]) < 1e-3 for r in range(P))


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("operands", ["tma", "tma tiled"])
@pytest.mark.parametrize("pair", ["down", "up"])
def test_fp8_pairs_change_no_bit(operands, pair):
    """fp8_down_pair (the down GEMM's loop steps two 1 x 64 hidden blocks, each promoted by its own scales) and
    fp8_up_pair (the up GEMM's, two 1 x 128 x blocks; on "tma tiled" the fused gate/up MMA) add the same products in
    the same order as one block a step: identical bits, on both TMA operand paths (pointer loads run one block a
    step: for_fp8 turns the pairs off there)."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import TileConfig

    P, T, K, E, H, I = 2, 48, 4, 8, 256, 128
    tile = TileConfig(block_m=32, up_n=32, up_k=32, down_n=64, down_k=32, num_chunks=1, gemm_programs=3,
                      pull_programs=5, pull_rows=4, group_m=2, w_tiled=operands == "tma tiled",
                      fp8_up_fused=operands == "tma tiled")
    pointers = replace(tile, tma=False, w_tiled=False, fp8_down_pair=True, fp8_up_pair=True).for_fp8()
    assert not (pointers.fp8_down_pair or pointers.fp8_up_pair)
    xs, idx, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=29)
    one, _, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision="fp8", tile=tile.for_fp8())
    paired_tile = replace(tile, **{f"fp8_{pair}_pair": True}).for_fp8()
    if pair == "down":
        assert paired_tile.fp8_down_pair and paired_tile.down_k == 64 and I % (2 * paired_tile.down_k) == 0
    else:  # two 128-deep steps of H = 256: the whole K loop is one paired step
        assert paired_tile.fp8_up_pair and paired_tile.up_k == 128 and H == 2 * paired_tile.up_k
        assert paired_tile.up_fused == (operands == "tma tiled")
    two, _, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision="fp8", tile=paired_tile)
    for r in range(P):
        assert torch.equal(two[0][r], one[0][r])
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, fp8=True, block_m=16)
    assert all(rel_l1(two[0][r], want[r]) < 1e-3 for r in range(P))


def test_down_programs_per_sm_and_fp8_down_width():
    """down_per_sm multiplies the down GEMM's programs (and no other launch); fp8_down_n is the fp8 down GEMM's
    column step; both are checked at construction."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import TileConfig, launch_programs

    base = TileConfig(comm_sms=24, shared_sms=24)
    two = replace(base, down_per_sm=2, down_warps=4)
    one_p = launch_programs(132, base, ready=True, overlap=True, has_shared=True)
    two_p = launch_programs(132, two, ready=True, overlap=True, has_shared=True)
    assert two_p["down"] == 2 * one_p["down"] == 264
    assert {k: v for k, v in two_p.items() if k != "down"} == {k: v for k, v in one_p.items() if k != "down"}
    # up_per_sm: each up launch (main, the helper after the pull, the side stream's after the shared expert) twice
    # the programs on the same SMs; the pull, the shared expert and the down GEMM as before
    ups = ("up", "up_helper", "up_side")
    up2 = launch_programs(132, replace(base, up_per_sm=2, up_warps=4), ready=True, overlap=True, has_shared=True)
    assert {k: up2[k] for k in ups} == {k: 2 * one_p[k] for k in ups} == {"up": 168, "up_helper": 48, "up_side": 48}
    assert {k: v for k, v in up2.items() if k not in ups} == {k: v for k, v in one_p.items() if k not in ups}
    with pytest.raises(ValueError, match="up_per_sm"):
        TileConfig(up_per_sm=0)
    assert replace(base, fp8_down_n=64).for_fp8().down_n == 64 and base.for_fp8().down_n == 128
    with pytest.raises(ValueError, match="down_per_sm"):
        TileConfig(down_per_sm=0)
    with pytest.raises(ValueError, match="fp8_down_n"):
        TileConfig(fp8_down_n=96)


def test_fp8_down_halves_is_the_default_where_few_experts_run_a_full_tile():
    """v16: the fp8 down GEMM as 64-row items at 4 warps, two programs an SM, where at most DOWN_HALVES_MAX_FULL of
    the experts have more than BM/2 rows (qwen3_5_397b, kimi_k2_7 at EP=1: 40 and 43 rows an expert), not on glm_5_2
    (64) or the compute-bound point; bf16 tiles keep their down GEMM."""
    from mok_kernels.mok_hopper.tiles import DOWN_HALVES_MAX_FULL, default_tile, full_tile_fraction

    cuda = dict(device=None, n_sm=132)
    for rows, want in ((2048 * 10 / 512, True), (2048 * 8 / 384, True), (2048 * 8 / 256, False), (1024.0, False)):
        assert (full_tile_fraction(rows) <= DOWN_HALVES_MAX_FULL) == want
        f8 = default_tile(precision="fp8", rows_per_expert=rows, **cuda)
        assert (f8.down_halves, f8.down_warps, f8.down_per_sm) == ((True, 4, 2) if want else (False, 8, 1))
        # v17: the up GEMM too (two programs of 4 warps an SM over 64-row items, 4 stages); 16-row pull steps
        assert (f8.up_halves, f8.up_warps, f8.up_per_sm, f8.up_stages) == ((True, 4, 2, 4) if want else
                                                                           (False, 8, 1, 6))
        assert f8.pull_rows == 16 and (f8.block_m // 2) % f8.pull_rows == 0  # (it must divide the ready granule)
        assert f8.fp8 and not f8.flat_down and not f8.tail_rows
        bf = default_tile(precision="bf16", rows_per_expert=rows, **cuda)
        assert not bf.down_halves and bf.down_per_sm == 1 and bf.down_warps == 8
        assert not bf.up_halves and bf.up_per_sm == 1 and bf.up_warps == 8 and bf.pull_rows == 4
    assert full_tile_fraction(0) == 0.0 and full_tile_fraction(20) < 1e-6 and full_tile_fraction(200) > 0.999


def _small_tile(operands: str, **over):
    """A tile for the interpreter's small layers: 32-row tiles with half tiles, TMA descriptors over tiled weights
    (``operands`` "tma tiled") or pointers."""
    from mok_kernels.mok_hopper.tiles import TileConfig

    tiled = operands == "tma tiled"
    return TileConfig(block_m=32, up_n=32, up_k=32, down_n=64, down_k=32, num_chunks=1, gemm_programs=3,
                      pull_programs=5, pull_rows=4, group_m=2, tma=operands != "pointers", w_tiled=tiled,
                      fp8_up_fused=tiled, **over)


def _run_ab_full_and_half(tile_a, tile_b, precision, seed, **kw):
    """The kernels on 2 simulated ranks (experts of 48 rows at BM 32: full and half tiles in the schedule, checked)
    under ``tile_a`` and under ``tile_b`` (``for_fp8`` applied in fp8): (P, outputs a, layers a, outputs b,
    layers b)."""
    P, T, K, E, H, I = 2, 48, 4, 8, 256, 128
    xs, idx, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=seed)
    counts = torch.bincount(torch.cat([i.reshape(-1) for i in idx]), minlength=E)
    assert (counts > tile_a.block_m).any() and (counts % tile_a.block_m <= tile_a.block_m // 2).any()  # full, half
    fp8 = precision == "fp8"
    one, l1, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision=precision,
                             tile=tile_a.for_fp8() if fp8 else tile_a, **kw)
    two, l2, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision=precision,
                             tile=tile_b.for_fp8() if fp8 else tile_b, **kw)
    return P, one, l1, two, l2


def _assert_same_saves(a, b):
    """Two layers' saved H (NaN where never written, see ``run_kernels``) and clamp decisions bitwise equal."""
    assert torch.equal(b.h_save.isnan(), a.h_save.isnan())
    assert torch.equal(b.h_save.nan_to_num(), a.h_save.nan_to_num())
    assert torch.equal(b.clip_save, a.clip_save)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("precision,operands", [("fp8", "tma tiled"), ("fp8", "pointers"), ("bf16", "tma tiled")])
def test_down_halves_change_no_bit(precision, operands):
    """down_halves (every down-GEMM tile as BM/2-row items, a full tile as two) computes each output row over the
    same K steps in the same order: identical bits, with full tiles in the schedule (experts of 48 rows at BM 32),
    at 4 warps and two programs an SM as the GPU variant runs it."""
    from dataclasses import replace

    tile = _small_tile(operands)
    halves = replace(tile, down_halves=True, down_warps=4, down_per_sm=2)
    P, one, _, two, _ = _run_ab_full_and_half(tile, halves, precision, 37)
    for r in range(P):
        assert torch.equal(two[0][r], one[0][r])
    with pytest.raises(ValueError, match="down_halves"):
        replace(tile, down_halves=True, flat_down=True)


@pytest.mark.slow
@needs_triton
def test_fp8_down_at_128_registers_changes_no_bit():
    """gpu_check's "fp8: 128-register down" variant (whole tiles 64 columns wide, two 8-warp programs an SM, the
    down GEMM capped at 128 registers a thread on the GPU; the interpreter has no registers to cap): each output
    column over the same K steps in the same order, so the same bits as the default's 128-wide items."""
    from dataclasses import replace

    from mok_tools.mok_hopper.variants import SWEEP

    over = next(o for label, o, _ in SWEEP if label.startswith("fp8: 128-register down"))
    tile = _small_tile("tma tiled")
    capped = replace(tile, **over)
    P, one, _, two, l2 = _run_ab_full_and_half(tile, capped, "fp8", 43)
    c = l2[0].cfg
    assert (c.down_n, c.down_warps, c.down_per_sm, c.down_maxnreg, c.down_halves) == (64, 8, 2, 128, False)
    for r in range(P):
        assert torch.equal(two[0][r], one[0][r])
    with pytest.raises(ValueError, match="down_maxnreg"):
        replace(tile, down_maxnreg=8)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("precision,operands", [("fp8", "tma tiled"), ("fp8", "pointers"), ("bf16", "tma tiled")])
def test_up_halves_change_no_bit(precision, operands):
    """up_halves (every up-GEMM tile as BM/2-row items, a full tile as two; fp8_up_halves in fp8) computes each
    hidden row over the same K steps in the same order: identical output, saved H and clamp decisions, with full
    and half tiles in the schedule, at 4 warps and two programs per SM of every up launch as the GPU runs it."""
    from dataclasses import replace

    tile = _small_tile(operands)
    fp8 = precision == "fp8"
    halves = replace(tile, fp8_up_halves=True) if fp8 else replace(tile, up_halves=True, up_warps=4, up_per_sm=2)
    P, one, l1, two, l2 = _run_ab_full_and_half(tile, halves, precision, 41, limit=0.5, save_h=True)
    assert l2[0].cfg.up_halves and (l2[0].cfg.up_warps, l2[0].cfg.up_per_sm) == (4, 2)
    assert not l1[0].cfg.up_halves
    for r in range(P):
        assert torch.equal(two[0][r], one[0][r])
        assert not l1[r].h_save.isnan().all()
        _assert_same_saves(l1[r], l2[r])
    with pytest.raises(ValueError, match="up_halves"):
        replace(tile, up_halves=True, tail_rows=16)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("precision,halves", [("bf16", False), ("fp8", False), ("fp8", True)])
def test_save_h_by_tma_stores_changes_no_bit(precision, halves):
    """save_h_tma: the training forward's saved H leaves the up GEMM as TMA block stores ([BM, BN] and [BM/2, BN]
    descriptors) instead of pointer stores: the same output, saved H and clamp decisions, with full and half tiles
    in the schedule (and every tile as 64-row items with fp8_up_halves); rows no tile covers stay untouched."""
    from dataclasses import replace

    tile = _small_tile("tma tiled", fp8_up_halves=halves)
    tma = replace(tile, save_h_tma=True)
    P, one, l1, two, l2 = _run_ab_full_and_half(tile, tma, precision, 43, limit=0.5, save_h=True)
    assert l2[0].cfg.save_h_tma and l2[0].cfg.up_halves == halves
    for r in range(P):
        assert torch.equal(two[0][r], one[0][r])
        nan = l1[r].h_save.isnan()
        assert nan.any() and not nan.all()  # untouched rows stay NaN
        _assert_same_saves(l1[r], l2[r])


@pytest.mark.slow
@needs_triton
def test_fp8_down_two_programs_an_sm_matches_the_twin():
    """The fp8 down GEMM 32 columns an item at 4 warps, twice the programs (down_per_sm; a CPU has 4 "SMs"): the
    forward the twin computes, as with the default launch."""
    from mok_kernels.mok_hopper.tiles import TileConfig

    P, T, K, E, H, I = 2, 48, 4, 8, 256, 128
    tile = TileConfig(block_m=32, up_n=32, up_k=32, down_n=64, down_k=32, num_chunks=1, pull_programs=5,
                      pull_rows=4, group_m=2, fp8_down_n=32, down_warps=4, down_per_sm=2)
    xs, idx, ws, w13, w2, sh = make_layer_inputs(P, T, K, E, H, I, seed=31)
    got, layers, _ = run_kernels(xs, idx, ws, w13, w2, sh, precision="fp8", tile=tile.for_fp8())
    assert layers[0].gemm_programs == 2 * 4 and layers[0].cfg.down_n == 32
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, fp8=True, block_m=16)
    assert all(rel_l1(got[0][r], want[r]) < 1e-3 for r in range(P))


@needs_triton
@pytest.mark.parametrize("tiles", ["half_tiles", "full_tiles", "tails", "packed"])
@pytest.mark.parametrize("mode,P,capacity", [("uniform", 2, None), ("one_rank", 2, None), ("masked", 4, None),
                                             ("empty_expert", 1, None), ("one_rank", 2, 48)])
def test_triton_schedule_equals_the_torch_schedule(mode, P, capacity, tiles):
    """The five-kernel schedule the layer runs writes the same tables as build_schedule (and the Python twin),
    counts the same overflow, and zeroes the ready and work counters."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile
    from mok_kernels.mok_hopper.workspace import Workspace, link_local

    T, K, E, H, I = 40, 3, 8, 128, 64
    xs, idx, ws, w13, w2, _ = make_layer_inputs(P, T, K, E, H, I, seed=5, mode=mode, shared=False)
    half, BM, TL = tiles != "full_tiles", 64 if tiles == "tails" else 16, 16 if tiles == "tails" else 0
    packed = tiles == "packed"
    tile = replace(default_tile(device=torch.device("cpu"), hidden=H, ffn=I), block_m=BM, half_tiles=half,
                   tail_rows=TL, num_chunks=3, pull_rows=4, packed_rows=packed)
    wss = link_local([Workspace(rank=r, world=P, device=torch.device("cpu"), tokens=T, hidden=H, topk=K,
                                fp8=False, symmetric=False) for r in range(P)])
    layers = [MoKHopperLayer(w13[r], w2[r], topk=K, tokens=T, rank=r, world=P, workspace=wss[r], tile=tile,
                             capacity=capacity) for r in range(P)]
    for r in range(P):
        layers[r].stage(xs[r], idx[r], ws[r])
    idx_PS = torch.stack([i.reshape(-1) for i in idx]).to(torch.int32)
    for r, layer in enumerate(layers):
        layer.ready.fill_(7)
        layer.work.fill_(7)
        got = layer.schedule()
        want = build_schedule(idx_PS, rank=r, local_experts=E // P, block_m=BM, capacity=layer.R, num_chunks=3,
                              half_tiles=half, tail_rows=TL, packed=packed)
        for f in ("row_code_R1", "tile_expert_M", "tile_row_M1", "chunk_tiles_C1", "counts_L", "num_tiles",
                  "overflow_rows"):
            assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
        assert torch.equal(layer.idx_all, idx_PS)
        assert not layer.ready.any() and not layer.work.any()
        assert layer.overflow_rows() == int(want.overflow_rows)
    if capacity is not None:
        assert layers[0].overflow_rows() > 0  # rank 0 gets every row and has room for 48 (BM 16) or 64 (BM 64)


@needs_triton
@pytest.mark.parametrize("half", [False, True], ids=["full_tiles", "half_tiles"])
def test_triton_schedule_packs_rows_as_the_torch_schedule(half):
    """The Triton schedule with packed rows on experts of 0, 1, BM/2, BM/2 + 1, BM - 1, BM, BM + 1 and 2 BM + 3 rows
    (BM 8), with room for all and (overflow) for 24 rows fewer than that rounded up to BM: the torch schedule's
    tables, which test_mok_hopper_schedule checks against the Python twin and the packed layout."""
    from test_mok_hopper_schedule import BM_PACKED, PACKED_COUNTS, check_packed, packed_routing

    from mok_kernels.mok_hopper.ops.schedule_kernels import DeviceScheduler
    from mok_kernels.mok_hopper.schedule import empty_schedule

    L, BM, C = len(PACKED_COUNTS), BM_PACKED, 3
    for seed, short in ((0, 0), (1, 0), (2, 24)):
        counts = [PACKED_COUNTS[(e + 3 * seed) % L] for e in range(L)]
        idx_PS = packed_routing(counts, seed, ranks=2).to(torch.int32)
        P, TK = idx_PS.shape
        R = -(-sum(counts) // BM) * BM - short
        for r in range(P):
            sch = DeviceScheduler(world=P, tokens=TK, topk=1, local_experts=L, block_m=BM, capacity=R,
                                  half_tiles=half, num_chunks=C, device=torch.device("cpu"), packed=True)
            got = empty_schedule(capacity=R, block_m=BM, local_experts=L, num_chunks=C, device=torch.device("cpu"),
                                 half_tiles=half, packed=True)
            got.row_code_R1.fill_(5)
            got.tile_row_M1.fill_(5)
            idx_all = torch.zeros_like(idx_PS)
            delta = torch.arange(P, dtype=torch.int64) * TK  # rank p's ids at element p * TK of one flat buffer
            sch(idx_PS.reshape(-1).contiguous(), delta, idx_all, rank=r, out=got,
                overflow_total=torch.zeros(1, dtype=torch.int32))
            want = build_schedule(idx_PS, rank=r, local_experts=L, block_m=BM, capacity=R, num_chunks=C,
                                  half_tiles=half, packed=True)
            for f in ("row_code_R1", "tile_expert_M", "tile_row_M1", "chunk_tiles_C1", "counts_L", "num_tiles",
                      "overflow_rows"):
                assert getattr(got, f).tolist() == getattr(want, f).tolist(), (f, seed, r)
            if r == 0:
                check_packed(got, idx_PS, rank=0, L=L, BM=BM, R=R, half=half)
                assert int(got.overflow_rows) == (sum(counts) - R if short else 0)


@needs_triton
def test_kernels_detect_overflow():
    xs, idx, ws, w13, w2, sh = make_layer_inputs(2, 16, 2, 8, 128, 64, seed=2, mode="one_rank", shared=False)
    runs, layers, _ = run_kernels(xs, idx, ws, w13, w2, sh, capacity=32)
    assert layers[0].overflow_rows() > 0 and layers[1].overflow_rows() == 0
    with pytest.raises(RuntimeError, match="did not fit"):
        layers[0].check_no_overflow()


@needs_triton
def test_functional_form_on_one_rank():
    from mok_kernels.mok_hopper.api import clear_layer_cache, mok_hopper_forward
    from mok_kernels.mok_hopper.workspace import clear_workspace_cache

    xs, idx, ws, w13, w2, sh = make_layer_inputs(1, 16, 2, 4, 128, 64, seed=3)
    out = mok_hopper_forward(xs[0], idx[0], ws[0], w13[0], w2[0], shared=sh, swiglu_limit=1.0)
    want = twin.simulate(xs, idx, ws, w13, w2, shared=sh, limit=1.0)[0]
    assert rel_l1(out, want) < 1e-3
    assert torch.equal(out, mok_hopper_forward(xs[0], idx[0], ws[0], w13[0], w2[0], shared=sh, swiglu_limit=1.0))
    clear_layer_cache()
    clear_workspace_cache()


@needs_triton
def test_quantize_rows_kernel_matches_torch():
    from mok_kernels.mok_hopper.ops.pull import quantize_rows

    x = (torch.randn(8, 256) * torch.logspace(-2, 2, 8)[:, None]).bfloat16()
    q = torch.empty(8, 256, dtype=torch.float8_e4m3fn)
    s = torch.empty(8, 2)
    quantize_rows(x, q, s)
    wq, ws_ = quantize_blocks(x, 1, 128)
    assert torch.equal(s, ws_) and torch.equal(q.view(torch.uint8), wq.view(torch.uint8))


@pytest.fixture(scope="module")
def aot_sweep():
    """One run of ``aot_check --arch 90 --sweep``: every kernel variant, then the GEMMs of gpu_check's sweep tiles.
    The two tests below read its output (the sweep run compiles every variant the plain run does, and then some; on
    a fresh machine each compile takes about a second of ptxas)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "mok_tools.mok_hopper.aot_check", "--arch", "90", "--sweep"],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent,
                          timeout=1800)


@pytest.mark.slow
@needs_triton
@pytest.mark.skipif(not has_nvidia_backend(), reason="Triton has no NVIDIA backend (ptxas) here")
def test_every_kernel_variant_compiles_for_hopper_without_spills(aot_sweep):
    """Ahead-of-time compilation for sm_90 (Triton's own ptxas, no GPU): catches lowering errors, shared memory
    over the limit and register spills, which the interpreter cannot see."""
    p = aot_sweep
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "up fp8" in p.stdout and "down bf16" in p.stdout and "Triton " in p.stdout
    assert "up bf16 tails 32 tma" in p.stdout and "down bf16 x w tails 32 tma" in p.stdout
    assert "up fp8 tma row-major" in p.stdout and "down bf16 x w tma row-major" in p.stdout  # (w_tiled off)
    assert "up bf16 fused tma" in p.stdout and "up bf16 fused tails 32 tma" in p.stdout  # (up_fused)
    assert "up fp8 tma" in p.stdout and "up fp8 unfused tma" in p.stdout  # (fp8_up_fused: the default, and v13's)
    assert "down fp8 x w single tma" in p.stdout  # (fp8_down_pair off: v14's)
    assert "up fp8 pair tma" in p.stdout and "up fp8 unfused pair tma" in p.stdout  # (fp8_up_pair)
    assert "down bf16 x w 256 tails 32 tma" in p.stdout  # (glm_5_2's v11 down GEMM)
    assert "up bf16 clamp save H fused tails 32 tma" in p.stdout and "up bf16 save H" in p.stdout  # (save_h)
    assert "bwd dgate clamp" in p.stdout and "bwd wgrad P resident" in p.stdout  # the backward's GEMMs
    assert "bwd dx push tiled gate/up" in p.stdout and "bwd wgrad tiled gate/up" in p.stdout  # (tiled parameters)
    assert "bwd wgrad P resident pointers" in p.stdout  # (v10's dW13)
    assert "[plain kimi_k2_7]" in p.stdout  # the default tiles over plain weights (mok_hopper.weights=plain)


@needs_triton
def test_aot_check_builds_each_default_tile_over_plain_weights():
    """mok_hopper.weights=plain runs each point's default tile with w_tiled and up_fused off: every routed TMA GEMM
    of those tiles is among aot_check's variants, and the ones it adds read row-major weights."""
    from dataclasses import replace

    from mok_tools.mok_hopper import aot_check
    from mok_kernels.mok_hopper.tiles import default_tile, plain_weights

    def key(v):
        return v.kernel, tuple(sorted(v.constexprs.items())), v.num_warps, v.maxnreg

    added = aot_check.plain_weight_variants()
    assert added and all(not v.constexprs["WT"] for v in added)
    have = {key(v) for v in aot_check.variants() + added}
    for hidden, ffn, rows in aot_check.PLAIN_POINTS.values():
        tile = plain_weights(default_tile(hidden=hidden, ffn=ffn, rows_per_expert=rows))
        assert not tile.w_tiled and not tile.up_fused and tile.tma
        for v in aot_check.variants(tile, hidden, ffn, extras=False, save_h=True):
            if v.label.startswith(("up ", "down ")) and v.label.endswith(" tma"):
                assert key(v) in have, v.label
                assert not v.constexprs["WT"]
        tiled = default_tile(hidden=hidden, ffn=ffn, rows_per_expert=rows)
        assert replace(tile, w_tiled=True, up_fused=tiled.up_fused) == tiled  # nothing else changed


@needs_triton
def test_aot_check_compiles_each_kernel_as_launched():
    """aot_check's specialisation: pointers and sizes divisible by 16, as the launch sees them, except the i32s a
    variant names plain (the pull's and the epilogue's K is the top-k). The backward's K is a hidden size: compiled
    without its divisibility, its loads and stores were not those that run (session 28)."""
    from mok_tools.mok_hopper import aot_check

    by_label = {v.label: v for v in aot_check.variants()}
    for label, k_divisible in (("bwd wgrad P resident", True), ("bwd wgrad P resident pointers", True),
                               ("bwd dgate", True), ("epilogue", False), ("pull bf16", False)):
        v = by_label[label]
        fn = aot_check.kernel(v.kernel)
        sig, attrs, _ = aot_check.specialisation(v, fn)
        k = fn.arg_names.index("K")
        assert sig["K"] == "i32"
        assert ((k,) in attrs) == k_divisible, label
        assert all((i,) in attrs for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")), label


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(not has_nvidia_backend(), reason="Triton has no NVIDIA backend (ptxas) here")
def test_every_sweep_variant_compiles_for_hopper_without_spills(aot_sweep):
    """gpu_check's sweep tiles too: a variant that cannot compile would only fail on a rented GPU."""
    p = aot_sweep
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "[down BK 128 x 3 st]" in p.stdout and "[tails of 16 rows (]" in p.stdout


def test_the_triton_range_has_one_source():
    """pyproject's Triton dependency is the range the kernels are checked on, and the backend refuses others."""
    import tomllib
    from pathlib import Path

    from mok_kernels.mok_hopper import TRITON_SPEC, triton_unsupported

    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    (dep,) = [d for d in meta["dependencies"] if d.startswith("triton")]
    assert dep.split(";")[0].strip() == f"triton{TRITON_SPEC}"
    for ok in ("3.6.0", "3.7.1", "3.8.0", "3.8.0+git1234"):
        assert triton_unsupported(ok) is None
    for bad in ("3.5.1", "3.9.0", "4.0.0"):
        assert f"pip install 'triton{TRITON_SPEC}'" in triton_unsupported(bad)


def test_a_sweep_variant_is_timed_against_the_default_interleaved(monkeypatch):
    """gpu_check's A/B: rounds alternate which side goes first, and the ratio is taken per round, so a clock drift
    shared by both sides of a round cancels."""
    from mok_tools.mok_hopper import gpu_check as gc

    from harness.measure.timing import Stats

    calls = []
    drift = iter([1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # the board slows down round by round
    clock = iter([1980, 1900, 1500, 1400, 1450, 1350])  # and its SM clock falls (the power limit)

    def fake_forward_stats(ctx, fn, iters, warmup):
        calls.append(fn())
        ms = next(drift) * (1.1 if calls[-1] == "var" else 1.0)
        return Stats(ms, ms, ms, ms, ms, warmup, iters, clocks={"sm_clock_mhz": float(next(clock))})

    monkeypatch.setattr(gc, "forward_stats", fake_forward_stats)
    ab = gc.ab_times(None, lambda: "base", lambda: "var", rounds=3, iters=4, warmup=1)
    assert calls == ["base", "var", "var", "base", "base", "var"]
    assert ab["ratio"] == ab["ratio_min"] == ab["ratio_max"] == pytest.approx(1.1)  # the drift is gone
    assert ab["base_forward_ms"] == 2.0 and ab["forward_ms"] == pytest.approx(2.2)
    # each side's median SM clock over the rounds: base 1980, 1400, 1450; variant 1900, 1500, 1350
    assert ab["base_sm_clock_mhz"] == 1450 and ab["sm_clock_mhz"] == 1500


def test_gpu_check_refuses_what_cannot_run_in_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    """Shapes come from configs/shape and are checked as the harness checks them, before any process group."""
    from mok_tools.mok_hopper import gpu_check as gc

    monkeypatch.setenv("WORLD_SIZE", "3")
    for args, said in ((["--shapes", "nope"], "unknown shape 'nope'"), (["--shapes", "glm_5_2"], "glm_5_2@<N>epg"),
                       (["--precisions", "mxfp8"], "mok_hopper runs bf16, fp8")):
        assert gc.main(["--out", str(tmp_path / "out"), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
    assert gc.main(["--out", str(tmp_path / "out"), "--tile", "tma=yes"]) == 2  # a switch is 0 / 1
    assert "tma='yes' is not an integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert gc.unrunnable(["glm_5_2@4epg", "kimi_k2_7"], gc.argparse.Namespace(
        precisions=["bf16", "fp8"], smoke=False, tokens=2048)) is None  # 4 per GPU; 384 experts split over 3


@pytest.mark.slow
@needs_triton
def test_gpu_check_smoke_runs_a_sweep_variant_on_the_cpu(tmp_path):
    """gpu_check end to end under the interpreter (one rank, tiny shape): checks, stage timing and one sweep
    variant with its interleaved ratio to the default. Measures nothing; guards the script the GPU runs use."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m",
                        "mok_tools.mok_hopper.gpu_check", "--smoke", "--out", str(tmp_path), "--precisions", "bf16",
                        "--no-edge", "--variants", "down 256", "--ab-rounds", "2"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "mok_hopper_gpu_check.csv") as f:
        rows = list(csv.DictReader(f))
    sweep = [r for r in rows if r["section"] == "sweep"]
    assert [r["variant"] for r in sweep] == ["down 256 wide x 4 stages, not flat"] and sweep[0]["ok"] == "True"
    r = sweep[0]
    assert r["ab_rounds"] == "2" and float(r["ratio_min"]) <= float(r["ratio"]) <= float(r["ratio_max"])
    assert float(r["forward_ms"]) > 0 and float(r["base_forward_ms"]) > 0
    assert any(r["section"] == "check" and r["status"] == "ok" for r in rows)
