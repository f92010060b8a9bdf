"""The cross-rank barrier over signal pads that every rank can address (the workspace's CUDA IPC form; torch
symmetric memory brings its own). The same protocol as symmetric memory's signal-pad barrier: per channel c, rank r
owns P int32 slots ``pad[c * P + q]``, one per peer q. At a barrier rank r sets slot r of channel c on every peer
(0 -> 1, waiting while that slot is still 1 from the barrier before), then takes each of its own slots of channel c
(1 -> 0, waiting until the peer has set it). Nothing is counted on the host, so a CUDA graph replays it as is.

Legend: P ranks, C channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mok_kernels.mok_hopper.ops.interp import INTERPRET  # noqa: F401 - applies the interpreter fixes once


@triton.jit
def _signal_pad_barrier(pad_ptr, peer_ptr, rank, world, channel):
    """Program q (q != rank) pairs this rank with peer q. ``peer_ptr[q]``: int32 elements from this rank's pads to
    rank q's (0 for this rank). Release on the signal, acquire on the wait, system scope: the writes this rank's
    stream made before the barrier are seen by the peers' work after theirs."""
    q = tl.program_id(0)
    if q != rank:
        remote = pad_ptr + tl.load(peer_ptr + q) + channel * world + rank
        v = tl.atomic_cas(remote, 0, 1, sem="release", scope="sys")
        while v != 0:
            v = tl.atomic_cas(remote, 0, 1, sem="release", scope="sys")
        local = pad_ptr + channel * world + q
        w = tl.atomic_cas(local, 1, 0, sem="acquire", scope="sys")
        while w != 1:
            w = tl.atomic_cas(local, 1, 0, sem="acquire", scope="sys")


def signal_pad_barrier(pads_CP: torch.Tensor, peer_P: torch.Tensor, *, rank: int, channel: int) -> None:
    """Every rank has reached this point on its stream (a launch on the current stream; no host wait).
    ``pads_CP``: this rank's int32 pads [C, P]; ``peer_P``: int64 element offsets to each rank's pads."""
    C, P = pads_CP.shape
    assert 0 <= channel < C, f"channel {channel} outside the {C} signal-pad channels"
    _signal_pad_barrier[(P,)](pads_CP, peer_P, rank, P, channel, num_warps=1)
