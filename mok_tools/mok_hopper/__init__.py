"""mok_hopper's GPU check (``gpu_check``: correctness, determinism, per-stage timing, tile sweeps) and its floors
(``perf_floors``)."""
