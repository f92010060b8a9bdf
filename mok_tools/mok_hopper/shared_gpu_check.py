"""Several ranks of mok_hopper on one device, in one process: every rank's output and 8 gradients against the
references, for P = 2 and 4 ranks, bf16 and fp8, H saved or recomputed, uniform routing and an idle rank (one whose
experts get no token), and N bitwise repeats of one case. One GPU proves the EP paths correct this way (not fast: the
ranks share it).

Run (repository root)::

    python -m mok_tools.mok_hopper.shared_gpu_check --out DIR                      # lockstep (GPU, or CPU)
    python -m mok_tools.mok_hopper.shared_gpu_check --out DIR --mode concurrent    # GPU: the ranks at once
    python -m mok_tools.mok_hopper.shared_gpu_check --out DIR --mode concurrent --ready-flags 1
    python -m mok_tools.mok_hopper.shared_gpu_check --out DIR --mode concurrent --break missing-fence  # must fail

Modes (:mod:`mok_tools.mok_hopper.shared_ranks`): ``lockstep`` runs each phase (stage, compute, finish, and the
backward's three) for every rank in turn, which satisfies the cross-rank barriers by order; ``concurrent`` (CUDA
only) puts every rank's phase in flight at once on its own stream, the barriers being event waits between the
ranks' streams, the last rank ``--skew-ms`` late at every phase. In the concurrent mode the default is
``--ready-flags 0``: the up GEMM waits for the pull by a stream event instead of spinning on the ready counters, so
no program ever waits on another and no residency assumption is needed. ``--ready-flags 1`` keeps the counters and
caps each rank's up GEMM grid by :func:`~mok_tools.mok_hopper.shared_ranks.spinning_cap`, from the compiled
kernels' registers and shared memory (read after a lockstep step has compiled them); no shared expert on SMs of its
own there (``shared_sms=0``). ``--break`` injects a fault (``shared_ranks.BREAKS``): the check must then fail.

Every checked step follows a step of other inputs on the same layers (a state one forward leaves must not leak into
the next). References: the twin (``twin.simulate``, ``twin_bwd.simulate_backward``: the same recipe, tolerance
``twin_tol``: ``TOL["twin"]``, fp8 on a GPU ``TWIN_TOL_FP8_GPU``) and, within the precision's gate, the bf16 twin
(forward) and torch autograd in fp32 (backward).

Writes ``DIR/shared_gpu_check.csv``: one row per case and direction (ranks, precision, direction, mode, routing, h,
break, ok, worst errors and where, identical repeats). Exit 0 if every check passed, 1 if one failed or a step timed
out, 2 (one line, nothing written) for options that cannot run here. On the CPU it runs in lockstep under
TRITON_INTERPRET=1 at the simulated-rank tests' sizes.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernels module imports triton
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # a hardware queue per stream (before CUDA starts)

from mok_tools.mok_hopper.shared_ranks import (BREAKS, MODES, CheckTimeout, Ranks, Weights,  # noqa: E402
                                                compiled_use, spinning_cap)
from mok_kernels.mok_hopper.twin import backward as twin_bwd, forward as twin  # noqa: E402
from mok_kernels.mok_hopper.tiles import TileConfig, default_tile, num_sms  # noqa: E402

PRECISIONS = ("bf16", "fp8")
ROUTINGS = ("uniform", "idle")  # idle: no token goes to the last rank's experts
H_MODES = ("save_h", "recompute")
# T, K, E, H, I: the simulated-rank tests' sizes on the CPU (fp8: hidden and ffn multiples of 128), and a shape the
# CUDA default tiles divide on a GPU
SHAPES = {("cpu", "bf16"): (24, 3, 8, 128, 64), ("cpu", "fp8"): (24, 3, 8, 256, 128),
          ("cuda", "bf16"): (256, 4, 16, 1024, 512), ("cuda", "fp8"): (256, 4, 16, 1024, 512)}
# rel-L1: to the twin; to the reference (the precision's gate). The shared expert's gradients are checked against the
# reference only, as the simulated-rank tests do (its backward runs torch GEMMs, the twin another rounding order).
TOL = {"twin": 5e-3, "bf16": 1e-2, "fp8": 0.1}
# fp8 kernel against its twin on a GPU, by direction: Hopper's fp8 MMA adds the products of each 128-deep scale block
# in an accumulator narrower than fp32 (Triton's default on sm_90), the twin in fp32; the e4m3 requantisations after
# the GEMMs carry that on. Measured on one H100 (P = 2 and 4, uniform and idle, 12 checks at the GPU shape): at most
# 6.14e-3 forward, 1.61e-2 backward (lab/diagnostics/2026-12-06-shared-gpu-h100/shared_gpu_check.csv); the bounds
# are those maxima with a margin of about 1.6. Under the interpreter (fp32 accumulation) the kernel meets TOL["twin"].
TWIN_TOL_FP8_GPU = {"fwd": 1e-2, "bwd": 2.5e-2}


def twin_tol(precision: str, direction: str, device: str) -> float:
    """The rel-L1 the kernel may differ from its twin by (see :data:`TWIN_TOL_FP8_GPU`)."""
    return TWIN_TOL_FP8_GPU[direction] if precision == "fp8" and device == "cuda" else TOL["twin"]
GRADS = ("x", "topk_w", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")
CSV_NAME = "shared_gpu_check.csv"


def make_weights(P: int, shape: tuple[int, ...], seed: int) -> Weights:
    """Every rank's expert weights and the shared expert's (bf16, host), seeded."""
    _, _, E, H, I = shape
    g = torch.Generator().manual_seed(seed)
    L = E // P
    w13 = [(torch.randn(L, 2 * I, H, generator=g) * H ** -0.5).bfloat16() for _ in range(P)]
    w2 = [(torch.randn(L, H, I, generator=g) * I ** -0.5).bfloat16() for _ in range(P)]
    sh = ((torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(), (torch.randn(I, H, generator=g) * H ** -0.5)
          .bfloat16(), (torch.randn(H, I, generator=g) * I ** -0.5).bfloat16())
    return Weights(w13, w2, sh)


def make_inputs(P: int, shape: tuple[int, ...], seed: int, routing: str) -> dict[str, list[torch.Tensor]]:
    """Per rank (host): tokens ``x``, top-k ids ``idx`` (``idle``: none on the last rank's experts), router weights
    ``w``, output gradient ``dO``."""
    T, K, E, H, _ = shape
    g = torch.Generator().manual_seed(seed)
    experts = torch.arange(E)
    if routing == "idle":
        experts = experts[experts // (E // P) != P - 1]
    return {"x": [torch.randn(T, H, generator=g).bfloat16() for _ in range(P)],
            "idx": [torch.stack([experts[torch.randperm(experts.numel(), generator=g)[:K]] for _ in range(T)])
                    for _ in range(P)],
            "w": [torch.softmax(torch.randn(T, K, generator=g), -1) for _ in range(P)],
            "dO": [(torch.randn(T, H, generator=g) * H ** -0.5).bfloat16() for _ in range(P)]}


def _to(d: Any, dev: torch.device) -> Any:
    """Tensors, or lists / tuples / dicts / :class:`Weights` of them, on ``dev``."""
    if isinstance(d, Weights):
        return Weights(_to(d.w13, dev), _to(d.w2, dev), _to(d.shared, dev))
    if isinstance(d, dict):
        return {k: _to(v, dev) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return type(d)(_to(v, dev) for v in d)
    return d.to(dev)


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().sum() / b.abs().sum().clamp(min=1e-12))


def named_grads(g: dict[str, Any], I: int) -> dict[str, torch.Tensor]:
    """The 8 gradients by name (:data:`GRADS`): the routed gate / up halves of ``w13``, the shared expert's three."""
    sg, su, sd = g["shared"]
    return {"x": g["x"], "topk_w": g["topk_w"], "w_gate": g["w13"][:, :I], "w_up": g["w13"][:, I:],
            "w_down": g["w2"], "shared_gate": sg, "shared_up": su, "shared_down": sd}


def check_step(got: dict[str, list[Any]], w: Weights, inp: dict[str, list[torch.Tensor]], precision: str,
               block_m: int, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """Per direction: ok, the worst rel-L1 to the twin and to the reference, and where (``name@rank``)."""
    fp8, P, I = precision == "fp8", len(w.w13), w.w2[0].shape[2]
    args = (inp["x"], inp["idx"], inp["w"])
    fwd_twin = twin.simulate(*args, w.w13, w.w2, shared=w.shared, fp8=fp8, block_m=block_m)
    fwd_ref = fwd_twin if not fp8 else twin.simulate(*args, w.w13, w.w2, shared=w.shared, block_m=block_m)
    bwd_twin = twin_bwd.simulate_backward(*args, inp["dO"], w.w13, w.w2, shared=w.shared, block_m=block_m, fp8=fp8)
    bwd_ref = twin_bwd.autograd_reference(*args, inp["dO"], w.w13, w.w2, shared=w.shared)
    fwd = [(f"out@{r}", got["out"][r], fwd_twin[r], fwd_ref[r]) for r in range(P)]
    bwd = [(f"{n}@{r}", t, named_grads(bwd_twin[r], I)[n], named_grads(bwd_ref[r], I)[n])
           for r in range(P) for n, t in named_grads(got["grads"][r], I).items()]
    out = {}
    for direction, items in (("fwd", fwd), ("bwd", bwd)):
        errs = [(0.0 if name.startswith("shared_") else rel_l1(t, a), rel_l1(t, b), name) for name, t, a, b in items]
        tol = twin_tol(precision, direction, device)
        worst = max(errs, key=lambda e: max(e[0] / tol, e[1] / TOL[precision]))
        out[direction] = dict(ok=all(a < tol and b < TOL[precision] for a, b, _ in errs),
                              twin_err=max(e[0] for e in errs), ref_err=max(e[1] for e in errs), worst=worst[2])
    return out


def same_bits(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> bool:
    """Whether two steps gave every rank's output and gradients bit for bit."""
    flat = lambda s: [s["out"]] + [[named_grads(g, g["w2"].shape[2])[n] for n in GRADS] for g in s["grads"]]  # noqa
    return all(torch.equal(x, y) for xs, ys in zip(flat(a), flat(b)) for x, y in zip(xs, ys))


def tile_for(args: argparse.Namespace, w: Weights, shape: tuple[int, ...], precision: str
             ) -> tuple[Optional[TileConfig], dict[str, Any]]:
    """The tile the ranks run (None: the layer's default) and what decided it (the grid cap, in ready-flag mode)."""
    T, K, E, H, I = shape
    dev = w.w13[0].device
    if args.mode == "lockstep":
        return None, {}
    base = default_tile(precision=precision, device=dev, hidden=H, ffn=I, rows_per_expert=T * K / w.w13[0].shape[0])
    if not args.ready_flags:
        return replace(base, ready_flags=False), {"ready_flags": 0}
    from mok_tools.mok_hopper.aot_check import kernel

    base = replace(base, shared_sms=0)  # no side stream: only the main stream's up programs spin
    Ranks(w, tokens=T, topk=K, precision=precision, save_h=True, tile=base).step(
        _to(make_inputs(len(w.w13), shape, 7, "uniform"), dev))  # compiles the kernels, in lockstep
    spin, pl = compiled_use(kernel("_up_swiglu_kernel")), compiled_use(kernel("_pull_rows_kernel"))
    cap = spinning_cap(num_sms(dev), len(w.w13), spin, pl)
    info = {"ready_flags": 1, "spin_cap": cap, "up_regs": spin.regs, "up_smem": spin.smem, "up_warps": spin.warps}
    return (base if cap is None else replace(base, gemm_programs=max(1, cap // base.up_per_sm))), info


def run_case_set(args: argparse.Namespace, P: int, precision: str, rows: list[dict[str, Any]]) -> None:
    """Every case of P ranks in one precision: both H modes, the routings, the repeats."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or SHAPES[(dev.type, precision)]
    T, K = shape[:2]
    host = make_weights(P, shape, seed=args.seed)
    w = _to(host, dev)
    tile, info = tile_for(args, w, shape, precision)
    for h in args.h_modes:
        ranks = Ranks(w, tokens=T, topk=K, precision=precision, save_h=h == "save_h", tile=tile, mode=args.mode,
                      skew_ms=args.skew_ms, breaks=args.breaks)
        bm = ranks.layers[0].cfg.block_m
        if info.get("spin_cap"):
            info["up_programs"] = ranks.layers[0].up_programs + ranks.layers[0].up_side_programs
            assert info["up_programs"] <= info["spin_cap"], info
        ranks.step(_to(make_inputs(P, shape, args.seed + 1, "uniform"), dev), args.timeout)  # (other inputs first)
        for routing in args.routings if h == "save_h" else args.routings[:1]:
            inp = make_inputs(P, shape, args.seed + 2 + ROUTINGS.index(routing), routing)
            t0 = time.time()
            got = ranks.step(_to(inp, dev), args.timeout)
            base = dict(ranks=P, precision=precision, mode=args.mode, routing=routing, h=h,
                        brk=",".join(args.breaks) or "none", device=_device_name(dev), **info)
            res = check_step(got, host, inp, precision, bm, dev.type)
            for direction in ("fwd", "bwd"):
                rows.append(dict(base, direction=direction, status="ok" if res[direction]["ok"] else "mismatch",
                                 seconds=round(time.time() - t0, 2), **res[direction]))
                _log(rows[-1])
            if h == "save_h" and routing == args.routings[0] and args.repeats > 1:
                same = 1 + sum(same_bits(ranks.step(_to(inp, dev), args.timeout), got) for _ in range(args.repeats - 1))
                rows.append(dict(base, direction="fwd+bwd", status="ok" if same == args.repeats else "mismatch",
                                 ok=same == args.repeats, identical=f"{same}/{args.repeats}"))
                _log(rows[-1])


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"


def _log(r: dict[str, Any]) -> None:
    what = r.get("identical") or f"twin {r['twin_err']:.1e}, ref {r['ref_err']:.1e} (worst {r['worst']})"
    print(f"[{time.strftime('%H:%M:%S')}] P={r['ranks']} {r['precision']} {r['direction']:<7} {r['mode']} "
          f"{r['routing']:<7} {r['h']:<9} break={r['brk']}: {r['status']}  {what}", flush=True)


def unrunnable(args: argparse.Namespace) -> Optional[str]:
    """Why these options can never run here (one line, the fix in it), or None."""
    from harness.core.tool_args import dir_write_problem

    cuda = torch.cuda.is_available()
    if args.mode not in MODES:
        return f"--mode {args.mode}: choose one of {', '.join(MODES)}"
    if args.mode == "concurrent" and not cuda:
        return "--mode concurrent runs the ranks' CUDA streams at once: it needs a GPU; use --mode lockstep here"
    for opt, vals, known in (("--precisions", args.precisions, PRECISIONS), ("--routings", args.routings, ROUTINGS),
                             ("--h-modes", args.h_modes, H_MODES), ("--break", args.breaks, tuple(BREAKS))):
        if not vals and opt != "--break" or set(vals) - set(known):
            return f"{opt} {','.join(vals) or '(none)'}: choose from {', '.join(known)}"
    if not args.ranks or any(p < 2 for p in args.ranks):
        return f"--ranks {args.ranks}: give rank counts of 2 or more, e.g. --ranks 2,4"
    for p in args.precisions:
        T, K, E, H, I = args.shape or SHAPES[("cuda" if cuda else "cpu", p)]
        if bad := [P for P in args.ranks if E % P or ("idle" in args.routings and K > E - E // P)]:
            return f"--ranks {bad[0]}: {E} experts must split evenly over the ranks (top-{K} without the idle rank's)"
    if "missing-fence" in args.breaks and args.mode == "lockstep":
        return "--break missing-fence drops a wait that lockstep's order makes moot: use --mode concurrent (a GPU)"
    if "skip-flag-reset" in args.breaks and args.mode == "concurrent" and not args.ready_flags:
        return "--break skip-flag-reset: --ready-flags 0 keeps no counters to reset; add --ready-flags 1"
    if args.repeats < 1 or args.timeout <= 0:
        return "--repeats must be 1 or more and --timeout positive"
    if why := dir_write_problem(args.out):
        return f"--out {args.out} {why}; give a folder you can write"
    return None


def _shape(text: str) -> tuple[int, ...]:
    v = tuple(int(x) for x in text.split(","))
    if len(v) != 5:
        raise argparse.ArgumentTypeError("give T,K,E,H,I")
    return v


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help=f"folder for {CSV_NAME}")
    ap.add_argument("--ranks", type=lambda v: [int(x) for x in _names(v)], default=[2, 4])
    ap.add_argument("--precisions", type=_names, default=list(PRECISIONS))
    ap.add_argument("--mode", default="lockstep", help="lockstep or concurrent (CUDA)")
    ap.add_argument("--ready-flags", type=int, choices=(0, 1), default=0,
                    help="concurrent: 0 the up GEMM waits for the pull by a stream event (default); 1 it spins on the "
                         "ready counters, each rank's grid capped by shared_ranks.spinning_cap")
    ap.add_argument("--repeats", type=int, default=20, help="steps of one case compared bitwise with the first")
    ap.add_argument("--routings", type=_names, default=list(ROUTINGS))
    ap.add_argument("--h-modes", type=_names, default=list(H_MODES), help="save_h, recompute (uniform routing only)")
    ap.add_argument("--break", dest="breaks", type=_names, default=[], help=f"inject a fault: {', '.join(BREAKS)}")
    ap.add_argument("--skew-ms", type=float, default=20.0, help="concurrent: the last rank's delay at every phase")
    ap.add_argument("--timeout", type=float, default=120.0, help="concurrent: seconds a step may take (a hang)")
    ap.add_argument("--shape", type=_shape, default=None, help="T,K,E,H,I (default: SHAPES)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if why := unrunnable(args):
        print(f"shared_gpu_check: {why}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    try:
        for P in args.ranks:
            for precision in args.precisions:
                run_case_set(args, P, precision, rows)
    except CheckTimeout as e:  # the GPU still runs the hung step: report, then leave without tearing CUDA down
        rows.append(dict(ranks=P, precision=precision, mode=args.mode, brk=",".join(args.breaks) or "none",
                         status="timeout", ok=False, worst=str(e)))
        print(f"wrote {write_csv(rows, args.out)}; timed out: {e}", flush=True)
        os._exit(1)
    failed = sum(not r["ok"] for r in rows)
    print(f"wrote {write_csv(rows, args.out)}; {failed} failed checks of {len(rows)}; {time.time() - t0:.0f} s")
    return 1 if failed else 0


def write_csv(rows: list[dict[str, Any]], out: str) -> str:
    """The rows as ``out/shared_gpu_check.csv`` (columns in first-seen order); returns its path."""
    os.makedirs(out, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    path = os.path.join(out, CSV_NAME)
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    return path


if __name__ == "__main__":
    sys.exit(main())
