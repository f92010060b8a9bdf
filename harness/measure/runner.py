"""Run one sweep point: every selected backend and direction on identical inputs, checked, timed, written.

``run_benchmark`` is the entry point (the Hydra main and the tests call it). It validates the configuration before
anything starts, then either joins the rank layout that torchrun or Slurm set up, or spawns the local ranks
itself. Rank 0 writes the rows; a backend that fails becomes a row and the sweep goes on; a rank that dies leaves
the launching process to write ``error`` rows for whatever was not reported. A run id given for a run whose folder
already holds rows is refused unless ``append=true`` (:func:`harness.config.validate.check_new_run`); Ctrl-C stops the
spawned ranks and keeps the rows written so far (:func:`kept_rows`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import pandas as pd
import torch
import torch.distributed as dist

from contract import LayerInputs, comm, direction_unsupported
from contract.backend import shared_gpu_unsupported
from contract.compiled import drop_compiled_state
from contract.options import options_text
from harness.measure import env as envinfo
from harness.measure import memory
from harness.core import results
from harness.config import routing
from harness.config import validate
from harness.core.backends import load_backend
from harness.measure.correctness import compare, leaves, run_once
from harness.config.schema import BenchConfig, Case, backend_order
from harness.config.point import Point, resolve, world_size_for
from harness.config.validate import given_run_id
from harness.measure.dist import RankEnv, free_port, from_environment, init
from harness.measure.inputs import fingerprint, make_inputs
from harness.measure.routing_steps import RoutingSteps, worst
from harness.measure.limits import StepTimeout, time_limit
from harness.core.results import base_row, make_row
from harness.core.run_names import default_run_id, gpu_model
from harness.measure.setup_profile import SetupProfile
from harness.measure.timing import Timer

SEVERITY = {s: i for i, s in enumerate(("ok", "unsupported", "mismatch", "timeout", "cancelled", "oom", "error"))}


def new_run_id(config: BenchConfig, ws: int) -> str:
    """A run id where none is given: what, where and when (:func:`harness.core.run_names.default_run_id`, from the
    configuration's names)."""
    names = {"device": config.device, "backends": list(config.backends), "directions": list(config.directions),
             "precision": {"name": config.precision.name}, "shape": {"name": config.shape.name}}
    return default_run_id(names, max(1, ws // max(1, int(config.ranks_per_gpu or 1))), gpu_model(config.device))


# ---------------------------------------------------------------------------------------------------------------
# the worker (every rank)


class Unsupported(Exception):
    """Raised inside an agreed step: this machine or installation cannot run it (the message says why and how)."""


def _require_supported(cls: type, case: Case, options: Any) -> None:
    why = cls.unsupported_reason(case) if options is None else cls.unsupported_reason(case, options)
    if why:
        raise Unsupported(why)


class _Agree:
    """Run a step on every rank, then agree on the worst outcome (a gloo group carries the verdict)."""

    def __init__(self, ctrl) -> None:
        self.ctrl = ctrl

    def __call__(self, fn: Callable[[], Any]) -> tuple[str, str, Any]:
        status, err, value = "ok", "", None
        try:
            value = fn()
        except Unsupported as e:
            status, err = "unsupported", str(e)
        except StepTimeout as e:
            status, err = "timeout", str(e)
        except torch.cuda.OutOfMemoryError as e:
            status, err = "oom", f"OutOfMemoryError: {str(e).splitlines()[0]}"
        except Exception as e:  # noqa: BLE001 - any backend failure becomes a row
            if _stopping:  # a collective broken by a peer that was stopped: this rank stops too, quietly
                raise KeyboardInterrupt from None
            status, err = "error", f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        if status != "ok" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        verdicts: list = [None] * dist.get_world_size(self.ctrl)
        dist.all_gather_object(verdicts, (status, err), group=self.ctrl)
        worst = max(verdicts, key=lambda v: SEVERITY[v[0]])
        return worst[0], worst[1][:2000], value


class Progress:
    """Rank 0's progress lines on stderr: which point, backend and phase is running, and for how long. Compiling
    and autotuning can take minutes with no other output; these lines tell that apart from a hang. One line when a
    phase starts, one when it ends (with its status and seconds); the bracket is the time since the point started."""

    def __init__(self, enabled: bool, point: str) -> None:
        self.enabled, self.point = enabled, point
        self.backend = ""  # "deepep (2/6)" while a backend runs
        self.t0 = self.t_phase = time.perf_counter()
        self.what = ""

    def line(self, text: str) -> str:
        where = f"{self.point} | {self.backend}" if self.backend else self.point
        return f"mokbench [{time.perf_counter() - self.t0:7.1f} s] {where} | {text}"

    def note(self, text: str) -> None:
        if self.enabled:
            print(self.line(text), file=sys.stderr, flush=True)

    def start(self, what: str) -> None:
        self.what, self.t_phase = what, time.perf_counter()
        self.note(f"{what} ...")

    def end(self, status: str, detail: str = "") -> None:
        took = time.perf_counter() - self.t_phase
        self.note(f"{self.what}: {status} in {took:.1f} s" + (f", {detail}" if detail else ""))


def point_label(case: Case, num: Optional[int] = None) -> str:
    """The sweep point in a progress line: number (in a multirun), shape, precision, workload, EP, tokens per GPU."""
    where = f"point #{num} " if num is not None else ""
    return f"{where}{case.shape} {case.precision} {routing.label(case)} EP{case.ep_size} T{case.tokens_per_gpu}"


@dataclass
class PointContext:
    """What every backend of one sweep point runs against (on each rank): the point
    (:class:`harness.config.point.Point`), its inputs, its routing steps (``steps``) and the reference outputs of each
    checked step (``ref``: step -> outputs, in host memory; None without the check), the process groups (``group``
    for the layer, ``ctrl``: gloo, for verdicts), the step runner that agrees on the outcome across ranks (``agree``),
    the timer, the columns every row shares (``base``), the directions to run, whether any needs gradients, and the
    progress lines."""

    point: Point
    inputs: LayerInputs
    steps: RoutingSteps
    ref: Optional[dict[int, dict]]
    group: Any
    ctrl: Any
    agree: Callable[[Callable[[], Any]], tuple[str, str, Any]]
    timer: Timer
    base: dict[str, Any]
    directions: list[str]
    need_grads: bool
    progress: Progress = field(default_factory=lambda: Progress(False, ""))


def worker(payload: dict, renv: RankEnv) -> None:
    """One rank of a point: ``payload`` holds the :class:`Point` (``point``: built once, in the process that
    prepared the run; spawned ranks get it pickled) and where the rows go. Its stages, each agreed across ranks:
    the inputs, the routing steps, the calibration, the reference, then each backend in turn
    (:func:`_run_backends`); a stage before the backends that fails gives every backend's rows its error."""
    pt: Point = payload["point"]
    cfg, case = pt.config, pt.case
    device = case.device
    if device == "cpu":  # ranks share the machine's cores: oversubscribed intra-op threads distort the timings
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, renv.world_size)))
    if device == "cuda":
        envinfo.cuda_alloc_conf()  # before the first CUDA allocation of this process
    dev = init(renv, device, timeout_s=cfg.dist_timeout_s, ranks_per_gpu=pt.ranks_per_gpu)
    group = dist.group.WORLD
    ctrl = dist.new_group(backend="gloo") if device == "cuda" else group
    agree = _Agree(ctrl)
    base = base_row(pt, run_id=payload["run_id"], num_nodes=renv.num_nodes, world_size=renv.world_size,
                    env=envinfo.collect(case.device))
    sink = JobRows(payload, keep=renv.rank == 0)
    progress = Progress(renv.rank == 0, point_label(case, payload.get("num")))
    timer = Timer(dev, group, align=cfg.timing.align, l2_flush=cfg.timing.l2_flush)
    directions = list(cfg.directions)
    need_grads = any(d != "fwd" for d in directions)

    why = routing.unsupported(case)  # a routing the harness cannot make yet: every backend's row says why
    if why:
        sink.every_row(pt, base, "unsupported", why)
        return
    progress.start("inputs")
    status, err, inputs = agree(lambda: make_inputs(case, renv.rank, dev))
    progress.end(status)
    if status != "ok":
        sink.every_row(pt, base, status, f"input generation failed: {err}")
        return
    status, err, steps = agree(lambda: RoutingSteps.build(case, renv.rank, inputs, group))
    if status != "ok":
        sink.every_row(pt, base, status, f"routing steps failed: {err}")
        return
    base.update(steps.stats())

    if cfg.calibrate:
        from harness.measure.calibrate import measure

        progress.start("calibration (GEMM, HBM, all-to-all rates)")
        status, err, calib = agree(lambda: measure(dev, group, case.precision))
        progress.end(status)
        base.update(calib or {})
        if status != "ok":
            base["notes"] = f"calibration failed: {err}"

    ref = None
    if cfg.check:
        from harness.measure.reference import ReferenceBackend

        progress.start("reference")
        status, err, ref = agree(lambda: _reference_outputs(ReferenceBackend(case, group), inputs, steps, need_grads))
        progress.end(status)
        if status != "ok":
            sink.every_row(pt, base, status, f"reference failed: {err}")
            return

    point = PointContext(point=pt, inputs=inputs, steps=steps, ref=ref, group=group, ctrl=ctrl, agree=agree,
                         timer=timer, base=base, directions=directions, need_grads=need_grads, progress=progress)
    _run_backends(point, payload, renv, sink)
    progress.backend = ""
    progress.note(f"done: {len(sink.rows)} rows")
    inputs = ref = point = None  # free the layer inputs and reference tensors before the final barrier
    dist.barrier(group=ctrl)


