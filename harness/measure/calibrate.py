"""Measure the machine's three ceilings in the run that uses them: dense GEMM rate, HBM bandwidth, link bandwidth.

* ``calib_gemm_tflops``: a square matrix product (8192^3 on a GPU) in the run's precision: bf16 ``mm``; fp8 through
  ``torch._scaled_mm`` with per-tensor scales (the fastest fp8 GEMM torch offers; e4m3 inputs, bf16 output).
* ``calib_hbm_gb_s``: a large device-to-device copy, counting bytes read plus bytes written.
* ``calib_link_gb_s``: ``all_to_all_single`` of a large buffer split evenly, remote bytes per rank per second
  (what NCCL achieves; the same collective the nccl baseline uses).
Each is the median of a few timed repetitions through the harness's one timing path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.measure.timing import Timer


def _gemm_tflops(timer: Timer, precision: str, n: int, iters: int) -> float:
    dev = timer.device
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    if precision in ("fp8", "mxfp8") and dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=dev)
        fn = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        fn = lambda: a @ b  # noqa: E731
    s = timer.run(fn, num_warmup=3, num_iters=iters)
    return 2 * n**3 / (s.median_ms / 1e3) / 1e12


def _hbm_gb_s(timer: Timer, nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).random_(0, 255)
    dst = torch.empty_like(src)
    s = timer.run(lambda: dst.copy_(src), num_warmup=3, num_iters=iters)
    return 2 * nbytes / (s.median_ms / 1e3) / 1e9


def _link_gb_s(timer: Timer, group, nbytes: int, iters: int) -> float:
    n = dist.get_world_size(group)
    per_peer = nbytes // n
    src = torch.empty(per_peer * n, dtype=torch.uint8, device=timer.device).random_(0, 255)
    dst = torch.empty_like(src)
    s = timer.run(lambda: dist.all_to_all_single(dst, src, group=group), num_warmup=3, num_iters=iters)
    return per_peer * (n - 1) / (s.median_ms / 1e3) / 1e9


def measure(device: torch.device, group, precision: str) -> dict[str, float]:
    """The three rates on this machine (identical on every rank: each is the max over ranks per iteration)."""
    gpu = device.type == "cuda"
    timer = Timer(device, group, align="barrier")
    out = {
        "calib_gemm_tflops": _gemm_tflops(timer, precision, 8192 if gpu else 512, 10 if gpu else 3),
        "calib_hbm_gb_s": _hbm_gb_s(timer, (2 << 30) if gpu else (64 << 20), 10 if gpu else 3),
    }
    if dist.get_world_size(group) > 1:
        out["calib_link_gb_s"] = _link_gb_s(timer, group, (1 << 30) if gpu else (16 << 20), 10 if gpu else 3)
    return out
