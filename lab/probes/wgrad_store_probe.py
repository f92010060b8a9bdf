"""How fast can one H200 write a weight gradient in the access patterns of mok_hopper's wgrad kernels?

The backward's weight-gradient stages write dW13 / dW2 at 57-70% of the copy rate (backward v5, run
mok_hopper-bf16-fwd-bwd_h200x1_20261202; the journal, lab/perf-notes.md). This probe writes the same tensors with no
loads and no MMA, so what it measures is the store pattern alone:

* ``zero_``: torch's fill of the whole tensor (contiguous writes);
* ``strips``: the resident kernel's order (a program owns the rows of one (expert, N block) strip and walks its K
  blocks, storing one [BN, BK] block per step), by TMA or by pointers, 1-4 programs per SM;
* ``blocks``: the reloaded-P kernel's order (work items (expert, N block, K block), K fastest across programs);
* ``contiguous``: the strips' order into a layout where every [BN, BK] block is one contiguous piece of memory (what
  tiled weight gradients would be);
* ``columns``: the Q-resident kernel's order (a program owns one (expert, K block) strip and walks its N blocks:
  programs running together write neighbouring column blocks of the same rows).

The strips also run with the kernel's other work added, one part at a time, to find what holds the resident kernel
at 2.4 TB/s on glm_5_2's dW13 where the stores alone reach 3.6-4.3 (the journal, lab/perf-notes.md: v10, dW13 by
pointer stores):

* ``+ MMA``: each stored block is an MMA over ``BR`` rows (P^T @ Q, the kernel's shapes) of operands made in
  registers (no global loads);
* ``+ MMA + Q loads``: the same with Q loaded each step from an [L BR, K] tensor (an expert's X rows, as the kernel
  reads them: the strips of one expert running together share them through L2).

Each variant is timed with CUDA events (median of ``--iters`` after two untimed passes) and reported as GB/s of
bytes written, beside the copy rate of the same bytes (``copy_``: read + write). One GPU::

    python3 lab/probes/wgrad_store_probe.py --out DIR [--shape glm_5_2]
    python3 lab/probes/wgrad_store_probe.py --aot    # compile each variant for sm_90, no GPU

Writes ``DIR/wgrad_store_probe.csv``. Needs CUDA (exit 2 on a machine without it), except ``--aot``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _put(dw_ptr, val, row0, col0, width, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """``val`` [BN, BK] at (row0, col0) of a row-major view ``width`` wide: by TMA (``dw_ptr`` a descriptor over that
    view, 32-bit offsets) or by pointers (64-bit offsets)."""
    if TMA:
        dw_ptr.store([row0, col0], val.to(tl.bfloat16))
    else:
        r = (row0 + tl.arange(0, BN)).to(tl.int64)
        tl.store(dw_ptr + r[:, None] * width + (col0 + tl.arange(0, BK))[None, :], val.to(tl.bfloat16))


@triton.jit
def _strip_value(q_ptr, e, k, wk, K, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, Q_LOAD: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The block a strips step stores: a constant (BR 0), or P^T @ Q over BR rows with P all ones and Q made in
    registers (``k + 1`` everywhere) or loaded from rows [e BR, (e + 1) BR) of the [L BR, K] tensor ``q_ptr``.
    UPCAST: fp32 operands (the interpreter's bf16 dot is broken)."""
    if BR == 0:  # (one return at the end: the compiler visits what follows an early return in a static if)
        val = tl.full((BN, BK), 1.0, tl.float32) * (wk + k)
    else:
        p = tl.full((BR, BN), 1.0, tl.float32).to(tl.bfloat16)
        if Q_LOAD:
            rows = (e * BR + tl.arange(0, BR)).to(tl.int64)
            q = tl.load(q_ptr + rows[:, None] * K + (k * BK + tl.arange(0, BK))[None, :])
        else:
            q = (tl.full((BR, BK), 1.0, tl.float32) * (k + 1)).to(tl.bfloat16)
        if UPCAST:
            val = tl.dot(p.T.to(tl.float32), q.to(tl.float32))
        else:
            val = tl.dot(p.T, q)
    return val


