"""Expert-weight bookkeeping shared by the reference and every PyTorch-based backend: the harness's weights as
autograd leaves, and their gradients in the harness layout."""

from __future__ import annotations

from typing import Optional

import torch

from contract.case import Case
from contract.inputs import LayerInputs


class ExpertLeaves:
    """The routed and shared weights as autograd leaves (aliasing the harness inputs, no copy), and their
    gradients in the harness layout (gate/up [L,I,H], down [L,H,I], shared gate/up [I,H], down [H,I])."""

    def __init__(self, case: Case, inputs: LayerInputs) -> None:
        self.case = case
        self.w13 = inputs.w13_LIH.detach().requires_grad_()
        self.w2 = inputs.w2_LHI.detach().requires_grad_()
        self.shared = None
        if case.shared_expert:
            self.shared = [t.detach().requires_grad_() for t in (inputs.ws_gate_IH, inputs.ws_up_IH, inputs.ws_down_HI)]

    def zero_grad(self) -> None:
        for p in [self.w13, self.w2, *(self.shared or [])]:
            p.grad = None

    def grads(self) -> dict[str, Optional[torch.Tensor]]:
        I, g13 = self.case.ffn, self.w13.grad
        sh = [p.grad for p in self.shared] if self.shared else [None] * 3
        return {"w_gate": None if g13 is None else g13[:, :I], "w_up": None if g13 is None else g13[:, I:],
                "w_down": self.w2.grad, "ws_gate": sh[0], "ws_up": sh[1], "ws_down": sh[2]}
