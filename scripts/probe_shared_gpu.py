"""Can P processes (P = 2 and 4) on ONE CUDA device do what a multi-rank mok_hopper layer needs of its ranks?

    python scripts/probe_shared_gpu.py --out DIR                # every step, P = 2 and 4
    python scripts/probe_shared_gpu.py --out DIR --ranks 2 --steps gloo,spin_wait --timeout 120

Steps, each for each P, each in a subprocess of its own with a time limit (a failing or hanging step is recorded, and
the later steps still run):

* ``gloo``: a gloo process group of P processes on device 0 exchanges CUDA tensors with host staging (copy to the
  host, all-gather, copy back), timed; and says whether gloo takes the CUDA tensors directly. (NCCL refuses two
  ranks on one device, which is why gloo.)
* ``symm_mem``: torch symmetric memory over that group (``symm_mem.empty`` + ``rendezvous``): each rank reads every
  peer's buffer, and the handle's barrier is timed.
* ``cuda_ipc``: without symmetric memory: a buffer shared by CUDA IPC (torch.multiprocessing's CUDA tensor sharing,
  ``cudaIpcGetMemHandle`` underneath), every rank writing its part and reading the others'; and an interprocess CUDA
  event (``torch.cuda.Event(interprocess=True)``): rank 0's stream waits on rank 1's event, recorded after a 50 ms
  device sleep and a write, and must see the write.
* ``spin_wait``: ranks 1..P-1 each launch a kernel that spins on a flag in the shared buffer, which rank 0's kernel
  sets: does the wait complete, and how long after the set (the GPU's global timer on both sides)? Without MPS the
  processes share the GPU by time-slicing, so a spin may progress only at slice boundaries. Each spin gives up after
  ``--spin-limit-s`` (reported as not seen), so a hang is measured, not suffered.

Writes ``DIR/probe_shared_gpu.json`` (each step's record: status ok / failed / timeout / error, the exact error,
timings, per-rank details) and ``DIR/probe_shared_gpu.txt`` (a table). Exit 0 once every step has a record, 2 (one
line, nothing written) without a GPU or for a bad option.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable, Optional, Sequence

STEPS = ("gloo", "symm_mem", "cuda_ipc", "spin_wait")
JSON_NAME, TEXT_NAME = "probe_shared_gpu.json", "probe_shared_gpu.txt"


# ---------------------------------------------------------------------------------------------------------------
# the runner: each step in a subprocess with a time limit, its record as JSON


def run_step(name: str, ranks: int, cmd: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run one step's command in a process group of its own; the command writes its record (JSON) to the path given
    as its last argument. Returns that record, or status ``timeout`` (the group killed after ``timeout`` s) or
    ``error`` (no record: the exit code and the end of the output), with ``seconds``."""
    base = {"step": name, "ranks": ranks}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "record.json")
        t0 = time.monotonic()
        p = subprocess.Popen([*cmd, path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the step and every rank it spawned
            out, _ = p.communicate()
            return dict(base, status="timeout", seconds=round(time.monotonic() - t0, 1),
                        error=f"no record after {timeout:.0f} s: the step hung", output=_tail(out))
        seconds = round(time.monotonic() - t0, 1)
        if not os.path.exists(path):
            return dict(base, status="error", seconds=seconds, error=f"exit {p.returncode} without a record",
                        output=_tail(out))
        with open(path) as f:
            rec = json.load(f)
    return {**base, **rec, "seconds": seconds, **({"output": _tail(out)} if rec.get("status") != "ok" else {})}


def _tail(text: Optional[str], n: int = 2000) -> str:
    return (text or "")[-n:]


def merge_ranks(name: str, ranks: int, records: dict[int, dict[str, Any]], summary: Callable[[list], str],
                timed_out: bool = False) -> dict[str, Any]:
    """One step's record from its ranks' records: ``ok`` where every rank reported ok, else ``failed`` with the first
    rank's error (``timeout`` where some rank never reported: its error says which)."""
    missing = [r for r in range(ranks) if r not in records]
    bad = [records[r] for r in sorted(records) if records[r].get("status") != "ok"]
    if bad:
        status, error = "failed", f"rank {bad[0]['rank']}: {bad[0].get('error', 'failed')}"
    elif missing:
        status, error = ("timeout" if timed_out else "error"), f"ranks {missing} never reported"
    else:
        status, error = "ok", ""
    every = [records[r] for r in sorted(records)]
    return {"step": name, "ranks": ranks, "status": status, "error": error,
            "summary": summary(every) if status == "ok" else "", "per_rank": every}


def write_report(out: Path, records: list[dict[str, Any]], env: dict[str, Any]) -> tuple[Path, Path]:
    """``out/probe_shared_gpu.json`` (env and every record) and ``out/probe_shared_gpu.txt`` (one line a step)."""
    out.mkdir(parents=True, exist_ok=True)
    js, txt = out / JSON_NAME, out / TEXT_NAME
    js.write_text(json.dumps({"env": env, "steps": records}, indent=1, default=str) + "\n")
    lines = [f"probe_shared_gpu: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
             f"MPS {env.get('mps', '?')}", "", f"{'P':>2} {'step':<10} {'status':<8} {'s':>6}  finding / error"]
    for r in records:
        what = r.get("summary") or r.get("error", "")
        lines.append(f"{r['ranks']:>2} {r['step']:<10} {r['status']:<8} {r.get('seconds', 0):6.1f}  {what}")
    txt.write_text("\n".join(lines) + "\n")
    return js, txt


# ---------------------------------------------------------------------------------------------------------------
# the steps' bodies: run on every rank (rank, ranks, options) -> that rank's findings; rank 0's hold the timings


def _gloo(rank: int, ranks: int, repeats: int, **_: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    n = 1 << 20
    x = torch.full((n,), float(rank + 1), device="cuda")
    times = []
    for _ in range(repeats + 1):  # (the first is a warm-up)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        h = x.cpu()
        parts = [torch.empty_like(h) for _ in range(ranks)]
        dist.all_gather(parts, h)
        y = torch.stack(parts).cuda()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    if not all(bool((y[q] == q + 1).all()) for q in range(ranks)):
        raise RuntimeError("the host-staged all-gather gave wrong values")
    try:
        parts = [torch.empty_like(x) for _ in range(ranks)]
        dist.all_gather(parts, x)
        torch.cuda.synchronize()
        direct = "ok" if all(bool((parts[q] == q + 1).all()) for q in range(ranks)) else "wrong values"
    except Exception as e:  # noqa: BLE001
        direct = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return {"staged_ms": median(times[1:]), "mib_per_rank": 4 * n / 2 ** 20, "direct_cuda_all_gather": direct}


def _symm_mem(rank: int, ranks: int, repeats: int, **_: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from mok_kernels.mok_hopper.workspace import _rendezvous  # (the layer's own path to a handle)

    n = 1024
    buf = symm_mem.empty(n, dtype=torch.int32, device="cuda")
    handle = _rendezvous(symm_mem, buf, dist.group.WORLD)
    buf.fill_(rank + 1)
    torch.cuda.synchronize()
    dist.barrier()
    seen = [int(handle.get_buffer(q, (n,), torch.int32)[0].item()) for q in range(ranks)]
    if seen != list(range(1, ranks + 1)):
        raise RuntimeError(f"peer buffers read {seen}, expected {list(range(1, ranks + 1))}")
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        handle.barrier(channel=0)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"peers_read": "ok", "barrier_ms": median(times[1:])}


def _share(rank: int, t: Any) -> Any:
    """Rank 0's CUDA tensor ``t`` in every rank, by CUDA IPC (torch.multiprocessing's sharing of CUDA tensors)."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    obj = [reduce_tensor(t) if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    if rank == 0:
        return t
    fn, args = obj[0]
    return fn(*args)


def _cuda_ipc(rank: int, ranks: int, **_: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    n = 1 << 16
    buf = _share(rank, torch.zeros(ranks * n + 1, dtype=torch.int32, device="cuda") if rank == 0 else None)
    buf[rank * n:(rank + 1) * n].fill_(rank + 1)
    torch.cuda.synchronize()
    dist.barrier()
    seen = [int(buf[q * n].item()) for q in range(ranks)]
    if seen != list(range(1, ranks + 1)):
        raise RuntimeError(f"the shared buffer read {seen}, expected {list(range(1, ranks + 1))}")
    marker, out = ranks * n, {"shared_buffer": "ok"}
    obj: list[Any] = [None]
    if rank == 1:  # a write 1e8 cycles (about 50 ms) of device sleep away, then an interprocess event
        ev = torch.cuda.Event(interprocess=True)
        torch.cuda._sleep(100_000_000)
        buf[marker:marker + 1].fill_(42)
        ev.record()
        obj = [ev.ipc_handle()]
    dist.broadcast_object_list(obj, src=1)
    if rank == 0:
        ev0 = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), obj[0])
        torch.cuda.current_stream().wait_event(ev0)
        got = int(buf[marker:marker + 1].clone().item())
        out["event_ordered_read"] = got == 42
        if got != 42:
            raise RuntimeError(f"rank 0's stream waited on rank 1's interprocess event yet read {got}, not 42")
    dist.barrier()
    return out


try:  # the spin-wait kernels (Triton comes with torch on Linux)
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _spin_kernel(flag_ptr, out_ptr, limit_ns):
        """Spin until the flag is set or ``limit_ns`` passed: [seen at, flag, spins, started at]."""
        t0 = _now()
        now = t0
        n = t0 * 0
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        while (v == 0) & (now - t0 < limit_ns):
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            now = _now()
            n += 1
        tl.store(out_ptr, now)
        tl.store(out_ptr + 1, v.to(tl.int64))
        tl.store(out_ptr + 2, n)
        tl.store(out_ptr + 3, t0)

    @triton.jit
    def _set_kernel(flag_ptr, out_ptr, n_flags, BLOCK: tl.constexpr):
        tl.store(out_ptr, _now())
        i = tl.arange(0, BLOCK)
        tl.atomic_xchg(flag_ptr + i, tl.full((BLOCK,), 1, tl.int32), mask=i < n_flags, sem="release", scope="gpu")
except ImportError:
    pass


def _spin_wait(rank: int, ranks: int, repeats: int, spin_limit_s: float, **_: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    flags = _share(rank, torch.zeros(ranks, dtype=torch.int32, device="cuda") if rank == 0 else None)
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    block = triton.next_power_of_2(ranks)
    if rank:  # compile both kernels before the timed rounds, on a flag of its own that is already set
        _spin_kernel[(1,)](torch.ones(1, dtype=torch.int32, device="cuda"), out, 1)
    else:
        _set_kernel[(1,)](torch.zeros(ranks, dtype=torch.int32, device="cuda"), out, ranks, BLOCK=block)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        if rank == 0:
            flags.zero_()
            torch.cuda.synchronize()
        dist.barrier()
        if rank:
            _spin_kernel[(1,)](flags[rank:], out, int(spin_limit_s * 1e9))
        dist.barrier()  # every spin is launched
        if rank == 0:
            time.sleep(0.005)
            _set_kernel[(1,)](flags, out, ranks, BLOCK=block)
        torch.cuda.synchronize()
        got: list[Any] = [None] * ranks
        dist.all_gather_object(got, out.tolist())
        t_set = got[0][0]
        rounds.append([{"seen": bool(v), "wait_ms": (t - t_set) / 1e6 if v else None,
                        "set_after_spin_start_ms": (t_set - t0) / 1e6, "spins": int(n)}
                       for t, v, n, t0 in got[1:]])
    return {"rounds": rounds} if rank == 0 else {}


BODIES: dict[str, Callable[..., dict[str, Any]]] = {"gloo": _gloo, "symm_mem": _symm_mem, "cuda_ipc": _cuda_ipc,
                                                     "spin_wait": _spin_wait}


def _spin_summary(recs: list[dict[str, Any]]) -> str:
    spins = [s for rnd in recs[0]["rounds"] for s in rnd]
    waits = [s["wait_ms"] for s in spins if s["seen"]]
    lost = len(spins) - len(waits)
    text = f"{len(spins)} spins: {len(waits)} saw the flag"
    if waits:
        text += f", {median(waits):.3f} ms after the set (median; max {max(waits):.3f})"
    starts = [s["set_after_spin_start_ms"] for s in spins]
    text += f"; the set ran {median(starts):.1f} ms after the spins began (median, 5 ms of it host sleep)"
    return text + (f"; {lost} gave up at the limit (a hang)" if lost else "")


SUMMARIES: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "gloo": lambda recs: (f"host-staged all-gather of {recs[0]['mib_per_rank']:.0f} MiB a rank: "
                          f"{recs[0]['staged_ms']:.2f} ms (median); gloo on CUDA tensors directly: "
                          f"{recs[0]['direct_cuda_all_gather']}"),
    "symm_mem": lambda recs: f"rendezvous ok, peers read ok, handle barrier {recs[0]['barrier_ms']:.3f} ms (median)",
    "cuda_ipc": lambda recs: ("shared buffer ok; rank 0's stream waited on rank 1's interprocess event and saw its "
                             "write"),
    "spin_wait": _spin_summary,
}


# ---------------------------------------------------------------------------------------------------------------
# inside a step: P rank processes on device 0, a gloo group


def step_main(name: str, ranks: int, record: str, timeout: float, opts: dict[str, Any]) -> int:
    """Spawn the ranks of step ``name``, wait for their records (at most 80% of ``timeout``), write the step's."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_rank, args=(ranks, name, d, opts), nprocs=ranks, join=False, start_method="spawn")
        deadline, timed_out, crashed = time.monotonic() + 0.8 * timeout, False, ""
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
        except Exception as e:  # noqa: BLE001 - a rank died outside its body (process group, CUDA start)
            crashed = f"{type(e).__name__}: {str(e).strip()[-500:]}"
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        recs = {}
        for r in range(ranks):
            f = Path(d) / f"rank{r}.json"
            if f.exists():
                recs[r] = json.loads(f.read_text())
    rec = merge_ranks(name, ranks, recs, SUMMARIES[name], timed_out)
    if crashed and rec["status"] != "failed":
        rec.update(status="error", error=crashed)
    Path(record).write_text(json.dumps(rec, default=str))
    return 0


def _rank(rank: int, ranks: int, name: str, d: str, opts: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=rank, world_size=ranks)
    rec: dict[str, Any] = {"rank": rank}
    try:
        rec.update(BODIES[name](rank, ranks, **opts))
        rec.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - the record holds the exact error
        rec.update(status="failed", error=f"{type(e).__name__}: {e}"[:600])
    (Path(d) / f"rank{rank}.json").write_text(json.dumps(rec, default=str))
    if rec["status"] == "ok":
        dist.barrier()
        dist.destroy_process_group()


def environment() -> dict[str, Any]:
    """The GPU, torch, and whether an MPS daemon serves this process (its pipe directory, or nvidia-smi's compute
    mode)."""
    import torch

    mode = ""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        mode = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "mps": "pipe " + os.environ["CUDA_MPS_PIPE_DIRECTORY"] if os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
            else "not configured", "compute_mode": mode, "gpus": torch.cuda.device_count()}


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help=f"folder for {JSON_NAME} and {TEXT_NAME}")
    ap.add_argument("--ranks", type=_names, default=["2", "4"])
    ap.add_argument("--steps", type=_names, default=list(STEPS))
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a step may take")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats within a step")
    ap.add_argument("--spin-limit-s", type=float, default=5.0, help="spin_wait: seconds a spin waits before giving up")
    ap.add_argument("--step", help=argparse.SUPPRESS)  # (inside the subprocess: run this step, write its record)
    ap.add_argument("record", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    opts = {"repeats": a.repeats, "spin_limit_s": a.spin_limit_s}
    if a.step:
        return step_main(a.step, int(a.ranks[0]), a.record, a.timeout, opts)
    why = _unrunnable(a)
    if why:
        print(f"probe_shared_gpu: {why}", file=sys.stderr)
        return 2
    here = str(Path(__file__).resolve())
    records = []
    for p in map(int, a.ranks):
        for name in a.steps:
            cmd = [sys.executable, here, "--step", name, "--ranks", str(p), "--timeout", str(a.timeout),
                   "--repeats", str(a.repeats), "--spin-limit-s", str(a.spin_limit_s)]
            records.append(run_step(name, p, cmd, a.timeout))
            r = records[-1]
            print(f"P={p} {name:<10} {r['status']:<8} {r.get('summary') or r.get('error', '')}", flush=True)
    js, txt = write_report(Path(a.out), records, environment())
    print(f"wrote {js} and {txt}")
    return 0


def _unrunnable(a: argparse.Namespace) -> Optional[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from harness.core.tool_args import dir_write_problem

    if not a.out:
        return "--out DIR is required"
    if not a.steps or any(s not in STEPS for s in a.steps):
        return f"--steps {','.join(a.steps) or '(none)'}: choose from {', '.join(STEPS)}"
    if not all(r.isdigit() and int(r) >= 2 for r in a.ranks) or not a.ranks:
        return f"--ranks {','.join(a.ranks)}: give process counts of 2 or more, e.g. --ranks 2,4"
    if a.timeout <= 0 or a.repeats < 1 or a.spin_limit_s <= 0:
        return "--timeout, --repeats and --spin-limit-s must be positive"
    if why := dir_write_problem(a.out):
        return f"--out {a.out} {why}; give a folder you can write"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (it probes P processes on one device); run it on a GPU machine"
    return None


if __name__ == "__main__":
    sys.exit(main())
