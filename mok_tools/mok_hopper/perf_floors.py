"""Floors, targets and the v1 cost model of the journal (lab/perf-notes.md), from a results CSV (the measured rates are
read, not copied).

    python -m mok_tools.mok_hopper.perf_floors \\
        results/runs/h200x2-nccl-20261130T005701/h200x2-nccl-20261130T005701.csv \\
        [results/runs/h200x2-ep-20261130T010910/h200x2-ep-20261130T010910.csv]

The first CSV gives the calibrated rates (``calib_gemm_tflops``, ``calib_hbm_gb_s``, ``calib_link_gb_s``; median over
its bf16 rows) and the remote bytes of each published shape (bf16 fwd, EP=2, 2048 tokens/GPU, uniform routing);
every CSV given contributes baseline latencies (fastest ``ok`` row per shape, any backend but mok*). Markdown on
stdout. Plain ``csv`` (no pandas); the shapes are the published ones of ``configs/shape/*.yaml``.
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from typing import Any

from mok_tools.shapes import published_shapes, shape_config


def published_dims() -> dict[str, tuple[int, int, int, int]]:
    """(E, H, I, K) of each published shape, from configs/shape."""
    return {n: (c["num_experts"], c["hidden"], c["ffn"], c["topk"]) for n in published_shapes()
            for c in (shape_config(n),)}


T, EP, BM = 2048, 2, 128

# v1 model knobs (assumptions, to be replaced by measurements)
HBM_EFF = 0.80  # fraction of the calibrated HBM rate a Triton weight-streaming GEMM sustains
MMA_EFF = {"bf16": 0.70, "fp8": 0.55}  # fraction of the dense GEMM rate on 128-row tiles (fp8: promotion cost)
FP8_GEMM_X = 2.0  # fp8 dense rate = 2 x bf16 (the notes measured 1463 vs 803 TFLOP/s on 8192^3)
PULL_EFF = 0.90  # fraction of the calibrated link rate the pull kernel reaches
FIXED_MS = 0.20  # stage copy + 2 barriers + schedule (about 15 small kernels) + epilogue + launches
CHUNKS = 4


def rows(path: str) -> list[dict[str, Any]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def expected_tiles(mean_rows: float, bm: int = BM) -> float:
    """E[ceil(X / bm)] for X ~ Poisson(mean_rows): tiles per expert (each tile re-reads the expert's weights)."""
    m = mean_rows
    total, spread = 0.0, 10 * math.sqrt(m) + 50
    for k in range(max(0, int(m - spread)), int(m + spread)):
        total += math.exp(-m + k * math.log(max(m, 1e-300)) - math.lgamma(k + 1)) * math.ceil(k / bm)
    return total


def main(argv: list[str]) -> None:
    if not argv:
        print(__doc__)
        return
    SHAPES = published_dims()
    calib = rows(argv[0])
    base = [r for r in calib
            if r.get("status") == "ok" and r.get("direction") == "fwd" and r.get("precision") == "bf16"]
    gemm = statistics.median(num(r["calib_gemm_tflops"]) for r in base if r.get("calib_gemm_tflops"))
    hbm = statistics.median(num(r["calib_hbm_gb_s"]) for r in base if r.get("calib_hbm_gb_s"))
    link = statistics.median(num(r["calib_link_gb_s"]) for r in base
                             if r.get("calib_link_gb_s") and not math.isnan(num(r["calib_link_gb_s"])))
    print(f"Rates (median of the bf16 rows of `{argv[0]}`): GEMM {gemm:.0f} TFLOP/s, HBM {hbm:.0f} GB/s, "
          f"link {link:.0f} GB/s.\n")
    best: dict[str, tuple[float, str]] = {}
    for path in argv:
        for r in rows(path):
            if (r.get("status") == "ok" and r.get("direction") == "fwd" and r.get("precision") == "bf16"
                    and r.get("shape") in SHAPES and int(num(r.get("ep_size"))) == EP
                    and int(num(r.get("tokens_per_gpu"))) == T and r.get("routing") == "uniform"
                    and not str(r.get("backend")).startswith("mok")):
                lat = num(r["latency_ms"])
                if r["shape"] not in best or lat < best[r["shape"]][0]:
                    best[r["shape"]] = (lat, r["backend"])
    remote = {r["shape"]: num(r["dispatch_bytes"]) + num(r["combine_bytes"]) for r in base
              if r.get("shape") in SHAPES and int(num(r.get("ep_size"))) == EP and r.get("routing") == "uniform"
              and int(num(r.get("tokens_per_gpu"))) == T}

    print("| shape | L/GPU | rows/expert | weights GB (bf16) | FLOP floor ms | HBM floor ms | NVLink floor ms "
          "| roofline ms | fastest baseline ms | target ms (70% roofline, 1.3x baseline) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    model: dict[str, dict[str, float]] = {}
    for s, (E, H, I, K) in SHAPES.items():
        L = E // EP
        flops = 6.0 * (T + T * K) * H * I
        weights = 3 * L * H * I * 2 + 3 * H * I * 2
        act = T * H * 2 * (2 + 2 * K)
        f_ms, m_ms = flops / gemm / 1e9, (weights + act) / hbm / 1e6
        l_ms = remote.get(s, math.nan) / link / 1e6
        roof = max(f_ms, m_ms, l_ms)
        b_ms, b_name = best.get(s, (math.nan, "-"))
        target = min(roof / 0.7, b_ms / 1.3)
        print(f"| {s} | {L} | {EP * T * K / E:.0f} | {weights / 1e9:.1f} | {f_ms:.2f} | {m_ms:.2f} | {l_ms:.2f} | "
              f"**{roof:.2f}** | {b_ms:.2f} ({b_name}) | **{target:.2f}** ({roof / 0.7:.2f}, {b_ms / 1.3:.2f}) |")
        model[s] = dict(roof=roof, target=target, baseline=b_ms, flops=flops, roof_link=l_ms)

    print(f"\nv1 model (assumptions: weights streamed once per expert at {HBM_EFF:.0%} of HBM (an expert's second row "
          f"tile re-reads them from L2: same group, same time), MMA bf16 {MMA_EFF['bf16']:.0%} / fp8 "
          f"{MMA_EFF['fp8']:.0%} of dense on the padded rows, fp8 dense = {FP8_GEMM_X} x bf16, pull at "
          f"{PULL_EFF:.0%} of the link, fixed {FIXED_MS} ms, {CHUNKS} chunks; GEMM stage = max(memory, MMA)):\n")
    print("| shape | prec | BM | padded rows / routed rows | up ms | down ms | shared ms | pull ms (exposed) "
          "| predicted ms | TF/s/GPU | % roofline | x fastest baseline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s, (E, H, I, K) in SHAPES.items():
        L = E // EP
        mean = EP * T * K / E
        for prec in ("bf16", "fp8"):
            bpw = 1 if prec == "fp8" else 2
            rate = gemm * (FP8_GEMM_X if prec == "fp8" else 1.0) * MMA_EFF[prec]
            # this precision's roofline: its weight bytes, its dense rate
            w_b = 3 * L * H * I * bpw + 3 * H * I * 2
            roof = max(model[s]["flops"] / (gemm * (FP8_GEMM_X if prec == "fp8" else 1.0)) / 1e9,
                       (w_b + T * H * 2 * (2 + 2 * K)) / hbm / 1e6, model[s]["roof_link"])
            for bm in (128, 64):
                rows_exec = expected_tiles(mean, bm) * bm * L
                up = max(L * 2 * I * H * bpw / (HBM_EFF * hbm) / 1e6, rows_exec * 4 * H * I / rate / 1e9)
                down = max(L * H * I * bpw / (HBM_EFF * hbm) / 1e6, rows_exec * 2 * H * I / rate / 1e9)
                shared = 6.0 * T * H * I / (gemm * MMA_EFF["bf16"]) / 1e9
                row_b = H + 4 * H // 128 if prec == "fp8" else 2 * H
                pull = (T * K / 2) * row_b / (PULL_EFF * link) / 1e6  # the remote half of this rank's rows at EP=2
                total = FIXED_MS + max(shared, pull / CHUNKS) + up + down
                m = model[s]
                print(f"| {s} | {prec} | {bm} | {rows_exec / (mean * L):.2f} | {up:.2f} | {down:.2f} | {shared:.2f} | "
                      f"{pull:.2f} ({pull / CHUNKS:.2f}) | **{total:.2f}** | {m['flops'] / total / 1e9:.0f} | "
                      f"{roof / total:.0%} of {roof:.2f} | {m['baseline'] / total:.2f} |")

if __name__ == "__main__":
    main(sys.argv[1:])
