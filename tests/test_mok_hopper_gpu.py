"""mok_hopper on real GPUs (skipped without CUDA). Run on the H200 machines:

    python -m pytest -m gpu tests/test_mok_hopper_gpu.py -q

Single GPU (EP=1, in process): edge cases against the plain reference, 20 repeats bit-identical, bf16 and fp8.
Two GPUs: the four published shapes and the edge cases through ``mok_tools.mok_hopper.gpu_check`` under torchrun
(correctness, 20x determinism), and the harness (mok_hopper vs the reference, forward only).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch
from conftest import HAS_GPU, NUM_GPUS, ROOT, compose_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU on this machine")]

GATES = {"bf16": (0.5, 0.01), "fp8": (1.0, 0.1)}


def _inputs(mode: str, K: int = 4, T: int = 512, E: int = 16, H: int = 1024, I: int = 512, seed: int = 0):
    from mok_hopper_layers import make_layer_inputs

    xs, idx, ws, w13, w2, sh = make_layer_inputs(1, T, K, E, H, I, seed=seed, mode=mode)
    dev = torch.device("cuda")
    return (xs[0].to(dev), idx[0].to(dev), ws[0].to(dev), w13[0].to(dev), w2[0].to(dev),
            tuple(t.to(dev) for t in sh), (xs, idx, ws, w13, w2, sh))


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("mode,K", [
    ("uniform", 4),
    ("empty_expert", 4),  # an expert with no tokens: no tile, nothing pushed for it
    ("one_expert", 4),  # every token's first choice is one expert: several tiles for it
    ("uniform", 1),  # top-1
    ("masked", 4),  # ids < 0 are skipped and contribute nothing
])
def test_single_gpu_matches_the_reference(precision, mode, K):
    from mok_hopper_layers import plain_reference, rel_l1

    from mok_kernels.mok_hopper.api import MoKHopperLayer

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    x, idx, w, w13, w2, sh, cpu = _inputs(mode, K)
    layer = MoKHopperLayer(w13, w2, topk=K, tokens=x.shape[0], shared=sh, precision=precision)
    out = layer(x, idx, w)
    want = plain_reference(*cpu)[0]
    atol, rtol = GATES[precision]
    assert rel_l1(out.cpu(), want) < rtol and (out.cpu().float() - want.float()).abs().max() < atol
    assert layer.overflow_rows() == 0


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_single_gpu_twenty_repeats_are_bit_identical(precision):
    from mok_kernels.mok_hopper.api import MoKHopperLayer

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    x, idx, w, w13, w2, sh, _ = _inputs("uniform", 8, T=2048, E=64, H=2048, I=1024)
    layer = MoKHopperLayer(w13, w2, topk=8, tokens=2048, shared=sh, precision=precision, swiglu_limit=7.0)
    first = layer(x, idx, w)
    for _ in range(20):
        assert torch.equal(layer(x, idx, w), first)


def test_single_gpu_shared_expert_beside_the_up_gemm_changes_no_bit():
    """``shared_sms`` (the default): the shared expert on SMs of its own stream beside the up GEMM, then more up
    programs. Every tile is computed the same way whichever program runs it, so the output is bitwise that of the
    shared expert before the up GEMM (``shared_sms=0``), and it stays so over 20 repeats (a missing stream join would
    show as stale or racing shared-expert rows)."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.tiles import SHARED_SMS, default_tile

    x, idx, w, w13, w2, sh, _ = _inputs("uniform", 8, T=2048, E=64, H=2048, I=1024)
    side = MoKHopperLayer(w13, w2, topk=8, tokens=2048, shared=sh)
    tile = default_tile(device=x.device, hidden=2048, ffn=1024, rows_per_expert=2048 * 8 / 64)  # the layer's own
    base = MoKHopperLayer(w13, w2, topk=8, tokens=2048, shared=sh, tile=replace(tile, shared_sms=0))
    assert side.side_programs == SHARED_SMS > 0 and base.side_programs == 0
    assert side.up_programs == base.up_programs - SHARED_SMS
    want = base(x, idx, w)
    for _ in range(20):
        assert torch.equal(side(x, idx, w), want)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [128, 192])  # 192 rows per expert: 32-row tails by default
