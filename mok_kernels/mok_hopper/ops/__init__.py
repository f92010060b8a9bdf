"""The Triton kernels of ``mok_hopper`` (one module per stage: the device schedule, the pull, the up and down
GEMMs of the forward, the backward's GEMMs, weight gradients and fused stages, their fp8 forms) and what they
share (``gemm_common``, ``interp``: what differs under Triton's interpreter). The host layer that launches them is
one level up (``api``, ``train``)."""
