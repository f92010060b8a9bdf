"""mok_hopper's device schedule (``mok_kernels/mok_hopper/schedule.py``) on the CPU: against its Python twin, its
capacity, its tile choices, and no host sync.

Legend: P ranks, T tokens per rank, K top-k, E experts, L = E / P local experts, H hidden, I ffn.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton

from mok_hopper_layers import routing  # noqa: E402
from mok_kernels.mok_hopper.schedule import build_schedule, capacity_rows, padded_rows, reference_schedule  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# schedule


@pytest.mark.parametrize("half", [False, True], ids=["full_tiles", "half_tiles"])
@pytest.mark.parametrize("P,T,K,E,BM,mode", [
    (1, 16, 2, 8, 4, "uniform"),
    (2, 16, 2, 8, 4, "uniform"),
    (4, 8, 3, 16, 8, "uniform"),
    (2, 16, 1, 8, 4, "uniform"),  # top-1
    (2, 16, 2, 8, 4, "empty_expert"),  # an expert with no rows gets no tile
    (2, 16, 2, 8, 4, "one_expert"),  # one expert gets P*T rows: several tiles
    (2, 16, 2, 8, 4, "one_rank"),  # rank 1 gets nothing at all
    (2, 16, 3, 8, 4, "masked"),  # ids < 0 are skipped
])
def test_schedule_matches_its_python_twin(P, T, K, E, BM, mode, half):
    idx_PS = torch.stack([i.reshape(-1) for i in routing(P, T, K, E, seed=P * 10 + K, mode=mode)])
    L = E // P
    for r in range(P):
        R = capacity_rows(ep=P, tokens=T, topk=K, local_experts=L, block_m=BM)
        s = build_schedule(idx_PS.to(torch.int32), rank=r, local_experts=L, block_m=BM, capacity=R, num_chunks=3,
                           half_tiles=half)
        codes, tiles, overflow, starts = reference_schedule(idx_PS, rank=r, local_experts=L, block_m=BM,
                                                            capacity=R, half_tiles=half)
        assert s.row_code_R.tolist() == codes
        assert s.tile_expert_M.tolist() == tiles
        assert s.tile_row_M1.tolist() == starts
        assert int(s.overflow_rows) == overflow == 0
        n_tiles = sum(1 for e in tiles if e < L)
        assert int(s.num_tiles) == n_tiles
        ch = s.chunk_tiles_C1.tolist()
        assert ch[0] == 0 and ch[-1] == n_tiles and ch == sorted(ch)  # chunks cover the tiles, in order
        mine = ((idx_PS >= r * L) & (idx_PS < (r + 1) * L)).sum()
        assert int(s.counts_L.sum()) == int(mine) == sum(1 for c in codes if c >= 0)
        sizes = [b - a for a, b in zip(starts[:n_tiles], starts[1 : n_tiles + 1])]
        assert set(sizes) <= ({BM, BM // 2} if half else {BM})
        # every expert's rows lie inside its own tiles, and a tile is at most as big as it needs to be
        for m in range(n_tiles):
            owners = {idx_PS.reshape(-1)[c].item() - r * L for c in codes[starts[m]: starts[m + 1]] if c >= 0}
            assert owners == {tiles[m]}
            if half and sizes[m] == BM:
                assert sum(1 for c in codes[starts[m]: starts[m + 1]] if c >= 0) > BM // 2


def test_half_tiles_cut_the_padding_of_experts_just_over_a_tile():
    # expert 0: 5 rows, expert 1: 2 rows, BM 4 -> full tiles: 4 + 4 | 4 = 12 rows; half tiles: 4 + 2 | 2 = 8 rows
    idx_PS = torch.tensor([[0, 0, 0, 0, 0, 1, 1]])
    full = build_schedule(idx_PS, rank=0, local_experts=2, block_m=4, capacity=16)
    half = build_schedule(idx_PS, rank=0, local_experts=2, block_m=4, capacity=16, half_tiles=True)
    assert full.tile_row_M1[:4].tolist() == [0, 4, 8, 12] and full.tile_expert_M[:3].tolist() == [0, 0, 1]
    assert half.tile_row_M1[:4].tolist() == [0, 4, 6, 8] and half.tile_expert_M[:4].tolist() == [0, 0, 1, 2]
    assert half.row_code_R.tolist()[:8] == [0, 1, 2, 3, 4, -1, 5, 6]


def test_tails_cut_the_padding_of_experts_just_over_a_half_or_a_full_tile():
    # BM 8, tails of 2: expert 0 has 9 rows (a full tile takes the rest: 8 + 2), expert 1 has 5 (a half tile + a
    # tail: 4 + 2), expert 2 has 3 (a half tile), expert 3 has 7 (a full tile)
    idx_PS = torch.tensor([[0] * 9 + [1] * 5 + [2] * 3 + [3] * 7])
    tiles, rows = padded_rows(torch.tensor([9, 5, 3, 7, 0, 16, 17, 19]), 8, True, 2)
    assert tiles.tolist() == [1, 1, 1, 1, 0, 2, 2, 3] and rows.tolist() == [10, 6, 4, 8, 0, 16, 18, 20]
    s = build_schedule(idx_PS, rank=0, local_experts=4, block_m=8, capacity=64, half_tiles=True, tail_rows=2)
    assert s.tile_row_M1[:5].tolist() == [0, 10, 16, 20, 28] and s.tile_expert_M[:5].tolist() == [0, 1, 2, 3, 4]
    assert s.row_code_R.tolist()[:10] == list(range(9)) + [-1]
    for bad in (dict(half_tiles=False, tail_rows=2), dict(half_tiles=True, tail_rows=3),
                dict(half_tiles=True, tail_rows=4)):
        with pytest.raises(AssertionError, match="tail_rows needs half tiles"):
            build_schedule(idx_PS, rank=0, local_experts=4, block_m=8, capacity=64, **bad)


@pytest.mark.parametrize("mode", ["uniform", "one_expert", "masked", "empty_expert"])
def test_schedule_with_tails_matches_its_python_twin(mode):
    P, T, K, E, BM, TL = 2, 24, 3, 8, 8, 2
    idx_PS = torch.stack([i.reshape(-1) for i in routing(P, T, K, E, seed=4, mode=mode)])
    L = E // P
    for r in range(P):
        R = capacity_rows(ep=P, tokens=T, topk=K, local_experts=L, block_m=BM)
        s = build_schedule(idx_PS.to(torch.int32), rank=r, local_experts=L, block_m=BM, capacity=R, num_chunks=2,
                           half_tiles=True, tail_rows=TL)
        codes, tiles, overflow, starts = reference_schedule(idx_PS, rank=r, local_experts=L, block_m=BM,
                                                            capacity=R, half_tiles=True, tail_rows=TL)
        assert (s.row_code_R.tolist(), s.tile_expert_M.tolist(), s.tile_row_M1.tolist()) == (codes, tiles, starts)
        assert int(s.overflow_rows) == overflow == 0
        n = int(s.num_tiles)
        sizes = [b - a for a, b in zip(starts[:n], starts[1:n + 1])]
        assert set(sizes) <= {BM // 2, BM // 2 + TL, BM, BM + TL}
        for m in range(n):  # a tile never has more padding than the next smaller tile kind would need rows
            used = sum(1 for c in codes[starts[m]: starts[m + 1]] if c >= 0)
            smaller = max([k for k in (0, BM // 2, BM // 2 + TL, BM) if k < sizes[m]])
            assert used > smaller or (sizes[m] == BM // 2 and used > 0)


def test_schedule_counts_overflow_instead_of_dropping_silently():
    P, T, K, E, BM = 2, 16, 2, 4, 4
    idx_PS = torch.stack([i.reshape(-1) for i in routing(P, T, K, E, seed=3)])
    R = 16  # far too small: 32 routed rows per rank
    for half in (False, True):
        s = build_schedule(idx_PS, rank=0, local_experts=2, block_m=BM, capacity=R, half_tiles=half)
        codes, tiles, overflow, starts = reference_schedule(idx_PS, rank=0, local_experts=2, block_m=BM,
                                                            capacity=R, half_tiles=half)
        assert overflow > 0 and int(s.overflow_rows) == overflow
        assert s.row_code_R.tolist() == codes and s.tile_expert_M.tolist() == tiles  # what fits is a prefix
        assert s.tile_row_M1.tolist() == starts and starts[int(s.num_tiles)] == R


def test_every_sweep_variant_is_a_valid_tile_on_every_published_shape():
    """gpu_check applies each sweep variant's overrides to the shape's default tile: none may be refused there
    (glm_5_2's default has tails, which flattened loops refuse)."""
    from dataclasses import replace

    from mok_tools.shapes import published_shapes, shape_config
    from mok_kernels.mok_hopper.tiles import default_tile
    from mok_tools.mok_hopper.variants import SWEEP, SWEEP_FP8, runs_at

    assert set(SWEEP_FP8) <= {label for label, _, _ in SWEEP}
    assert not any(label.startswith("fp8:") for label in SWEEP_FP8)  # (those run in fp8 by their label alone)
    assert runs_at("fp8: 128-register down 64 wide, 8 warps, two programs an SM", "fp8")  # (session 28's, lost)
    assert not runs_at("fp8: 128-register down 64 wide, 8 warps, two programs an SM", "bf16")
    assert runs_at("default again (A/A control)", "fp8") and runs_at("default again (A/A control)", "bf16")
    assert not runs_at("v3 layout (full tiles, events, 3/4 stages, torch schedule)", "fp8")
    shapes = [shape_config(n) for n in published_shapes()]
    assert len(shapes) == 4
    for E, H, I, K in ((s["num_experts"], s["hidden"], s["ffn"], s["topk"]) for s in shapes):
        base = default_tile(hidden=H, ffn=I, rows_per_expert=2 * 2048 * K / E)
        for label, over, _ in SWEEP:
            tile = replace(base, **over)
            if runs_at(label, "fp8"):
                tile.for_fp8()


def test_fp8_tile_is_applied_once():
    from mok_kernels.mok_hopper.tiles import TileConfig

    f8 = TileConfig().for_fp8()
    assert f8.fp8 and f8.for_fp8() == f8 and (f8.up_k, f8.up_n) == (128, 64)
    assert f8.up_stages == TileConfig().up_stages + 2


def test_default_tile_flattens_the_down_loop_only_where_half_tiles_are_rare():
    from mok_kernels.mok_hopper.tiles import default_tile, half_tile_waste

    assert half_tile_waste(64) == pytest.approx(0.5, abs=0.05)  # half the experts end in a half tile of 64 rows
    assert half_tile_waste(96) < 0.01 and half_tile_waste(128) == pytest.approx(0.25, abs=0.03)
    rows = {"kimi_k2_7": 2 * 2048 * 8 / 384, "glm_5_2": 2 * 2048 * 8 / 256, "qwen3_5_397b": 2 * 2048 * 10 / 512,
            "deepseek_v4_pro": 2 * 2048 * 6 / 384, "qwen3_5_397b@8epg": 2 * 2048 * 10 / 16}
    flat = {name: default_tile(rows_per_expert=m).flat_down for name, m in rows.items()}
    assert flat == {"kimi_k2_7": True, "glm_5_2": False, "qwen3_5_397b": True, "deepseek_v4_pro": False,
                    "qwen3_5_397b@8epg": True}
    t = default_tile(rows_per_expert=rows["qwen3_5_397b"])
    assert (t.down_n, t.down_stages) == (256, 4) and default_tile().flat_down is False
    f8 = default_tile(precision="fp8", rows_per_expert=rows["qwen3_5_397b"])
    # fp8: measured slower flattened; two 1 x 64 hidden blocks a step, 4 stages of them (v15)
    assert not f8.flat_down and (f8.down_n, f8.down_stages, f8.fp8_down_pair) == (128, 4, True)
    assert not default_tile(precision="fp8", ffn=192).fp8_down_pair  # (ffn not a multiple of two 1 x 64 blocks)


def test_default_tile_gives_tails_where_experts_often_end_in_a_full_and_a_half_tile():
    from mok_kernels.mok_hopper.tiles import default_tile, paired_fraction

    # 128 +- 11 rows: about half the experts have 129-192 rows (a full tile, then a half tile); 64 or 85: none
    assert paired_fraction(128) == pytest.approx(0.48, abs=0.03) and paired_fraction(85) < 0.001
    assert paired_fraction(64) == 0
    rows = {"kimi_k2_7": 2048 * 8 / 192, "glm_5_2": 2048 * 8 / 128, "qwen3_5_397b": 2048 * 10 / 256,
            "deepseek_v4_pro": 2048 * 6 / 192, "glm_5_2@4epg": 2048 * 8 / 4}
    tails = {name: default_tile(rows_per_expert=m).tail_rows for name, m in rows.items()}
    # (at 4 experts per GPU the flattened down loop wins: a tail is 1 item in 32)
    assert tails == {"kimi_k2_7": 0, "glm_5_2": 32, "qwen3_5_397b": 0, "deepseek_v4_pro": 0, "glm_5_2@4epg": 0}
    assert not default_tile(precision="fp8", rows_per_expert=128).tail_rows  # bf16 only
    assert not default_tile(device=torch.device("cpu"), rows_per_expert=128).tail_rows  # (the CPU's 32-row tiles)


def test_default_tile_runs_the_shared_expert_beside_the_up_gemm_on_cuda_only():
    from mok_kernels.mok_hopper.tiles import SHARED_SMS, default_tile, launch_programs

    assert SHARED_SMS == 24  # measured best of 16/24/32/40 on 2xH200 (lab/perf-notes.md, v8)
    for precision in ("bf16", "fp8"):
        t = default_tile(precision=precision)
        assert t.shared_sms == SHARED_SMS and not t.shared_last
        assert launch_programs(132, t, ready=True, overlap=True, has_shared=True)["side"] == SHARED_SMS
    assert default_tile(device=torch.device("cpu"), hidden=256, ffn=128).shared_sms == 0  # no streams there
    assert default_tile(comm_sms=24, n_sm=132).shared_sms == SHARED_SMS  # 84 SMs left to the up GEMM
    wide = default_tile(comm_sms=100, n_sm=132)  # 8 would be left: the shared expert goes before the up GEMM
    assert wide.shared_sms == 0 and launch_programs(132, wide, ready=True, overlap=True, has_shared=True)["up"] == 32


def test_retired_tile_flags_are_gone():
    """v7's paired tiles (replaced by tails in v9; the paired up GEMM spilled registers under Triton 3.8) and
    session 9's early down GEMM (no gain) were retired: a sweep that still names them fails loudly."""
    from dataclasses import fields, replace

    from mok_kernels.mok_hopper.tiles import TileConfig
    from mok_tools.mok_hopper.variants import SWEEP

    names = {f.name for f in fields(TileConfig)}
    retired = {"pair_up", "pair_down", "up_pair_stages", "down_pair_stages", "early_down"}
    assert not names & retired
    assert not any(set(over) & retired for _, over, _ in SWEEP)
    with pytest.raises(TypeError):
        replace(TileConfig(), pair_up=True)


def test_launch_programs_split_the_sms():
    """Programs per launch on 132 SMs: the default split (the pull's comm_sms beside the up GEMM, then a helper on
    them), and shared_sms, which moves the shared expert onto SMs of its own beside the up GEMM."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import launch_programs
    from mok_kernels.mok_hopper.tiles import TileConfig

    base = TileConfig()
    kw = dict(ready=True, overlap=True, has_shared=True)
    assert launch_programs(132, base, **kw) == {"pull": 24, "shared": 108, "up": 108, "up_helper": 24, "side": 0,
                                                "up_side": 0, "down": 132}
    side = launch_programs(132, replace(base, shared_sms=16), **kw)
    assert side == {"pull": 24, "shared": 16, "up": 92, "up_helper": 24, "side": 16, "up_side": 16, "down": 132}
    assert side["up"] + side["side"] + side["pull"] == 132  # spinning up programs never fill every SM
    # nothing to move (no shared expert, no streams on the CPU, no work counter, chunks): the default split
    for over, args in ((dict(), dict(has_shared=False)), (dict(), dict(overlap=False)),
                       (dict(ready_flags=False), dict(ready=False)), (dict(num_chunks=2), dict())):
        t = replace(base, shared_sms=16, **over)
        assert launch_programs(132, t, **{**kw, **args}) == launch_programs(132, replace(t, shared_sms=0),
                                                                             **{**kw, **args})
        assert launch_programs(132, t, **{**kw, **args})["side"] == 0
    with pytest.raises(ValueError, match="leaves no SM to the up GEMM"):
        launch_programs(132, replace(base, shared_sms=108), **kw)
    with pytest.raises(ValueError, match="cannot be combined with shared_last"):
        replace(base, shared_sms=16, shared_last=True)
    with pytest.raises(ValueError, match="ready_flags need 1 <= comm_sms"):
        launch_programs(132, replace(base, comm_sms=0), **kw)


def test_flat_up_refuses_ready_flags():
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.tiles import TileConfig

    w13, w2 = torch.zeros(2, 64, 32, dtype=torch.bfloat16), torch.zeros(2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="flat_up needs ready_flags=False"):
        MoKHopperLayer(w13, w2, topk=1, tokens=4, tile=replace(TileConfig(), flat_up=True), rank=0, world=1)


def test_capacity_is_the_worst_case_up_to_ep2_and_moks_rule_beyond():
    kw = dict(tokens=2048, topk=8, block_m=128)
    assert capacity_rows(ep=1, local_experts=384, **kw) >= 2048 * 8 + 384 * 127
    assert capacity_rows(ep=2, local_experts=192, **kw) >= 2 * 2048 * 8 + 192 * 127
    assert capacity_rows(ep=8, local_experts=48, **kw) == -(-(2048 * 8 * 4 + 48 * 127) // 128) * 128
    assert capacity_rows(ep=8, local_experts=48, capacity_multiplier=None, **kw) >= 8 * 2048 * 8
    for ep in (1, 2, 8):
        assert capacity_rows(ep=ep, local_experts=4, **kw) % 128 == 0


@pytest.mark.parametrize("tail", [0, 2], ids=["half-tiles", "half-tiles+tails"])
def test_capacity_with_half_tiles_holds_every_routing_and_no_less_would(tail):
    """capacity_rows(half_tiles=True) pads each expert with rows by BM/2 - 1 at most: every routing of EP <= 2 fits
    (padded_rows summed, and build_schedule reports no overflow), and without tails the routing that pads each expert
    by BM/2 - 1 fills it to within one tile, so no smaller static bound is safe there (tails pad an expert that has
    a full tile by at most BM/2 - TL - 1: a bound TL rows an expert tighter would hold, not taken)."""
    BM, L = 16, 6
    kw = dict(tokens=16, topk=3, local_experts=L, block_m=BM, half_tiles=True)
    g = torch.Generator().manual_seed(4)
    for ep in (1, 2):
        R = capacity_rows(ep=ep, **kw)
        assert R < capacity_rows(ep=ep, **{**kw, "half_tiles": False})
        n = ep * 16 * 3  # every slot of every rank routed to this rank's experts
        worst = torch.full((L,), 1)  # each expert 1 row (pad BM/2 - 1) or BM/2 + 1 (pad BM/2 - 1), the rest in full
        worst[: (n - L) // BM] += BM  # tiles
        worst[0] += n - int(worst.sum())
        routings = [worst] + [torch.bincount(torch.randint(0, L, (n,), generator=g), minlength=L) for _ in range(50)]
        for counts in routings:
            assert int(counts.sum()) == n
            _, rows = padded_rows(counts, BM, True, tail)
            assert int(rows.sum()) <= R
            idx = torch.repeat_interleave(torch.arange(L), counts)[torch.randperm(n, generator=g)].reshape(ep, -1)
            sch = build_schedule(idx, rank=0, local_experts=L, block_m=BM, capacity=R, half_tiles=True,
                                 tail_rows=tail)
            assert int(sch.overflow_rows) == 0
        if not tail:
            _, rows = padded_rows(worst, BM, True, tail)
            assert R - int(rows.sum()) < BM  # the bound is reached (up to the rounding to BM)


def test_schedule_never_syncs_with_the_host(monkeypatch):
    """Only static-shape device ops: no .item(), .tolist(), .cpu(), nonzero or bincount (all sync on CUDA)."""
    idx_PS = torch.stack([i.reshape(-1) for i in routing(2, 16, 2, 8, seed=1)])

    def boom(*a, **k):
        raise AssertionError("host sync in the schedule")

    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    monkeypatch.setattr(torch, "bincount", boom)
    monkeypatch.setattr(torch, "repeat_interleave", boom)
    build_schedule(idx_PS, rank=1, local_experts=4, block_m=4, capacity=64, num_chunks=2)
    build_schedule(idx_PS, rank=1, local_experts=4, block_m=4, capacity=64, num_chunks=2, half_tiles=True)



# ---------------------------------------------------------------------------------------------------------------
# packed rows (TileConfig.packed_rows): no tile padding

BM_PACKED = 8
# rows per local expert: empty, 1 row, BM/2, BM/2 + 1, BM - 1, exactly BM, BM + 1, 2 BM + 3
PACKED_COUNTS = [0, 1, 4, 5, 7, 8, 9, 19]


def packed_routing(counts: list[int], seed: int, ranks: int = 1) -> torch.Tensor:
    """idx_PS [P, S] giving rank 0's expert e ``counts[e]`` rows, slots shuffled (other ranks' experts take the rest
    of the slots when ``ranks`` > 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    if ranks > 1:
        ids = torch.cat([ids, len(counts) + torch.randint(0, len(counts), ((ranks - 1) * ids.numel(),), generator=g)])
    return ids[torch.randperm(ids.numel(), generator=g)].reshape(ranks, -1)


def check_packed(s, idx_PS, *, rank: int, L: int, BM: int, R: int, half: bool) -> None:
    """build_schedule with packed rows against its Python twin, and the packed layout itself: each expert's rows
    right after the previous expert's, its tiles BM rows each but the last (the rest), no padding row below the
    rows in use."""
    codes, tiles, overflow, starts = reference_schedule(idx_PS, rank=rank, local_experts=L, block_m=BM, capacity=R,
                                                        half_tiles=half, packed=True)
    assert (s.row_code_R.tolist(), s.tile_expert_M.tolist(), s.tile_row_M1.tolist()) == (codes, tiles, starts)
    assert int(s.overflow_rows) == overflow
    n = int(s.num_tiles)
    counts = s.counts_L.tolist()
    used = min(sum(counts), R)
    assert starts[n] == used and all(c >= 0 for c in codes[:used]) and all(c == -1 for c in codes[used:])
    row = 0
    for e, cnt in enumerate(counts):  # expert e: rows [row, row + cnt), tiles of BM from its first row
        mine = [m for m in range(n) if tiles[m] == e]
        want = [row + j * BM for j in range(-(-cnt // BM)) if row + j * BM < R]
        assert [starts[m] for m in mine] == want
        for m in mine:
            assert starts[m + 1] == min(row + cnt, starts[m] + BM, R)
            assert all(idx_PS.reshape(-1)[c].item() == rank * L + e for c in codes[starts[m]:starts[m + 1]])
        row += cnt


@pytest.mark.parametrize("half", [False, True], ids=["full_tiles", "half_tiles"])
def test_packed_schedule_packs_every_expert_and_matches_its_python_twin(half):
    L, BM = len(PACKED_COUNTS), BM_PACKED
    for seed in range(3):
        counts = [PACKED_COUNTS[(e + seed) % L] for e in range(L)]
        idx_PS = packed_routing(counts, seed)
        R = capacity_rows(ep=1, tokens=idx_PS.shape[1], topk=1, local_experts=L, block_m=BM, packed=True)
        assert R == -(-sum(counts) // BM) * BM  # the routed rows, rounded up to BM: no padding
        s = build_schedule(idx_PS, rank=0, local_experts=L, block_m=BM, capacity=R, num_chunks=3, half_tiles=half,
                           packed=True)
        check_packed(s, idx_PS, rank=0, L=L, BM=BM, R=R, half=half)
        assert int(s.overflow_rows) == 0


@pytest.mark.parametrize("mode", ["uniform", "one_expert", "one_rank", "empty_expert", "masked"])
def test_packed_schedule_of_random_routings_matches_its_python_twin(mode):
    P, T, K, E, BM = 2, 16, 3, 8, 4
    idx_PS = torch.stack([i.reshape(-1) for i in routing(P, T, K, E, seed=6, mode=mode)])
    L = E // P
    for r in range(P):
        R = capacity_rows(ep=P, tokens=T, topk=K, local_experts=L, block_m=BM, packed=True)
        s = build_schedule(idx_PS.to(torch.int32), rank=r, local_experts=L, block_m=BM, capacity=R, num_chunks=2,
                           half_tiles=True, packed=True)
        check_packed(s, idx_PS, rank=r, L=L, BM=BM, R=R, half=True)
        assert int(s.overflow_rows) == 0


def test_packed_schedule_counts_overflow():
    counts, BM = [9, 1, 19, 8], BM_PACKED  # 37 rows into 24: a tile starting below R may end past it
    idx_PS = packed_routing(counts, seed=2)
    s = build_schedule(idx_PS, rank=0, local_experts=4, block_m=BM, capacity=24, half_tiles=True, packed=True)
    check_packed(s, idx_PS, rank=0, L=4, BM=BM, R=24, half=True)
    assert int(s.overflow_rows) == 37 - 24 and int(s.tile_row_M1[int(s.num_tiles)]) == 24


def test_packed_rows_need_no_tails_and_no_tma_store_of_h():
    from dataclasses import replace

    from mok_kernels.mok_hopper.tiles import TileConfig

    for bad in (dict(tail_rows=16), dict(save_h_tma=True)):
        with pytest.raises(ValueError, match="packed_rows"):
            replace(TileConfig(), packed_rows=True, **bad)
    assert TileConfig(packed_rows=True, flat_down=True).packed_rows  # the flattened loops mask by the tile's end