def test_single_gpu_tiled_weights_change_no_bit(precision, rows):
    """``w_tiled`` (the CUDA default since v10): the layer's weights in TMA block order feed the same blocks to
    the same MMAs as row-major weights, so the output is bitwise the row-major layer's, over 20 repeats."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    T, K, H, I = 2048, 8, 2048, 1024
    E = T * K // rows
    x, idx, w, w13, w2, sh, _ = _inputs("uniform", K, T=T, E=E, H=H, I=I)
    tile = replace(default_tile(device=x.device, hidden=H, ffn=I, rows_per_expert=rows), up_fused=False)
    assert tile.w_tiled
    tiled = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=tile, precision=precision)
    plain = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=replace(tile, w_tiled=False),
                           precision=precision)
    assert tiled.w13.dim() == 5 and plain.w13.dim() == 3
    want = plain(x, idx, w)
    for _ in range(20):
        assert torch.equal(tiled(x, idx, w), want)


def test_single_gpu_fp8_down_halves_change_no_bit():
    """v16's fp8 default where experts average well under 64 rows (40 here): the down GEMM as 64-row items at 4
    warps, two programs an SM. Each output row is summed over the same K steps in the same order as by v15's 8-warp
    programs over whole tiles: bitwise v15's output, and bitwise repeatable over 20 calls (two programs sharing an
    SM race for nothing)."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    T, K, E, H, I = 1024, 5, 128, 2048, 1024
    x, idx, w, w13, w2, sh, _ = _inputs("uniform", K, T=T, E=E, H=H, I=I)
    tile = default_tile(device=x.device, hidden=H, ffn=I, rows_per_expert=T * K / E)  # the layer's own (bf16)
    assert tile.fp8_down_halves
    v16 = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, precision="fp8")
    assert v16.cfg == tile.for_fp8() and v16.cfg.down_halves and (v16.cfg.down_per_sm, v16.cfg.down_warps) == (2, 4)
    v15 = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, precision="fp8",
                         tile=replace(tile, fp8_down_halves=False))
    assert not v15.cfg.down_halves and v15.gemm_programs * 2 == v16.gemm_programs
    want = v15(x, idx, w)
    for _ in range(20):
        assert torch.equal(v16(x, idx, w), want)


@pytest.mark.parametrize("rows", [40, 96])
def test_single_gpu_fp8_up_halves_change_no_bit(rows):
    """fp8_up_halves (session 27): the fp8 up GEMM as 64-row items at 4 warps, two programs an SM in every up launch
    (beside the pull's spinning ready flags). Each hidden row is summed over the same K steps in the same order as
    by the 8-warp programs over whole tiles: bitwise the same output and saved H (training forward), with experts
    of 40 rows (half tiles only) and of 96 (full tiles, run as two items), and bitwise repeatable over 20 calls."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    T, K, H, I = 1024, 5, 2048, 1024
    E = T * K // rows
    x, idx, w, w13, w2, sh, _ = _inputs("uniform", K, T=T, E=E, H=H, I=I)
    tile = default_tile(device=x.device, hidden=H, ffn=I, rows_per_expert=rows)
    kw = dict(topk=K, tokens=T, shared=sh, precision="fp8", save_h=True)
    base = MoKHopperLayer(w13, w2, tile=replace(tile, fp8_up_halves=False), **kw)
    halves = MoKHopperLayer(w13, w2, tile=replace(tile, fp8_up_halves=True), **kw)
    assert halves.cfg.up_halves and (halves.cfg.up_warps, halves.cfg.up_per_sm) == (4, 2)
    assert halves.up_programs == 2 * base.up_programs and not base.cfg.up_halves
    want = base(x, idx, w)
    want_h = base.h_save.clone()
    for _ in range(20):
        assert torch.equal(halves(x, idx, w), want)
    assert want_h.abs().sum() > 0 and torch.equal(halves.h_save, want_h)


@pytest.mark.parametrize("rows", [128, 192])
def test_single_gpu_fused_gate_up_mma_matches_the_default_per_token(rows):
    """``up_fused``: one MMA of N = 2 x up_n over interleaved gate and up weight rows, split after the loop. The
    same products summed in the same K order; the MMA's N width may change the order inside it, so every token
    within rounding of the default's (a swapped gate / up column would be far off); 20 repeats bit-identical."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile

    T, K, H, I = 2048, 8, 2048, 1024
    E = T * K // rows
    x, idx, w, w13, w2, sh, _ = _inputs("uniform", K, T=T, E=E, H=H, I=I)
    tile = default_tile(device=x.device, hidden=H, ffn=I, rows_per_expert=rows)
    base = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=replace(tile, up_fused=False))
    fused = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=replace(tile, up_fused=True))
    want = base(x, idx, w).float()
    got = fused(x, idx, w)
    err = (got.float() - want).abs().amax(dim=1) / want.abs().amax(dim=1).clamp_min(1e-6)
    assert err.max() < 0.02, f"worst token off by {err.max():.3g} of its max"
    for _ in range(20):
        assert torch.equal(fused(x, idx, w), got)