class JobRows:
    """The rows of the job's file, kept and written by rank 0 (``keep``) as each comes; other ranks keep none. A
    hand-off (processes of their own) continues the job's file: the rows of the earlier processes stay."""

    def __init__(self, payload: dict, keep: bool) -> None:
        self.path, self.keep = payload["path"], keep
        self.rows: list[dict] = results.read_file(self.path).to_dict("records") if payload.get("handoff") and \
            keep and Path(self.path).exists() else []

    def emit(self, row: dict) -> None:
        if self.keep:
            self.rows.append(row)
            results.write_rows(self.path, self.rows)

    def every_row(self, pt: Point, base: dict, status: str, error: str) -> None:
        """One row per backend and direction of the point, each with this status and error."""
        for b in pt.config.backends:
            for d in pt.config.directions:
                self.emit(make_row(base, b, d, status, error=error))


def _reference_outputs(b, inputs: LayerInputs, steps: RoutingSteps, need_grads: bool) -> dict[int, dict]:
    """step -> the reference backend ``b``'s outputs (in host memory), for every routing step the check covers."""
    b.setup(inputs)
    out = {}
    for s in steps.checked:
        steps.select(inputs, s)
        out[s] = _to_host(run_once(b, inputs, need_grads))
    b.teardown()
    return out


def _run_backends(point: PointContext, payload: dict, renv: RankEnv, sink: JobRows) -> None:
    """Each backend of the point in its order (``payload["order"]``, else :func:`run_order`), from this process set's
    first (a hand-off's position); after each, its memory released, and where the next must run in fresh processes
    (:func:`_next_needs_fresh_processes`) the hand-off written, or, under torchrun or Slurm, the rest's error rows."""
    pt, inputs, steps, base = point.point, point.inputs, point.steps, point.base
    handoff = payload.get("handoff") or {}
    order = list(payload.get("order") or run_order(pt))
    first = handoff.get("position", 0)  # this process set's first backend in the point's order
    probe = memory.Probe.of(point.timer.device)
    _release_memory()
    start_used = probe.used() if probe is not None else None  # the point's inputs and reference, all processes
    steps.select(inputs, 0)
    start_print = fingerprint(inputs)  # what every backend must leave as it found it
    for pos in range(first, len(order)):
        name = order[pos]
        point.progress.backend = f"{name} ({pos + 1}/{len(order)})"
        own_note = handoff.get("note", "") if pos == first else ""
        for row in run_backend(name, dataclasses.replace(point, base=dict(base, backend_position=pos))):
            sink.emit(dict(row, notes=_with_note(row.get("notes"), own_note)) if own_note else row)
        _release_memory()  # the next backend must not inherit anything of this one (its memory, its compiles)
        if pos + 1 == len(order):
            break
        why = _next_needs_fresh_processes(pt, order, pos, probe, start_used, point.ctrl,
                                          _inputs_changed(point, start_print))
        if why:
            _hand_off(point, payload, renv, sink, order, pos, why)
            break


