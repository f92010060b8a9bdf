"""Shared fixtures: Hydra composition of the real configs/ and a per-test results folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels under the interpreter: read when a kernels module is imported, so
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before any test module (or what it imports) is collected

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from harness.config.schema import register_configs  # noqa: E402

register_configs()

# Ranks spawned by the harness import the fake backends from here.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH")]))

HAS_GPU = torch.cuda.is_available()
NUM_GPUS = torch.cuda.device_count() if HAS_GPU else 0


def has_nvidia_backend() -> bool:
    """Whether Triton here can compile for an NVIDIA GPU without one (its NVIDIA backend and ptxas)."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return False
    return True


def compose_cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    return tmp_path / "results"


def use_fake_backends(monkeypatch, fakes: str) -> None:
    """Register the backends of ``fakes`` (``name=module:Class,...``, from tests/fake_backends.py) in this process's
    registry and, through MOKBENCH_EXTRA_BACKENDS, in the ranks it spawns."""
    import harness.core.backends as hb

    monkeypatch.setenv("MOKBENCH_EXTRA_BACKENDS", fakes)
    for item in fakes.split(","):
        k, _, v = item.partition("=")
        monkeypatch.setitem(hb.BACKENDS, k, v)


def cpu_cfg(results_dir: Path, *overrides: str):
    """The CPU default, small: tiny shape, 64 tokens per rank, a couple of timed iterations."""
    return compose_cfg("device=cpu", "shape=tiny", "timing=quick", "workload.tokens_per_gpu=64",
                       "timing.num_warmup=1", "timing.num_iters=2", "timing.phase_iters=2",
                       f"results_dir={results_dir}", "print_table=false", *overrides)


def free_port_env(monkeypatch) -> None:
    """Make this process the only rank, as torchrun would set it up: the harness runs the worker here (no spawned
    ranks), so monkeypatches reach it. The caller destroys the process group afterwards."""
    from harness.measure.dist import free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)


def run_here(monkeypatch, cfg):
    """``harness.measure.runner.run_benchmark(cfg)`` with this process as the only rank (:func:`free_port_env`), so
    monkeypatches reach the worker; the process group is destroyed afterwards, failed or not. The run's rows."""
    import torch.distributed as dist

    from harness.measure.runner import run_benchmark

    free_port_env(monkeypatch)
    try:
        return run_benchmark(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def one_rank():
    """This process as a one-rank gloo group (the one already initialised, if any)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from harness.measure.dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
