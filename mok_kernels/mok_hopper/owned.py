"""The routed weights re-laid in place: ``mok_hopper.weights=owned`` (bf16, CUDA).

The harness hands every backend the same plain weights ([L, 2I, H] / [L, H, I]). With ``owned`` the adapter
(:mod:`mok_kernels.mok_hopper.backend`) takes those tensors as the layer's own parameters for its lifetime: it rewrites
their storage, one expert at a time, into the kernels' TMA block order (``tile_weights`` / ``tile_weights_gu``, a
one-expert temporary each), so the layer reads its tiled weights without a second weight-sized copy, and the
backward returns the weight gradients in that order too (as :class:`~mok_kernels.mok_hopper.module.MoKHopperMoE`'s
``layout="tiled"`` parameters do). Before anything outside the layer reads a gradient it is put back into the plain
order in place (:meth:`OwnedWeights.plain_grad_`), and at teardown the weights are (:meth:`OwnedWeights.restore`),
checked against a checksum taken before the first rewrite, so the next backend sees the plain weights bit for bit.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from contract.inputs import checksum
from mok_kernels.mok_hopper.ops.gemm_common import (layout_shapes, tile_weights, tile_weights_gu, untile_weights,
                                                untile_weights_gu)
from mok_kernels.mok_hopper.tiles import TileConfig

Relayout = Callable[[torch.Tensor], torch.Tensor]


def relayout_(w: torch.Tensor, shape: tuple[int, ...], fn: Relayout, experts: Optional[range] = None) -> None:
    """Rewrite the contiguous tensor ``w`` (L experts along dim 0) in place: each expert's run of memory (of
    ``experts``; default all) becomes ``fn`` of that expert seen as ``shape`` (the layout it holds now, [1, ...]);
    one expert's temporary at a time. ``fn`` returns [1, ...] in the new layout (a copy)."""
    assert w.is_contiguous(), "relayout_ rewrites a contiguous tensor's storage"
    flat = w.view(w.shape[0], -1)
    for j in experts if experts is not None else range(w.shape[0]):
        new = fn(flat[j].view(shape)).contiguous()
        if new.data_ptr() == flat[j].data_ptr():  # a view of the expert itself: copy before writing over it
            new = new.clone()
        flat[j].copy_(new.reshape(-1))


class OwnedWeights:
    """The harness's routed weights, in place, in the TMA block order of ``tile`` (bf16, ``w_tiled``)."""

    def __init__(self, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor, tile: TileConfig) -> None:
        assert tile.w_tiled, "owned weights are the tiled layout (w_tiled)"
        L, I2, H = w13_LIH.shape
        I = I2 // 2
        self.plain13, self.plain2 = (1, 2 * I, H), (1, H, I)
        self.shape13, self.shape2 = layout_shapes(L, I, H, tile)
        bn, bk, dn, dk = tile.up_n, tile.up_k, tile.down_n, tile.down_k
        self.tile13: Relayout = (lambda w: tile_weights_gu(w, bn, bk)) if tile.up_fused else (
            lambda w: tile_weights(w, bn, bk))
        self.tile2: Relayout = lambda w: tile_weights(w, dn, dk)
        self.untile13: Relayout = untile_weights_gu if tile.up_fused else untile_weights
        self.w13, self.w2 = w13_LIH, w2_LHI
        self.sums = (checksum(w13_LIH, 1), checksum(w2_LHI, 1))  # one expert's temporaries at a time
        self.tiled = False
        steps = ((w13_LIH, self.plain13, self.tile13, (1, *self.shape13[1:]), self.untile13),
                 (w2_LHI, self.plain2, self.tile2, (1, *self.shape2[1:]), untile_weights))
        done: list[tuple[int, int]] = []  # (tensor, experts rewritten), to undo a rewrite that fails half way
        try:
            for i, (w, shape, fn, _, _) in enumerate(steps):
                for j in range(L):
                    relayout_(w, shape, fn, range(j, j + 1))
                    done.append((i, j))
        except BaseException:
            for i, j in done:
                w, _, _, tiled_shape, inverse = steps[i]
                relayout_(w, tiled_shape, inverse, range(j, j + 1))
            raise
        self.tiled = True

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as the layer reads them: [L, N/bn, K/bk, bn, bk] views of the harness's storage."""
        return self.w13.view(self.shape13), self.w2.view(self.shape2)

    def plain_grad_(self, g13: torch.Tensor, g2: torch.Tensor) -> None:
        """Gradients the backward wrote in the tiled order (shaped as the plain weights) into the plain order, in
        place."""
        relayout_(g13, (1, *self.shape13[1:]), self.untile13)
        relayout_(g2, (1, *self.shape2[1:]), untile_weights)

    def tiled_grad_(self, g13: torch.Tensor, g2: torch.Tensor) -> None:
        """The inverse of :meth:`plain_grad_` (gradients a later backward accumulates into, back in its order)."""
        relayout_(g13, self.plain13, self.tile13)
        relayout_(g2, self.plain2, self.tile2)

    def restore(self) -> None:
        """The weights back in the plain order, in place; a RuntimeError if they differ from what setup found."""
        if not self.tiled:
            return
        relayout_(self.w13, (1, *self.shape13[1:]), self.untile13)
        relayout_(self.w2, (1, *self.shape2[1:]), untile_weights)
        self.tiled = False
        if (checksum(self.w13, 1), checksum(self.w2, 1)) != self.sums:
            raise RuntimeError("mok_hopper.weights=owned: the restored routed weights differ from the harness's "
                               "(the rows of the backends after this one are not valid)")
