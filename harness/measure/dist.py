"""Where this process sits: torchrun, Slurm, or a plain process that spawns its local ranks itself."""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | slurm | spawn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_slurm_host(nodelist: str) -> str:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    # "node[01-04,07]" -> "node01"; "a,b" -> "a"
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        return prefix + rest.rstrip("]").split("-")[0].split(",")[0]
    return head


def from_environment() -> Optional[RankEnv]:
    """The rank layout set up by torchrun or Slurm, or None for a plain process."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e and "MASTER_ADDR" in e:
        ws = int(e["WORLD_SIZE"])
        local_ws = int(e.get("LOCAL_WORLD_SIZE", ws))
        return RankEnv(int(e["RANK"]), ws, int(e.get("LOCAL_RANK", 0)), max(1, ws // max(local_ws, 1)),
                       e["MASTER_ADDR"], int(e.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in e and int(e.get("SLURM_NTASKS", "1")) > 1:
        job = int(e.get("SLURM_JOB_ID", "0"))
        return RankEnv(
            rank=int(e["SLURM_PROCID"]),
            world_size=int(e["SLURM_NTASKS"]),
            local_rank=int(e.get("SLURM_LOCALID", 0)),
            num_nodes=int(e.get("SLURM_JOB_NUM_NODES", e.get("SLURM_NNODES", 1))),
            master_addr=e.get("MASTER_ADDR") or _first_slurm_host(e.get("SLURM_JOB_NODELIST", "localhost")),
            master_port=int(e.get("MASTER_PORT", 20000 + job % 20000)),
            launcher="slurm",
        )
    return None


def init(env: RankEnv, device: str, timeout_s: int = 900, ranks_per_gpu: int = 1) -> torch.device:
    """Join the process group and pick this rank's device. ``ranks_per_gpu`` > 1: consecutive local ranks share a
    GPU, and the group is gloo (NCCL refuses two ranks on one device; :mod:`contract.comm` stages through the
    host)."""
    shared = device == "cuda" and ranks_per_gpu > 1
    if device == "cuda":
        n = torch.cuda.device_count()
        # Tasks that see every GPU of the node pick theirs by local rank; tasks given one GPU use it.
        dev = torch.device("cuda", (env.local_rank // ranks_per_gpu if shared else env.local_rank) % n)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device == "cuda" and not shared else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if device == "cuda" and not shared else None,
        )
    return dev
