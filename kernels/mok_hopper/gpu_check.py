"""GPU check of mok_hopper: correctness against a plain torch reference, 20x determinism, per-stage timing.

Run (repository root; 2 GPUs, then 1)::

    torchrun --nproc-per-node=2 -m kernels.mok_hopper.gpu_check --out /tmp/mokh
    torchrun --nproc-per-node=1 -m kernels.mok_hopper.gpu_check --out /tmp/mokh1 --shapes glm_5_2
    # the published experts per GPU: shape@Nepg
    torchrun --nproc-per-node=2 -m kernels.mok_hopper.gpu_check --out /tmp/mokh --shapes qwen3_5_397b@8epg

What it does, every rank in lockstep (self-contained: no harness imports):

1. edge cases on a small shape (bf16, and fp8 for the first two): uniform routing, an expert with no tokens,
   every token's first choice on one expert, every token on rank 0's experts, top-1, masked ids (-1),
   clamped SwiGLU, router weights applied in the epilogue; each checked against the reference;
2. the four published shapes at ``--tokens`` per GPU (EP = world size), bf16 and fp8: check against the
   reference (bf16 gate abs 0.5 / rel-L1 0.01, fp8 gate 1.0 / 0.1), 20 repeats must give identical bits, then
   the whole forward timed (median of per-iteration max over ranks, CUDA events, aligned by an all-reduce), then
   every stage timed alone (non-overlapped), with bandwidths and FLOP rates, and torch._grouped_mm on the same
   rows for comparison;
   then a timeline of the real forward (GPU-timer stamps at every phase end, both streams, graph replayed);
3. a sweep of tile / pipeline variants against the defaults (``SWEEP``; fp8 runs ``SWEEP_FP8``; ``--no-sweep``
   skips it);
4. rates of this machine for the floors: HBM copy, dense bf16 GEMM.

Prints a compact table and writes ``DIR/mok_hopper_gpu_check.csv`` (rank 0). Exit code 1 if any check failed.
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
from dataclasses import fields, replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.mok_hopper.tiles import TileConfig
from kernels.mok_hopper.api import MoKHopperLayer, default_tile
from kernels.mok_hopper.workspace import clear_workspace_cache

SHAPES = {  # name: (E, H, I, K); each has one shared expert with the same I
    "kimi_k2_7": (384, 7168, 2048, 8),
    "glm_5_2": (256, 6144, 2048, 8),
    "qwen3_5_397b": (512, 4096, 1024, 10),
    "deepseek_v4_pro": (384, 7168, 3072, 6),
}
SMOKE_SHAPES = {"tiny": (8, 256, 128, 2)}  # --smoke (CPU interpreter)
GATES = {"bf16": (0.5, 0.01), "fp8": (1.0, 0.1)}  # (abs-max, rel-L1), the published gates


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
# inputs and the reference


def make_routing(T: int, K: int, E: int, P: int, rank: int, mode: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    logits = torch.randn(T, E, generator=g)
    if mode == "empty_expert":
        logits[:, 0] = -1e9  # expert 0 never chosen
    elif mode == "one_expert":
        logits[:, 1] = 1e9  # every token's first choice is expert 1
    elif mode == "one_rank":
        logits[:, E // P :] = -1e9  # every token to rank 0's experts
    vals, idx = logits.topk(K, dim=-1)
    w = torch.softmax(vals, dim=-1)
    if mode == "masked":
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    return idx, w


def make_inputs(ctx: Ctx, E: int, H: int, I: int, K: int, T: int, mode: str, seed: int) -> dict[str, Any]:
    P, L = ctx.world, E // ctx.world
    idx, w = make_routing(T, K, E, P, ctx.rank, mode, seed)
    g = torch.Generator(device=ctx.dev).manual_seed(seed * 7 + 11)  # same shared weights everywhere
    gr = torch.Generator(device=ctx.dev).manual_seed(seed * 7 + 1000 + ctx.rank)  # this rank's experts

    def rnd(shape, scale, gen):
        return torch.randn(shape, generator=gen, device=ctx.dev, dtype=torch.bfloat16).mul_(scale)

    xg = torch.Generator(device=ctx.dev).manual_seed(seed * 7 + 2000 + ctx.rank)
    return dict(x=rnd((T, H), 1.0, xg), idx=idx.to(ctx.dev), w=w.to(ctx.dev),
                w13=rnd((L, 2 * I, H), H ** -0.5, gr), w2=rnd((L, H, I), I ** -0.5, gr),
                shared=(rnd((I, H), H ** -0.5, g), rnd((I, H), H ** -0.5, g), rnd((H, I), I ** -0.5, g)))


def _swiglu(g: torch.Tensor, u: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


@torch.no_grad()
def reference(ctx: Ctx, inp: dict[str, Any], limit: Optional[float]) -> torch.Tensor:
    """All-gather tokens, routing and router weights; each rank runs its experts with per-expert bf16 GEMMs and
    adds router-weighted rows in fp32; sum over ranks; plus the shared expert."""
    x, idx, w, w13, w2 = inp["x"], inp["idx"], inp["w"], inp["w13"], inp["w2"]
    P, T, L, I = ctx.world, x.shape[0], w13.shape[0], w2.shape[2]

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(P)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    x_all, idx_all, w_all = gather(x), gather(idx), gather(w)
    acc = torch.zeros(x_all.shape, dtype=torch.float32, device=x.device)
    for j in range(L):
        tok, kk = torch.nonzero(idx_all == ctx.rank * L + j, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x_all[tok]
        ye = _swiglu(xe @ w13[j, :I].t(), xe @ w13[j, I:].t(), limit) @ w2[j].t()
        acc.index_add_(0, tok, w_all[tok, kk].unsqueeze(-1) * ye.float())
    dist.all_reduce(acc)
    out = acc[ctx.rank * T : (ctx.rank + 1) * T]
    sg, su, sd = inp["shared"]
    out = out + (_swiglu(x @ sg.t(), x @ su.t(), limit) @ sd.t()).float()
    return out.to(torch.bfloat16)


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    d = (got.float() - want.float()).abs()
    return float(d.max()), float(d.sum() / want.float().abs().sum().clamp(min=1e-30))


def worst(ctx: Ctx, a: float, r: float) -> tuple[float, float]:
    t = torch.tensor([a, r], device=ctx.dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


# ---------------------------------------------------------------------------------------------------------------
# timing


def time_iters(ctx: Ctx, fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    """Per-iteration ms, max over ranks (aligned by an all-reduce before each iteration)."""
    align = torch.zeros(1, device=ctx.dev)
    for _ in range(warmup):
        dist.all_reduce(align)
        fn()
    if ctx.smoke:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        dist.all_reduce(align)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    t = torch.tensor([s.elapsed_time(e) for s, e in ev], device=ctx.dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class _HostEvent:
    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def med(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


STAGES = ("stage", "barrier0", "schedule", "pull", "shared", "up", "down", "barrier1", "epilogue")


def time_stages(ctx: Ctx, layer: MoKHopperLayer, inp: dict[str, Any], iters: int) -> dict[str, float]:
    """Median ms of each stage run alone, in order, on the main stream (no overlap)."""
    C = layer.cfg.num_chunks
    x, idx, w = inp["x"], inp["idx"], inp["w"]
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


def timeline(ctx: Ctx, inp: dict[str, Any], tile: TileConfig, precision: str, iters: int) -> dict[str, float]:
    """Where each phase of the real (overlapped, graph-replayed) forward ends: ms from its start, median over
    iterations, max over ranks, from GPU-timer stamps (a layer built with ``timeline=True``)."""
    from kernels.mok_hopper.api import STAMPS

    if ctx.smoke:
        return {}
    T, K = inp["idx"].shape
    layer = MoKHopperLayer(inp["w13"], inp["w2"], topk=K, tokens=T, shared=inp["shared"], group=ctx.group,
                           tile=tile, precision=precision, timeline=True)
    samples: dict[str, list[float]] = {s: [] for s in STAMPS}
    align = torch.zeros(1, device=ctx.dev)
    for it in range(iters + 3):
        dist.all_reduce(align)
        layer(inp["x"], inp["idx"], inp["w"])
        ms = layer.timeline_ms()
        if it >= 3:
            for k, v in ms.items():
                samples[k].append(v)
    t = torch.tensor([med(samples[s]) for s in STAMPS], device=ctx.dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(STAMPS, t.tolist()))


def grouped_mm_ms(ctx: Ctx, layer: MoKHopperLayer, inp: dict[str, Any], iters: int) -> Optional[float]:
    """torch._grouped_mm gate/up + SwiGLU + down on the same (padded) rows and the layer's weights as given
    (``inp``; the layer's own copy may be tiled), for comparison (bf16 only)."""
    if not hasattr(torch, "_grouped_mm") or layer.fp8 or ctx.smoke:
        return None
    counts = layer.sched.counts_L.long()
    padded = ((counts + layer.cfg.block_m - 1) // layer.cfg.block_m) * layer.cfg.block_m
    offs = torch.cumsum(padded, 0).to(torch.int32)
    n = int(offs[-1])
    x = layer.x_rows[:n]
    w13t, w2t = inp["w13"].transpose(-2, -1), inp["w2"].transpose(-2, -1)

    def run() -> None:
        h = torch._grouped_mm(x, w13t, offs=offs)
        g, u = h.chunk(2, dim=-1)
        torch._grouped_mm(F.silu(g) * u, w2t, offs=offs)

    return med(time_iters(ctx, run, iters, 3))


def machine_rates(ctx: Ctx) -> dict[str, float]:
    """HBM copy GB/s (read + write bytes) and dense bf16 GEMM TFLOP/s on this GPU."""
    if ctx.smoke:
        return {"hbm_gb_s": 1.0, "gemm_tflops": 1.0}
    a = torch.empty(1 << 30, dtype=torch.uint8, device=ctx.dev)
    b = torch.empty_like(a)
    hbm = 2 * a.numel() / (med(time_iters(ctx, lambda: b.copy_(a), 10, 3)) / 1e3) / 1e9
    m = torch.randn(8192, 8192, device=ctx.dev, dtype=torch.bfloat16)
    gemm = 2 * 8192 ** 3 / (med(time_iters(ctx, lambda: m @ m, 10, 3)) / 1e3) / 1e12
    return {"hbm_gb_s": hbm, "gemm_tflops": gemm}


# ---------------------------------------------------------------------------------------------------------------
# checks


def check_layer(ctx: Ctx, label: str, inp: dict[str, Any], *, precision: str, limit: Optional[float] = None,
                repeats: int = 0, **layer_kw: Any) -> tuple[Optional[MoKHopperLayer], dict[str, Any]]:
    T, K = inp["idx"].shape
    res: dict[str, Any] = {"check": label, "precision": precision}
    layer = None
    try:
        layer = MoKHopperLayer(inp["w13"], inp["w2"], topk=K, tokens=T, shared=inp["shared"], swiglu_limit=limit,
                               precision=precision, group=ctx.group, **layer_kw)
        out = layer(inp["x"], inp["idx"], inp["w"])
        if not ctx.smoke:
            torch.cuda.synchronize()
        want = reference(ctx, inp, limit)
        a, r = worst(ctx, *errors(out, want))
        overflow = layer.overflow_rows()
        atol, rtol = GATES[precision]
        ok = a <= atol and r <= rtol and overflow == 0 and bool(torch.isfinite(out.float()).all())
        res.update(max_abs_err=a, rel_err=r, overflow_rows=overflow)
        if repeats:
            same = True
            for _ in range(repeats):  # every rank runs every repeat (each forward has barriers)
                same &= torch.equal(out, layer(inp["x"], inp["idx"], inp["w"]))
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


def edge_cases(ctx: Ctx, tile_over: Optional[dict[str, Any]] = None) -> None:
    P = ctx.world
    E, H, I, K, T = (8, 256, 128, 2, 32) if ctx.smoke else (16 * P, 1024, 512, 4, 512)
    ctx.log(f"edge cases: E={E} H={H} I={I} K={K} T={T} EP={P}")
    cases = [("uniform", K, {}), ("empty_expert", K, {}), ("one_expert", K, {}), ("one_rank", K, {}),
             ("uniform", 1, {}), ("masked", K, {}), ("uniform", K, {"limit": 0.05}),
             ("uniform", K, {"router_weight_in": "epilogue"}), ("uniform", K, {"tile_chunks": 1})]
    for n, (mode, k, extra) in enumerate(cases):
        inp = make_inputs(ctx, E, H, I, k, T, mode, seed=100 + n)
        extra = dict(extra)
        limit = extra.pop("limit", None)
        kw: dict[str, Any] = {}
        if "router_weight_in" in extra:
            kw["router_weight_in"] = extra["router_weight_in"]
        label = f"edge {mode} K={k}" + "".join(f" {a}={b}" for a, b in extra.items()) + \
                (f" limit={limit}" if limit else "")
        for prec in (("bf16", "fp8") if n < 2 else ("bf16",)):
            tile = replace(default_tile(precision=prec, device=ctx.dev, hidden=H, ffn=I), **(tile_over or {}))
            if prec == "fp8":
                tile = tile.for_fp8()
            if "tile_chunks" in extra:
                tile = replace(tile, num_chunks=extra["tile_chunks"])
            layer, _ = check_layer(ctx, label, inp, precision=prec, limit=limit, repeats=3, tile=tile, **kw)
            del layer
        del inp
        clear_workspace_cache()


def published(ctx: Ctx, name: str, args: argparse.Namespace, rates: dict[str, float]) -> None:
    base_name, _, per_gpu = name.partition("@")  # "shape@6epg": the published experts per GPU
    E, H, I, K = {**SHAPES, **SMOKE_SHAPES}[base_name]
    P, T = ctx.world, args.tokens
    if per_gpu:
        E = int(per_gpu.removesuffix("epg")) * P
    if E % P:
        ctx.log(f"{name}: {E} experts do not split over {P} ranks, skipped")
        return
    L = E // P
    ctx.log(f"{name}: E={E} (L={L}/GPU) H={H} I={I} K={K} T={T} EP={P}")
    t0 = time.time()
    inp = make_inputs(ctx, E, H, I, K, T, "uniform", seed=1)
    flops = 6.0 * (T + T * K) * H * I  # published formula
    for prec in args.precisions:
        base = default_tile(device=ctx.dev, comm_sms=args.comm_sms, hidden=H, ffn=I, rows_per_expert=P * T * K / E)
        base = replace(base, **args.tile_over)  # bf16; the sweep's overrides apply to it before for_fp8
        tile = base.for_fp8() if prec == "fp8" else base
        layer, res = check_layer(ctx, f"{name}", inp, precision=prec, repeats=args.repeats, tile=tile)
        if layer is None or res["status"] != "ok":
            layer = None
            continue
        x, idx, w = inp["x"], inp["idx"], inp["w"]
        fwd = time_iters(ctx, lambda: layer(x, idx, w), args.iters, args.warmup)
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
        lat = med(fwd)
        s = sorted(fwd)
        ctx.add(section="forward", shape=name, precision=prec, ep=P, tokens=T, latency_ms=lat,
                p20_ms=s[len(s) // 5], p80_ms=s[(4 * len(s)) // 5], tflops_per_gpu=flops / lat / 1e9,
                memory_floor_ms=mem_floor, compute_floor_ms=comp_floor,
                roofline_fraction=max(mem_floor, comp_floor) / lat, tiles=n_tiles, block_m=BM, gemm_rows=exec_rows,
                routed_rows=int(layer.sched.counts_L.sum()), half_tiles=tile.half_tiles, ready_flags=tile.ready_flags,
                comm_sms=tile.comm_sms, chunks=tile.num_chunks, grouped_mm_ms=gmm, graph_error=layer.graph_error)
        ctx.log(f"  forward {prec}: {lat:.3f} ms  {flops / lat / 1e9:.0f} TF/s/GPU  floor {max(mem_floor, comp_floor):.3f}"
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
                  ab_rounds=args.ab_rounds, iters=min(20, args.iters), warmup=min(5, args.warmup))
        layer = None  # frees the layer's buffers (and, with the cache cleared, the workspace)
        clear_workspace_cache()
        _empty_cache(ctx)
    del inp
    _empty_cache(ctx)
    ctx.log(f"  ({time.time() - t0:.0f} s)")


def _empty_cache(ctx: Ctx) -> None:
    if not ctx.smoke:
        torch.cuda.empty_cache()


SWEEP = [  # (label, overrides of the base tile, layer options); tiles checked by aot_check to fit on sm_90
    # the default itself, as a second layer: its ratio is what a sweep reads when nothing changes (A/A control)
    ("default again (A/A control)", {}, {}),
    # the expert weights row-major, as given, instead of in TMA block order (w_tiled, the default from session 10)
    ("row-major weights (v9)", dict(w_tiled=False, up_fused=False), {}),
    # one up-GEMM MMA of N = 2 x up_n over gate and up weight rows interleaved (up_fused; the default on glm_5_2
    # from v11, session 11), here on any shape
    ("fused gate/up MMA", dict(up_fused=True), {}),
    # with the down GEMM 256 wide, 4 stages, not flattened (v11's glm_5_2 tiles, on any shape)
    ("fused gate/up MMA + 256-wide down", dict(up_fused=True, flat_down=False, down_n=256,
                                             down_stages=4), {}),
    # two up-GEMM MMAs, gate and up blocks apart (v10; with "down v5" below, glm_5_2's v10 GEMMs)
    ("unfused gate/up MMAs (v10)", dict(up_fused=False), {}),
    ("v3 layout (full tiles, events, 3/4 stages, torch schedule)",  # the reference point of PERF_NOTES v3
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
    # an expert's last rows as a second MMA with the rows in N, off the same weight tiles (tail_rows; PERF_NOTES
    # session 9)
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
]
SWEEP_FP8 = ("default again (A/A control)", "pull 24 x 16 warps x 8 rows", "shared last",
             "shared before up, beside the pull (v7)",
             "shared beside up on 16 SMs", "shared beside up on 24 SMs",
             "shared beside up on 32 SMs", "shared beside up on 40 SMs")
TIMELINE_VARIANTS = ("v3 layout (full tiles, events, 3/4 stages, torch schedule)",)  # also get a timeline


def ab_times(ctx: Ctx, base_fn: Callable[[], Any], var_fn: Callable[[], Any], *, rounds: int, iters: int,
             warmup: int) -> dict[str, float]:
    """A variant against the default, interleaved: ``rounds`` rounds of ``iters`` forwards of each, the order
    alternating (default first in even rounds). A board at its power limit drifts in clock by several percent
    within a minute (PERF_NOTES, session 8), so a variant timed once after the default can win or lose by the
    drift alone; the ratio of each round's medians cancels what the two share. Returns the medians over the
    rounds' medians (``forward_ms``, ``base_forward_ms``) and the median, lowest and highest per-round ratio
    variant / default."""
    var, base = [], []
    for r in range(max(1, rounds)):
        for fn, out in ((base_fn, base), (var_fn, var)) if r % 2 == 0 else ((var_fn, var), (base_fn, base)):
            out.append(med(time_iters(ctx, fn, iters, warmup)))
    ratios = [v / b for v, b in zip(var, base)]
    return {"forward_ms": med(var), "base_forward_ms": med(base), "ratio": med(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


def sweep(ctx: Ctx, name: str, inp: dict[str, Any], base_layer: MoKHopperLayer, base: TileConfig,
          precision: str = "bf16", only: Sequence[str] = (), ab_rounds: int = 3, iters: int = 20,
          warmup: int = 5) -> None:
    """Forward and stage times of tile / pipeline variants on the same inputs (a layer per variant), each forward
    timed against the default interleaved (:func:`ab_times`). ``only``: the variants whose label contains one of
    these (lower case); fp8 runs the ``SWEEP_FP8`` ones."""
    T, K = inp["idx"].shape
    for label, over, layer_kw in SWEEP:
        if precision == "fp8" and label not in SWEEP_FP8:
            continue
        if only and not any(o in label.lower() for o in only):
            continue
        try:
            tile = replace(base, **over)
            if precision == "fp8":
                tile = tile.for_fp8()
            layer = MoKHopperLayer(inp["w13"], inp["w2"], topk=K, tokens=T, shared=inp["shared"], group=ctx.group,
                                   tile=tile, precision=precision, **layer_kw)
            out = layer(inp["x"], inp["idx"], inp["w"])
            ok = ctx.all_ok(errors(out, base_layer(inp["x"], inp["idx"], inp["w"]))[1] < 0.01)
            ab = ab_times(ctx, lambda: base_layer(inp["x"], inp["idx"], inp["w"]),
                          lambda: layer(inp["x"], inp["idx"], inp["w"]), rounds=ab_rounds, iters=iters, warmup=warmup)
            st = time_stages(ctx, layer, inp, 5)
            ctx.add(section="sweep", shape=name, precision=precision, variant=label, ok=ok, forward_ms=ab["forward_ms"],
                    base_forward_ms=ab["base_forward_ms"], ratio=ab["ratio"], ratio_min=ab["ratio_min"],
                    ratio_max=ab["ratio_max"], ab_rounds=ab_rounds, up_ms=st["up"], down_ms=st["down"],
                    pull_ms=st["pull"], shared_ms=st["shared"], schedule_ms=st["schedule"],
                    graph_error=layer.graph_error)
            ctx.log(f"  sweep {precision} {label:<22} forward {ab['forward_ms']:.3f} (default "
                    f"{ab['base_forward_ms']:.3f}; x{ab['ratio']:.3f}, rounds {ab['ratio_min']:.3f}-"
                    f"{ab['ratio_max']:.3f})  up {st['up']:.3f}  down {st['down']:.3f}  pull {st['pull']:.3f} ms"
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


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for mok_hopper_gpu_check.csv")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of published shapes")
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
    ap.add_argument("--no-edge", dest="edge", action="store_false")
    ap.add_argument("--quick", action="store_true", help="edge cases + one shape, bf16, few iterations")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, 1 rank, TRITON_INTERPRET=1, tiny shapes: tests this script, measures nothing")
    args = ap.parse_args(argv)
    args.precisions = [p for p in args.precisions.split(",") if p]
    args.tile_over = {k: int(v) for k, _, v in (kv.partition("=") for kv in args.tile.split(",") if kv)}
    for f in fields(TileConfig):  # the on/off switches (annotations are strings here)
        if f.name in args.tile_over and f.type == "bool":
            args.tile_over[f.name] = bool(args.tile_over[f.name])
    if args.watchdog > 0 and not args.smoke:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    shapes = [s for s in args.shapes.split(",") if s]
    if args.quick:
        shapes, args.precisions, args.iters, args.warmup, args.sweep = shapes[:1], ["bf16"], 10, 3, False
    if args.smoke:
        shapes, args.tokens, args.iters, args.warmup, args.repeats = ["tiny"], 32, 2, 1, 2
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
        path = os.path.join(args.out, "mok_hopper_gpu_check.csv")
        keys: list[str] = []
        for r in ctx.rows:
            keys += [k for k in r if k not in keys]
        with open(path, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys)
            wr.writeheader()
            wr.writerows(ctx.rows)
        print_table(ctx.rows)
        print(f"wrote {path}; {ctx.failed} failed checks; {time.time() - t0:.0f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if ctx.failed else 0


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
        order = list(SHAPES) + list(SMOKE_SHAPES)
        keys = sorted({(r["shape"], r["precision"]) for r in st},
                      key=lambda k: (order.index(k[0].partition("@")[0]), k[0], k[1]))
        for shape, prec in keys:
            ms = {r["stage"]: r["ms"] for r in st if r["shape"] == shape and r["precision"] == prec}
            print(f"{shape:<16} {prec:<5} " + " ".join(f"{ms.get(s, math.nan):9.3f}" for s in STAGES))


if __name__ == "__main__":
    sys.exit(main())
