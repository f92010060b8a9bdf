"""The options of the ``mok_hopper`` backend (torch-free: the harness reads them to build its schema, without
importing the kernel); :mod:`contract.options` says how the harness reads them."""

from __future__ import annotations

from dataclasses import dataclass

from contract.options import option

# What the forward keeps for its backward (kernels/mok_hopper/train.py): save_h = X and the pre-SwiGLU gate/up output
# H (SonicMoE's choice, the default), recompute = X only (the backward recomputes H: one more read of the gate/up
# weights), inference = nothing (the forward-only layer; its backward rows are unsupported).
FORWARDS = ("save_h", "recompute", "inference")


@dataclass
class MokHopperOptions:
    forward: str = option("save_h", choices=FORWARDS, alias="mok_hopper_forward",
                          help="what the forward keeps for the backward: save_h, recompute or inference (forward only)")
