"""The pure-torch twin of the kernel pipeline (not the kernel): the same schedule, roundings and fixed-order
epilogue, on any device. :mod:`~mok_kernels.mok_hopper.twin.forward` and :mod:`~mok_kernels.mok_hopper.twin.backward`
simulate every rank in one process (the CPU tests' references); :mod:`~mok_kernels.mok_hopper.twin.ranks` runs them on
real ranks (the ``mok_hopper`` backend on a CPU)."""
