"""The options of the ``mok_hopper`` backend (torch-free: the harness reads them to build its schema, without
importing the kernel); :mod:`contract.options` says how the harness reads them."""

from __future__ import annotations

from dataclasses import dataclass

from contract.options import option

# What the forward keeps for its backward (mok_kernels/mok_hopper/train.py): save_h = X and the pre-SwiGLU gate/up
# output H (SonicMoE's choice, the default), recompute = X only (the backward recomputes H: one more read of the gate/up
# weights), inference = nothing (the forward-only layer; its backward rows are unsupported).
FORWARDS = ("save_h", "recompute", "inference")

# The routed bf16 weights the CUDA kernels read (mok_kernels/mok_hopper/backend.py): plain = the harness's
# [L, 2I, H] / [L, H, I] tensors themselves through strided TMA descriptors (no weight copy; the default), tiled = the
# layer's own copy in TMA block order (TileConfig.w_tiled: each TMA block one contiguous run, and gate / up rows
# interleaved for one fused MMA; the value points measured before the option held), owned = the harness's tensors
# rewritten in place into TMA block order for the layer's lifetime and restored at teardown
# (mok_kernels/mok_hopper/owned.py). fp8 reads the layer's own e4m3 copy, which its forward needs whatever the option,
# in TMA block order: the option changes nothing there, so it enters fp8 points' hashes never, and bf16 points' hashes
# away from tiled.
WEIGHTS = ("tiled", "plain", "owned")

# How the routed rows sit in the layer's row buffers (mok_kernels/mok_hopper/tiles.py): packed = each expert's rows
# right after the previous expert's (capacity T·K: TileConfig.packed_rows, without tails or the TMA store of the saved
# H; the default), padded = each expert's rows padded to its last tile (capacity T·K + 63 rows an expert at EP=1; the
# value points measured before the option held, so it stays out of their hashes).
ROWS = ("padded", "packed")


@dataclass
class MokHopperOptions:
    forward: str = option("save_h", choices=FORWARDS, alias="mok_hopper_forward",
                          help="what the forward keeps for the backward: save_h, recompute or inference (forward only)")
    weights: str = option("plain", choices=WEIGHTS, alias="mok_hopper_weights", unhashed="tiled",
                          hash_precision="bf16",
                          help="the routed bf16 weights the kernels read: plain (the caller's tensors through strided "
                               "TMA, no copy), tiled (a copy in TMA block order) or owned (the caller's tensors "
                               "re-laid in place into TMA block order, restored at teardown); fp8 always reads its "
                               "own e4m3 copy in TMA block order")
    rows: str = option("packed", choices=ROWS, alias="mok_hopper_rows", unhashed="padded",
                       help="how the routed rows sit in the layer's row buffers: padded (each expert's rows padded "
                            "to its last tile) or packed (no tile padding: capacity = the routed rows)")
