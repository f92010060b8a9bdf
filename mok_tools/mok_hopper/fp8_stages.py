"""Where the fp8 kernel and its twin part: one rank's fp8 forward (the layer's kernels: Triton on a GPU, the
interpreter on the CPU), each stage recomputed by the twin's recipe from the kernel's own input to that stage.

    python -m mok_tools.mok_hopper.fp8_stages                      # T, K, E, H, I = 256, 4, 16, 1024, 512
    python -m mok_tools.mok_hopper.fp8_stages --shape 64,4,8,256,128 --seeds 0,1

Stages (the kernel's buffers after one forward with ``save_h``): ``dispatch`` (x quantised 1x128 at the source:
``x_rows`` / ``xs_rows`` against ``twin.quant_rows``), ``up`` (the gate/up GEMM's fp32 accumulators as saved in bf16,
``h_save``, against the twin's fp32 GEMM of the kernel's own e4m3 rows, rounded to bf16), ``swiglu+requant`` (H
quantised 1x64: ``h_rows`` / ``hs_rows`` against the twin's SwiGLU and quantisation of its fp32 H from the kernel's
rows), ``down`` (the combine rows the down GEMM pushed, x router weight, bf16, against the twin's GEMM of the kernel's
own e4m3 H), ``epilogue`` (the output against the twin's epilogue of the kernel's combine rows) and ``end to end``
(the output against ``twin.simulate``). Per stage: the fraction of e4m3 codes / bf16 values that differ, the largest
difference in units of the format's spacing, and rel-L1; plus, for the requantised H, what the output becomes when only
H's differing codes are taken from the kernel (``h only -> out``), which is that stage's share of the end-to-end gap.

One rank is enough: the fp8 numerics of a row do not depend on where its token came from (the GPU runs at P = 2
and 4 gave the same errors, uniform and idle). Prints one line a stage and seed; exit 0.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional

import torch


def _swiglu(g: torch.Tensor, u: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    """SwiGLU in fp32 with the optional clamp, as the twin computes it."""
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(g) * u


def _rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().sum() / b.abs().sum().clamp(min=1e-30))


def _codes_differ(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Fraction of e4m3 codes that differ, and the largest difference in codes (steps of the format)."""
    ia = a.view(torch.uint8).to(torch.int16)
    ib = b.view(torch.uint8).to(torch.int16)
    sa, sb = ia >> 7, ib >> 7
    ma = torch.where(sa == 1, -(ia & 0x7F), ia & 0x7F)  # monotone in the value (sign-magnitude -> signed)
    mb = torch.where(sb == 1, -(ib & 0x7F), ib & 0x7F)
    d = (ma - mb).abs()
    return float((d > 0).float().mean()), int(d.max())


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    ia = a.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    ib = b.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    ma = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    mb = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    d = (ma - mb).abs()
    return float((d > 0).float().mean()), int(d.max())


