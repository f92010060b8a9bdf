"""GPU check of mok_hopper: correctness against the harness's reference, 20x determinism, per-stage timing, sweeps.

Run (repository root; 2 GPUs, then 1)::

    torchrun --nproc-per-node=2 -m mok_tools.mok_hopper.gpu_check --out /tmp/mokh
    torchrun --nproc-per-node=1 -m mok_tools.mok_hopper.gpu_check --out /tmp/mokh1 --shapes glm_5_2
    # the published experts per GPU: shape@Nepg (the harness's shape.local_experts=N)
    torchrun --nproc-per-node=2 -m mok_tools.mok_hopper.gpu_check --out /tmp/mokh --shapes qwen3_5_397b@8epg

The layer's definitions are the harness's: shapes from ``configs/shape/*.yaml`` (any of them by name; the default is
the published ones), gates (atol, rtol) from ``configs/precision/*.yaml``, inputs from ``harness.measure.inputs`` (the
harness's seed: the same tokens, routing and weights as a harness run of the shape at this EP and token count), the
reference from ``harness.measure.reference`` and forward times from ``harness.measure.timing.Timer``. What stays here is
the kernel's own: edge-case routings, the stages timed one by one, the timeline stamps, and the sweep of tile variants
(``mok_tools.mok_hopper.variants``) timed against the default in interleaved rounds.

What it does, every rank in lockstep:

1. edge cases on a small shape (bf16, and fp8 for the first two): uniform routing, an expert with no tokens,
   every token's first choice on one expert, every token on rank 0's experts, top-1, masked ids (-1),
   clamped SwiGLU, router weights applied in the epilogue; each checked against the reference;
2. the published shapes at ``--tokens`` per GPU (EP = world size), bf16 and fp8: check against the reference
   (the precision's gate), 20 repeats must give identical bits, then the whole forward timed (the harness's
   timer: median of per-iteration max over ranks), then every stage timed alone (non-overlapped), with bandwidths
   and FLOP rates, and torch._grouped_mm on the same rows for comparison;
   then a timeline of the real forward (GPU-timer stamps at every phase end, both streams, graph replayed);
3. a sweep of tile / pipeline variants against the defaults (``SWEEP``; fp8 runs the "fp8:" ones and
   ``SWEEP_FP8``; ``--no-sweep`` skips it);
4. rates of this machine for the floors (``harness.measure.calibrate``): HBM copy, dense bf16 GEMM, link.

Prints a compact table and writes ``DIR/mok_hopper_gpu_check.csv`` (rank 0). Exit code 1 if any check failed, 2
(one line, before anything runs) for a shape or precision that cannot run here.
Budget: about 3-5 minutes on 2xH200 (most of it Triton compilation and weight generation).

Legend: P ranks, T tokens per rank, K top-k, E experts, L = E / P local experts, H hidden, I ffn.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import traceback
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mok_tools.shapes import make_shape_case, published_shapes, shape_config
from contract import Case, LayerInputs
from harness.measure.calibrate import measure
from harness.measure.correctness import compare
from harness.config.schema import ConfigError
from harness.measure.inputs import make_inputs
from harness.measure.reference import ReferenceBackend
from harness.measure.timing import Stats, Timer
from mok_kernels.mok_hopper.api import MoKHopperLayer, default_tile
from mok_kernels.mok_hopper.tiles import TileConfig, parse_tile_overrides
from mok_tools.mok_hopper.variants import SWEEP, TIMELINE_VARIANTS, runs_at
from mok_kernels.mok_hopper.workspace import clear_workspace_cache

PRECISIONS = ("bf16", "fp8")  # the layer's (configs/precision/<name>.yaml gives each one's gate)
SMOKE_SHAPE = "tiny"  # --smoke (CPU interpreter)


class Ctx:
    def __init__(self, smoke: bool = False) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.smoke = smoke  # CPU, one rank, Triton interpreter: checks this script's plumbing, times nothing
        if smoke:
            assert self.world == 1 and os.environ.get("TRITON_INTERPRET") == "1", \
                "--smoke runs one CPU rank under TRITON_INTERPRET=1"
            self.dev = torch.device("cpu")
            dist.init_process_group("gloo")
        else:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            self.dev = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=self.dev)
        self.group = dist.group.WORLD
        # host-side verdicts (harness.measure.correctness.compare reduces CPU tensors), as the harness's runner does
        self.ctrl = dist.new_group(backend="gloo") if not smoke else self.group
        self.timer = Timer(self.dev, self.group, align="barrier")  # the harness's one timing path
        self.rows: list[dict[str, Any]] = []
        self.failed = 0

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def add(self, **row: Any) -> None:
        if self.rank == 0:
            self.rows.append(row)

    def all_ok(self, ok: bool) -> bool:
        t = torch.tensor([0.0 if ok else 1.0], device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# inputs and the reference (the harness's), the kernel's edge-case routings


EDGE_ROUTINGS = ("uniform", "empty_expert", "one_expert", "one_rank", "masked")


def edge_routing(case: Case, rank: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and router weights of an edge case: the harness's uniform routing, or top-k of per-rank logits
    (seeded as the harness seeds a rank) bent to the case: expert 0 never chosen (``empty_expert``), every token's
    first choice on expert 1 (``one_expert``), every token to rank 0's experts (``one_rank``), 20% of the ids -1
    (``masked``: dropped tokens)."""
    from harness.measure.inputs import make_routing

    if mode == "uniform":
        return make_routing(case, rank)
    T, E, K, P = case.tokens_per_gpu, case.num_experts, case.topk, case.ep_size
    g = torch.Generator().manual_seed(case.seed + rank)
    logits = torch.randn(T, E, generator=g)
    if mode == "empty_expert":
        logits[:, 0] = -1e9
    elif mode == "one_expert":
        logits[:, 1] = 1e9
    elif mode == "one_rank":
        logits[:, E // P :] = -1e9
    vals, idx = logits.topk(K, dim=-1)
    w = torch.softmax(vals, dim=-1)
    if mode == "masked":
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    return idx, w


def layer_inputs(ctx: Ctx, case: Case, mode: str = "uniform") -> LayerInputs:
    """The harness's inputs of ``case`` on this rank, with an edge case's routing in place of the harness's."""
    inp = make_inputs(case, ctx.rank, ctx.dev)
    if mode != "uniform":
        idx, w = edge_routing(case, ctx.rank, mode)
        inp = replace(inp, topk_idx_TK=idx.to(ctx.dev), topk_w_TK=w.to(ctx.dev))
    return inp


def shared_weights(inp: LayerInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return inp.ws_gate_IH, inp.ws_up_IH, inp.ws_down_HI


def call(layer: MoKHopperLayer, inp: LayerInputs) -> torch.Tensor:
    return layer(inp.x_TH, inp.topk_idx_TK, inp.topk_w_TK)


@torch.no_grad()
def reference(ctx: Ctx, case: Case, inp: LayerInputs) -> torch.Tensor:
    """The harness's ground truth (all-gather, per-expert loop, all-reduce) on the same inputs."""
    ref = ReferenceBackend(case, ctx.group)
    ref.setup(inp)
    return ref.forward(inp.x_TH, inp.topk_idx_TK, inp.topk_w_TK)


def errors(ctx: Ctx, got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """abs-max and relative-L1 error of the output, worst over ranks (``harness.measure.correctness.compare``)."""
    c = compare({"out": got}, {"out": want}, ctx.ctrl)
    return c["max_abs_err"], c["rel_err"]


# ---------------------------------------------------------------------------------------------------------------
# timing: whole forwards through the harness's timer; the kernel's stages and timeline stamps here


def forward_stats(ctx: Ctx, fn: Callable[[], Any], iters: int, warmup: int) -> Stats:
    """``fn`` through ``harness.measure.timing.Timer`` (per-iteration events, aligned, max over ranks; the SM clock and
    power of the timed iterations in ``clocks``)."""
    return ctx.timer.run(fn, num_warmup=warmup, num_iters=iters)


def forward_ms(ctx: Ctx, fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Median ms of ``fn`` (:func:`forward_stats`)."""
    return forward_stats(ctx, fn, iters, warmup).median_ms


class _HostEvent:
    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def med(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


STAGES = ("stage", "barrier0", "schedule", "pull", "shared", "up", "down", "barrier1", "epilogue")


def time_stages(ctx: Ctx, layer: MoKHopperLayer, inp: LayerInputs, iters: int) -> dict[str, float]:
    """Median ms of each stage run alone, in order, on the main stream (no overlap), max over ranks."""
    C = layer.cfg.num_chunks
    x, idx, w = inp.x_TH, inp.topk_idx_TK, inp.topk_w_TK
    steps: list[Callable[[], Any]] = [
        lambda: layer.stage(x, idx, w), lambda: layer.ws.barrier(0), layer.schedule,
        lambda: [layer.pull(c) for c in range(C)],
        lambda: layer.shared_expert(x), lambda: [layer.up(c) for c in range(C)],
        lambda: [layer.down(c) for c in range(C)], lambda: layer.ws.barrier(1), layer.finish]
    samples: dict[str, list[float]] = {s: [] for s in STAGES}
    align = torch.zeros(1, device=ctx.dev)
    with torch.no_grad():
        for it in range(iters + 2):
            dist.all_reduce(align)
            ev: list[Any] = [_HostEvent() if ctx.smoke else torch.cuda.Event(enable_timing=True)
                             for _ in range(len(steps) + 1)]
            ev[0].record()
            for i, fn in enumerate(steps):
                fn()
                ev[i + 1].record()
            if not ctx.smoke:
                torch.cuda.synchronize()
            if it >= 2:
                for i, s in enumerate(STAGES):
                    samples[s].append(ev[i].elapsed_time(ev[i + 1]))
    out = {}
    for s in STAGES:
        t = torch.tensor(samples[s], device=ctx.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[s] = med(t.tolist())
    return out


def timeline(ctx: Ctx, inp: LayerInputs, tile: TileConfig, precision: str, iters: int) -> dict[str, float]:
    """Where each phase of the real (overlapped, graph-replayed) forward ends: ms from its start, median over
    iterations, max over ranks, from GPU-timer stamps (a layer built with ``timeline=True``)."""
    from mok_kernels.mok_hopper.api import STAMPS

    if ctx.smoke:
        return {}
    T, K = inp.topk_idx_TK.shape
    layer = MoKHopperLayer(inp.w13_LIH, inp.w2_LHI, topk=K, tokens=T, shared=shared_weights(inp), group=ctx.group,
                           tile=tile, precision=precision, timeline=True)
    samples: dict[str, list[float]] = {s: [] for s in STAMPS}
    align = torch.zeros(1, device=ctx.dev)
    for it in range(iters + 3):
        dist.all_reduce(align)
        call(layer, inp)
        ms = layer.timeline_ms()
        if it >= 3:
            for k, v in ms.items():
                samples[k].append(v)
    t = torch.tensor([med(samples[s]) for s in STAMPS], device=ctx.dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(STAMPS, t.tolist()))


def grouped_mm_ms(ctx: Ctx, layer: MoKHopperLayer, inp: LayerInputs, iters: int) -> Optional[float]:
    """torch._grouped_mm gate/up + SwiGLU + down on the same (padded) rows and the layer's weights as given
    (``inp``; the layer's own copy may be tiled), for comparison (bf16 only)."""
    if not hasattr(torch, "_grouped_mm") or layer.fp8 or ctx.smoke:
        return None
    counts = layer.sched.counts_L.long()
    padded = ((counts + layer.cfg.block_m - 1) // layer.cfg.block_m) * layer.cfg.block_m
    offs = torch.cumsum(padded, 0).to(torch.int32)
    n = int(offs[-1])
    # (full tiles pad up to BM - 1 rows an expert; the layer's capacity pads BM/2 - 1 with half tiles: may be fewer)
    x = layer.x_rows[:n] if n <= layer.R else torch.cat([layer.x_rows, layer.x_rows.new_zeros(n - layer.R,
                                                                                              layer.H)])
    w13t, w2t = inp.w13_LIH.transpose(-2, -1), inp.w2_LHI.transpose(-2, -1)

    def run() -> None:
        h = torch._grouped_mm(x, w13t, offs=offs)
        g, u = h.chunk(2, dim=-1)
        torch._grouped_mm(F.silu(g) * u, w2t, offs=offs)

    return forward_ms(ctx, run, iters, 3)


def machine_rates(ctx: Ctx) -> dict[str, float]:
    """This machine's rates for the floors, from ``harness.measure.calibrate`` (bf16 dense GEMM TFLOP/s, HBM copy GB/s
    counting bytes read and written, and with 2+ ranks NCCL all-to-all GB/s; on the CPU of --smoke they are the
    CPU's, and mean nothing for the GPU)."""
    r = measure(ctx.dev, ctx.group, "bf16")
    out = {"hbm_gb_s": r["calib_hbm_gb_s"], "gemm_tflops": r["calib_gemm_tflops"]}
    if "calib_link_gb_s" in r:
        out["link_gb_s"] = r["calib_link_gb_s"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# checks


def check_layer(ctx: Ctx, label: str, case: Case, inp: LayerInputs, *, repeats: int = 0,
                **layer_kw: Any) -> tuple[Optional[MoKHopperLayer], dict[str, Any]]:
    """The layer in ``case.precision`` against the harness's reference, gated by the precision's (atol, rtol) from
    configs/precision; ``repeats`` more forwards must give identical bits."""
    T, K = inp.topk_idx_TK.shape
    precision = case.precision
    res: dict[str, Any] = {"check": label, "precision": precision}
    layer = None
    try:
        layer = MoKHopperLayer(inp.w13_LIH, inp.w2_LHI, topk=K, tokens=T, shared=shared_weights(inp),
                               swiglu_limit=case.swiglu_limit, precision=precision, group=ctx.group, **layer_kw)
        out = call(layer, inp)
        if not ctx.smoke:
            torch.cuda.synchronize()
        want = reference(ctx, case, inp)
        a, r = errors(ctx, out, want)
        overflow = layer.overflow_rows()
        atol, rtol = case.atol, case.rtol
        ok = a <= atol and r <= rtol and overflow == 0 and bool(torch.isfinite(out.float()).all())
        res.update(max_abs_err=a, rel_err=r, overflow_rows=overflow)
        if repeats:
            same = True
            for _ in range(repeats):  # every rank runs every repeat (each forward has barriers)
                same &= torch.equal(out, call(layer, inp))
            res["deterministic"] = ctx.all_ok(same)
            ok = ok and res["deterministic"]
        ok = ctx.all_ok(ok)
    except Exception as e:  # noqa: BLE001 - report and go on (ranks fail together: same code, same shapes)
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}"[:300]
        ok = False
    res["status"] = "ok" if ok else "FAIL"
    if not ok:
        ctx.failed += 1
    ctx.add(section="check", **res)
    ctx.log(f"  {label:<40} {precision:<5} {res['status']:<5} abs {res.get('max_abs_err', float('nan')):.4g} "
            f"rel {res.get('rel_err', float('nan')):.4g}"
            + (f" deterministic={res['deterministic']}" if "deterministic" in res else "")
            + (f"  {res['error']}" if "error" in res else ""))
    return layer, res


EDGE_CASES = [("uniform", 0, {}), ("empty_expert", 0, {}), ("one_expert", 0, {}), ("one_rank", 0, {}),
              ("uniform", 1, {}), ("masked", 0, {}), ("uniform", 0, {"limit": 0.05}),
              ("uniform", 0, {"router_weight_in": "epilogue"}), ("uniform", 0, {"tile_chunks": 1})]  # K 0: the shape's


def edge_case_shape(ctx: Ctx) -> dict[str, Any]:
    """A small layer for the edge cases: the tiny shape (configs/shape/tiny.yaml) on the CPU, 16 experts per rank of
    H 1024, I 512, top-4 on a GPU."""
    shape = shape_config(SMOKE_SHAPE)
    if not ctx.smoke:
        shape.update(name="edge", num_experts=16 * ctx.world, hidden=1024, ffn=512, topk=4)
    return shape


def edge_cases(ctx: Ctx, tile_over: Optional[dict[str, Any]] = None) -> None:
    shape = edge_case_shape(ctx)
    T = 32 if ctx.smoke else 512
    E, H, I, K = shape["num_experts"], shape["hidden"], shape["ffn"], shape["topk"]
    ctx.log(f"edge cases: E={E} H={H} I={I} K={K} T={T} EP={ctx.world}")
    for n, (mode, k, extra) in enumerate(EDGE_CASES):
        extra = dict(extra)
        limit = extra.pop("limit", None)
        sh = dict(shape, topk=k or K, swiglu_limit=limit)
        cases = {prec: make_shape_case(sh, ep_size=ctx.world, device=ctx.dev.type, tokens=T, precision=prec,
                                       seed=100 + n) for prec in (("bf16", "fp8") if n < 2 else ("bf16",))}
        inp = layer_inputs(ctx, cases["bf16"], mode)
        kw: dict[str, Any] = {}
        if "router_weight_in" in extra:
            kw["router_weight_in"] = extra["router_weight_in"]
        label = f"edge {mode} K={k or K}" + "".join(f" {a}={b}" for a, b in extra.items()) + \
                (f" limit={limit}" if limit else "")
        for prec, case in cases.items():
            tile = replace(default_tile(precision=prec, device=ctx.dev, hidden=H, ffn=I), **(tile_over or {}))
            if prec == "fp8":
                tile = tile.for_fp8()
            if "tile_chunks" in extra:
                tile = replace(tile, num_chunks=extra["tile_chunks"])
            layer, _ = check_layer(ctx, label, case, inp, repeats=3, tile=tile, **kw)
            del layer
        del inp
        clear_workspace_cache()


def shape_cases(name: str, world: int, device: str, tokens: int, precisions: Sequence[str]) -> dict[str, Case]:
    """The harness's case of a shape (``name`` or ``name@Nepg``) in each precision at EP = ``world`` (raises
    ``ConfigError`` where it cannot run, e.g. experts that do not split over the ranks)."""
    shape = shape_config(name)
    return {p: make_shape_case(shape, ep_size=world, device=device, tokens=tokens, precision=p) for p in precisions}


def published(ctx: Ctx, name: str, args: argparse.Namespace, rates: dict[str, float]) -> None:
    cases = shape_cases(name, ctx.world, ctx.dev.type, args.tokens, args.precisions)
    c = next(iter(cases.values()))
    E, H, I, K, L = c.num_experts, c.hidden, c.ffn, c.topk, c.local_experts
    P, T = ctx.world, c.tokens_per_gpu
    ctx.log(f"{name}: E={E} (L={L}/GPU) H={H} I={I} K={K} T={T} EP={P}")
    t0 = time.time()
    inp = layer_inputs(ctx, c)  # the inputs do not depend on the precision
    flops = c.flops("fwd")  # the published formula
    for prec, case in cases.items():
        base = default_tile(device=ctx.dev, comm_sms=args.comm_sms, hidden=H, ffn=I, rows_per_expert=P * T * K / E)
        base = replace(base, **args.tile_over)  # bf16; the sweep's overrides apply to it before for_fp8
        tile = base.for_fp8() if prec == "fp8" else base
        layer, res = check_layer(ctx, f"{name}", case, inp, repeats=args.repeats, tile=tile)
        if layer is None or res["status"] != "ok":
            layer = None
            continue
        fwd = ctx.timer.run(partial(call, layer, inp), num_warmup=args.warmup, num_iters=args.iters)
        st = time_stages(ctx, layer, inp, max(5, args.iters // 2))
        gmm = grouped_mm_ms(ctx, layer, inp, max(5, args.iters // 2))
        bpw = 1 if prec == "fp8" else 2
        n_tiles = int(layer.sched.num_tiles)
        exec_rows = int(layer.sched.tile_row_M1[n_tiles])  # rows the GEMMs run (tiles of BM or BM/2 rows)
        BM = layer.cfg.block_m
        d_rows, c_rows = layer.rows_per_peer()
        row_bytes = H + 4 * (H // 128) if prec == "fp8" else 2 * H
        pulled = int(layer.sched.counts_L.sum())
        remote_pushed = sum(r for p, r in enumerate(c_rows) if p != ctx.rank)
        weights = 3 * L * H * I * bpw + 3 * H * I * 2
        mem_floor = (weights + T * H * 2 * (2 + 2 * K)) / (rates["hbm_gb_s"] * 1e9) * 1e3
        comp_floor = flops / (rates["gemm_tflops"] * 1e12) * 1e3
        lat = fwd.median_ms
        ctx.add(section="forward", shape=name, precision=prec, ep=P, tokens=T, latency_ms=lat,
                p20_ms=fwd.p20_ms, p80_ms=fwd.p80_ms, tflops_per_gpu=flops / lat / 1e9,
                memory_floor_ms=mem_floor, compute_floor_ms=comp_floor,
                roofline_fraction=max(mem_floor, comp_floor) / lat, tiles=n_tiles, block_m=BM, gemm_rows=exec_rows,
                routed_rows=int(layer.sched.counts_L.sum()), half_tiles=tile.half_tiles, ready_flags=tile.ready_flags,
                comm_sms=tile.comm_sms, chunks=tile.num_chunks, grouped_mm_ms=gmm, graph_error=layer.graph_error,
                **fwd.clocks)
        ctx.log(f"  forward {prec}: {lat:.3f} ms  {flops / lat / 1e9:.0f} TF/s/GPU"
                f"  floor {max(mem_floor, comp_floor):.3f}"
                f" ms ({max(mem_floor, comp_floor) / lat:.0%})" + (f"  [torch grouped_mm GEMMs alone {gmm:.3f} ms]"
                                                                  if gmm else ""))
        derived = {
            "pull": (pulled * row_bytes / 1e6, "MB pulled (all rows)"),
            "up": (n_tiles * 2 * I * H * bpw / 1e6, "MB weights"),
            "down": (n_tiles * H * I * bpw / 1e6, "MB weights"),
        }
        for sname in STAGES:
            ms = st[sname]
            row: dict[str, Any] = dict(section="stage", shape=name, precision=prec, stage=sname, ms=ms)
            if sname in derived:
                mb, what = derived[sname]
                row.update(mbytes=mb, gb_s=mb / ms if ms > 0 else None, bytes_are=what)
            if sname in ("up", "down"):
                ex = 2.0 * exec_rows * H * I * (2 if sname == "up" else 1)
                row["executed_tflops"] = ex / ms / 1e9
                row["useful_tflops"] = 2.0 * pulled * H * I * (2 if sname == "up" else 1) / ms / 1e9
            if sname == "shared":
                row["executed_tflops"] = 6.0 * T * H * I / ms / 1e9
            if sname == "pull":
                row["remote_rows"] = pulled - (c_rows[ctx.rank] if c_rows else 0)
            ctx.add(**row)
        ctx.log("  stages (ms): " + "  ".join(f"{k} {v:.3f}" for k, v in st.items())
                + f"  | up {derived['up'][0] / st['up']:.0f} GB/s, down {derived['down'][0] / st['down']:.0f} GB/s,"
                  f" pull {derived['pull'][0] / st['pull']:.0f} GB/s (remote pushed rows {remote_pushed})")
        if not args.sweep:  # the timeline's layer keeps its own (tiled) copy of the weights: one layer at a time
            layer = None  # (deepseek_v4_pro at EP=1: 51 GB of bf16 weights a copy)
            _empty_cache(ctx)
        tline = timeline(ctx, inp, tile, prec, max(5, args.iters // 2))
        if tline:
            ctx.add(section="timeline", shape=name, precision=prec, **{f"{k}_ms": v for k, v in tline.items()})
            ctx.log("  timeline (ms from start, phase ends): " + "  ".join(f"{k} {v:.3f}" for k, v in tline.items()))
        if args.sweep:
            sweep(ctx, name, inp, layer, base, prec, only=[v for v in args.variants.lower().split(",") if v],
                  ab_rounds=args.ab_rounds,
                  iters=args.ab_iters if args.ab_iters is not None else min(20, args.iters),
                  warmup=args.ab_warmup if args.ab_warmup is not None else min(5, args.warmup))
        layer = None  # frees the layer's buffers (and, with the cache cleared, the workspace)
        clear_workspace_cache()
        _empty_cache(ctx)
    del inp
    _empty_cache(ctx)
    ctx.log(f"  ({time.time() - t0:.0f} s)")


def _empty_cache(ctx: Ctx) -> None:
    if not ctx.smoke:
        torch.cuda.empty_cache()


def ab_times(ctx: Ctx, base_fn: Callable[[], Any], var_fn: Callable[[], Any], *, rounds: int, iters: int,
             warmup: int) -> dict[str, float]:
    """A variant against the default, interleaved: ``rounds`` rounds of ``iters`` forwards of each, the order
    alternating (default first in even rounds). A board at its power limit drifts in clock by several percent within a
    minute (the journal, lab/perf-notes.md: the clock each row ran at), so a variant timed once after the default can
    win or lose by the drift alone; the ratio of each round's medians cancels what the two share. Returns the medians
    over the rounds' medians (``forward_ms``, ``base_forward_ms``), the median, lowest and highest per-round ratio
    variant / default, and each side's median SM clock over the rounds (``sm_clock_mhz``, ``base_sm_clock_mhz``; NaN
    without NVML)."""
    var, base, var_clk, base_clk = [], [], [], []
    for r in range(max(1, rounds)):
        pairs = ((base_fn, base, base_clk), (var_fn, var, var_clk))
        for fn, out, clk in pairs if r % 2 == 0 else pairs[::-1]:
            st = forward_stats(ctx, fn, iters, warmup)
            out.append(st.median_ms)
            clk.append(st.clocks.get("sm_clock_mhz", float("nan")))
    ratios = [v / b for v, b in zip(var, base)]
    return {"forward_ms": med(var), "base_forward_ms": med(base), "ratio": med(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "sm_clock_mhz": med(var_clk), "base_sm_clock_mhz": med(base_clk)}


def sweep(ctx: Ctx, name: str, inp: LayerInputs, base_layer: MoKHopperLayer, base: TileConfig,
          precision: str = "bf16", only: Sequence[str] = (), ab_rounds: int = 3, iters: int = 20,
          warmup: int = 5) -> None:
    """Forward and stage times of tile / pipeline variants on the same inputs (a layer per variant), each forward
    timed against the default interleaved (:func:`ab_times`). ``only``: the variants whose label contains one of
    these (lower case); which run at ``precision``: :func:`~mok_tools.mok_hopper.variants.runs_at`."""
    T, K = inp.topk_idx_TK.shape
    for label, over, layer_kw in SWEEP:
        if not runs_at(label, precision):
            continue
        if only and not any(o in label.lower() for o in only):
            continue
        try:
            tile = replace(base, **over)
            if precision == "fp8":
                tile = tile.for_fp8()
            layer = MoKHopperLayer(inp.w13_LIH, inp.w2_LHI, topk=K, tokens=T, shared=shared_weights(inp),
                                   group=ctx.group, tile=tile, precision=precision, **layer_kw)
            out = call(layer, inp)
            ok = ctx.all_ok(errors(ctx, out, call(base_layer, inp))[1] < 0.01)
            ab = ab_times(ctx, lambda: call(base_layer, inp), lambda: call(layer, inp), rounds=ab_rounds,
                          iters=iters, warmup=warmup)
            st = time_stages(ctx, layer, inp, 5)
            ctx.add(section="sweep", shape=name, precision=precision, variant=label, ok=ok, forward_ms=ab["forward_ms"],
                    base_forward_ms=ab["base_forward_ms"], ratio=ab["ratio"], ratio_min=ab["ratio_min"],
                    ratio_max=ab["ratio_max"], ab_rounds=ab_rounds, ab_iters=iters, ab_warmup=warmup,
                    sm_clock_mhz=ab["sm_clock_mhz"], base_sm_clock_mhz=ab["base_sm_clock_mhz"],
                    up_ms=st["up"], down_ms=st["down"],
                    pull_ms=st["pull"], shared_ms=st["shared"], schedule_ms=st["schedule"],
                    graph_error=layer.graph_error)
            ctx.log(f"  sweep {precision} {label:<22} forward {ab['forward_ms']:.3f} (default "
                    f"{ab['base_forward_ms']:.3f}; x{ab['ratio']:.3f}, rounds {ab['ratio_min']:.3f}-"
                    f"{ab['ratio_max']:.3f}; {ab['sm_clock_mhz']:.0f} / {ab['base_sm_clock_mhz']:.0f} MHz)  up "
                    f"{st['up']:.3f}  down {st['down']:.3f}  pull {st['pull']:.3f} ms"
                    + ("" if ok else "  MISMATCH")
                    + (f"  graph failed: {layer.graph_error}" if layer.graph_error else ""))
            layer = None
            if label in TIMELINE_VARIANTS:
                tline = timeline(ctx, inp, tile, precision, 10)
                if tline:
                    ctx.add(section="timeline", shape=name, precision=precision, variant=label,
                            **{f"{k}_ms": v for k, v in tline.items()})
                    ctx.log("    timeline: " + "  ".join(f"{k} {v:.3f}" for k, v in tline.items()))
        except Exception as e:  # noqa: BLE001
            ctx.log(f"  sweep {label}: {type(e).__name__}: {e}")
            ctx.add(section="sweep", shape=name, precision=precision, variant=label, ok=False, error=str(e)[:200])


def unrunnable(shapes: Sequence[str], args: argparse.Namespace) -> Optional[str]:
    """Why these shapes and precisions can never run at this world size (the harness's own checks), or None."""
    bad = [p for p in args.precisions if p not in PRECISIONS]
    if bad or not args.precisions:
        return f"--precisions {','.join(bad) or '(none)'}: mok_hopper runs {', '.join(PRECISIONS)}"
    if not shapes:
        return "--shapes is empty: name one of configs/shape, e.g. --shapes glm_5_2"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name in shapes:
        try:
            shape_cases(name, world, "cpu" if args.smoke else "cuda", args.tokens, args.precisions)
        except (ConfigError, ValueError) as e:
            return f"--shapes {name}: {e}" + (f" (here: --shapes {name.partition('@')[0]}@<N>epg)"
                                              if "local_experts" in str(e) else "")
    return None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for mok_hopper_gpu_check.csv")
    ap.add_argument("--shapes", default=",".join(published_shapes()),
                    help="comma list of shapes of configs/shape (name or name@Nepg: N experts per GPU); default: the "
                         "published ones")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=20, help="determinism: forwards compared bitwise to the first")
    ap.add_argument("--comm-sms", type=int, default=None)
    ap.add_argument("--tile", default="", help="base tile overrides, e.g. tma=1,num_chunks=2")
    ap.add_argument("--watchdog", type=float, default=150.0,
                    help="every this many seconds without finishing, every rank prints its Python stack")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--variants", default="",
                    help="comma list: run only the sweep variants whose label contains one of these (case-insensitive)")
    ap.add_argument("--ab-rounds", type=int, default=3,
                    help="sweep: rounds of default / variant forwards, interleaved (their per-round ratio is reported)")
    ap.add_argument("--ab-iters", type=int, default=None,
                    help="sweep: timed forwards per round and side (default min(20, --iters)); a few hundred keep the "
                         "board at its power limit, as the harness's published timing does")
    ap.add_argument("--ab-warmup", type=int, default=None,
                    help="sweep: untimed forwards before each (default min(5, --warmup))")
    ap.add_argument("--no-edge", dest="edge", action="store_false")
    ap.add_argument("--quick", action="store_true", help="edge cases + the first of --shapes, bf16, few iterations")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, 1 rank, TRITON_INTERPRET=1, tiny shapes: tests this script, measures nothing")
    args = ap.parse_args(argv)
    args.precisions = [p for p in args.precisions.split(",") if p]
    try:
        args.tile_over = parse_tile_overrides(args.tile)
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    shapes = [s for s in args.shapes.split(",") if s]
    if args.quick:
        shapes, args.precisions, args.iters, args.warmup, args.sweep = shapes[:1], ["bf16"], 10, 3, False
    if args.smoke:
        shapes, args.tokens, args.iters, args.warmup, args.repeats = [SMOKE_SHAPE], 32, 2, 1, 2
    why = unrunnable(shapes, args)
    if why:  # one line, exit 2, before any rank initialises anything
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"gpu_check: {why}", file=sys.stderr)
        return 2
    if args.watchdog > 0 and not args.smoke:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    ctx = Ctx(smoke=args.smoke)
    t0 = time.time()
    gpu = "cpu (smoke)" if ctx.smoke else torch.cuda.get_device_name()
    ctx.log(f"mok_hopper gpu_check: {gpu} x{ctx.world}, torch {torch.__version__}, "
            f"triton {__import__('triton').__version__}, multicast env "
            f"{os.environ.get('TORCH_SYMM_MEM_DISABLE_MULTICAST', 'unset')}")
    rates = machine_rates(ctx)
    ctx.add(section="machine", **rates, gpu=gpu, world=ctx.world)
    ctx.log(f"machine: HBM copy {rates['hbm_gb_s']:.0f} GB/s, bf16 GEMM {rates['gemm_tflops']:.0f} TFLOP/s")
    if args.edge:
        edge_cases(ctx, args.tile_over)
    for name in shapes:
        published(ctx, name, args, rates)
    if ctx.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = write_csv(ctx.rows, os.path.join(args.out, "mok_hopper_gpu_check.csv"))
        print_table(ctx.rows)
        print(f"wrote {path}; {ctx.failed} failed checks; {time.time() - t0:.0f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if ctx.failed else 0


def write_csv(rows: list[dict[str, Any]], path: str) -> str:
    """The rows as a CSV (columns in first-seen order; a row without a column leaves it empty); returns ``path``."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    return path


def print_table(rows: list[dict[str, Any]]) -> None:
    fw = [r for r in rows if r["section"] == "forward"]
    if fw:
        print(f"\n{'shape':<16} {'prec':<5} {'ms':>7} {'TF/s':>6} {'floor':>6} {'roof%':>6} {'gmm ms':>7}")
        for r in fw:
            g = r.get("grouped_mm_ms")
            print(f"{r['shape']:<16} {r['precision']:<5} {r['latency_ms']:7.3f} {r['tflops_per_gpu']:6.0f} "
                  f"{max(r['memory_floor_ms'], r['compute_floor_ms']):6.3f} {100 * r['roofline_fraction']:5.0f}% "
                  f"{g if g is None else round(g, 3)!s:>7}")
    st = [r for r in rows if r["section"] == "stage"]
    if st:
        print(f"\n{'shape':<16} {'prec':<5} " + " ".join(f"{s:>9}" for s in STAGES))
        order = published_shapes() + [SMOKE_SHAPE]
        keys = sorted({(r["shape"], r["precision"]) for r in st},
                      key=lambda k: (order.index(b) if (b := k[0].partition("@")[0]) in order else len(order), k[0],
                                     k[1]))
        for shape, prec in keys:
            ms = {r["stage"]: r["ms"] for r in st if r["shape"] == shape and r["precision"] == prec}
            print(f"{shape:<16} {prec:<5} " + " ".join(f"{ms.get(s, math.nan):9.3f}" for s in STAGES))


if __name__ == "__main__":
    sys.exit(main())
