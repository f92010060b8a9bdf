"""Construct one small ``HybridEPBuffer`` (DeepEP's hybrid-ep branch) on 2 ranks after a given import / preload
order, print which libstdc++ objects are mapped, then OK or crash (lab/diagnostics/2026-11-30-hybridep-preload)::

    torchrun --nproc-per-node=2 lab/probes/hybridep_probe.py VARIANT

VARIANT: ``plain`` (``import torch`` only), ``stdcxx`` (``libstdc++.so.6`` loaded RTLD_GLOBAL first, what the
harness's ``MOKBENCH_DEEPEP_PRELOAD`` default does), ``te`` (Transformer Engine imported first), ``deepbind``
(``hybrid_ep_cpp`` loaded with RTLD_DEEPBIND), ``harness`` (``import harness.run`` first, as a spawned rank of the
CLI). Needs 2 GPUs and deep_ep; everything but this docstring loads inside :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

VARIANTS = ("plain", "stdcxx", "te", "deepbind", "harness")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", choices=VARIANTS)
    v = ap.parse_args(argv).variant

    import ctypes
    import faulthandler
    import os

    faulthandler.enable()
    import torch
    import torch.distributed as dist

    if v == "stdcxx":
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    elif v == "te":
        import transformer_engine.pytorch  # noqa: F401
    elif v == "deepbind":
        old = sys.getdlopenflags()
        sys.setdlopenflags(os.RTLD_NOW | os.RTLD_DEEPBIND)
        import hybrid_ep_cpp  # noqa: F401

        sys.setdlopenflags(old)
    elif v == "harness":
        import harness.run  # noqa: F401  (what a spawned rank of the CLI imports first)
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    from deep_ep import HybridEPBuffer

    with open("/proc/self/maps") as f:
        maps = sorted({line.split()[-1] for line in f if "stdc++" in line})
    print(f"[{v}] r{rank} libstdc++ mapped: {maps}", flush=True)
    HybridEPBuffer(group=dist.group.WORLD, hidden_dim=1024, max_num_of_tokens_per_rank=256, num_local_experts=4,
                   use_fp8=False, num_sms_dispatch_api=8, num_sms_combine_api=8)
    print(f"[{v}] r{rank} CTOR OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
