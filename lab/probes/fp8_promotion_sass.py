"""Does the block-scaled fp8 GEMM loop keep its tensor-core MMA in flight while the CUDA cores promote the previous
K step's product? A compile-only probe (sm_90 SASS from Triton's own ptxas; no GPU) of two minimal kernels with
the loop of mok_hopper's fp8 up GEMM (``up_gemm._up_item``, FP8 branch: per K step of 128 an e4m3 MMA, then the
product times its 1 x 128 activation scales and its 128 x 128 weight scale added into an fp32 accumulator):

* ``inline``: today's order: this step's MMA, then at once its promotion (what the up GEMM does);
* ``pingpong``: this step's MMA issued, then the previous step's promotion, the product carried one step
  (the candidate for the fp8 forward in the journal, lab/perf-notes.md: ping-pong over K).

With ``--tma`` the operands come through TMA descriptors, as in the up GEMM, and a third loop runs
beside them: ``no promotion`` (``acc = dot(a, w, acc)``, no scales: a wrong result, only to see what the scale
loads and the promotion add to the schedule).

For each: registers and spilled bytes, the QGMMA shapes, the warpgroup waits (``WARPGROUP.DEPBAR.LE gsb0, 0xN``:
N = how many MMA groups may still run; 0 everywhere means each MMA is waited for before anything else), and the
block-wide barriers (``BAR.SYNC``: every warp of the program stops there, so the two warpgroups of an 8-warp
program run each K step in lockstep) and ``LDGSTS`` (cp.async copies: the pipelined pointer loads)::

    python3 lab/probes/fp8_promotion_sass.py [--bm 128 --bn 64 --warps 8 --stages 4] [--tma]

It measures nothing about speed: it says what the compiler schedules.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from typing import Any, Optional

import triton
import triton.language as tl


@triton.jit
def _fp8_loop_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, K, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, STAGES: tl.constexpr, PINGPONG: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PINGPONG:
        prev = tl.zeros((BM, BN), dtype=tl.float32)
        prev_s = tl.zeros((BM,), dtype=tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            a = tl.load(a_ptr + rows[:, None] * K + (k0 + kk)[None, :])
            w = tl.load(w_ptr + (k0 + kk)[:, None] * BN + cols[None, :])
            s = tl.load(sa_ptr + rows * (K // BK) + k0 // BK) * tl.load(sw_ptr + k0 // BK)
            part = tl.dot(a, w)
            acc += prev * prev_s[:, None]
            prev = part
            prev_s = s
        acc += prev * prev_s[:, None]
    else:
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            a = tl.load(a_ptr + rows[:, None] * K + (k0 + kk)[None, :])
            w = tl.load(w_ptr + (k0 + kk)[:, None] * BN + cols[None, :])
            s = tl.load(sa_ptr + rows * (K // BK) + k0 // BK) * tl.load(sw_ptr + k0 // BK)
            acc += tl.dot(a, w) * s[:, None]
    tl.store(out_ptr + rows[:, None] * BN + cols[None, :], acc)


@triton.jit
def _fp8_tma_loop_kernel(a_desc, sa_ptr, w_desc, sw_ptr, out_ptr, K, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, STAGES: tl.constexpr, PROMOTE: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        a = a_desc.load([0, k0])
        w = w_desc.load([0, k0])  # [BN, BK]: weight rows, as the tiled weights
        if PROMOTE:
            s = tl.load(sa_ptr + rows * (K // BK) + k0 // BK) * tl.load(sw_ptr + k0 // BK)
            acc += tl.dot(a, w.T) * s[:, None]
        else:
            acc = tl.dot(a, w.T, acc)
    tl.store(out_ptr + rows[:, None] * BN + cols[None, :], acc)


def _count(sass: list[str], pattern: str) -> dict[str, int]:
    return dict(Counter(m.group(1) if m.groups() else m.group(0) for line in sass
                        for m in [re.search(pattern, line)] if m))


def probe(pingpong: bool, bm: int, bn: int, warps: int, stages: int, arch: int = 90, tma: bool = False,
          promote: bool = True) -> dict[str, Any]:
    from mok_tools.mok_hopper.aot_check import Variant, compile_variant

    if tma:
        label = "fp8 TMA " + ("inline" if promote else "no promotion")
        fn = _fp8_tma_loop_kernel
        v = Variant(label, "_fp8_tma_loop_kernel",
                    dict(a_desc=f"tensordesc<fp8e4nv[{bm}, 128]>", sa_ptr="*fp32",
                         w_desc=f"tensordesc<fp8e4nv[{bn}, 128]>", sw_ptr="*fp32", out_ptr="*fp32", K="i32"),
                    dict(BM=bm, BN=bn, BK=128, STAGES=stages, PROMOTE=promote), warps)
    else:
        fn = _fp8_loop_kernel
        v = Variant("fp8 " + ("pingpong" if pingpong else "inline"), "_fp8_loop_kernel",
                    dict(a_ptr="*fp8e4nv", sa_ptr="*fp32", w_ptr="*fp8e4nv", sw_ptr="*fp32", out_ptr="*fp32",
                         K="i32"),
                    dict(BM=bm, BN=bn, BK=128, STAGES=stages, PINGPONG=pingpong), warps)
    res = compile_variant(v, arch, sass=True, fn=fn)
    sass = res.pop("sass").splitlines()
    res["mma"] = _count(sass, r"[QH]GMMA\.\S+")
    res["waits"] = _count(sass, r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)")
    res["bar_sync"] = sum(_count(sass, r"BAR\.SYNC\S*").values())
    res["ldgsts"] = sum(_count(sass, r"LDGSTS\S*").values())
    return res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bm", type=int, default=128)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--tma", action="store_true", help="operands through TMA descriptors; with and without promotion")
    args = ap.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90, BM {args.bm} x BN {args.bn} x BK 128, {args.warps} warps, "
          f"{args.stages} stages")
    runs = ([dict(pingpong=False, tma=True, promote=True), dict(pingpong=False, tma=True, promote=False)] if args.tma
            else [dict(pingpong=False), dict(pingpong=True)])
    for kw in runs:
        r = probe(bm=args.bm, bn=args.bn, warps=args.warps, stages=args.stages, **kw)
        print(f"{r['label']:22s} regs {r['regs']}, stack {r['stack']} B; MMAs {r['mma']}; waits {r['waits']}; "
              f"BAR.SYNC {r['bar_sync']}; LDGSTS {r['ldgsts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
