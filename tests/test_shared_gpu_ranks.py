"""Several ranks on one GPU (``ranks_per_gpu`` > 1), the parts that run on a CPU: the host-staged collectives of
:mod:`contract.comm` against the direct ones, the runner's path for such ranks (correctness rows, nothing timed, the
backends that cannot share a GPU as `unsupported`), the watchdog that ends ranks that hang, and the options' checks.
On a GPU the same path runs over gloo with CUDA tensors (tests/test_shared_gpu.py, marked gpu)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ROOT, compose_cfg, cpu_cfg, use_fake_backends

from contract import comm
from harness.measure import runner
from harness.core.run_names import run_dir_of
from harness.config.schema import ConfigError, config_hash
from harness.config.point import make_case
from harness.measure.dist import free_port
from harness.config.validate import validate_run_options

FAKES = "one_rank_per_gpu=fake_backends:OneRankPerGpu,slow_setup=fake_backends:SlowSetup"


@pytest.fixture(autouse=True)
def _fake_backends(monkeypatch):
    use_fake_backends(monkeypatch, FAKES)


# ---- contract.comm: staged through the host, the same results --------------------------------------------------


def _collectives(rank: int, port: int, staged: bool, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if staged:  # what a gloo group does with CUDA tensors, on CPU tensors
            comm.host_staged = lambda group, t: True
        g = torch.Generator().manual_seed(rank)
        # uneven splits: rank r sends 1 + r + 2 * peer rows to each peer
        in_splits = [1 + rank + 2 * p for p in range(2)]
        out_splits = [1 + p + 2 * rank for p in range(2)]
        x = torch.randn(sum(in_splits), 3, generator=g).to(torch.bfloat16)
        got = torch.full((sum(out_splits), 3), -7.0, dtype=torch.bfloat16)  # a copy back that is missed shows
        comm.all_to_all_single(got, x, out_splits, in_splits, group=dist.group.WORLD)
        parts = [torch.full((4,), -7, dtype=torch.int64) for _ in range(2)]
        comm.all_gather(parts, torch.arange(4) + 10 * rank, group=dist.group.WORLD)
        mx = torch.tensor([float(rank), 5.0 - rank], dtype=torch.float64)
        comm.all_reduce(mx, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        sm = torch.full((2,), 1.5 + rank)
        comm.all_reduce(sm, group=dist.group.WORLD)
        torch.save({"a2a": got, "gather": torch.stack(parts), "max": mx, "sum": sm},
                   os.path.join(out_dir, f"{int(staged)}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_host_staged_collectives_give_what_the_direct_ones_give(tmp_path):
    for staged in (False, True):
        mp.spawn(_collectives, args=(free_port(), staged, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        direct, staged = (torch.load(tmp_path / f"{s}-{rank}.pt") for s in (0, 1))
        for k in direct:
            assert torch.equal(direct[k], staged[k]), (rank, k)
        assert not (staged["a2a"] == -7).any() and staged["gather"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
        assert staged["max"].tolist() == [1.0, 5.0] and staged["sum"].tolist() == [4.0, 4.0]


def test_only_a_gloo_group_given_device_tensors_is_staged():
    class T:
        def __init__(self, kind):
            self.device = torch.device(kind)

    assert not comm.host_staged(None, T("cpu"))  # decided before any group is asked


# ---- the runner with several ranks on one GPU ----------------------------------------------------------------


def _shared_run(results_dir, monkeypatch, backends: str, *overrides: str):
    """``harness.run``'s own path with ranks_per_gpu=2, on CPU ranks. Validation refuses the option on a CPU (there
    is no GPU to share), so that one check is switched off here; everything else (the launch, the watchdog, the
    rows the launcher fills in) is the runner's."""
    import harness.config.validate

    monkeypatch.setattr(harness.config.validate, "_check_shared_gpu", lambda c: None)
    return runner.run_benchmark(cpu_cfg(results_dir, "ep_size=2", "ranks_per_gpu=2", f"backends={backends}",
                                        "directions=[fwd,bwd]", *overrides))


def _row(df, backend, direction):
    r = df[(df.backend == backend) & (df.direction == direction)]
    assert len(r) == 1, df[["backend", "direction", "status"]]
    return r.iloc[0]


IDLE_RANK = ("workload=hot_rank", "workload.hot_rank=1", "workload.hot_ratio=0")


@pytest.mark.slow
@pytest.mark.parametrize("workload", [(), IDLE_RANK], ids=["uniform", "idle_rank"])
def test_ranks_that_share_a_gpu_check_every_backend_and_time_none(results_dir, monkeypatch, workload):
    df = _shared_run(results_dir, monkeypatch, "[nccl,one_rank_per_gpu,mok_hopper]", *workload)
    if workload:
        assert (df.routing == "hot_rank(r=1,x0)").all()
    for b in ("nccl", "mok_hopper"):
        for d in ("fwd", "bwd"):
            r = _row(df, b, d)
            assert r.status == "ok", r.error
            assert bool(r.shared_gpu) and int(r.ranks_per_gpu) == 2
            assert math.isnan(r.latency_ms) and math.isnan(r.tflops_per_gpu)
            assert "2 ranks shared each GPU: checked against the reference, not timed" in r.notes
            assert r.rel_err == r.rel_err  # the check ran and left its error columns
    for d in ("fwd", "bwd"):
        r = _row(df, "one_rank_per_gpu", d)
        assert r.status == "unsupported" and "drop ranks_per_gpu to run it" in r.error