def run(shape: tuple[int, ...], seed: int, device: torch.device, tile: Any = None) -> list[dict[str, Any]]:
    from contract.fp8 import dequantize_blocks
    from mok_kernels.mok_hopper.api import MoKHopperLayer
    from mok_kernels.mok_hopper.fp8 import quantize_expert_weights
    from mok_kernels.mok_hopper.twin import forward as twin

    T, K, E, H, I = shape
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    rw = torch.softmax(torch.randn(T, K, generator=g), -1)
    layer = MoKHopperLayer(w13.to(device), w2.to(device), topk=K, tokens=T, precision="fp8", save_h=True,
                           cuda_graph=False, tile=tile)
    out = layer(x.to(device), idx.to(device), rw.to(device)).cpu()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    hb = layer.cfg.h_block
    s = layer.sched
    codes = s.row_code_R.cpu().long()
    starts, experts = s.tile_row_M1.cpu().tolist(), s.tile_expert_M.cpu().tolist()
    x_rows, xs_rows = layer.x_rows.cpu(), layer.xs_rows.cpu()
    h_save, h_rows, hs_rows = layer.h_save.cpu(), layer.h_rows.cpu(), layer.hs_rows.cpu()
    comb = layer.ws.comb.cpu()
    q13, s13 = quantize_expert_weights(w13)  # what the layer quantised (it may keep them in TMA block order)
    q2, s2 = quantize_expert_weights(w2)
    rows: list[dict[str, Any]] = []

    def add(stage: str, frac: float, steps: int, rel: float, note: str = "") -> None:
        rows.append(dict(seed=seed, stage=stage, differ=frac, max_steps=steps, rel_l1=rel, note=note))

    valid = codes >= 0
    tok = torch.where(valid, codes, 0) // K
    xq, xs = twin.quant_rows(x)
    frac, steps = _codes_differ(x_rows[valid], xq[tok[valid]])
    add("dispatch", frac, steps, _rel_l1(xs_rows[valid], xs[tok[valid]]), "e4m3 codes; rel-L1 of the scales")

    # per tile, from the kernel's own input to each stage
    h32 = torch.zeros(x_rows.shape[0], 2 * I)
    hq_t = torch.zeros_like(h_rows)
    hs_t = torch.zeros_like(hs_rows)
    y_t = torch.zeros(x_rows.shape[0], H)
    y_h_only = torch.zeros(x_rows.shape[0], H)
    used = torch.zeros(x_rows.shape[0], dtype=torch.bool)
    for m, e in enumerate(experts):
        if e >= layer.L or starts[m + 1] <= starts[m]:
            continue
        r = slice(starts[m], starts[m + 1])
        used[r] = True
        a = dequantize_blocks(x_rows[r], xs_rows[r], 1, 128)
        w13e = dequantize_blocks(q13[e], s13[e], 128, 128)
        h32[r] = a @ w13e.t()
        hh = _swiglu(h32[r, :I], h32[r, I:], None)
        hq_t[r], hs_t[r] = twin.quant_rows(hh, hb)
        w2e = dequantize_blocks(q2[e], s2[e], 128, 128)
        y_t[r] = dequantize_blocks(h_rows[r], hs_rows[r], 1, hb) @ w2e.t()  # from the kernel's own H
        y_h_only[r] = dequantize_blocks(hq_t[r], hs_t[r], 1, hb) @ w2e.t()  # from the twin's H
    live = used & valid
    frac, steps = _bf16_ulps(h_save[live], h32[live])
    add("up", frac, steps, _rel_l1(h_save[live], h32[live].bfloat16()), "bf16 steps of the saved fp32 accumulators")
    frac, steps = _codes_differ(h_rows[live], hq_t[live])
    add("swiglu+requant", frac, steps, _rel_l1(hs_rows[live], hs_t[live]), "e4m3 codes of H; rel-L1 of its scales")
    wl = rw.reshape(-1)[codes[live]][:, None]
    comb_t = (y_t[live] * wl).bfloat16()
    slots = codes[live]
    frac, steps = _bf16_ulps(comb[slots], comb_t)
    add("down", frac, steps, _rel_l1(comb[slots], comb_t), "bf16 combine rows from the kernel's own H")
    ep = twin.epilogue(comb, idx, None, None)
    frac, steps = _bf16_ulps(out, ep)
    add("epilogue", frac, steps, _rel_l1(out, ep), "from the kernel's own combine rows")
    want = twin.simulate([x], [idx], [rw], [w13], [w2], fp8=True, block_m=layer.cfg.block_m, h_block=hb)[0]
    frac, steps = _bf16_ulps(out, want)
    add("end to end", frac, steps, _rel_l1(out, want), "the check's kernel-vs-twin number")
    # H's share: the twin's own pipeline except H taken from the kernel where their codes differ
    comb_h = torch.zeros_like(comb)
    comb_h[slots] = (y_h_only[live] * wl).bfloat16()
    comb_k = torch.zeros_like(comb)
    comb_k[slots] = comb_t
    a_only = twin.epilogue(comb_h, idx, None, None)
    b_only = twin.epilogue(comb_k, idx, None, None)
    add("h only -> out", *_bf16_ulps(b_only, a_only), _rel_l1(b_only, a_only),
        "the output's change from H's differing codes alone")
    return rows