@pytest.mark.parametrize("save_h", [False, True], ids=["inference", "training"])
def test_single_gpu_stacked_box_is_bitwise_the_tiled_fused_mma(save_h):
    """``up_stacked`` (the caller's plain weights, each K step's gate and up blocks as one [up_n, 2, up_k] TMA box
    of W13 seen as [L, I, 2, H], a strided view) feeds the MMA the interleaved block the tiled copy holds
    (``up_fused``): the same output and saved H bit for bit (both without tails), no weights of the layer's own, 20
    repeats bit-identical."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile
    from mok_kernels.mok_hopper.tiles import plain_weights

    T, K, H, I, rows = 2048, 8, 2048, 1024, 192
    E = T * K // rows
    x, idx, w, w13, w2, sh, _ = _inputs("uniform", K, T=T, E=E, H=H, I=I)
    tile = replace(default_tile(device=x.device, hidden=H, ffn=I, rows_per_expert=rows), tail_rows=0)
    assert tile.up_fused and tile.w_tiled
    fused = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=tile, save_h=save_h)
    stacked = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=plain_weights(tile, stacked=True),
                             save_h=save_h)
    assert stacked.cfg.up_stacked and stacked.w13.data_ptr() == w13.data_ptr()
    want = fused(x, idx, w)
    got = stacked(x, idx, w)
    assert torch.equal(got, want)
    if save_h:
        assert torch.equal(stacked.h_save, fused.h_save)
    for _ in range(20):
        assert torch.equal(stacked(x, idx, w), got)


@pytest.mark.parametrize("tail", [16, 32])
def test_single_gpu_tails_match_the_default_per_token(tail):
    """``tail_rows``: an expert's last rows as a second, swapped MMA (rows in N). Same math, another order inside
    the MMA: every token's output within rounding of the default's (a dropped or misplaced tail row would move its
    token by a whole expert's share), on uneven loads that give every tile kind; 20 repeats bit-identical."""
    from dataclasses import replace

    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile

    T, K, E, H, I = 2048, 6, 64, 2048, 1024
    x, _, w, w13, w2, sh, _ = _inputs("uniform", K, T=T, E=E, H=H, I=I)
    g = torch.Generator().manual_seed(3)  # loads from 1x to 3x the mean: tiles of every size
    load = torch.rand(E, generator=g) * 2 + 1
    idx = torch.stack([torch.multinomial(load, K, generator=g) for _ in range(T)]).to(x.device)
    tile = replace(default_tile(device=x.device, hidden=H, ffn=I, rows_per_expert=T * K / E), flat_down=False,
                   tail_rows=0, down_n=128, down_stages=6)  # (192 rows per expert: tails by default)
    base = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=tile)
    tails = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, tile=replace(tile, tail_rows=tail))
    want, got = base(x, idx, w).float(), tails(x, idx, w)
    per_token = (got.float() - want).norm(dim=1) / want.norm(dim=1)
    assert float(per_token.max()) < 1e-2, float(per_token.max())
    n = int(tails.sched.num_tiles)
    rows = tails.sched.tile_row_M1[: n + 1].tolist()
    bm = tile.block_m
    assert {bm // 2 + tail, bm + tail} <= {b - a for a, b in zip(rows[:-1], rows[1:])}
    for _ in range(20):
        assert torch.equal(tails(x, idx, w), got)


@pytest.mark.parametrize("limit", [None, 0.5], ids=["no_limit", "clamped"])
@pytest.mark.parametrize("rows", [64, 192])  # 64: half tiles, two gate/up MMAs; 192: tails and the fused MMA
def test_single_gpu_save_h_matches_torch(rows, limit):
    """``save_h`` on the GPU (the CUDA default tile: TMA, tiled weights, half tiles, shared expert beside the up
    GEMM, CUDA graph): h_save and clip_save against twin_bwd.saved of the layer's X rows per tile (torch fp32
    matmul; H within bf16 rounding, clamp decisions exact away from the limit), on uneven loads that give every
    tile kind, after the eager first call and again after a graph replay (the buffers refilled with NaN / 7 in
    between: the replay must write them in place); the forward bitwise that of the layer without save_h."""
    from mok_hopper_layers import check_saved_h

    from mok_kernels.mok_hopper.api import MoKHopperLayer

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32
    T, K, H, I = 2048, 8, 2048, 1024
    E = T * K // rows
    x, _, w, w13, w2, sh, _ = _inputs("uniform", K, T=T, E=E, H=H, I=I)
    g = torch.Generator().manual_seed(5)  # loads from 1x to 3x the mean: tiles of every size
    load = torch.rand(E, generator=g) * 2 + 1
    idx = torch.stack([torch.multinomial(load, K, generator=g) for _ in range(T)]).to(x.device)
    plain = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, swiglu_limit=limit)
    layer = MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, swiglu_limit=limit, save_h=True)
    assert layer.cfg == plain.cfg and bool(layer.cfg.up_fused and layer.cfg.tail_rows) == (rows == 192)
    want = plain(x, idx, w)
    for call in ("eager", "replay"):
        layer.h_save.fill_(float("nan"))
        if limit is not None:
            layer.clip_save.fill_(7)
        out = layer(x, idx, w)
        torch.cuda.synchronize()
        assert torch.equal(out, want), call
        seen = check_saved_h(layer, w13, limit)
        assert seen["rows"] > 0 and seen["inexact"] <= 0.01 * seen["rows"] * 2 * I, (call, seen["inexact"])
        if limit is not None:
            assert min(seen["clip_gate"], seen["clip_up_pos"], seen["clip_up_neg"]) > 0
    assert layer.graph_error is None and len(layer._graphs) == 1
    bm = layer.cfg.block_m
    assert {bm // 2, bm} <= seen["sizes"]
    if rows == 192:
        assert {bm // 2 + layer.cfg.tail_rows, bm + layer.cfg.tail_rows} <= seen["sizes"]


def test_single_gpu_kernels_agree_with_the_twin_to_rounding():
    """The kernel pipeline and its pure-torch twin do the same math with the same roundings."""
    from mok_hopper_layers import rel_l1

    from mok_kernels.mok_hopper.twin import forward as twin
    from mok_kernels.mok_hopper.api import MoKHopperLayer

    x, idx, w, w13, w2, sh, cpu = _inputs("uniform", 4)
    layer = MoKHopperLayer(w13, w2, topk=4, tokens=x.shape[0], shared=sh)
    out = layer(x, idx, w).cpu()
    xs, idx_c, ws, w13_c, w2_c, sh_c = cpu
    want = twin.simulate(xs, idx_c, ws, w13_c, w2_c, shared=sh_c, block_m=layer.cfg.block_m)[0]
    assert rel_l1(out, want) < 2e-3


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=[pytest.mark.multigpu, pytest.mark.skipif(
    NUM_GPUS < 2, reason="needs 2 GPUs")])])
