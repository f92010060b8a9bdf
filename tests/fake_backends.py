"""Deliberately broken backends, to prove that failures become rows and never crash the sweep."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from baselines.nccl import NcclBackend


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
