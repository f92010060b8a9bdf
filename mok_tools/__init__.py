"""Tools that measure the kernels with the harness's definitions (shapes, precisions, inputs, the reference, the
timer): they import both ``mok_kernels`` and ``harness``, so they live here, beside the kernels, not inside them."""
