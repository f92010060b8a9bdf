"""The environment a row was measured in: GPU, driver, versions, git SHA, Slurm job."""

from __future__ import annotations

import functools
import os
import importlib.metadata as md
import platform
import socket
import subprocess
from typing import Any, Optional

import torch

from harness.config.schema import REPO_ROOT

# row column -> distribution names to try (first found wins)
OPTIONAL_PACKAGES = {
    "deepep_version": ("deep_ep", "deep-ep"),
    "transformer_engine_version": ("transformer_engine", "transformer-engine", "transformer_engine_torch"),
    "megatron_core_version": ("megatron-core", "megatron_core"),
    "mok_version": ("mok", "mixture-of-kittens"),
    "triton_version": ("triton",),
}


# The CUDA caching allocator's settings the harness runs with unless the user sets PYTORCH_CUDA_ALLOC_CONF: segments
# that grow in place instead of one fixed segment per large request. Without it, kimi_k2_7's mok_hopper backward
# (two weight copies, its gradients and the reference's: about 126 GiB of 140) ran out of memory in a process where
# two backends had run before it, with 10.8 GiB reserved but unallocated (run mok_hopper-bf16-fwd-bwd_h200x1_20261203;
# lab/runs.md).
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def cuda_alloc_conf() -> str:
    """Set the allocator default (``DEFAULT_ALLOC_CONF``) unless the user set ``PYTORCH_CUDA_ALLOC_CONF``, and
    return the setting in force. Call before the process's first CUDA allocation (torch reads it once)."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", DEFAULT_ALLOC_CONF)


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(names: tuple[str, ...]) -> Optional[str]:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def collect(device: str) -> dict[str, Any]:
    # A copy of the tree without .git (e.g. shipped to a GPU machine) names its commit in MOKBENCH_GIT_SHA.
    # MOKBENCH_GIT_DIRTY: any non-empty text means the shipped tree differed from that commit.
    if os.environ.get("MOKBENCH_GIT_SHA"):
        sha, dirty = os.environ["MOKBENCH_GIT_SHA"], os.environ.get("MOKBENCH_GIT_DIRTY", "")
    else:
        sha, dirty = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    info: dict[str, Any] = {
        "git_sha": sha or "unknown",
        "git_dirty": None if dirty is None else bool(dirty),
        "hostname": socket.gethostname(),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "device": device,
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if device == "cuda" else None,
    }
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a torch built without NCCL
            nccl = None
    info["nccl_version"] = nccl
    if device == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name()
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver_version"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            info["driver_version"] = None
    else:
        info["gpu_name"] = "cpu"
        info["driver_version"] = None
    for col, names in OPTIONAL_PACKAGES.items():
        info[col] = _version(names)
    return info


def add_site(path: str) -> list[str]:
    """Put an ``own_pythonpath`` value (``DIR[:DIR]``) first on ``sys.path``, each folder as a site-packages folder:
    its ``.pth`` files processed as Python's site does (a folder line adds that folder; an ``import`` line runs),
    which ``pip install --target`` leaves undone (nvidia-cutlass-dsl 4.4 names its ``python_packages`` folder in
    one, 4.8 adds its ``dsl_packages`` folder from an import line). The given folders go ahead of everything before
    the ``.pth`` files run, so an import line imports this site's package. Returns the entries added, in the order
    they now lead ``sys.path`` (what child processes get through ``PYTHONPATH``)."""
    import site
    import sys

    folders = [f for f in path.split(os.pathsep) if f]
    before = list(sys.path)
    sys.path[:0] = [f for f in folders if f not in sys.path]
    for folder in folders:
        site.addsitedir(folder)  # its .pth files; the folder itself is on the path already
    added = [p for p in dict.fromkeys(sys.path) if p not in before]
    sys.path[:] = added + [p for p in before if p not in added]
    return added


def available_memory_bytes() -> Optional[int]:
    """Memory this machine can still give new processes: the kernel's MemAvailable, or less where a cgroup (a
    container, a Slurm job) caps this process tree lower. None when neither can be read."""
    avail: Optional[int] = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    # (limit, usage, stat file, the stat's reclaimable page cache) for cgroup v2 and v1
    for limit_file, usage_file, stat_file, cache_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        root = "/sys/fs/cgroup/"
        try:
            with open(root + limit_file) as f:
                limit = f.read().strip()
            with open(root + usage_file) as f:
                used = int(f.read().strip())
            with open(root + stat_file) as f:
                stat = dict(line.split() for line in f if len(line.split()) == 2)
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            left = max(0, int(limit) - used + int(stat.get(cache_key, 0)))
            avail = left if avail is None else min(avail, left)
        break
    return avail
