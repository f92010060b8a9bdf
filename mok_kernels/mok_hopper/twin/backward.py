"""Pure-torch twin of the bf16 backward (its plan: the journal, lab/perf-notes.md, "Next: the bf16 backward"): the
stages the kernels run, with their roundings and their fixed summation orders, so that each kernel can be checked
against it stage by stage; it also fixes the backward's dataflow (which rows go where, what the forward must save).
Not the kernel.

Per rank, over this rank's routed rows r (the forward's schedule: row code -> source rank, token t, slot k; expert e;
router weight s_r), with the forward's saved H_r = [x_r W_gate[e]^T, x_r W_up[e]^T] (bf16, pre-SwiGLU):

    dgate   G_r = dO[t] @ W2[e]                      (fp32 accumulation over H)
            A_r = SwiGLU(H_r)                        (recomputed, fp32)
            ds_r = sum_j G_r[j] A_r[j]               (the router-weight gradient; fp32, j ascending)
            dH_r = bf16([s_r G_r SwiGLU'_gate(H_r), s_r G_r SwiGLU'_up(H_r)])
            sA_r = bf16(s_r A_r)                      (for dW2)
    dx      dX_r = bf16(dH_r @ W13[e])               (fp32 accumulation over 2I), pushed to rank src, slot t*K + k
    dW13    dW13[e] = bf16(sum_r dH_r^T x_r)          (the expert's rows in schedule order, fp32)
    dW2     dW2[e]  = bf16(sum_r dO[t]^T sA_r)
    dx[t]   = sum_k dX_(t,k) (fp32, k ascending) + the shared expert's dx

Legend: P ranks, T tokens per rank, K top-k, H hidden, I ffn, L local experts, R routed rows of a rank.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from contract.fp8 import dequantize_blocks, quantize_blocks
from mok_kernels.mok_hopper.fp8 import quantize_expert_weights
from mok_kernels.mok_hopper.schedule import build_schedule, capacity_rows
from mok_kernels.mok_hopper.twin.forward import epilogue


def swiglu_grads(g: torch.Tensor, u: torch.Tensor, dA: torch.Tensor, limit: Optional[float],
                 clipped: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (A, dgate, dup) of A = silu(g') * u' with g' = min(g, limit), u' = clamp(u, -limit, limit): the clamp
    passes no gradient where it clips (torch's convention at the boundary: the gradient passes).

    ``clipped`` (gate mask, up mask): where the forward clipped, decided on its fp32 accumulators. The backward
    reads g and u rounded to bf16, and rounding moves values across the limit: deciding the clamp again from them
    gave 2-4% rel-L1 error on dx at limits 0.5 and 2.0 (tests/test_mok_hopper_bwd.py), over the bf16 gate. With the
    masks the decisions are the forward's."""
    g, u, dA = g.float(), u.float(), dA.float()
    gc, uc = g, u
    if limit is not None:
        gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        if clipped is not None:
            gc = torch.where(clipped[0], torch.full_like(g, limit), gc)
            uc = torch.where(clipped[1], torch.sign(u) * limit, uc)
    sig = torch.sigmoid(gc)
    silu = gc * sig
    A = silu * uc
    dg = dA * uc * (sig * (1 + gc * (1 - sig)))
    du = dA * silu
    if limit is not None:
        clip_g, clip_u = clipped if clipped is not None else (g > limit, (u > limit) | (u < -limit))
        dg = torch.where(clip_g, torch.zeros_like(dg), dg)
        du = torch.where(clip_u, torch.zeros_like(du), du)
    return A, dg, du


