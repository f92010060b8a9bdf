"""The workspace over CUDA IPC (mok_kernels/mok_hopper/ipc.py), on the CPU: gloo ranks in processes of their own with a
stand-in IPC layer (tests/fake_ipc.py: shared files mapped in every process), the Triton kernels under the
interpreter. Checked: the handle exchange and every region's peer offset table (each rank reads every peer's
pattern through the table), the signal-pad barrier (it waits for a late rank; on every channel each signal given is
taken), the teardown (every peer unmaps before any rank frees), the layer's forward across the processes against
the twin, and the planted faults (a wrong peer pointer misroutes; a skipped barrier leaves the peers waiting). The
GPU side (CUDA driver IPC, harness rows) is tests/test_shared_gpu.py."""

from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fake_ipc import FileIpc
from mok_kernels.mok_hopper import ipc
from mok_kernels.mok_hopper.workspace import Workspace

T, H, K = 8, 256, 2


def _init(rank: int, world: int, tmp: str, fault: str) -> FileIpc:
    os.environ["TRITON_INTERPRET"] = "1"
    if fault:
        os.environ[ipc.FAULT_ENV] = fault
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    (Path(tmp) / "maps").mkdir(exist_ok=True)
    return FileIpc(f"{tmp}/maps")


def _pattern(rank: int, region: int, n: int) -> torch.Tensor:
    return ((torch.arange(n) * 7 + 31 * rank + 101 * region + 1) % 251 + 1).to(torch.uint8)


def _read(addr: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8).clone()


def _exchange_rank(rank: int, world: int, tmp: str, fault: str) -> None:
    layer = _init(rank, world, tmp, fault)
    ws = Workspace(rank=rank, world=world, device="cpu", tokens=T, hidden=H, topk=K, fp8=True, ipc=layer)
    rec: dict = {"transport": ws.transport, "pads": list(ws.handle.pads.shape)}
    names = list(ws.views)
    if rank == world - 1:
        time.sleep(1.5)  # the late rank: a barrier that does not wait lets the others read zeros below
    for i, name in enumerate(names):
        v = ws.views[name]
        v.view(torch.uint8).view(-1).copy_(_pattern(rank, i, v.numel() * v.element_size()))
    ws.barrier(0)
    seen = {}
    for i, name in enumerate(names):
        v = ws.views[name]
        nb, es = v.numel() * v.element_size(), v.element_size()
        seen[name] = [next((p for p in range(world) if torch.equal(_read(v.data_ptr() + int(d) * es, nb),
                                                                     _pattern(p, i, nb))), -1)
                      for d in ws.tables[name].tolist()]
    rec["seen"] = seen
    # the schedule's own kernel reads every rank's top-k ids through the idx table
    from mok_kernels.mok_hopper.ops.schedule_kernels import gather_peer_i32

    ws.barrier(1)
    out = torch.zeros(world, T * K, dtype=torch.int32)
    gather_peer_i32(ws.idx, ws.tables["idx"], out)
    rec["idx_rows"] = [bool(torch.equal(out[p].view(torch.uint8), _pattern(p, names.index("idx"), T * K * 4)))
                       for p in range(world)]
    for c in (2, 3, 0, 1, 1, 2):  # every channel, in another order, one twice in a row
        ws.barrier(c)
        rec.setdefault("pads_set", []).append(int(ws.handle.pads.sum()))  # (a faster peer may have signalled on)
    dist.barrier()  # every rank is past its last device barrier: every signal given has been taken
    rec["pads_zero_at_end"] = bool((ws.handle.pads == 0).all())
    ws.close()
    rec["log"] = layer.log
    rec["files_left"] = sorted(os.listdir(f"{tmp}/maps"))
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(rec))
    dist.destroy_process_group()