def _inputs_changed(point: PointContext, start_print: dict) -> list[str]:
    """The input fields whose fingerprint differs from the point's start (on this rank)."""
    point.steps.select(point.inputs, 0)  # the routing tensors are the steps' to rewrite
    now = fingerprint(point.inputs)
    return [k for k, v in start_print.items() if now.get(k) != v]


def _hand_off(point: PointContext, payload: dict, renv: RankEnv, sink: JobRows, order: list[str], pos: int,
              why: str) -> None:
    """The backends after ``order[pos]`` go to fresh processes: spawned ranks leave the hand-off for the launching
    process; ranks that torchrun or Slurm started cannot, and write each remaining backend's error rows."""
    pt = point.point
    if renv.launcher == "spawn":
        if renv.rank == 0:
            _write_handoff(payload["path"], {"position": pos + 1, "note": why})
        return
    for b in order[pos + 1:]:
        for d in point.directions:
            sink.emit(make_row(dict(point.base, backend_position=order.index(b)), b, d, "error",
                               error=f"{why}; the ranks were started by {renv.launcher}, not by this harness, "
                                     f"so no fresh process could run it: run {b} in a job of its own "
                                     f"(backends=[{b}])", backend_options=pt.options_text(b)))


def _release_memory() -> None:
    """Drop what a finished backend left behind, ok or not: its torch.compile state (compiled code, the CUDA graph
    trees of max-autotune with their private memory pool, inductor's autotuning subprocesses, which hold device
    memory of their own), the frames of its last exception, cycles holding its tensors, then the allocator's cached
    blocks (contract.compiled). Without it the caching allocator keeps tens of GB reserved for the next backend's
    setup (fp8 deepseek_v4_pro on 2xH200: deepep and hybridep ran out of memory after a failed nccl compile, with
    80 GB still allocated), and an autotuning subprocess kept 13 GiB of one H100 after a compile."""
    sys.last_type = sys.last_value = sys.last_traceback = None  # an exception's frames hold the backend's tensors
    drop_compiled_state()


LEAK_TOLERANCE_BYTES = 1 << 30  # device memory in use beyond the point's start that still counts as returned


def run_order(pt: Point) -> list[str]:
    """The backends of a point in the order they run: ``backend_order``, then those of ``own_process`` last (each
    runs alone in a set of processes of its own)."""
    cfg = pt.config
    order = backend_order(list(cfg.backends), cfg.backend_order, pt.case.seed)
    own = set(cfg.own_process)
    return [b for b in order if b not in own] + [b for b in order if b in own]


def _next_needs_fresh_processes(pt: Point, order: list[str], pos: int, probe: Optional[memory.Probe],
                                start_used: Optional[int], ctrl, changed: list[str]) -> str:
    """Why the backend after ``order[pos]`` must run in fresh processes ('' where it can run in these): it, or the
    one before it, runs in processes of its own (``own_process``), ``order[pos]`` left the point's inputs changed
    (``changed``: the fields whose :func:`harness.measure.inputs.fingerprint` differs from the point's start, on this
    rank; fresh processes draw them again), or device memory did not come back after ``order[pos]`` (all processes,
    cudaMemGetInfo, more than :data:`LEAK_TOLERANCE_BYTES` over the point's start on some rank). Every rank gets
    the same answer."""
    own, nxt = set(pt.config.own_process), order[pos + 1]
    if nxt in own:
        path = pt.config.own_pythonpath.get(nxt)
        return "ran in processes of its own (own_process)" + (f", {path} first on its path (own_pythonpath)"
                                                              if path else "")
    if order[pos] in own:
        return f"ran in fresh processes after {order[pos]}, which has processes of its own (own_process)"
    over = float(probe.used() - start_used) if probe is not None and start_used is not None else 0.0
    held = [(0.0, [])] * dist.get_world_size(ctrl)
    dist.all_gather_object(held, (over, changed), group=ctrl)
    spoiled = sorted({k for _, ch in held for k in ch})
    if spoiled:
        return (f"ran in fresh processes: {order[pos]} left the point's inputs changed ({', '.join(spoiled)} differ "
                f"from the point's start), so they were drawn again")
    worst = max(o for o, _ in held)
    if worst > LEAK_TOLERANCE_BYTES:
        return (f"ran in fresh processes: device memory did not come back after {order[pos]} ({worst / 2**30:.1f} GiB "
                f"more in use, all processes, than at the point's start)")
    return ""


def handoff_path(path: Union[str, Path]) -> Path:
    """Where a set of ranks leaves the backends that must run in fresh processes (beside the job's file)."""
    return Path(str(path) + ".handoff.json")


def _write_handoff(path: Union[str, Path], data: dict) -> None:
    import json

    handoff_path(path).write_text(json.dumps(data))


def _take_handoff(path: Union[str, Path]) -> Optional[dict]:
    """The hand-off the last set of ranks left (removed once read), or None."""
    import json

    f = handoff_path(path)
    if not f.exists():
        return None
    data = json.loads(f.read_text())
    f.unlink()
    return data