def test_gpu_check(tmp_path, nproc):
    """The four published shapes (bf16 and fp8) and the edge cases against the reference, 20x determinism, through
    gpu_check under torchrun (EP = nproc)."""
    env = dict(os.environ)  # PYTHONPATH: conftest put the repo on it, before what was there
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "-m",
                        "mok_tools.mok_hopper.gpu_check", "--out", str(tmp_path), "--no-sweep", "--iters", "5",
                        "--warmup", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    with open(tmp_path / "mok_hopper_gpu_check.csv") as f:
        rows = list(csv.DictReader(f))
    checks = [r for r in rows if r["section"] == "check"]
    assert len(checks) >= 4 * 2 + 9 and all(r["status"] == "ok" for r in checks)
    published = [r for r in checks if r["check"] in ("kimi_k2_7", "glm_5_2", "qwen3_5_397b", "deepseek_v4_pro")]
    assert len(published) == 8 and all(r["deterministic"] == "True" for r in published)


def _gpu_cfg(results_dir, *overrides):
    return compose_cfg("device=cuda", "timing=quick", f"results_dir={results_dir}", "print_table=false",
                       "compile=false", *overrides)


def test_harness_checks_mok_hopper_against_the_reference(results_dir):
    from harness.measure.runner import run_benchmark

    ep = min(NUM_GPUS, 2)
    df = run_benchmark(_gpu_cfg(results_dir, "shape=tiny", "workload.tokens_per_gpu=256", f"ep_size={ep}",
                                "backends=[mok_hopper]", "directions=[fwd,bwd]"))
    f = df[df.direction == "fwd"].iloc[0]
    assert f.status == "ok", f.error
    assert f.rel_err < 0.01 and "Triton" in f.notes
    b = df[df.direction == "bwd"].iloc[0]  # the backward runs at any EP (bf16 and fp8)
    assert b.status == "ok" and b.rel_err < 0.01, b.error