@pytest.mark.slow
def test_the_watchdog_ends_ranks_that_hang_and_their_rows_say_timeout(results_dir, monkeypatch):
    """slow_setup sleeps 60 s in its setup, as a rank spinning on a flag that never comes would: the watchdog stops
    the ranks after 10 s and every missing row is a timeout row saying so."""
    import time

    t0 = time.monotonic()
    df = _shared_run(results_dir, monkeypatch, "[slow_setup]", "watchdog_s=10")
    assert time.monotonic() - t0 < 55
    for d in ("fwd", "bwd"):
        r = _row(df, "slow_setup", d)
        assert r.status == "timeout" and "watchdog timeout" in r.error and "10 s" in r.error
        assert bool(r.shared_gpu) and int(r.ranks_per_gpu) == 2  # the launcher's fill-in rows are marked too


def test_a_dry_run_plans_ranks_that_share_a_gpu_on_fewer_gpus(tmp_path):
    """The node launcher plans ep_size=2 ranks_per_gpu=2 on the one GPU it is told of (the run itself spawns both
    ranks there)."""
    import subprocess
    import sys

    from conftest import ROOT

    p = subprocess.run([sys.executable, "-m", "harness.run", "-m", "hydra/launcher=node",
                        "hydra.launcher.gpus_per_node=1", "hydra.launcher.dry_run=true", "ep_size=2", "ranks_per_gpu=2",
                        "backends=[nccl,mok_hopper]", f"results_dir={tmp_path}/r", f"hydra.sweep.dir={tmp_path}/s"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "EP 2, 1 GPUs, cuda" in p.stdout and "nothing run" in p.stdout
    assert not (tmp_path / "r").exists()


# ---- the options ---------------------------------------------------------------------------------------------


def _resolved(*overrides):
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(compose_cfg("device=cpu", "shape=tiny", "timing=quick", *overrides), resolve=True)
    return c


@pytest.mark.parametrize("extra,words", [(["check=false"], "drop check=false"),
                                         (["calibrate=true"], "drop calibrate=true")])
def test_what_ranks_that_share_a_gpu_cannot_do_is_refused(extra, words):
    from harness.config.point import typed_config

    c = _resolved("ranks_per_gpu=2", *extra)
    c["device"] = "cuda"  # as resolved on a GPU machine
    with pytest.raises(ConfigError, match=words):
        validate_run_options(typed_config(c))


def test_an_idle_rank_gets_no_token_and_needs_enough_other_experts():
    from harness.config.validate import validate_case
    from harness.measure.inputs import make_routing

    case = make_case(_resolved("ep_size=2", *IDLE_RANK), ep_size=2, device="cpu")
    validate_case(case)
    for rank in range(2):
        idx, _ = make_routing(case, rank)
        assert not (idx // case.local_experts == 1).any() and (idx >= 0).all()
    with pytest.raises(ConfigError, match="hot_ratio=0 leaves 4 experts to route to, fewer than top-5"):
        make_case(_resolved("ep_size=2", *IDLE_RANK, f"shape.topk={case.num_experts - case.local_experts + 1}"),
                  ep_size=2, device="cpu")


def test_one_rank_per_gpu_keeps_the_hash_a_point_had_before_the_option():
    c = _resolved()
    case = make_case(c, ep_size=2, device="cpu")
    before = config_hash({k: v for k, v in c.items() if k != "ranks_per_gpu"}, case)
    assert config_hash(c, case) == before
    assert config_hash(dict(c, ranks_per_gpu=2), case) != before
    assert config_hash(dict(c, watchdog_s=30), case) == before


def test_which_backends_run_with_ranks_that_share_a_gpu(monkeypatch):
    """nccl and the reference do anywhere; mok_hopper does (the CPU twin; the kernel with its workspaces over CUDA
    IPC) where the CUDA driver's IPC calls load, and where they do not says why and what checks several of its ranks
    on one GPU instead; a backend without the attribute says to drop the option."""
    from types import SimpleNamespace

    from baselines.nccl import NcclBackend
    from contract.backend import shared_gpu_unsupported
    from harness.measure.reference import ReferenceBackend
    from mok_kernels.mok_hopper import ipc
    from mok_kernels.mok_hopper.backend import MokHopperBackend

    cpu, cuda = SimpleNamespace(device="cpu"), SimpleNamespace(device="cuda")
    for cls in (NcclBackend, ReferenceBackend):
        assert shared_gpu_unsupported(cls, cuda, cls.name, 2) is None
    assert shared_gpu_unsupported(MokHopperBackend, cpu, "mok_hopper", 2) is None
    monkeypatch.setattr(ipc, "_driver", lambda: object())  # a driver that loads
    assert shared_gpu_unsupported(MokHopperBackend, cuda, "mok_hopper", 2) is None

    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(ipc, "_driver", missing)
    why = shared_gpu_unsupported(MokHopperBackend, cuda, "mok_hopper", 2)
    assert "CUDA IPC" in why and "libcuda.so.1" in why and "mok_tools.mok_hopper.shared_gpu_check" in why
    assert "drop ranks_per_gpu" in shared_gpu_unsupported(SimpleNamespace(), cuda, "other", 4)


def test_a_run_of_ranks_that_shared_a_gpu_is_no_environment_of_the_speed_charts():
    """The notebook and the charts draw per environment; a run whose rows all shared a GPU times nothing, so it is
    none of them (its panel had no claims to draw and failed)."""
    from harness.report import claims

    from harness.core import results
    df = claims.prepare(results.load(run_dir_of("mok_hopper-bf16-fwd-bwd-custom_h100x1_20261206")), "run")
    assert len(df) and df.shared_gpu.all()
    assert claims.environments(df) == []
    both = claims.prepare(results.load(ROOT / "results" / "runs"), "run")
    envs = claims.environments(both)
    shared_ids = set(df["run_id"].astype(str))
    assert envs and not [e for e in envs if str(e.get("run_id")) in shared_ids]
