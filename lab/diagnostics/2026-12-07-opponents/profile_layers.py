"""Per-kernel CUDA time of the eager `torch` and `nccl` layers at EP=1, one training step (forward + backward) at a
time: `python profile_layers.py SHAPE PRECISION OUT.txt` on a GPU machine, from the repository root. Builds the
point's case, inputs and backends as the harness does (one rank, nccl process group), warms 5 steps, profiles 10,
and writes torch.profiler's kernel table per backend (sorted by CUDA time) to OUT.txt."""

import os
import sys

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from harness.backends import load_backend
from harness.config import register_configs
from harness.inputs import make_inputs
from harness.point import Point
from harness.runner import resolve

shape, prec, out = sys.argv[1:4]
register_configs()
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
with initialize_config_dir(config_dir=os.path.abspath("configs"), version_base=None):
    cfg = compose("config", overrides=[f"shape={shape}", f"precision={prec}", "ep_size=1", "compile=false"])
pt = Point.build(resolve(cfg), ep_size=1, device="cuda")
inputs = make_inputs(pt.case, 0, torch.device("cuda"))
lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__} shape={shape} precision={prec} "
         f"tokens={pt.case.tokens_per_gpu}: 10 steps (forward + backward), after 5 untimed"]
for name in ("torch", "nccl"):
    opts = pt.options(name)
    cls = load_backend(name)
    b = cls(pt.case, dist.group.WORLD) if opts is None else cls(pt.case, dist.group.WORLD, opts)
    b.setup(inputs)
    x = inputs.x_TH.detach().requires_grad_()
    w = inputs.topk_w_TK.detach().requires_grad_()

    def step():
        b.zero_grad()
        b.forward(x, inputs.topk_idx_TK, w).backward(inputs.grad_out_TH)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as p:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    ka = p.key_averages()
    key = "device_time_total" if hasattr(ka[0], "device_time_total") else "cuda_time_total"
    info = b.info() if hasattr(b, "info") else {}
    lines += ["", f"=== {name}: {info.get('notes', '')}",
              ka.table(sort_by=key, row_limit=45, max_name_column_width=70)]
    b.teardown()
    del b, step
    torch.cuda.empty_cache()
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines)[:6000])
dist.destroy_process_group()
