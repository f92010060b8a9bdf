"""Deliberately broken backends, to prove that failures become rows and never crash the sweep."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from baselines.nccl import NcclBackend
from mok_kernels.mok_hopper.backend import MokHopperBackend


class WrongOutput(NcclBackend):
    """Numerically wrong: the output is 10% too large (and so are the gradients)."""

    name = "wrong"

    def forward(self, x, idx, w):
        return super().forward(x, idx, w) * 1.1


class FailsSetup(NcclBackend):
    name = "fails_setup"

    def setup(self, inputs):
        raise RuntimeError("boom in setup")


class SlowSetup(NcclBackend):
    """A setup that would take a minute (as SonicMoE's compiles of every autotuning config do): cut by
    ``setup_timeout_s``."""

    name = "slow_setup"

    def setup(self, inputs):
        import time

        time.sleep(60)
        super().setup(inputs)


class NotInstalled(NcclBackend):
    name = "not_installed"

    @classmethod
    def unsupported_reason(cls, case):
        return "package frobnicate is not installed; pip install frobnicate"


class ForwardOnly(NcclBackend):
    name = "fwd_only"
    directions = ("fwd",)


class DiesHard(NcclBackend):
    """The process dies without a Python exception (like a segfault or an OOM kill)."""

    name = "dies"

    def forward(self, x, idx, w):
        if dist.get_rank() == 0:
            os._exit(17)
        return super().forward(x, idx, w)


class NanGrad(NcclBackend):
    name = "nan_grad"

    def weight_grads(self):
        g = super().weight_grads()
        if g["w_down"] is not None:
            g["w_down"] = torch.full_like(g["w_down"], float("nan"))
        return g


class RemovesResults(NcclBackend):
    """Rank 0 replaces the results folder ($MOKBENCH_TEST_RESULTS_DIR) with a file during setup: a results disk that
    went away in the middle of a run."""

    name = "removes_results"

    def setup(self, inputs):
        if dist.get_rank() == 0:
            import shutil
            from pathlib import Path

            p = Path(os.environ["MOKBENCH_TEST_RESULTS_DIR"])
            shutil.rmtree(p, ignore_errors=True)
            p.write_text("gone\n")
        super().setup(inputs)


class OneRankPerGpu(NcclBackend):
    """Runs only with one rank per GPU (does not declare ``runs_shared_gpu``)."""

    name = "one_rank_per_gpu"
    runs_shared_gpu = False


class MokHopperTwoChunks(MokHopperBackend):
    """``mok_hopper`` with its pull / GEMM pipeline in two chunks a rank (``num_chunks=2`` over the default tile):
    the harness has no tile option, and several ranks on one GPU must also run more than one chunk a rank."""

    name = "mok_hopper_2chunks"

    def __init__(self, case, group, options=None):
        super().__init__(case, group, options)
        self.tile_overrides = {"num_chunks": 2}


# ---- device memory that does not come back (harness.measure.runner's clean-up between backends) --------------------
# A stand-in device-memory counter: MOKBENCH_MEMORY_PROBE=fake_backends:fake_probe gives every rank a probe that reads
# it (the CPU has none), and FakeBlock objects count as allocated device memory while they live.

FAKE_TOTAL_BYTES = 80 << 30
HOLD_BYTES = 4 << 30
_held = {"bytes": 0}
_leaked: list = []  # what LeaksMemory keeps for good (as a library's module-level cache would)


class FakeBlock:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        _held["bytes"] += nbytes

    def __del__(self) -> None:
        _held["bytes"] -= self.nbytes


def fake_probe(device):
    from harness.measure.memory import Probe

    return Probe(allocated=lambda: _held["bytes"], peak=lambda: _held["bytes"], reset_peak=lambda: None,
                 free_total=lambda: (FAKE_TOTAL_BYTES - _held["bytes"], FAKE_TOTAL_BYTES), sync=lambda: None)


class HoldsMemoryAndFails(NcclBackend):
    """Takes 4 GiB of (fake) device memory in a reference cycle, then fails its setup: only the harness's clean-up
    (the garbage collector, the exception's frames dropped) gives the memory back."""

    name = "holds_memory"

    def setup(self, inputs):
        super().setup(inputs)
        self.block = FakeBlock(HOLD_BYTES)
        self.me = self  # a cycle: reference counting alone never frees it
        raise RuntimeError("boom after taking 4 GiB")


class LeaksMemory(NcclBackend):
    """Runs fine, and keeps 4 GiB of (fake) device memory for good: no clean-up can give it back."""

    name = "leaks_memory"

    def setup(self, inputs):
        super().setup(inputs)
        _leaked.append(FakeBlock(HOLD_BYTES))


class HoldsDeviceMemoryAndFails(NcclBackend):
    """Takes ``MOKBENCH_PLANTED_GIB`` GiB (default 8) of real device memory in a reference cycle, then fails its
    setup (the GPU side of HoldsMemoryAndFails)."""

    name = "holds_device_memory"

    def setup(self, inputs):
        gib = float(os.environ.get("MOKBENCH_PLANTED_GIB", "8"))
        self.block = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=inputs.x_TH.device)
        self.me = self
        raise RuntimeError(f"boom after taking {gib:g} GiB of device memory")


class FirstRouting(NcclBackend):
    """Keeps the routing it saw at setup and routes every later call by it (a plan built once): right for one routing,
    wrong once the routing changes between steps."""

    name = "first_routing"

    def setup(self, inputs):
        super().setup(inputs)
        self.idx0 = inputs.topk_idx_TK.clone()

    def forward(self, x, idx, w):
        return super().forward(x, self.idx0, w)


class SpoilsInputs(NcclBackend):
    """Runs fine, then leaves the point's routed weights changed at teardown (as a backend that re-lays them in place
    and fails to restore them would): every backend after it would be checked against the wrong inputs."""

    name = "spoils_inputs"

    def setup(self, inputs):
        super().setup(inputs)
        self.spoil = inputs.w2_LHI

    def teardown(self):
        with torch.no_grad():
            self.spoil.mul_(2)
        super().teardown()


class ReplaysGraphs(NcclBackend):
    """nccl whose info says its compiled code replays CUDA graphs (as ``compile_mode=max-autotune`` does)."""

    name = "replays_graphs"

    def info(self):
        return dict(super().info(), compiled=True, compile_mode="max-autotune")