def _truncate(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``v`` with its significand cut to ``bits`` bits after the point (toward zero)."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.trunc(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)


def _narrow_gemm(bits: int, step: int = 32, block: int = 128) -> Any:
    """``a @ w.t()`` whose running sum inside each ``block``-deep scale block keeps ``bits`` significand bits after
    each ``step``-deep MMA (a model of an fp8 tensor-core accumulator narrower than fp32), promoted into an fp32 sum
    at each block's end."""

    def gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(a.shape[0], w.shape[0])
        for k0 in range(0, a.shape[1], block):
            part = torch.zeros_like(out)
            for k in range(k0, min(k0 + block, a.shape[1]), step):
                part = _truncate(part + a[:, k : k + step] @ w[:, k : k + step].t(), bits)
            out += part
        return out

    return gemm


def _aligned_gemm(bits: int, step: int = 32, block: int = 128) -> Any:
    """``a @ w.t()`` as an fp8 tensor core may add: each ``step``-deep MMA adds its products and the running sum after
    aligning them to the largest exponent among them, keeping ``bits`` bits below it (the rest cut toward zero); the
    running sum restarts at each ``block``-deep scale block and is then promoted into an fp32 sum."""

    def cut(v: torch.Tensor, quantum: torch.Tensor) -> torch.Tensor:
        return torch.trunc(v / quantum) * quantum

    def gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(a.shape[0], w.shape[0])
        for k0 in range(0, a.shape[1], block):
            part = torch.zeros_like(out)
            for k in range(k0, min(k0 + block, a.shape[1]), step):
                terms = a[:, None, k : k + step] * w[None, :, k : k + step]  # exact: e4m3 x e4m3 fits fp32
                top = torch.maximum(terms.abs().amax(-1), part.abs()).clamp(min=1e-30)
                quantum = torch.ldexp(torch.ones_like(top), torch.frexp(top)[1] - bits)
                part = cut(part, quantum) + cut(terms, quantum[..., None]).sum(-1)
            out += part
        return out

    return gemm


def accumulation_model(shape: tuple[int, ...], seed: int, bits: list[int], aligned: bool = True
                       ) -> list[tuple[int, float]]:
    """The twin's fp8 forward (every rank, the shared expert too: what the one-process check compares) with its two
    expert GEMMs through :func:`_narrow_gemm`, against the twin as it is: rel-L1 of the outputs for each width."""
    from mok_tools.mok_hopper.shared_gpu_check import make_inputs, make_weights
    from contract.fp8 import dequantize_blocks
    from mok_kernels.mok_hopper.twin import forward as twin

    P = 2
    w, inp = make_weights(P, shape, seed), make_inputs(P, shape, seed + 1, "uniform")
    args = (inp["x"], inp["idx"], inp["w"], w.w13, w.w2)
    exact = twin.simulate(*args, shared=w.shared, fp8=True)
    orig = twin.expert_rows
    out = []
    for b in bits:
        gemm = _aligned_gemm(b) if aligned else _narrow_gemm(b)

        def expert_rows(x_RH, tile_expert_M, block_m, w13_LIH, w2_LHI, *, limit, fp8, w13_scale=None,
                        w2_scale=None, x_scale=None, h_block=64):  # the twin's fp8 recipe, its GEMMs narrowed
            R, I, L = x_RH.shape[0], w2_LHI.shape[2], w13_LIH.shape[0]
            y = torch.zeros(R, w2_LHI.shape[1])
            for m, e in enumerate(tile_expert_M.tolist()):
                if e >= L:
                    continue
                r = slice(m * block_m, (m + 1) * block_m)
                a = dequantize_blocks(x_RH[r], x_scale[r], 1, 128)
                w13 = dequantize_blocks(w13_LIH[e], w13_scale[e], 128, 128)
                h = _swiglu(gemm(a, w13[:I]), gemm(a, w13[I:]), limit)
                hq, hs = twin.quant_rows(h, h_block)
                y[r] = gemm(dequantize_blocks(hq, hs, 1, h_block), dequantize_blocks(w2_LHI[e], w2_scale[e], 128, 128))
            return y

        twin.expert_rows = expert_rows
        try:
            got = twin.simulate(*args, shared=w.shared, fp8=True)
        finally:
            twin.expert_rows = orig
        out.append((b, max(_rel_l1(g, e) for g, e in zip(got, exact))))
    return out


def backward_model(shape: tuple[int, ...], seed: int, bits: list[int]) -> list[tuple[int, float, str]]:
    """The twin's fp8 backward (every rank, the check's inputs, H as the fp8 forward saves it) with each of its fp8
    GEMMs (H's recomputation, dgate, dX, both weight gradients) through :func:`_aligned_gemm`, against the twin as it
    is: the worst rel-L1 over the routed gradients (x, router weights, gate / up / down weights) and which."""
    from mok_tools.mok_hopper.shared_gpu_check import make_inputs, make_weights, named_grads
    from contract.fp8 import dequantize_blocks, quantize_blocks
    from mok_kernels.mok_hopper.twin import backward as twin_bwd

    P, I = 2, shape[4]
    w, inp = make_weights(P, shape, seed), make_inputs(P, shape, seed + 1, "uniform")
    args = (inp["x"], inp["idx"], inp["w"], inp["dO"], w.w13, w.w2)
    exact = twin_bwd.simulate_backward(*args, shared=w.shared, fp8=True)
    orig = twin_bwd.expert_backward_fp8, twin_bwd.saved_fp8
    out = []
    for b in bits:
        gemm = _aligned_gemm(b)

        def saved_fp8(xq_rH, xs_rB, w13q_2IH, w13s, limit):  # (no clamp in the check's inputs)
            h = gemm(dequantize_blocks(xq_rH, xs_rB, 1, 128), dequantize_blocks(w13q_2IH, w13s, 128, 128))
            return h.to(torch.bfloat16), None

        def expert_backward_fp8(xq_rH, xs_rB, h_r2I, dOq_rH, dOs_rB, s_r, w13q_2IH, w13s, w2q_HI, w2s, *, limit,
                                clip_r2I=None):  # the twin's recipe, its GEMMs through the model
            x = dequantize_blocks(xq_rH, xs_rB, 1, 128)
            dO = dequantize_blocks(dOq_rH, dOs_rB, 1, 128)
            w13 = dequantize_blocks(w13q_2IH, w13s, 128, 128)
            w2 = dequantize_blocks(w2q_HI, w2s, 128, 128)
            G = gemm(dO, w2.t().contiguous())
            A, dg, du = twin_bwd.swiglu_grads(h_r2I[:, :I], h_r2I[:, I:], G * s_r[:, None], limit, None)
            ds = (G * A).sum(dim=1)
            dH32 = torch.cat([dg, du], dim=1)
            dHq, dHs = quantize_blocks(dH32, 1, 128)
            sA = (A * s_r[:, None]).to(torch.bfloat16)
            tq = twin_bwd.token_quant
            dX = gemm(dequantize_blocks(dHq, dHs, 1, 128), w13.t().contiguous()).to(torch.bfloat16)
            dW13 = gemm(tq(dH32.to(torch.bfloat16)).t().contiguous(), tq(x).t().contiguous()).to(torch.bfloat16)
            dW2 = gemm(tq(dO).t().contiguous(), tq(sA).t().contiguous()).to(torch.bfloat16)
            return {"dX": dX, "ds": ds, "dW13": dW13, "dW2": dW2}

        twin_bwd.expert_backward_fp8, twin_bwd.saved_fp8 = expert_backward_fp8, saved_fp8
        try:
            got = twin_bwd.simulate_backward(*args, shared=w.shared, fp8=True)
        finally:
            twin_bwd.expert_backward_fp8, twin_bwd.saved_fp8 = orig
        errs = [(_rel_l1(named_grads(g, I)[n], named_grads(e, I)[n]), f"{n}@{r}")
                for r, (g, e) in enumerate(zip(got, exact)) for n in named_grads(g, I) if not n.startswith("shared")]
        worst = max(errs)
        out.append((b, worst[0], worst[1]))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="256,4,16,1024,512", help="T,K,E,H,I")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--gpu-tile", action="store_true",
                    help="the CUDA default tile's GEMM variants (fused gate/up MMA, paired down blocks, weights in TMA "
                         "block order) with pointer loads, on any device (the CPU's default tile runs other variants)")
    ap.add_argument("--acc-bits", default="",
                    help="instead: the accumulation model, for these significand widths (e.g. 10,12,13,14,16,23)")
    ap.add_argument("--backward", action="store_true", help="the accumulation model of the backward (aligned)")
    ap.add_argument("--acc-model", choices=("aligned", "running"), default="aligned",
                    help="aligned: products cut at the largest exponent of each MMA step; running: the running sum "
                         "rounded to its own exponent")
    a = ap.parse_args(argv)
    shape = tuple(int(v) for v in a.shape.split(","))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = torch.device("cuda" if cuda else "cpu")
    if a.acc_bits and a.backward:
        for seed in (int(v) for v in a.seeds.split(",")):
            for b, err, where in backward_model(shape, seed, [int(v) for v in a.acc_bits.split(",")]):
                print(f"seed {seed}  backward, aligned accumulator {b:>2} bits  worst rel-L1 to the twin {err:.3e} "
                      f"({where})", flush=True)
        return 0
    if a.acc_bits:
        for seed in (int(v) for v in a.seeds.split(",")):
            for b, err in accumulation_model(shape, seed, [int(v) for v in a.acc_bits.split(",")],
                                             a.acc_model == "aligned"):
                print(f"seed {seed}  {a.acc_model} accumulator {b:>2} bits  out rel-L1 to the twin {err:.3e}",
                      flush=True)
        return 0
    print(f"fp8 stages, T,K,E,H,I = {shape}, {'GPU ' + torch.cuda.get_device_name() if cuda else 'CPU interpreter'}")
    tile = None
    if a.gpu_tile:
        from dataclasses import replace

        from mok_kernels.mok_hopper.tiles import default_tile

        T, K, E, H, I = shape
        tile = default_tile(precision="fp8", hidden=H, ffn=I, rows_per_expert=T * K / E)
        if not cuda:
            tile = replace(tile, shared_sms=0, gemm_programs=2, pull_programs=2, comm_sms=1)
        print(f"tile: {tile}")
    for seed in (int(v) for v in a.seeds.split(",")):
        for r in run(shape, seed, dev, tile):
            print(f"seed {r['seed']}  {r['stage']:<15} differ {r['differ']:.3e}  max {r['max_steps']:>3} steps  "
                  f"rel-L1 {r['rel_l1']:.3e}   ({r['note']})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