def _to_host(ref: Optional[dict]) -> Optional[dict]:
    """The reference's tensors in host memory (on a GPU), so that every backend gets the device as the point's
    inputs leave it; :func:`harness.measure.correctness.compare` moves them back a slice at a time."""
    if not ref:
        return ref
    return {k: (v.cpu() if isinstance(v, torch.Tensor) and v.is_cuda else v) for k, v in ref.items()}


def _write_setup_profile(prof: SetupProfile, progress: Progress) -> None:
    """The setup's profile into ``profile_setup_dir`` (once; a failure to write is said, never raised)."""
    try:
        path = prof.write()
    except Exception as e:  # noqa: BLE001 (a profile is a diagnostic: it must not cost the backend its rows)
        progress.note(f"setup profile not written: {type(e).__name__}: {e}")
        return
    if path is not None:
        progress.note(f"setup profile: {path}")


def run_backend(name: str, point: PointContext) -> Iterator[dict[str, Any]]:
    """Yield one row per direction for one backend at one sweep point, stage by stage: can it run here, its setup,
    its first call checked against the reference, its memory, its traffic, its timing per direction, its teardown.
    Never raises for backend failures. Every step that can fail is agreed across ranks (``point.agree``), so every
    rank takes the same branch."""
    options = point.point.options(name)  # None: the backend declares none
    base = point.base if options is None else dict(point.base, backend_options=options_text(options))
    cls, refused = _supported(name, point, options)
    if refused is not None:
        yield from (make_row(base, name, d, refused[0], error=refused[1]) for d in point.directions)
        return

    run = BackendRun.start(name, cls, options, base, point)
    status, err = _set_up(run, point)
    if status == "ok" and point.ref is not None:
        status, err = _check_first_call(run, point)
        if status == "ok" and all(g[0] != "ok" for g in run.gate.values()):  # nothing left to time
            yield from (run.row(d, run.gate[d][0], error=run.gate[d][1], **run.extra, **run.gate[d][2])
                        for d in point.directions)
            point.agree(run.backend.teardown)
            return
    _write_setup_profile(run.prof, point.progress)  # where no check ran (written once: after the check, a no-op)
    if status != "ok":
        yield from (run.row(d, status, error=err, **run.extra) for d in point.directions)
        if run.backend is not None:
            point.agree(run.backend.teardown)
        return
    # construction plus the checked first call, which pays for torch.compile (autotuning included) and JIT builds
    run.extra.setdefault("setup_s", round(time.perf_counter() - run.t_setup, 2))

    if name == "reference" and not point.point.config.time_reference:
        yield from (run.row(d, "ok", **{**run.extra, **run.checked(d),
                                        "notes": "ground truth, not timed (set time_reference=true to time it)"})
                    for d in point.directions)
        point.agree(run.backend.teardown)
        return

    if run.probe is not None:
        _measure_memory(run, point)
    _measure_traffic(run, point)
    blind = memory.graph_blind(run.extra)  # allocator peaks a CUDA graph replay does not show
    if blind:
        run.note(memory.GRAPH_BLIND_NOTE)
    for d in point.directions:
        yield _direction_row(run, point, d, blind)
    point.agree(run.backend.teardown)


