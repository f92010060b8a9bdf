"""A mok_hopper layer's test inputs on several simulated ranks, the plain reference of its math, and the check of
the H and clamp decisions a training layer saves; shared by the CPU tests (``test_mok_hopper_schedule``,
``test_mok_hopper_twin``, ``test_mok_hopper_ops``) and the GPU ones (``test_mok_hopper_gpu``).

Legend: P ranks, T tokens per rank, K top-k, E experts, L = E / P local experts, H hidden, I ffn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def routing(P: int, T: int, K: int, E: int, seed: int, mode: str = "uniform") -> list[torch.Tensor]:
    """[T, K] global expert ids per rank. Modes are the edge cases the schedule must survive."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(P):
        if mode == "uniform":
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        elif mode == "one_expert":  # every token's first choice is expert 1 (one expert gets P*T rows)
            idx = torch.stack([torch.cat([torch.tensor([1]), torch.randperm(E - 1, generator=g)[: K - 1] + 2])
                               if K > 1 else torch.tensor([1]) for _ in range(T)])
            idx = torch.where(idx >= E, idx - E + 2, idx)
        elif mode == "one_rank":  # every id on rank 0's experts
            L = E // P
            idx = torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(T)])
        elif mode == "empty_expert":  # expert 0 never chosen
            idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] + 1 for _ in range(T)])
        elif mode == "masked":  # some slots masked with -1
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
            idx[torch.rand(T, K, generator=g) < 0.25] = -1
        else:
            raise ValueError(mode)
        out.append(idx.to(torch.int64))
    return out


def skewed_routing(T: int, K: int, E: int, seed: int) -> torch.Tensor:
    """[T, K] ids with a skewed expert popularity (expert e chosen with weight ~ 1 / (e + 1), one expert never), so
    that experts get anything from none to several tiles of rows."""
    g = torch.Generator().manual_seed(seed)
    wt = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
    wt[E // 2] = 0.0  # an empty expert
    return torch.stack([torch.multinomial(wt, K, replacement=False, generator=g) for _ in range(T)])


def make_layer_inputs(P: int, T: int, K: int, E: int, H: int, I: int, seed: int = 0, mode: str = "uniform",
                      shared: bool = True):
    g = torch.Generator().manual_seed(seed + 100)
    L = E // P
    xs = [torch.randn(T, H, generator=g).bfloat16() for _ in range(P)]
    ws = [torch.softmax(torch.randn(T, K, generator=g), -1) for _ in range(P)]
    w13 = [(torch.randn(L, 2 * I, H, generator=g) * H ** -0.5).bfloat16() for _ in range(P)]
    w2 = [(torch.randn(L, H, I, generator=g) * I ** -0.5).bfloat16() for _ in range(P)]
    sh = None
    if shared:
        sh = ((torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
              (torch.randn(I, H, generator=g) * H ** -0.5).bfloat16(),
              (torch.randn(H, I, generator=g) * I ** -0.5).bfloat16())
    return xs, routing(P, T, K, E, seed, mode), ws, w13, w2, sh


def plain_reference(xs, idx, ws, w13, w2, sh, limit=None) -> list[torch.Tensor]:
    """The harness reference's math: per expert, bf16 GEMM outputs; fp32 router-weighted sum, then + shared."""
    P, L = len(xs), w13[0].shape[0]
    I = w2[0].shape[2]
    x_all, idx_all, w_all = torch.cat(xs), torch.cat(idx), torch.cat(ws)
    acc = torch.zeros(x_all.shape, dtype=torch.float32)
    for e in range(P * L):
        tok, kk = torch.nonzero(idx_all == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        W13, W2 = w13[e // L][e % L], w2[e // L][e % L]
        x = x_all[tok]
        g, u = x @ W13[:I].t(), x @ W13[I:].t()
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        acc.index_add_(0, tok, w_all[tok, kk].unsqueeze(-1) * ((F.silu(g) * u) @ W2.t()).float())
    outs = []
    for r, part in enumerate(acc.chunk(P)):
        if sh is not None:
            g, u = xs[r] @ sh[0].t(), xs[r] @ sh[1].t()
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            part = part + ((F.silu(g) * u) @ sh[2].t()).float()
        outs.append(part.bfloat16())
    return outs


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum().clamp(min=1e-30))



def check_saved_h(layer, w13_LIH: torch.Tensor, limit) -> dict[str, int]:
    """The layer's h_save / clip_save against twin_bwd.saved of its X rows, tile by tile (each tile's rows with its
    expert's weights): H within the bf16 rounding of the fp32 product (the kernel's fp32 sum runs in another
    order than torch's, which can move a value across a bf16 rounding boundary: never more than that), and
    equal to the twin's bf16 H almost everywhere; the clamp decisions equal except within 1e-4 of the limit;
    rows past the last tile left alone. Returns counts, for the caller to check the test saw something."""
    from mok_kernels.mok_hopper.twin.backward import saved

    s = layer.sched
    n = int(s.num_tiles)
    rows = s.tile_row_M1[: n + 1].tolist()
    I = layer.I
    seen = {"rows": 0, "inexact": 0, "clip_gate": 0, "clip_up_pos": 0, "clip_up_neg": 0, "sizes": set()}
    for m in range(n):
        a, b, e = rows[m], rows[m + 1], int(s.tile_expert_M[m])
        seen["sizes"].add(b - a)
        x = layer.x_rows[a:b]
        h_want, clip_want = saved(x, w13_LIH[e], limit)
        h32 = x.float() @ w13_LIH[e].float().t()
        got = layer.h_save[a:b]
        assert not got.isnan().any(), f"tile {m} (rows {a}-{b}): rows the up GEMM computed were not saved"
        err = (got.float() - h32).abs()
        bound = h32.abs() * 2.0 ** -8 + 1e-5  # half a bf16 ulp, plus the fp32 sum's order
        assert (err <= bound).all(), f"tile {m}: H off by {float((err - bound).max())} beyond rounding"
        seen["inexact"] += int((got != h_want).sum())
        seen["rows"] += b - a
        if limit is None:
            continue
        clip = layer.clip_save[a:b]
        assert clip.max() <= 1, f"tile {m}: clamp decisions not written"
        near = torch.cat([(h32[:, :I] - limit).abs(), (h32[:, I:].abs() - limit).abs()], dim=1) < 1e-4
        wrong = (clip.bool() != clip_want) & ~near
        assert not wrong.any(), f"tile {m}: {int(wrong.sum())} clamp decisions differ from the fp32 product's"
        seen["clip_gate"] += int(clip_want[:, :I].sum())
        seen["clip_up_pos"] += int((clip_want[:, I:] & (h32[:, I:] > 0)).sum())
        seen["clip_up_neg"] += int((clip_want[:, I:] & (h32[:, I:] < 0)).sum())
    end = rows[n]
    assert layer.h_save[end:].isnan().all(), "rows no tile covers were written"
    if limit is not None:
        assert (layer.clip_save[end:] == 7).all()
    return seen