def _spawn(fn, world: int, tmp: Path, *args) -> list[dict]:
    mp.spawn(fn, args=(world, str(tmp), *args), nprocs=world, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ipc_exchange_tables_barrier_and_teardown(tmp_path, world):
    recs = _spawn(_exchange_rank, world, tmp_path, "")
    for r, rec in enumerate(recs):
        assert rec["transport"] == "ipc" and rec["pads"] == [ipc.CHANNELS, world]
        assert rec["pads_zero_at_end"] and all(0 <= n <= world - 1 for n in rec["pads_set"])
        # every region's table names every rank's own copy (the late rank's too: the barrier waited for it)
        assert all(s == list(range(world)) for s in rec["seen"].values()), rec["seen"]
        assert rec["idx_rows"] == [True] * world
        calls = [c for c, _, _ in rec["log"]]
        assert calls == ["alloc", "export"] + ["open"] * (world - 1) + ["close"] * (world - 1) + ["free"], calls
        opened = sorted(f for c, _, f in rec["log"] if c == "open")
        assert opened == sorted(f for c, _, f in rec["log"] if c == "close")
        assert opened == sorted(f for q, o in enumerate(recs) if q != r for c, _, f in o["log"] if c == "alloc")
    # no rank frees its buffer before every peer has unmapped it; every file is gone
    last_close = max(t for rec in recs for c, t, _ in rec["log"] if c == "close")
    assert last_close < min(t for rec in recs for c, t, _ in rec["log"] if c == "free")
    assert not os.listdir(tmp_path / "maps")


def test_planted_wrong_peer_pointer_misroutes_rank_0_only(tmp_path):
    recs = _spawn(_exchange_rank, 2, tmp_path, "wrong-peer-pointer")
    assert all(s == [0, 0] for s in recs[0]["seen"].values()), recs[0]["seen"]  # rank 0 finds itself as rank 1
    assert all(s == [0, 1] for s in recs[1]["seen"].values())
    assert recs[0]["idx_rows"] == [True, False]


def _skip_rank(rank: int, world: int, tmp: str, fault: str) -> None:
    layer = _init(rank, world, tmp, fault)
    ws = Workspace(rank=rank, world=world, device="cpu", tokens=T, hidden=H, topk=K, fp8=False, ipc=layer)
    ws.barrier(0)
    Path(tmp, f"passed0-{rank}").touch()
    ws.barrier(1)
    Path(tmp, f"passed1-{rank}").touch()


@pytest.mark.parametrize("fault", ["", "skip-barrier"])
def test_planted_skipped_barrier_leaves_the_peer_waiting(tmp_path, fault):
    ctx = mp.spawn(_skip_rank, args=(2, str(tmp_path), fault), nprocs=2, join=False)
    deadline = time.monotonic() + (60 if not fault else 15)
    while time.monotonic() < deadline and not ctx.join(timeout=0.5):
        pass
    alive = [p.is_alive() for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    passed = sorted(f.name for f in tmp_path.glob("passed*"))
    if not fault:
        assert not any(alive) and passed == ["passed0-0", "passed0-1", "passed1-0", "passed1-1"]
    else:  # rank 0 neither signals nor waits on channel 1: it goes on, rank 1 waits for its signal
        assert alive == [False, True] and passed == ["passed0-0", "passed0-1", "passed1-0"], (alive, passed)


def test_a_fault_name_not_in_the_table_is_an_error(monkeypatch):
    monkeypatch.setenv(ipc.FAULT_ENV, "no-such-fault")
    with pytest.raises(ValueError, match="wrong-peer-pointer"):
        ipc.planted_fault()
    monkeypatch.delenv(ipc.FAULT_ENV)
    assert ipc.planted_fault() is None


def test_only_a_gloo_group_on_cuda_takes_the_ipc_route():
    assert not ipc.wanted(None, torch.device("cpu"))  # (no process group here either)


SHAPE = (24, 3, 8, 128, 64)  # T, K, E, H, I: the simulated-rank tests' bf16 size


def _forward_rank(rank: int, world: int, tmp: str, fault: str) -> None:
    from mok_tools.mok_hopper.shared_gpu_check import make_inputs, make_weights
    from mok_kernels.mok_hopper.api import MoKHopperLayer

    layer_ipc = _init(rank, world, tmp, fault)
    Tn, Kn = SHAPE[:2]
    w, inp = make_weights(world, SHAPE, seed=3), make_inputs(world, SHAPE, seed=4, routing="uniform")
    ws = Workspace(rank=rank, world=world, device="cpu", tokens=Tn, hidden=SHAPE[3], topk=Kn, fp8=False,
                   ipc=layer_ipc)
    layer = MoKHopperLayer(w.w13[rank], w.w2[rank], topk=Kn, tokens=Tn, shared=w.shared, rank=rank, world=world,
                           workspace=ws, cuda_graph=False)
    if rank == world - 1:
        time.sleep(1.0)  # late: the other ranks' barriers must wait for its stage and its pushes
    out = layer(inp["x"][rank], inp["idx"][rank], inp["w"][rank])
    torch.save(out, Path(tmp, f"out{rank}.pt"))
    del layer
    ws.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("fault", ["", "wrong-peer-pointer"])
def test_the_layer_runs_across_processes_over_ipc_workspaces(tmp_path, fault):
    """Two processes, each one rank of the layer (the kernels under the interpreter) over IPC workspaces: every
    rank's output equals the twin's bit for bit. With rank 0's peer pointer for rank 1 wrong, rank 0 reads its own
    ids and rows as rank 1's and pushes their results into its own slots (the values its own rows give there, so its
    output stays right), and rank 1 never gets the rows rank 0's experts owe it: rank 1's output is wrong."""
    from mok_tools.mok_hopper.shared_gpu_check import make_inputs, make_weights
    from mok_kernels.mok_hopper.twin import forward as twin

    mp.spawn(_forward_rank, args=(2, str(tmp_path), fault), nprocs=2, join=True)
    w, inp = make_weights(2, SHAPE, seed=3), make_inputs(2, SHAPE, seed=4, routing="uniform")
    want = twin.simulate(inp["x"], inp["idx"], inp["w"], w.w13, w.w2, shared=w.shared)
    got = [torch.load(tmp_path / f"out{r}.pt") for r in range(2)]
    same = [torch.equal(g, t) for g, t in zip(got, want)]
    assert same == ([True, True] if not fault else [True, False]), [float((g.float() - t.float()).abs().max())
                                                                   for g, t in zip(got, want)]


_AOT = """
from mok_tools.mok_hopper.aot_check import compile_variant, problems
from mok_tools.mok_hopper.aot_variant import Variant
from mok_kernels.mok_hopper.ops.barrier import _signal_pad_barrier
v = Variant("signal-pad barrier", "_signal_pad_barrier",
            dict(pad_ptr="*i32", peer_ptr="*i64", rank="i32", world="i32", channel="i32"), {}, 1,
            plain=("rank", "world", "channel"))
r = compile_variant(v, 90, sass=True, fn=_signal_pad_barrier)
assert problems(r, 90) is None, problems(r, 90)
sass = r["sass"] if isinstance(r["sass"], list) else r["sass"].splitlines()
print(sum("ATOMG.E.CAS.STRONG.SYS" in line for line in sass), sum("MEMBAR.ALL.SYS" in line for line in sass))
"""


def test_the_barrier_kernel_compiles_for_hopper_with_system_scope_atomics():
    """The barrier's kernel for sm_90 (Triton's ptxas, no GPU): no spill, and its signal and wait are system-scope
    compare-and-swaps, the signal behind a system fence (what orders this rank's writes before its peers' reads)."""
    import subprocess
    import sys

    from conftest import ROOT, has_nvidia_backend

    if not has_nvidia_backend():
        pytest.skip("Triton has no NVIDIA backend (ptxas) here to compile the barrier for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _AOT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    cas, fences = map(int, p.stdout.split())
    assert cas >= 2 and fences >= 1, p.stdout
