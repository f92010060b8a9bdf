#!/usr/bin/env python3
"""torchrun --nproc-per-node=2 .device/hybridep_probe.py VARIANT: construct one small HybridEPBuffer after a given
import / preload order, print which libstdc++ objects are mapped, and OK or crash."""
import ctypes, faulthandler, os, sys
faulthandler.enable()
v = sys.argv[1]
import torch, torch.distributed as dist
if v == "stdcxx":
    ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
elif v == "te":
    import transformer_engine.pytorch  # noqa: F401
elif v == "deepbind":
    import importlib
    old = sys.getdlopenflags(); sys.setdlopenflags(os.RTLD_NOW | os.RTLD_DEEPBIND)
    import hybrid_ep_cpp  # noqa: F401
    sys.setdlopenflags(old)
elif v == "harness":
    import harness.run  # noqa: F401  (what a spawned rank of the CLI imports first)
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
from deep_ep import HybridEPBuffer
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "stdc++" in l})
print(f"[{v}] r{rank} libstdc++ mapped: {maps}", flush=True)
buf = HybridEPBuffer(group=dist.group.WORLD, hidden_dim=1024, max_num_of_tokens_per_rank=256, num_local_experts=4,
                     use_fp8=False, num_sms_dispatch_api=8, num_sms_combine_api=8)
print(f"[{v}] r{rank} CTOR OK", flush=True)
dist.barrier()
dist.destroy_process_group()