@pytest.mark.multigpu
@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_harness_published_shape_on_two_gpus(results_dir, precision):
    from harness.measure.runner import run_benchmark

    df = run_benchmark(_gpu_cfg(results_dir, "shape=glm_5_2", "ep_size=2", f"precision={precision}",
                                "backends=[mok_hopper]", "directions=[fwd]"))
    r = df.iloc[0]
    assert r.status == "ok", r.error
    assert r.dispatch_bytes > 0 and r.dispatch_gb_s > 50


def test_backend_tile_overrides_without_spin_waits_change_no_bit():
    """bwd_check's ``--tile ready_flags=0`` (what Nsight Compute needs: it runs kernels one at a time, and an up
    GEMM spinning on the pull's counters before the pull ran would never end): the backend builds its layer with
    the overrides, and the up GEMM's wait by stream event gives the same bits as the spin wait, forward and
    backward."""
    import torch.distributed as dist

    from harness.measure.correctness import run_once
    from harness.config.point import make_case
    from harness.measure.inputs import make_inputs
    from mok_kernels.mok_hopper.backend import MokHopperBackend

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)  # the harness's group at EP=1
    try:
        case = make_case(compose_cfg("device=cuda", "shape=tiny", "workload.tokens_per_gpu=256"), ep_size=1,
                         device="cuda")
        inputs = make_inputs(case, 0, torch.device("cuda"))
        got = []
        for over in ({}, {"ready_flags": False}):
            b = MokHopperBackend(case, dist.group.WORLD)
            b.tile_overrides = over
            b.setup(inputs)
            assert b._tile.ready_flags is (not over) and b.impl.cfg.ready_flags is (not over)
            got.append({k: None if v is None else v.detach().cpu().clone()
                        for k, v in run_once(b, inputs, True).items()})
            b.teardown()
        assert got[0].keys() == got[1].keys() and got[0]["d_w_up"] is not None
        for k, v in got[0].items():
            assert (v is None and got[1][k] is None) or torch.equal(v, got[1][k]), k
    finally:
        if own:
            dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_single_gpu_packed_rows_train_bitwise_like_padded(precision):
    """The harness's default tile (plain bf16 weights, then ``packed_rows``: experts' rows back to back, no tile
    padding) against the same tile with padded rows, on a point whose experts end mid-tile (40 rows each, qwen3_5_397b's
    share at 2048 tokens, and an empty expert): a training forward and its backward give the same output and
    gradients bit for bit, and 20 repeats of the packed step are bit-identical."""
    from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile
    from mok_kernels.mok_hopper.tiles import packed_rows, plain_weights
    from mok_kernels.mok_hopper.train import layer_backward

    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs SM89+")
    T, K, H, I, E = 2048, 8, 2048, 1024, 400  # 2048·8 / 400 ≈ 41 rows an expert: every expert ends mid-tile
    x, idx, w, w13, w2, sh, _ = _inputs("empty_expert", K, T=T, E=E, H=H, I=I)
    dO = torch.randn_like(x) * 0.1
    tile = default_tile(precision=precision, device=x.device, rows_per_expert=T * K / E)
    if precision == "bf16":
        tile = plain_weights(tile)

    def step(layer):
        with torch.no_grad():
            out = layer(x, idx, w)
            g = layer_backward(layer, dO, x, idx, w, w13, w2, sh)
        assert layer.overflow_rows() == 0
        return [out, *(g[k] for k in ("x", "topk_w", "w13", "w2"))]

    layers = [MoKHopperLayer(w13, w2, topk=K, tokens=T, shared=sh, precision=precision, tile=t, save_h=True,
                             train=True) for t in (tile, packed_rows(tile))]
    assert layers[1].cfg.packed_rows and layers[1].R < layers[0].R
    padded, packed = step(layers[0]), step(layers[1])
    for a, b, name in zip(padded, packed, ("out", "x", "topk_w", "w13", "w2")):
        assert torch.equal(a, b), name
    for _ in range(20):
        for a, b in zip(step(layers[1]), packed):
            assert torch.equal(a, b)