def expert_backward(x_rH: torch.Tensor, h_r2I: torch.Tensor, dO_rH: torch.Tensor, s_r: torch.Tensor,
                    w13_2IH: torch.Tensor, w2_HI: torch.Tensor, *, limit: Optional[float],
                    clip_r2I: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The four stages for one expert's rows (in schedule order): ``dX`` bf16 [r, H], ``ds`` fp32 [r], ``dW13`` bf16
    [2I, H], ``dW2`` bf16 [H, I]. ``clip_r2I``: the forward's clamp masks (:func:`saved`)."""
    I = w2_HI.shape[1]
    G = dO_rH.float() @ w2_HI.float()  # dgate
    clipped = (clip_r2I[:, :I], clip_r2I[:, I:]) if clip_r2I is not None else None
    A, dg, du = swiglu_grads(h_r2I[:, :I], h_r2I[:, I:], G * s_r[:, None], limit, clipped)
    ds = (G * A).sum(dim=1)
    dH = torch.cat([dg, du], dim=1).to(torch.bfloat16)
    sA = (A * s_r[:, None]).to(torch.bfloat16)
    dX = (dH.float() @ w13_2IH.float()).to(torch.bfloat16)  # dx
    dW13 = (dH.float().t() @ x_rH.float()).to(torch.bfloat16)  # dW13
    dW2 = (dO_rH.float().t() @ sA.float()).to(torch.bfloat16)  # dW2
    return {"dX": dX, "ds": ds, "dW13": dW13, "dW2": dW2}


def token_quant(v_rC: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The fp8 weight gradients' operand rounding: e4m3 with one scale per column over each ``block``
    rows of the expert's rows (from its first row; the last block may be short), dequantised (fp32)."""
    r, C = v_rC.shape
    pad = -(-r // block) * block - r
    vp = torch.cat([v_rC.float(), v_rC.new_zeros(pad, C, dtype=torch.float32)]) if pad else v_rC.float()
    q, s = quantize_blocks(vp, block, 1)
    return dequantize_blocks(q, s, block, 1)[:r]


def expert_backward_fp8(xq_rH: torch.Tensor, xs_rB: torch.Tensor, h_r2I: torch.Tensor, dOq_rH: torch.Tensor,
                        dOs_rB: torch.Tensor, s_r: torch.Tensor, w13q_2IH: torch.Tensor, w13s: torch.Tensor,
                        w2q_HI: torch.Tensor, w2s: torch.Tensor, *, limit: Optional[float],
                        clip_r2I: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The fp8 backward of one expert's rows, the recipe the kernels run (:mod:`mok_kernels.mok_hopper.
    bwd_fp8`): every GEMM on e4m3 operands with fp32 accumulation.

    * dgate: G = dO @ W2 with dO in 1 x 128 blocks along H (quantised at its source rank, as the forward's x) and
      W2 in the forward's 128 x 128 blocks; the epilogue as in bf16, and dH also quantised 1 x 128 along 2I (from
      its fp32 values) for dX;
    * dX = dH @ W13 (dH 1 x 128, W13's 128 x 128 blocks: the forward's, transposed);
    * dW13 = dH^T X, dW2 = dO^T sA, reduced over the expert's rows with both operands quantised in 128-row blocks
      along the tokens (:func:`token_quant`): dH and sA from their bf16 values, X and dO from their 1 x 128 e4m3
      rows (dequantised, then quantised along the tokens: the forward keeps X only in fp8).

    Inputs: X rows and dO rows as e4m3 + 1 x 128 scales, ``h_r2I`` the fp8 forward's pre-SwiGLU H (bf16), weights
    as e4m3 + 128 x 128 scales. Outputs as :func:`expert_backward` (bf16 dX, dW13, dW2; fp32 ds)."""
    I = w2q_HI.shape[1]
    x = dequantize_blocks(xq_rH, xs_rB, 1, 128)
    dO = dequantize_blocks(dOq_rH, dOs_rB, 1, 128)
    w13 = dequantize_blocks(w13q_2IH, w13s, 128, 128)
    w2 = dequantize_blocks(w2q_HI, w2s, 128, 128)
    G = dO @ w2
    clipped = (clip_r2I[:, :I], clip_r2I[:, I:]) if clip_r2I is not None else None
    A, dg, du = swiglu_grads(h_r2I[:, :I], h_r2I[:, I:], G * s_r[:, None], limit, clipped)
    ds = (G * A).sum(dim=1)
    dH32 = torch.cat([dg, du], dim=1)
    dHq, dHs = quantize_blocks(dH32, 1, 128)
    dH = dH32.to(torch.bfloat16)
    sA = (A * s_r[:, None]).to(torch.bfloat16)
    dX = (dequantize_blocks(dHq, dHs, 1, 128) @ w13).to(torch.bfloat16)
    dW13 = (token_quant(dH).t() @ token_quant(x)).to(torch.bfloat16)
    dW2 = (token_quant(dO).t() @ token_quant(sA)).to(torch.bfloat16)
    return {"dX": dX, "ds": ds, "dW13": dW13, "dW2": dW2}


def saved_fp8(xq_rH: torch.Tensor, xs_rB: torch.Tensor, w13q_2IH: torch.Tensor, w13s: torch.Tensor,
              limit: Optional[float]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`saved` of the fp8 forward: H from the e4m3 X rows and weights (fp32 accumulation), rounded to bf16."""
    h = dequantize_blocks(xq_rH, xs_rB, 1, 128) @ dequantize_blocks(w13q_2IH, w13s, 128, 128).t()
    clip = None
    if limit is not None:
        I = h.shape[1] // 2
        clip = torch.cat([h[:, :I] > limit, h[:, I:].abs() > limit], dim=1)
    return h.to(torch.bfloat16), clip


def saved(x_rH: torch.Tensor, w13_2IH: torch.Tensor,
          limit: Optional[float]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What the training forward saves per routed row: the pre-SwiGLU gate and up outputs, bf16 [r, 2I], and with
    a clamped SwiGLU where it clipped them (bool [r, 2I], decided on the fp32 accumulators; a kernel packs them in
    bits: 2I / 8 bytes a row)."""
    h = x_rH.float() @ w13_2IH.float().t()
    clip = None
    if limit is not None:
        I = h.shape[1] // 2
        clip = torch.cat([h[:, :I] > limit, h[:, I:].abs() > limit], dim=1)
    return h.to(torch.bfloat16), clip


def rank_backward(x_all: torch.Tensor, dO_all: torch.Tensor, idx_all_PS: torch.Tensor, w_all_S: torch.Tensor,
                  w13_LIH: torch.Tensor, w2_LHI: torch.Tensor, *, rank: int, limit: Optional[float],
                  block_m: int = 128, capacity_multiplier: Optional[float] = 0.5, fp8: bool = False,
                  w_quant: Optional[tuple] = None) -> dict[str, object]:
    """One rank's part of the backward: for every row its experts computed, (slot code, bf16 dX row, fp32 ds), and
    the bf16 gradients of its experts' weights ([L, 2I, H], [L, H, I]; zero for an expert with no row). ``fp8``:
    the fp8 recipe (:func:`expert_backward_fp8`): x and dO quantised 1 x 128 at their source, the weights in
    128 x 128 blocks (``w_quant``: (q13, s13, q2, s2), else quantised here)."""
    P, S_per = idx_all_PS.shape
    T = x_all.shape[0] // P
    K = S_per // T
    L, H = w13_LIH.shape[0], w13_LIH.shape[2]
    R = capacity_rows(ep=P, tokens=T, topk=K, local_experts=L, block_m=block_m,
                      capacity_multiplier=capacity_multiplier)
    sch = build_schedule(idx_all_PS, rank=rank, local_experts=L, block_m=block_m, capacity=R)
    codes = sch.row_code_R.long()
    expert = sch.tile_expert_M.long().repeat_interleave(block_m)[: codes.numel()]
    dW13 = torch.zeros_like(w13_LIH)
    dW2 = torch.zeros_like(w2_LHI)
    rows: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    if fp8:  # each source rank quantises its own rows, once (the stage kernel)
        xq, xs = quantize_blocks(x_all, 1, 128)
        dOq, dOs = quantize_blocks(dO_all, 1, 128)
        if w_quant is None:
            w_quant = (*quantize_expert_weights(w13_LIH), *quantize_expert_weights(w2_LHI))
    for e in range(L):
        r = ((codes >= 0) & (expert == e)).nonzero().flatten()  # schedule order
        if r.numel() == 0:
            continue
        c = codes[r]
        tok = (c // (T * K)) * T + (c % (T * K)) // K
        s_r = w_all_S[c].float()
        if fp8:
            q13, s13, q2, s2 = w_quant
            h, clip = saved_fp8(xq[tok], xs[tok], q13[e], s13[e], limit)
            out = expert_backward_fp8(xq[tok], xs[tok], h, dOq[tok], dOs[tok], s_r, q13[e], s13[e], q2[e], s2[e],
                                      limit=limit, clip_r2I=clip)
        else:
            x_r, dO_r = x_all[tok], dO_all[tok]
            h, clip = saved(x_r, w13_LIH[e], limit)
            out = expert_backward(x_r, h, dO_r, s_r, w13_LIH[e], w2_LHI[e], limit=limit, clip_r2I=clip)
        dW13[e], dW2[e] = out["dW13"], out["dW2"]
        rows += [(int(ci), dx, ds) for ci, dx, ds in zip(c.tolist(), out["dX"], out["ds"])]
    return {"rows": rows, "dW13": dW13, "dW2": dW2, "H": H}


def shared_backward(x_TH: torch.Tensor, dO_TH: torch.Tensor, shared: Sequence[torch.Tensor],
                    limit: Optional[float]) -> dict[str, torch.Tensor]:
    """The shared expert's gradients (one expert over every token, router weight 1), all bf16: dx [T, H], gate
    [I, H], up [I, H], down [H, I]."""
    g, u, d = shared
    I = g.shape[0]
    w13 = torch.cat([g, u])
    h, clip = saved(x_TH, w13, limit)
    out = expert_backward(x_TH, h, dO_TH, torch.ones(x_TH.shape[0], device=x_TH.device), w13, d, limit=limit,
                         clip_r2I=clip)
    return {"dx": out["dX"], "gate": out["dW13"][:I], "up": out["dW13"][I:], "down": out["dW2"]}


def simulate_backward(xs_PTH: Sequence[torch.Tensor], idx_PTK: Sequence[torch.Tensor],
                      w_PTK: Sequence[torch.Tensor], dO_PTH: Sequence[torch.Tensor],
                      w13_PLIH: Sequence[torch.Tensor], w2_PLHI: Sequence[torch.Tensor], *,
                      shared: Optional[Sequence[torch.Tensor]] = None, limit: Optional[float] = None,
                      block_m: int = 128, capacity_multiplier: Optional[float] = 0.5,
                      fp8: bool = False) -> list[dict[str, object]]:
    """Every rank's gradients, all P ranks in one process (the twin of a P-rank backward): per rank ``x`` bf16
    [T, H], ``topk_w`` fp32 [T, K], ``w13`` / ``w2`` bf16 (its experts), and with a shared expert ``shared`` (bf16
    gate, up, down; each rank's own, as data parallel would have it before any reduction). ``fp8``: the routed
    experts' fp8 recipe (:func:`expert_backward_fp8`); the shared expert is bf16 in every precision."""
    P = len(xs_PTH)
    T, K = idx_PTK[0].shape
    idx_all = torch.stack([i.reshape(-1) for i in idx_PTK]).to(torch.int64)
    x_all, dO_all = torch.cat(list(xs_PTH)), torch.cat(list(dO_PTH))
    w_all = torch.cat([w.reshape(-1) for w in w_PTK])
    H = x_all.shape[1]
    dx_rows = [torch.zeros(T * K, H, dtype=torch.bfloat16) for _ in range(P)]
    ds = [torch.zeros(T * K, dtype=torch.float32) for _ in range(P)]
    grads = []
    for r in range(P):
        out = rank_backward(x_all, dO_all, idx_all, w_all, w13_PLIH[r], w2_PLHI[r], rank=r, limit=limit,
                            block_m=block_m, capacity_multiplier=capacity_multiplier, fp8=fp8)
        for code, dx_row, ds_row in out["rows"]:  # pushed to the source rank's slot
            src, slot = divmod(code, T * K)
            dx_rows[src][slot], ds[src][slot] = dx_row, ds_row
        grads.append({"w13": out["dW13"], "w2": out["dW2"]})
    result = []
    for r in range(P):
        live = idx_PTK[r] >= 0
        g = {**grads[r], "topk_w": torch.where(live, ds[r].view(T, K), torch.zeros(()))}
        sh = shared_backward(xs_PTH[r], dO_PTH[r], shared, limit) if shared is not None else None
        if sh is not None:
            g["shared"] = (sh["gate"], sh["up"], sh["down"])
        # dx: the forward's epilogue, on the dX rows (k ascending, fp32, masked slots left out) plus the shared dx
        g["x"] = epilogue(dx_rows[r], idx_PTK[r], None, sh["dx"] if sh is not None else None)
        result.append(g)
    return result


def autograd_reference(xs_PTH: Sequence[torch.Tensor], idx_PTK: Sequence[torch.Tensor],
                       w_PTK: Sequence[torch.Tensor], dO_PTH: Sequence[torch.Tensor],
                       w13_PLIH: Sequence[torch.Tensor], w2_PLHI: Sequence[torch.Tensor], *,
                       shared: Optional[Sequence[torch.Tensor]] = None,
                       limit: Optional[float] = None) -> list[dict[str, object]]:
    """The same gradients by torch autograd in fp32 over a plain per-expert loop (what the twin is checked
    against)."""
    P = len(xs_PTH)
    L = w13_PLIH[0].shape[0]
    I = w2_PLHI[0].shape[2]
    def leaf(t: torch.Tensor) -> torch.Tensor:  # an fp32 copy (``.float()`` of an fp32 tensor is the tensor itself)
        return t.detach().to(torch.float32, copy=True).requires_grad_()

    xs, ws = [leaf(x) for x in xs_PTH], [leaf(w) for w in w_PTK]
    w13, w2 = [leaf(w) for w in w13_PLIH], [leaf(w) for w in w2_PLHI]
    sh = [[leaf(t) for t in shared] for _ in range(P)] if shared is not None else None
    loss = 0.0
    for p in range(P):
        out = torch.zeros_like(xs[p])
        for e_glob in range(P * L):
            owner, e = divmod(e_glob, L)
            t, k = (idx_PTK[p] == e_glob).nonzero(as_tuple=True)
            if t.numel() == 0:
                continue
            xe = xs[p][t]
            g, u = xe @ w13[owner][e, :I].t(), xe @ w13[owner][e, I:].t()
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            y = (F.silu(g) * u) @ w2[owner][e].t()
            out = out.index_add(0, t, ws[p][t, k, None] * y)
        if sh is not None:
            sg, su, sd = sh[p]
            g, u = xs[p] @ sg.t(), xs[p] @ su.t()
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            out = out + (F.silu(g) * u) @ sd.t()
        loss = loss + (out * dO_PTH[p].float()).sum()
    loss.backward()
    res = []
    for p in range(P):
        def grad(t: torch.Tensor) -> torch.Tensor:  # a leaf no path reached (an idle rank's experts): zeros
            return t.grad if t.grad is not None else torch.zeros_like(t.detach())

        g = {"x": grad(xs[p]), "topk_w": grad(ws[p]), "w13": grad(w13[p]), "w2": grad(w2[p])}
        if sh is not None:
            g["shared"] = tuple(grad(t) for t in sh[p])
        res.append(g)
    return res
