"""Per-kernel time of backends at one point, one training step (forward + backward) at a time, from torch.profiler:

    python -m mok_tools.profile_backends --backends torch,nccl --out profile.txt -- shape=qwen3_5_397b precision=bf16

The arguments after ``--`` are the harness's overrides (``ep_size`` is 1: one rank, this process). The point's case,
inputs and backends are built as the harness builds them; each backend is set up, runs ``--warmup`` untimed steps,
then ``--steps`` profiled ones, and is torn down before the next. The file holds one kernel table per backend
(on a GPU sorted by CUDA time; on the CPU by CPU time). A diagnostic, not a measurement: the profiler's overhead is
in its times, and result rows come from ``harness.run`` only."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def profile(backends: list[str], overrides: list[str], steps: int, warmup: int) -> str:
    from hydra import compose, initialize_config_dir

    from harness.core.backends import load_backend
    from harness.config.schema import register_configs
    from harness.measure.dist import free_port
    from harness.measure.inputs import make_inputs
    from harness.config.point import Point
    from harness.config.routing import label
    from harness.config.point import resolve

    register_configs()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        configs = Path(__file__).resolve().parent.parent / "configs"
        with initialize_config_dir(config_dir=str(configs), version_base=None):
            cfg = compose("config", overrides=[*overrides, "ep_size=1"])
        pt = Point.build(resolve(cfg), ep_size=1, device="cuda" if cuda else "cpu")
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        inputs = make_inputs(pt.case, 0, device)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        c = pt.case
        lines = [f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}: shape={c.shape} "
                 f"precision={c.precision} tokens={c.tokens_per_gpu} routing={label(c)}; {steps} steps "
                 f"(forward + backward) after {warmup} untimed"]
        for name in backends:
            options = pt.options(name)
            cls = load_backend(name)
            b = cls(c, dist.group.WORLD) if options is None else cls(c, dist.group.WORLD, options)
            b.setup(inputs)
            x = inputs.x_TH.detach().requires_grad_()
            w = inputs.topk_w_TK.detach().requires_grad_()

            def step() -> None:
                b.zero_grad()
                b.forward(x, inputs.topk_idx_TK, w).backward(inputs.grad_out_TH)

            for _ in range(warmup):
                step()
            if cuda:
                torch.cuda.synchronize()
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(steps):
                    step()
                if cuda:
                    torch.cuda.synchronize()
            table = prof.key_averages()
            sort = ("device_time_total" if hasattr(table[0], "device_time_total") else "cuda_time_total") if cuda \
                else "cpu_time_total"
            lines += ["", f"=== {name}: {b.info().get('notes', '')}",
                      table.table(sort_by=sort, row_limit=45, max_name_column_width=70)]
            b.teardown()
            del b, step
            if cuda:
                torch.cuda.empty_cache()
        return "\n".join(lines) + "\n"
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    own, _, overrides = _split(argv)
    p = argparse.ArgumentParser(prog="python -m mok_tools.profile_backends", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", required=True, help="comma-separated registry names")
    p.add_argument("--out", required=True, type=Path, help="the text file of kernel tables")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(own)
    text = profile([b for b in a.backends.split(",") if b], overrides, a.steps, a.warmup)
    a.out.write_text(text)
    print(f"kernel tables of {a.backends}: {a.out}")
    return 0


def _split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], "--", argv[i + 1:]
    return argv, "", []


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