@triton.jit
def _store_kernel(dw_ptr, N, K, L, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGS: tl.constexpr,
                  ORDER: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr, q_ptr=None, BR: tl.constexpr = 0,
                  Q_LOAD: tl.constexpr = False, UPCAST: tl.constexpr = False):
    """ORDER 0: strips (e, n), K blocks inner; 1: blocks (e, n, k), k fastest; 2: strips into contiguous blocks
    (the [L N K / BK, BK] view: block (e, n, k) is rows blk BN ... of it); 3: strips (e, k), N blocks inner.
    BR > 0 (strips): each block an MMA over BR rows, its Q from registers or (Q_LOAD) from ``q_ptr``
    (:func:`_strip_value`)."""
    n_n = N // BN
    n_k = K // BK
    if ORDER == 3:
        for wk in range(tl.program_id(0), L * n_k, NUM_PROGS):
            e = wk // n_k
            k = wk % n_k
            for n in tl.range(0, n_n, num_stages=STAGES):
                _put(dw_ptr, tl.full((BN, BK), 1.0, tl.float32) * (wk + n), e * N + n * BN, k * BK, K, BN, BK, TMA)
    elif ORDER == 1:
        for wk in tl.range(tl.program_id(0), L * n_n * n_k, NUM_PROGS, num_stages=STAGES):
            e = wk // (n_n * n_k)
            n = (wk // n_k) % n_n
            k = wk % n_k
            _put(dw_ptr, tl.full((BN, BK), 1.0, tl.float32) * wk, e * N + n * BN, k * BK, K, BN, BK, TMA)
    else:
        for wk in range(tl.program_id(0), L * n_n, NUM_PROGS):
            e = wk // n_n
            n = wk % n_n
            for k in tl.range(0, n_k, num_stages=STAGES):
                val = _strip_value(q_ptr, e, k, wk, K, BN, BK, BR, Q_LOAD, UPCAST)
                if ORDER == 2:
                    _put(dw_ptr, val, ((e * n_n + n) * n_k + k) * BN, 0, BK, BN, BK, TMA)
                else:
                    _put(dw_ptr, val, e * N + n * BN, k * BK, K, BN, BK, TMA)


ORDERS = {"strips": 0, "blocks": 1, "contiguous": 2, "columns": 3}
# (label, order, tma, BN, BK, warps, programs per SM, stages[, MMA rows BR, Q loaded])
VARIANTS = [
    ("strips tma 128x64 4w 2/SM (v5 wide)", "strips", True, 128, 64, 4, 2, 3),
    ("strips tma 128x128 4w 2/SM (v5)", "strips", True, 128, 128, 4, 2, 3),
    ("strips tma 128x64 4w 1/SM", "strips", True, 128, 64, 4, 1, 3),
    ("strips tma 128x64 4w 4/SM", "strips", True, 128, 64, 4, 4, 3),
    ("strips tma 128x128 8w 1/SM", "strips", True, 128, 128, 8, 1, 3),
    ("strips tma 64x256 4w 2/SM", "strips", True, 64, 256, 4, 2, 3),
    ("strips tma 128x64 4w 2/SM 1 stage", "strips", True, 128, 64, 4, 2, 1),
    ("strips ptr 128x64 4w 2/SM", "strips", False, 128, 64, 4, 2, 3),
    ("strips ptr 128x128 8w 2/SM", "strips", False, 128, 128, 8, 2, 3),
    ("blocks tma 128x64 4w 2/SM", "blocks", True, 128, 64, 4, 2, 3),
    ("blocks tma 128x128 4w 2/SM", "blocks", True, 128, 128, 4, 2, 3),
    ("contiguous tma 128x64 4w 2/SM", "contiguous", True, 128, 64, 4, 2, 3),
    ("contiguous ptr 128x64 4w 2/SM", "contiguous", False, 128, 64, 4, 2, 3),
    # the Q-resident order
    ("columns tma 128x64 4w 2/SM", "columns", True, 128, 64, 4, 2, 3),
    ("columns tma 128x128 4w 2/SM", "columns", True, 128, 128, 4, 2, 3),
    ("columns ptr 128x128 8w 2/SM", "columns", False, 128, 128, 8, 2, 3),
    ("columns ptr 128x128 8w 1/SM", "columns", False, 128, 128, 8, 1, 3),
    # the resident kernel's launches with its MMA, then with its MMA and its Q loads (glm_5_2: 128 rows,
    # 128 x 64 blocks; qwen3_5_397b / kimi_k2_7: 64 rows, 128 x 128, dW13 by pointers since v10)
    ("strips tma 128x64 4w 2/SM + MMA 128 rows", "strips", True, 128, 64, 4, 2, 3, 128, False),
    ("strips tma 128x64 4w 2/SM + MMA 128 rows + Q loads", "strips", True, 128, 64, 4, 2, 3, 128, True),
    ("strips ptr 128x64 4w 2/SM + MMA 128 rows + Q loads", "strips", False, 128, 64, 4, 2, 3, 128, True),
    ("strips tma 128x128 4w 2/SM + MMA 64 rows", "strips", True, 128, 128, 4, 2, 3, 64, False),
    ("strips tma 128x128 4w 2/SM + MMA 64 rows + Q loads", "strips", True, 128, 128, 4, 2, 3, 64, True),
    ("strips ptr 128x128 4w 2/SM + MMA 64 rows + Q loads", "strips", False, 128, 128, 4, 2, 3, 64, True),
    # every weight-gradient stage measured takes about its stores at 4.2 TB/s plus its MMA (over the padded rows)
    # at 790 TFLOP/s, as if the two never overlapped (the journal, lab/perf-notes.md: the weight gradients as stores
    # plus MMA). Half the MMA rows: does the time follow the MMA's FLOPs? Four programs an SM: do more programs
    # overlap one's MMA with another's stores?
    ("strips tma 128x64 4w 2/SM + MMA 64 rows", "strips", True, 128, 64, 4, 2, 3, 64, False),
    ("strips tma 128x64 4w 2/SM + MMA 32 rows", "strips", True, 128, 64, 4, 2, 3, 32, False),
    ("strips tma 128x64 4w 4/SM + MMA 128 rows", "strips", True, 128, 64, 4, 4, 3, 128, False),
    ("strips ptr 128x128 4w 2/SM + MMA 32 rows + Q loads", "strips", False, 128, 128, 4, 2, 3, 32, True),
    # v11's launch for glm_5_2's experts of at most 64 rows (128 x 64 by pointers over 64 rows)
    ("strips ptr 128x64 4w 2/SM + MMA 64 rows + Q loads", "strips", False, 128, 64, 4, 2, 3, 64, True),
]


def _time(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[iters // 2]


def aot(arch: int = 90) -> list[dict]:
    """Compile every variant of :data:`VARIANTS` for ``arch`` without a GPU (aot_check's compiler): registers,
    spill and shared memory, or the error (a variant that does not compile shows here before it costs GPU time)."""
    from mok_tools.mok_hopper import aot_check

    out = []
    for label, order, tma, bn, bk, warps, per_sm, stages, *mma in VARIANTS:
        br, q_load = mma if mma else (0, False)
        types = dict(dw_ptr=f"tensordesc<bf16[{bn}, {bk}]>" if tma else "*bf16", N="i32", K="i32", L="i32",
                     q_ptr="*bf16")
        consts = dict(BN=bn, BK=bk, NUM_PROGS=132 * per_sm, ORDER=ORDERS[order], TMA=tma, STAGES=stages, BR=br,
                      Q_LOAD=q_load, UPCAST=False)
        v = aot_check.Variant(label, "_store_kernel", types, consts, warps)
        try:
            res = aot_check.compile_variant(v, arch=arch, fn=_store_kernel)
            out.append(dict(variant=label, regs=res["regs"], stack=res["stack"], shared=res["shared"]))
        except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
            out.append(dict(variant=label, error=f"{type(e).__name__}: {e}"[:300]))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for wgrad_store_probe.csv (needed unless --aot)")
    ap.add_argument("--shape", default="glm_5_2")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--aot", action="store_true", help="compile every variant for sm_90 (no GPU), exit 1 on an error")
    args = ap.parse_args(argv)
    if args.aot:
        res = aot()
        for r in res:
            print(f"{r['variant']:<56} " + (r["error"] if "error" in r else
                                              f"{r['regs']} registers, {r['stack']} B spill, {r['shared']} B shared"))
        return 1 if any("error" in r for r in res) else 0
    if args.out is None:
        print("wgrad_store_probe: --out DIR is needed to time the variants", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("wgrad_store_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mok_tools.shapes import shape_config

    s = shape_config(args.shape)
    L, H, I = s["num_experts"], s["hidden"], s["ffn"]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for name, (N, K) in {"dW13": (2 * I, H), "dW2": (H, I)}.items():
        dw = torch.empty(L, N, K, dtype=torch.bfloat16, device=dev)
        src = torch.empty_like(dw).normal_()
        gb = dw.numel() * 2 / 1e9
        ms = _time(dw.zero_, args.iters)
        rows.append(dict(tensor=name, variant="torch zero_", ms=round(ms, 4), GBps=round(gb / ms * 1e3, 1)))
        ms = _time(lambda: dw.copy_(src), args.iters)
        rows.append(dict(tensor=name, variant="torch copy_ (read + write)", ms=round(ms, 4),
                         GBps=round(gb / ms * 1e3, 1)))
        del src
        q_rows = {}  # BR -> an [L BR, K] tensor of "X rows", BR per expert
        for label, order, tma, bn, bk, warps, per_sm, stages, *mma in VARIANTS:
            br, q_load = mma if mma else (0, False)
            progs = sms * per_sm
            if order == "contiguous":
                view = dw.view(-1, bk)
            else:
                view = dw.view(-1, K)
            arg = TensorDescriptor.from_tensor(view, [bn, bk]) if tma else dw
            q = None
            if q_load:
                q = q_rows.setdefault(br, torch.randn(L * br, K, dtype=torch.bfloat16, device=dev))

            def run(arg=arg, order=order, tma=tma, bn=bn, bk=bk, warps=warps, progs=progs, stages=stages, q=q, br=br,
                    q_load=q_load):
                _store_kernel[(progs,)](arg, N, K, L, BN=bn, BK=bk, NUM_PROGS=progs, ORDER=ORDERS[order], TMA=tma,
                                        STAGES=stages, q_ptr=q, BR=br, Q_LOAD=q_load, num_warps=warps)

            try:
                ms = _time(run, args.iters)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not the end
                rows.append(dict(tensor=name, variant=label, error=f"{type(e).__name__}: {e}"[:200]))
                continue
            rows.append(dict(tensor=name, variant=label, ms=round(ms, 4), GBps=round(gb / ms * 1e3, 1)))
        del dw, q_rows
        torch.cuda.empty_cache()
    for r in rows:
        print(f"{args.shape} {r['tensor']} {r['variant']}: {r.get('ms')} ms, {r.get('GBps')} GB/s {r.get('error', '')}",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    keys = ["shape", "tensor", "variant", "ms", "GBps", "error"]
    with open(os.path.join(args.out, "wgrad_store_probe.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({"shape": args.shape, **r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