@dataclass
class BackendRun:
    """One backend at one sweep point, as its stages in :func:`run_backend` leave it: its class and options, the
    columns of its rows (``base``), the setup's profile and start time, the device-memory probe, the backend once
    constructed, what it says of itself (``info``), whether it runs any gradient direction, the columns its stages
    add (``extra``), the memory it holds (``mem``) and the check's verdict per direction (``gate``: status, error,
    error columns)."""

    name: str
    cls: type
    options: Any
    base: dict[str, Any]
    prof: SetupProfile
    probe: Optional[memory.Probe]
    t_setup: float
    backend: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    grads_supported: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    mem: dict[str, float] = field(default_factory=dict)
    gate: dict[str, tuple[str, Optional[str], dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def start(cls, name: str, backend_cls: type, options: Any, base: dict[str, Any],
              point: PointContext) -> "BackendRun":
        """Before the setup: its clock starts, and its profile (``profile_setup_dir``) is named."""
        pt, case = point.point, point.point.case
        t_setup = time.perf_counter()
        rank = dist.get_rank() if dist.is_initialized() else 0
        prof = SetupProfile(pt.config.profile_setup_dir, f"{base.get('run_id')}-{pt.config_hash[:8]}-"
                            f"{case.shape}-{case.precision}-ep{case.ep_size}-{name}-rank{rank}")
        return cls(name, backend_cls, options, base, prof, memory.Probe.of(point.timer.device), t_setup)

    def row(self, direction: str, status: str, **cols: Any) -> dict[str, Any]:
        return make_row(self.base, self.name, direction, status, **cols)

    def checked(self, direction: str) -> dict[str, Any]:
        """The check's error columns of a direction (none where the check did not run)."""
        return self.gate.get(direction, ("ok", None, {}))[2]

    def note(self, text: str) -> None:
        self.extra["notes"] = _with_note(self.extra.get("notes"), text)


def _supported(name: str, point: PointContext, options: Any) -> tuple[Optional[type], Optional[tuple[str, str]]]:
    """The backend's class, and (status, error) of every row where it cannot run here (None where it can): its
    import fails, it declares the point unsupported, or it cannot share a GPU between ranks."""
    case, agree = point.point.case, point.agree
    status, err, cls = agree(lambda: load_backend(name))
    if status != "ok":
        return None, ("unsupported" if "BackendImportError" in err else status, err)
    status, err, _ = agree(lambda: _require_supported(cls, case, options))  # every rank takes the same branch
    if status != "ok":
        return cls, (status, err)
    rpg = point.point.ranks_per_gpu
    why = shared_gpu_unsupported(cls, case, name, rpg) if rpg > 1 else None
    if why:
        return cls, ("unsupported", why)
    return cls, None


def _set_up(run: BackendRun, point: PointContext) -> tuple[str, str]:
    """Construct the backend and run its setup (agreed), then ask what it says of itself and which directions it
    runs; (status, error)."""
    point.progress.start("setup (construct, buffers, JIT builds)")
    status, err, _ = point.agree(lambda: _construct(run, point))
    point.progress.end(status)
    if status == "ok":
        _, _, info = point.agree(run.backend.info)
        run.info = info or {}
    run.grads_supported = any(direction_unsupported(run.cls, point.point.case, d, run.options) is None
                              for d in point.directions if d != "fwd")
    run.extra = dict(run.info)
    if run.prof.folder is not None:  # cProfile slows Python-heavy setups: the row says its setup_s was profiled
        run.note("setup under cProfile (profile_setup_dir): setup_s includes the profiler's overhead")
    return status, err


def _construct(run: BackendRun, point: PointContext) -> None:
    """The backend built and set up on the point's inputs (``run.backend`` set as soon as it exists, so that a failed
    setup is still torn down), under the setup limit and the profile; the memory the setup kept."""
    case, group, cfg = point.point.case, point.group, point.point.config
    before = memory.allocated(run.probe)
    point.timer.own_base(before)  # the timed windows' peaks less this: the backend's own memory
    with run.prof.on():
        run.backend = run.cls(case, group) if run.options is None else run.cls(case, group, run.options)
        with time_limit(cfg.setup_timeout_s, f"{run.name}'s setup"):
            run.backend.setup(point.inputs)
    run.mem[memory.SETUP] = memory.held_since(run.probe, before)


def _check_first_call(run: BackendRun, point: PointContext) -> tuple[str, str]:
    """The backend's first calls against the reference (agreed); sets ``run.gate``, per direction: a forward row
    needs the output to match; a backward row needs the output and every gradient (a backend whose gradients are off
    still has a valid forward, and is timed forward). (status, error) of the check itself."""
    case, progress = point.point.case, point.progress
    with_grads = point.need_grads and run.grads_supported
    compiling = " (torch.compile and its autotuning run here)" if run.info.get("compiled") else ""
    progress.start(f"check: first call against the reference{compiling}")
    status, err, verdicts = point.agree(lambda: _checked_calls(run, point, with_grads))
    run.extra["setup_s"] = round(time.perf_counter() - run.t_setup, 2)
    if status == "ok":
        for d in point.directions:
            run.gate[d] = _gate(verdicts[1] if d == "fwd" else verdicts[0], case)
    progress.end(status, ", ".join(f"{d} {g[0]}" for d, g in run.gate.items()))
    _write_setup_profile(run.prof, progress)
    return status, err


def _checked_calls(run: BackendRun, point: PointContext, with_grads: bool) -> tuple[dict, dict]:
    """Every checked routing step, step 0 last (the traffic columns read the last forward): the worst verdict over
    all the compared tensors, and over the output alone."""
    steps, inputs, ref, ctrl = point.steps, point.inputs, point.ref, point.ctrl
    fulls, outs = [], []
    for s in steps.checked:
        steps.select(inputs, s)
        with run.prof.on():
            got = run_once(run.backend, inputs, with_grads)
        r = ref[s]
        full = compare(got, r if with_grads else {"out": r["out"]}, ctrl)
        fulls.append((s, full))
        outs.append((s, compare({"out": got["out"]}, {"out": r["out"]}, ctrl) if with_grads else full))
    return worst(fulls), worst(outs)


def _measure_memory(run: BackendRun, point: PointContext) -> None:
    """What the backend holds, and what one training forward keeps until its backward (agreed; the columns, or a
    note that says why they are empty)."""
    status, err, held = point.agree(lambda: _held_memory(run, point))
    if status == "ok":
        run.extra.update({k: v for k, v in held.items() if v == v})
    else:
        run.note(f"memory not measured: {err}")


def _held_memory(run: BackendRun, point: PointContext) -> dict[str, float]:
    inputs = point.inputs
    x, w = leaves(inputs, True)
    run.mem[memory.ACTIVATION] = memory.activation_bytes(run.probe,
                                                         lambda: run.backend.forward(x, inputs.topk_idx_TK, w))
    return memory.max_over_ranks(run.mem, point.timer.device, point.group)


def _measure_traffic(run: BackendRun, point: PointContext) -> None:
    """Byte counts and per-phase bandwidth (communication kernels alone, on the last forward's rows; without the
    check no forward has run yet, so :func:`_traffic` runs one, untimed). A failure is a note: the layer itself may
    still time fine."""
    progress, case = point.progress, point.point.case
    t = dataclasses.asdict(point.point.config.timing)
    t_traffic = dict(t, phase_iters=0) if point.point.ranks_per_gpu > 1 else t  # ranks that share a GPU time nothing
    progress.start("bytes and per-phase bandwidth")
    status, err, traffic = point.agree(lambda: _traffic(run.backend, case, point.group, point.timer, t_traffic,
                                                        point.inputs if point.ref is None else None))
    progress.end(status)
    if status == "ok":
        run.extra.update(traffic)
    else:
        run.note(f"traffic / phase timing failed: {err}")


def _direction_row(run: BackendRun, point: PointContext, d: str, blind: set) -> dict[str, Any]:
    """The row of direction ``d``: unsupported, its mismatch (not timed), a correctness check alone (ranks that
    share a GPU), or timed (:func:`_timed_row`)."""
    checked, extra = run.checked(d), run.extra
    why = direction_unsupported(run.cls, point.point.case, d, run.options)
    if why is not None:
        return run.row(d, "unsupported", error=why, **extra, **checked)
    if d in run.gate and run.gate[d][0] != "ok":
        return run.row(d, run.gate[d][0], error=run.gate[d][1], **extra, **checked)  # mismatches: not timed
    rpg = point.point.ranks_per_gpu
    if rpg > 1:
        note = f"{rpg} ranks shared each GPU: checked against the reference, not timed"
        return run.row(d, "ok", **{**extra, **checked, "notes": _with_note(extra.get("notes"), note)})
    return _timed_row(run, point, d, blind)


def _timed_row(run: BackendRun, point: PointContext, d: str, blind: set) -> dict[str, Any]:
    """Direction ``d`` through the one timing path (agreed), as a row with its latency, throughput, clocks, memory
    peaks (less those a CUDA graph replay hides: ``blind``) and roofline."""
    case, progress, extra, checked = point.point.case, point.progress, run.extra, run.checked(d)
    t = dataclasses.asdict(point.point.config.timing)
    progress.start(f"timing {d} ({t['num_warmup']} warmup + {t['num_iters']} timed)")
    status, err, stats = point.agree(lambda: time_direction(run.backend, point.inputs, d, point.timer, t,
                                                            point.steps))
    progress.end(status, f"median {stats.median_ms:.4g} ms" if status == "ok" else "")
    if status != "ok":
        return run.row(d, status, error=err, **extra, **checked)
    flops = case.flops(d)
    lat_s = stats.median_ms / 1e3
    row = run.row(
        d, "ok",
        latency_ms=stats.median_ms, latency_p20_ms=stats.p20_ms, latency_p80_ms=stats.p80_ms,
        latency_min_ms=stats.min_ms, latency_max_ms=stats.max_ms, latency_step_mean_ms=stats.step_mean_ms,
        latency_step_max_ms=stats.step_max_ms, num_warmup=stats.num_warmup,
        num_iters=stats.num_iters, flops_per_gpu=flops, tflops_per_gpu=flops / lat_s / 1e12,
        tokens_per_s_per_gpu=case.tokens_per_gpu / lat_s, **stats.clocks,
        **{k: v for k, v in stats.memory.items() if v == v and k not in blind}, **extra, **checked,
    )
    return _with_roofline(row)


def _with_note(notes: Optional[str], note: str) -> str:
    """``notes`` with ``note`` added (``; ``-separated)."""
    return "; ".join(filter(None, [notes, note]))


def _gate(verdict: dict[str, Any], case: Case) -> tuple[str, Optional[str], dict[str, Any]]:
    """(status, error, error columns) of one comparison against the published tolerances of the precision."""
    cols = dict(max_abs_err=verdict["max_abs_err"], rel_err=verdict["rel_err"], worst_tensor=verdict["worst_tensor"])
    if not (verdict["any_missing"] or verdict["max_abs_err"] > case.atol or verdict["rel_err"] > case.rtol):
        return "ok", None, cols
    err = (f"worst abs-max {verdict['max_abs_err']:.4g} (tol {case.atol}) on {verdict.get('abs_tensor') or '-'}, "
           f"worst rel-L1 {verdict['rel_err']:.4g} (tol {case.rtol}) on {verdict['worst_tensor'] or '-'}")
    if verdict["any_missing"]:
        err += f"; tensors missing: {', '.join(verdict['missing']) or 'on another rank'}"
    return "mismatch", err, cols


def _with_roofline(row: dict) -> dict:
    """Fill roofline_ms / roofline_fraction from the calibrated rates, where this run measured them."""
    if row.get("calib_gemm_tflops") is None:
        return row
    from harness.core.roofline import layer_floors

    f = layer_floors(row, row.get("calib_gemm_tflops"), row.get("calib_hbm_gb_s"), row.get("calib_link_gb_s"))
    row.update(roofline_ms=f["roofline_ms"], roofline_fraction=f["roofline_fraction"], roofline_bound=f["bound"])
    return row


def time_direction(backend, inputs, direction: str, timer: Timer, t: dict, steps: Optional[RoutingSteps] = None):
    """The one timing path of a direction (``t``: num_warmup, num_iters): fwd times the forward; bwd the backward,
    each after an untimed forward (as published); fwd_bwd both. ``steps`` with several routings: iteration i
    (warmup and timed together) runs routing i % N, copied into the inputs before it, untimed; step 0 after."""
    stepper = steps.stepper(inputs) if steps is not None else None
    try:
        return _time_direction(backend, inputs, direction, timer, t,
                               dict(step=stepper, cycle=steps.n) if stepper is not None else {})
    finally:
        if stepper is not None:
            steps.select(inputs, 0)


def _time_direction(backend, inputs, direction: str, timer: Timer, t: dict, cycle: dict):
    # Leaves that require grad in every direction: the timed forward is a training forward (autograd records the
    # graph), as in the published runs.
    x, w = leaves(inputs, True)
    if direction == "fwd":

        def fn():
            backend.forward(x, inputs.topk_idx_TK, w)

        return timer.run(fn, num_warmup=t["num_warmup"], num_iters=t["num_iters"], **cycle)
    if direction == "bwd":
        holder: list = []

        def pre():
            backend.zero_grad()
            x.grad = w.grad = None
            holder[:] = [backend.forward(x, inputs.topk_idx_TK, w)]

        def fn():
            holder[0].backward(inputs.grad_out_TH)

        stats = timer.run(fn, num_warmup=t["num_warmup"], num_iters=t["num_iters"], pre=pre, **cycle)
        holder.clear()
        backend.zero_grad()
        return stats

    def fwd_bwd():
        backend.zero_grad()
        x.grad = w.grad = None
        backend.forward(x, inputs.topk_idx_TK, w).backward(inputs.grad_out_TH)

    stats = timer.run(fwd_bwd, num_warmup=t["num_warmup"], num_iters=t["num_iters"], **cycle)
    backend.zero_grad()
    return stats


def _traffic(backend, case: Case, group, timer: Timer, t: dict, inputs: LayerInputs = None) -> dict[str, Any]:
    """Remote / local bytes per rank (mean over ranks) and each phase's bandwidth from its own time, from the
    backend's last forward; ``inputs``: run that forward first, on these inputs (no checked forward ran)."""
    if inputs is not None:
        x, w = leaves(inputs, True)  # as the timed forward takes them (no other torch.compile variant)
        backend.forward(x, inputs.topk_idx_TK, w)
    tr = backend.traffic()
    if not tr:
        return {}
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, Any] = {}
    sums = []
    for phase in ("dispatch", "combine"):
        rows_to = tr[f"{phase}_rows_to"]
        rb = tr[f"{phase}_row_bytes"]
        remote = sum(r for i, r in enumerate(rows_to) if i != rank) * rb
        sums += [remote, rows_to[rank] * rb]
    v = torch.tensor(sums, dtype=torch.float64, device=timer.device)
    if n > 1:
        comm.all_reduce(v, group=group)
    v = (v / n).tolist()
    out.update(dispatch_bytes=round(v[0]), dispatch_local_bytes=round(v[1]), combine_bytes=round(v[2]),
               combine_local_bytes=round(v[3]))
    iters = t.get("phase_iters", 0)
    if iters > 0 and n > 1:
        phases = backend.phases()
        for phase in ("dispatch", "combine"):
            if phase in phases:
                s = timer.run(phases[phase], num_warmup=min(5, iters), num_iters=iters)
                out[f"{phase}_ms"] = s.median_ms
                out[f"{phase}_gb_s"] = out[f"{phase}_bytes"] / (s.median_ms / 1e3) / 1e9
        out["raw_a2a_gb_s"] = raw_all_to_all_gb_s(tr["dispatch_rows_to"], tr["dispatch_row_bytes"], group, timer,
                                                  iters)
    return out


def raw_all_to_all_gb_s(rows_to: list[int], row_bytes: int, group, timer: Timer, iters: int) -> float:
    """A plain ``all_to_all_single`` loop over the same per-peer bytes as the dispatch, on fresh buffers:
    remote bytes per rank (mean over ranks) per second of the median iteration."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    send = torch.tensor(rows_to, dtype=torch.int64, device=timer.device) * row_bytes
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    send_l, recv_l = send.tolist(), recv.tolist()
    src = torch.empty(sum(send_l), dtype=torch.uint8, device=timer.device).random_(0, 255)
    dst = torch.empty(sum(recv_l), dtype=torch.uint8, device=timer.device)
    s = timer.run(lambda: comm.all_to_all_single(dst, src, recv_l, send_l, group=group),
                  num_warmup=min(5, iters), num_iters=iters)
    remote = torch.tensor([float(sum(b for i, b in enumerate(send_l) if i != rank))], dtype=torch.float64,
                          device=timer.device)
    comm.all_reduce(remote, group=group)
    return float(remote) / n / (s.median_ms / 1e3) / 1e9


# ---------------------------------------------------------------------------------------------------------------
# launching


SHARED_GPU_WATCHDOG_S = 900  # the watchdog's limit when ranks share a GPU and watchdog_s is not given
_stopping = False  # set in a spawned rank when the launching process stops it (Ctrl-C)


def _stop_rank(signum: int, frame: Any) -> None:
    global _stopping
    _stopping = True
    raise KeyboardInterrupt


def _spawn_entry(local_rank: int, payload: dict, renv: RankEnv) -> None:
    import faulthandler

    faulthandler.enable()  # a crash inside a backend's native code still leaves a Python stack in the log
    # The rank starts with SIGINT ignored (_run_ranks): Ctrl-C reaches the launching process, which stops the ranks
    # with SIGTERM. Here SIGTERM leaves through KeyboardInterrupt (rank 0's file write in progress completes or is
    # undone), and the rank is stopped with the launching process if that dies.
    signal.signal(signal.SIGTERM, _stop_rank)
    _die_with_parent(signal.SIGTERM)
    env = RankEnv(local_rank, renv.world_size, local_rank, 1, renv.master_addr, renv.master_port, "spawn")
    if payload.get("pythonpath"):  # a backend's own packages (own_pythonpath), ahead of everything else
        folders = envinfo.add_site(payload["pythonpath"])  # with what their .pth files add
        os.environ["PYTHONPATH"] = os.pathsep.join([*folders, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        worker(payload, env)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent(sig: int) -> None:
    try:
        from torch.multiprocessing.spawn import _prctl_pr_set_pdeathsig

        _prctl_pr_set_pdeathsig(sig)
    except (ImportError, AttributeError, OSError):  # not Linux, or another torch: torch's own SIGINT stays
        pass


def _run_ranks(payload: dict, renv: RankEnv, n: int, watchdog_s: Optional[float] = None) -> None:
    """Spawn the ``n`` local ranks and wait for them. Ctrl-C (SIGINT, to this process or its process group): the
    ranks, which ignore SIGINT, get SIGTERM and leave; one that has not left after 30 s is killed; then the
    KeyboardInterrupt goes on up (harness.run says how many rows were kept). ``watchdog_s``: ranks still running
    that long after their start are stopped the same way (10 s to leave) and :class:`TimeoutError` is raised (a
    rank spinning inside a GPU kernel never reaches a collective's timeout)."""
    import torch.multiprocessing as mp

    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the ranks at their start
    try:
        ctx = mp.start_processes(_spawn_entry, args=(payload, renv), nprocs=n, join=False, start_method="spawn")
    finally:
        signal.signal(signal.SIGINT, handler)
    deadline = None if watchdog_s is None else time.monotonic() + watchdog_s
    try:
        while not ctx.join(None if deadline is None else 1.0):
            if deadline is not None and time.monotonic() > deadline:
                _stop_ranks(ctx.processes, grace_s=10)
                raise TimeoutError(f"watchdog timeout: the ranks were still running after {watchdog_s:g} s "
                                   f"(watchdog_s) and were stopped")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stopping short
        _stop_ranks(ctx.processes, grace_s=30)
        raise


def _stop_ranks(processes: list, grace_s: float) -> None:
    """SIGTERM to each rank still alive; one that has not left after ``grace_s`` is killed."""
    for p in processes:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# The job files this process's runs write, and the run folders a launcher in this process sent jobs to write into
# (with the files they held before): the rows a Ctrl-C leaves (kept_rows).
_JOB_FILES: list[Path] = []
_RUN_DIRS: dict[Path, frozenset[Path]] = {}


def watch_run_dir(run_dir: Path) -> None:
    """Rows that jobs started from this process will write into ``run_dir`` (files there now are not theirs)."""
    run_dir = Path(run_dir)
    if run_dir not in _RUN_DIRS:
        _RUN_DIRS[run_dir] = frozenset(run_dir.glob("*")) if run_dir.is_dir() else frozenset()


def kept_rows() -> tuple[int, list[str]]:
    """The rows this process's runs (and the jobs it launched) have written so far, and their run folders."""
    files = {results.written_path(f) for f in _JOB_FILES}
    for d, before in _RUN_DIRS.items():
        files |= set(results.find_files(d)[0]) - before if d.is_dir() else set()
    n = 0
    for f in files:
        if f.exists():
            try:
                n += len(results.read_file(f))
            except results.ResultsFileError:  # a damaged file: its rows are not counted as kept
                pass
    return n, sorted({str(f.parent) for f in _JOB_FILES} | {str(d) for d in _RUN_DIRS})


def prepare(cfg: Any) -> tuple[Point, Optional[RankEnv], int]:
    """Every check a run makes before anything starts (raises :class:`ConfigError`): the point, the rank layout
    (None: this process spawns the ranks) and the rank count. Sweeps call it for each point first."""
    config = resolve(cfg)  # typed once: everything after reads it
    renv = from_environment()
    ws = world_size_for(config, renv.world_size if renv is not None else None)
    point = Point.build(config, ep_size=ws, device=config.device)
    if renv is None and point.case.device == "cpu":  # the ranks this process spawns share this machine's memory
        avail = envinfo.available_memory_bytes()
        if avail is not None:
            validate.check_cpu_memory(point.case, avail)
    results.check_dir(point.config.results_dir)
    return point, renv, ws


def run_benchmark(cfg: Any) -> pd.DataFrame:
    """Validate, run every rank, and return this sweep point's rows (rank 0 and the launcher; others: empty)."""
    point, renv, ws = prepare(cfg)  # raises ConfigError before anything starts
    pc = point.config
    if not _point_of_a_sweep(pc):  # a sweep checked its run folder before its first point
        validate.check_new_run(pc)
    run_id = given_run_id(pc)[0] or new_run_id(pc, ws)
    path = results.job_file(pc.results_dir, run_id, point.config_hash, pc.results_format)
    _JOB_FILES.append(path)
    payload = {"point": point, "run_id": run_id, "path": str(path), "num": sweep_point_num()}

    failure: Optional[str] = None
    if renv is not None:
        worker(payload, renv)
        if renv.rank != 0:
            return results.to_frame([])
    else:
        watchdog = pc.watchdog_s or (SHARED_GPU_WATCHDOG_S if point.ranks_per_gpu > 1 else None)
        payload["order"] = order = run_order(point)
        payload["pythonpath"] = pc.own_pythonpath.get(order[0], "") if order[0] in pc.own_process else ""
        while True:  # one set of ranks, then one more for each hand-off (backends that need fresh processes)
            spawn_env = RankEnv(0, ws, 0, 1, "127.0.0.1", free_port(), "spawn")
            try:
                _run_ranks(payload, spawn_env, ws, watchdog)
            except Exception as e:  # noqa: BLE001 - a rank died: record what did not report
                failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            handoff = _take_handoff(path)
            if failure or handoff is None:
                break
            nxt = order[handoff["position"]]
            payload = dict(payload, handoff=handoff,
                           pythonpath=pc.own_pythonpath.get(nxt, "") if nxt in pc.own_process else "")
        renv = spawn_env
    written = results.written_path(path)
    done = results.read_file(written) if written.exists() else results.to_frame([])
    if failure or len(done) < len(pc.backends) * len(pc.directions):
        done = _fill_missing(done, point, renv, run_id, path, failure or "a rank exited early")
    if results.written_path(path) != path:
        print(f"mokbench: the rows of this run are in {results.written_path(path)} (the results folder could not be "
              f"written)", file=sys.stderr)
    from harness.core import run_meta

    run_meta.refresh_meta(results.written_path(path).parent)  # the run's meta.json, from all of its rows so far
    return done


def _point_of_a_sweep(config: BenchConfig) -> bool:
    """Whether this run is a point of a sweep, whose points share one run folder by design: a Hydra multirun job
    (submitit's array jobs included), or a job that slurm/submit.sh started for a point the sweep's dry run planned
    (its hydra.run.dir holds that point's file, with this run id)."""
    if sweep_point_num() is not None:
        return True
    try:
        from hydra.core.hydra_config import HydraConfig

        from harness.config.launcher_options import POINT_FILE

        planned = Path(str(HydraConfig.get().run.dir)) / POINT_FILE
    except (ValueError, ImportError, AttributeError):
        return False
    if not planned.exists():
        return False
    from omegaconf import OmegaConf

    return str(OmegaConf.load(planned).get("run_id") or "") == given_run_id(config)[0]


def sweep_point_num() -> Optional[int]:
    """This job's number in a Hydra multirun (None outside one), for the progress lines."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return int(hc.job.num) if hc.mode == RunMode.MULTIRUN else None
    except (ValueError, ImportError, AttributeError, TypeError):
        return None


def _fill_missing(done: pd.DataFrame, point: Point, renv: RankEnv, run_id: str, path, why: str) -> pd.DataFrame:
    have = set(zip(done["backend"], done["direction"])) if len(done) else set()
    base = base_row(point, run_id=run_id, num_nodes=renv.num_nodes, world_size=renv.world_size,
                    env=envinfo.collect(point.case.device))
    rows = done.to_dict("records")
    status = "timeout" if "timeout" in why.lower() or "timed out" in why.lower() else "error"
    for b in point.config.backends:
        for d in point.config.directions:
            if (b, d) not in have:
                rows.append(make_row(base, b, d, status, error=f"no row reported: {why}",
                                     backend_options=point.options_text(b)))
    return results.read_file(results.write_rows(path, rows))
