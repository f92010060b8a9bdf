"""The results schema, atomic writes and the loader.

One tidy row per (sweep point x backend x direction). Each job's rank 0 writes one file of its own under
``<results_dir>/<run_id>/``; the file is rewritten atomically (temp file + rename) as rows arrive, so a crash
never leaves a partial file, and no file of another job or run is ever touched. ``load`` merges every file it
finds and keeps repeated runs apart by ``(run_id, row_id)``.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import os
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from contract.case import CUDAGRAPH_MODES

STATUSES = ("ok", "unsupported", "mismatch", "error", "oom", "timeout", "cancelled")

# column -> pandas dtype. The contract named in the harness-core issue, plus context columns.
COLUMNS: dict[str, str] = {
    "run_id": "string",
    "row_id": "string",
    # the row was run with append=true: added on purpose to a run folder that may hold another invocation's rows
    # (empty in files written before the column)
    "appended": "boolean",
    # the row ran several ranks on one GPU, time-sharing it: a correctness check, never a speed measurement; every
    # speed table and chart leaves it out (harness.report.claims.speed_rows). Empty (false) in files written
    # before the column
    "shared_gpu": "boolean",
    "ranks_per_gpu": "Int64",  # how many ranks shared each GPU in a shared_gpu row (empty otherwise)
    "timestamp": "string",
    "git_sha": "string",
    "git_dirty": "boolean",
    "config_hash": "string",
    "backend": "string",
    # the backend's own options (contract/options.py) as `field=value` pairs; empty for a backend that takes none
    # (and in files written before the column)
    "backend_options": "string",
    "shape": "string",
    "num_experts": "Int64",
    "local_experts": "Int64",
    "experts_override": "boolean",
    "published_local_experts": "Int64",
    "hidden": "Int64",
    "ffn": "Int64",
    "topk": "Int64",
    "shared_expert": "boolean",
    "swiglu_limit": "float64",
    "precision": "string",
    "scaling": "string",
    "direction": "string",
    # what a forward row timed: "training" (the forward keeps what its backward needs) or "inference" (it saves
    # nothing for a backward); speedups pair like with like. Empty in files written before the column
    # (harness.report.labels.forward_kind derives it there)
    "forward_kind": "string",
    "compiled": "boolean",
    "compile_mode": "string",
    "comm_sms": "Int64",
    "tokens_per_gpu": "Int64",
    "ep_size": "Int64",
    "num_nodes": "Int64",
    "world_size": "Int64",
    "routing": "string",
    "seed": "Int64",
    # routings per rank cycled through warmup and timing (workload.steps; empty in files written before the column: 1)
    "routing_steps": "Int64",
    # the routing's balance; with routing_steps > 1 the median over the steps' routings, and their min and max in the
    # _min / _max columns (empty for one routing)
    "expert_load_max_over_mean": "float64",
    "rank_load_max_over_mean": "float64",
    "empty_experts": "Int64",
    "expert_load_max_over_mean_min": "float64",
    "expert_load_max_over_mean_max": "float64",
    "rank_load_max_over_mean_min": "float64",
    "rank_load_max_over_mean_max": "float64",
    "empty_experts_min": "Int64",
    "empty_experts_max": "Int64",
    "status": "string",
    "error": "string",
    "latency_ms": "float64",
    "latency_p20_ms": "float64",
    "latency_p80_ms": "float64",
    "latency_min_ms": "float64",
    "latency_max_ms": "float64",
    # routing_steps > 1: each routing step's median latency (over the timed iterations that ran it), their mean and
    # their max (a burst step a median over all iterations would hide); empty for one routing
    "latency_step_mean_ms": "float64",
    "latency_step_max_ms": "float64",
    "num_warmup": "Int64",
    "num_iters": "Int64",
    "setup_s": "float64",
    "backend_position": "Int64",  # where the backend ran in the process's order (0 = first; backend_order)
    # The GPUs over the timed iterations (NVML; harness.measure.gpu_clocks): slowest SM clock, largest board power and
    # share of the time held below the requested clocks by the power / thermal limit.
    "sm_clock_mhz": "float64",
    "sm_clock_min_mhz": "float64",
    "power_w": "float64",
    "power_capped_fraction": "float64",
    "thermal_capped_fraction": "float64",
    # Device memory (harness.measure.memory; CUDA only, largest over ranks): held after setup, kept by a forward for its
    # backward, the allocator's peak and the device's used memory around the timed iterations.
    "mem_setup_bytes": "Int64",
    "mem_activation_bytes": "Int64",
    "mem_peak_allocated_bytes": "Int64",
    "mem_device_used_before_bytes": "Int64",
    "mem_device_used_peak_bytes": "Int64",
    # the allocator's peak during the timed iterations less what was allocated when the backend's setup began, plus
    # mem_graph_pool_bytes: the memory of this backend alone (its setup, workspaces, activations, gradients and CUDA
    # graphs' working memory), without the point's shared inputs or what earlier backends left (empty in files
    # written before the column)
    "mem_peak_own_bytes": "Int64",
    # the free bytes of the CUDA graph pools made since the backend's setup began (the graphs' intermediates, which
    # a replay does not allocate), added into mem_peak_own_bytes; empty in files written before the column
    "mem_graph_pool_bytes": "Int64",
    "timing_preset": "string",
    "l2_flush": "boolean",
    "align": "string",
    "flops_per_gpu": "float64",
    "tflops_per_gpu": "float64",
    "tokens_per_s_per_gpu": "float64",
    "dispatch_bytes": "Int64",
    "dispatch_local_bytes": "Int64",
    "combine_bytes": "Int64",
    "combine_local_bytes": "Int64",
    "dispatch_ms": "float64",
    "combine_ms": "float64",
    "dispatch_gb_s": "float64",
    "combine_gb_s": "float64",
    "raw_a2a_gb_s": "float64",
    "calib_gemm_tflops": "float64",
    "calib_hbm_gb_s": "float64",
    "calib_link_gb_s": "float64",
    "roofline_ms": "float64",
    "roofline_bound": "string",
    "roofline_fraction": "float64",
    "max_abs_err": "float64",
    "rel_err": "float64",
    "worst_tensor": "string",
    "atol": "float64",
    "rtol": "float64",
    "notes": "string",
    "device": "string",
    "gpu_name": "string",
    "num_gpus": "Int64",
    "driver_version": "string",
    "hostname": "string",
    "slurm_job_id": "string",
    "python_version": "string",
    "torch_version": "string",
    "cuda_version": "string",
    "nccl_version": "string",
    "cuda_alloc_conf": "string",  # PYTORCH_CUDA_ALLOC_CONF in force (harness.measure.env.cuda_alloc_conf)
    "triton_version": "string",
    "deepep_version": "string",
    "transformer_engine_version": "string",
    "megatron_core_version": "string",
    "mok_version": "string",
    # the point as its config_hash reads it (harness.config.schema.point_config, JSON): with ep_size and device it gives
    # back the point's Case and hash (empty in files written before the column)
    "point_config": "string",
}

KEY = ("run_id", "row_id")


def new_row_id() -> str:
    return uuid.uuid4().hex[:12]


def base_row(point: Any, *, run_id: str, num_nodes: int, world_size: int, env: dict[str, Any]) -> dict[str, Any]:
    """The columns every row of a sweep point (a :class:`harness.config.point.Point`) shares: the point's own
    (:meth:`~harness.config.point.Point.columns`), its run and hash, where it ran (``num_nodes``, ``world_size``) and
    the environment columns (``env``: :func:`harness.measure.env.collect`)."""
    row = {"run_id": run_id, "config_hash": point.config_hash, **point.columns(), "num_nodes": num_nodes,
           "world_size": world_size, "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    row.update(env)
    return row


def make_row(base: dict, backend: str, direction: str, status: str, **kw: Any) -> dict[str, Any]:
    """One row: the point's shared columns (:func:`base_row`), the backend, direction and status, a fresh row id and
    timestamp, then ``kw`` (measurements, errors, notes)."""
    row = dict(base, backend=backend, direction=direction, status=status, row_id=new_row_id(),
               timestamp=pd.Timestamp.now(tz="UTC").isoformat())
    row.update(kw)
    if direction != "fwd":
        row.pop("forward_kind", None)  # what a forward row timed (a backend's info() gives it for all its rows)
    return row



def own_peak_counts_graphs(row: Any) -> bool:
    """Whether a row's ``mem_peak_own_bytes`` holds its CUDA graphs' memory: always, unless the backend replays
    CUDA graphs and the row predates ``mem_graph_pool_bytes`` (its own peak then missed the graphs' pools)."""
    pool = row.get("mem_graph_pool_bytes")
    try:
        has_pool = pool is not None and not bool(pd.isna(pool))
    except (TypeError, ValueError):
        has_pool = False
    return has_pool or not replays_cuda_graphs(row)


def replays_cuda_graphs(row: Any) -> bool:
    """Whether a row's backend ran compiled code that replays CUDA graphs (``compiled`` with a ``compile_mode`` of
    :data:`contract.case.CUDAGRAPH_MODES`): its allocator peaks miss the graphs' private pool
    (harness.measure.memory)."""
    def isna(v: Any) -> bool:
        try:
            return v is None or bool(pd.isna(v))
        except (TypeError, ValueError):
            return False

    compiled, mode = row.get("compiled"), row.get("compile_mode")
    return not isna(compiled) and bool(compiled) and not isna(mode) and str(mode) in CUDAGRAPH_MODES


def job_file(results_dir: Union[str, Path], run_id: str, config_hash: str, fmt: str = "csv") -> Path:
    """A file name no other job can pick: time, config, host, pid and a random tag."""
    stamp = pd.Timestamp.now(tz="UTC").strftime("%Y%m%dT%H%M%S")
    name = f"{stamp}_{config_hash}_{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}.{fmt}"
    return Path(results_dir) / run_id / name


def to_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    return _typed(pd.DataFrame(list(rows)))


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every schema column (missing ones blank) in the schema's order and type, then any others."""
    df = df.copy()
    for col, dtype in COLUMNS.items():
        if col not in df:
            df[col] = pd.NA
        df[col] = _coerce(df[col], dtype)
    extra = [c for c in df.columns if c not in COLUMNS]
    return df[list(COLUMNS) + extra]


def _coerce(s: pd.Series, dtype: str) -> pd.Series:
    if dtype == "boolean":
        return s.map(_to_bool, na_action=None).astype("boolean")
    if dtype in ("Int64", "float64"):
        return pd.to_numeric(s, errors="coerce").astype(dtype)
    return s.astype("string")


def _to_bool(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    return {"true": True, "false": False, "1": True, "0": False}.get(str(v).strip().lower(), pd.NA)


def check_dir(results_dir: Union[str, Path]) -> None:
    """Raise ``ConfigError`` (naming the fix) unless rows can be written under ``results_dir``: it, or the folder
    it would be made in, must be a writable folder. Probes with a temporary file that is removed at once; creates
    nothing."""
    from harness.core.tool_args import dir_write_problem
    from harness.core.errors import ConfigError

    if why := dir_write_problem(results_dir):
        raise ConfigError(f"results_dir={results_dir} {why}: give results_dir=<a folder you can write> "
                          f"(default {LOCAL_RUNS.relative_to(REPO_RESULTS.parent)})")


def rescue_path(path: Union[str, Path]) -> Path:
    """Where :func:`write_rows` saves a job's rows when their own file cannot be written: the same run folder and
    file name under ``$MOKBENCH_RESCUE_DIR`` (default: ``mokbench-rescued-results`` in the temp folder)."""
    path = Path(path)
    root = Path(os.environ.get("MOKBENCH_RESCUE_DIR") or Path(tempfile.gettempdir()) / "mokbench-rescued-results")
    return root / path.parent.name / path.name


def written_path(path: Union[str, Path]) -> Path:
    """The file a job's rows are in: its own, or the rescue file once writing its own failed."""
    rescue = rescue_path(path)
    return rescue if rescue.exists() else Path(path)


def write_rows(path: Union[str, Path], rows: list[dict[str, Any]]) -> Path:
    """Atomically (re)write this job's own file with all its rows so far. Returns the file written. If it cannot be
    written (the results folder vanished, a full disk, lost permissions), the rows go to :func:`rescue_path` instead,
    and stay there for the rest of the job; stderr says where."""
    path = Path(path)
    df = to_frame(rows)
    rescue = rescue_path(path)
    if not rescue.exists():
        try:
            return _write_atomic(path, df)
        except OSError as e:
            print(f"mokbench: cannot write results to {path} ({e.strerror or e}); the rows are saved in {rescue}",
                  file=sys.stderr, flush=True)
    return _write_atomic(rescue, df)


def _write_atomic(path: Path, df: pd.DataFrame) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        if path.suffix == ".parquet":
            df.to_parquet(tmp, index=False)
        else:
            df.to_csv(tmp, index=False)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path


class ResultsFileError(ValueError):
    """A results file that cannot be read as one: the message names the file (and the line) and what is wrong.
    ``path``: the file (None for a problem across files); ``reason``: what is wrong, without the file's name."""

    def __init__(self, message: str, path: Optional[Path] = None, reason: str = ""):
        super().__init__(message)
        self.path = path
        self.reason = reason or message


REPO_RESULTS = Path(__file__).resolve().parents[2] / "results"
REFERENCE_RUNS = REPO_RESULTS / "runs"  # the measured runs the project commits (reports and notebook read these)
LOCAL_RUNS = REPO_RESULTS / "local"  # a user's own runs: harness.run's default results_dir, ignored by git
HEADER_START = "run_id,row_id,"
ROW_SUFFIXES = (".csv", ".parquet")
NOT_TABLE = "not .csv or .parquet"  # the skip reason of logs, text, JSON, charts in a results folder
GATE_LOG = "gate.log"  # harness.gate's log of one run, in the run's folder
RUN_NAMES = "names.csv"  # results/runs/names.csv: each committed run's display name (harness.core.run_names)
RUN_COMPANIONS = ("meta.json", "ERRATA.md", GATE_LOG, RUN_NAMES)  # files beside the rows: never rows, never counted
DAMAGED_FIX = "restore or remove it, or leave damaged files out (--skip-damaged; load(skip_damaged=True))"
_BLANK = ("", "nan", "<na>", "na", "none", "null")  # values that read as missing in any column
_BOOL_TEXT = ("true", "false", "1", "0")


def _damaged(path: Path, reason: str, more: str = "") -> ResultsFileError:
    return ResultsFileError(f"{path}: {reason}{more}: a damaged file; {DAMAGED_FIX}", path, reason)


def read_file(path: Union[str, Path]) -> pd.DataFrame:
    """One results file (CSV or Parquet) as a typed frame. Raises :class:`ResultsFileError` naming the file (and
    the line) when it is not a results file of this schema (no ``run_id`` / ``row_id`` header) or is damaged (see
    :func:`load`)."""
    path = Path(path)
    raw, lines = _read_raw(path)
    bad = _row_problems(raw, lines, np.zeros(len(raw), dtype=int))
    if bad:
        raise _damaged(path, _where(path, *bad[0]))
    return _typed(raw)


def _read_raw(path: Path) -> tuple[pd.DataFrame, np.ndarray]:
    """A file's rows as given (values unparsed, blanks missing) and the line (CSV) or row (Parquet) of each."""
    if path.suffix == ".parquet":
        try:
            df = pd.read_parquet(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            detail = str(e).splitlines()[0][:120] if str(e) else ""
            raise _damaged(path, f"not a readable Parquet file ({type(e).__name__}: {detail})") from None
        if missing := [c for c in KEY if c not in df.columns]:
            raise ResultsFileError(f"{path}: not a results file: no {' / '.join(missing)} column", path)
        return df.reset_index(drop=True), np.arange(1, len(df) + 1)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _damaged(path, f"cannot be read ({e.strerror or e})") from None
    if b"\x00" in data:
        raise _damaged(path, "not a CSV file (binary content)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _damaged(path, "not a CSV file (not UTF-8 text)") from None
    if not text.strip():
        raise _damaged(path, "empty file, no header and no rows")
    reader = csv.reader(io.StringIO(text))  # quoted fields may hold newlines (error messages)
    records, starts, prev = [], [], 0
    try:
        for rec in reader:
            records.append(rec)
            starts.append(prev + 1)
            prev = reader.line_num
    except csv.Error as e:
        raise _damaged(path, f"line {prev + 1}: not a CSV file ({e})") from None
    while records and not records[-1]:
        records.pop()  # blank trailing lines
    if len(records) == 1 and not text.endswith(("\n", "\r")):
        raise _damaged(path, "cut inside its header (no line end, no rows)")
    header = records[0]
    if missing := [c for c in KEY if c not in header]:
        raise ResultsFileError(f"{path}: not a results file: its header has no {' / '.join(missing)} column "
                               f"(it starts '{','.join(header)[:60]}')", path)
    if twice := sorted({c for c in header if header.count(c) > 1}):
        raise _damaged(path, f"its header names {', '.join(twice)} more than once")
    for rec, line in zip(records[1:], starts[1:]):
        if len(rec) != len(header):
            raise _damaged(path, f"line {line} has {len(rec)} fields, the header {len(header)}: a truncated row")
    df = pd.DataFrame(records[1:], columns=header, dtype=object)
    return df.mask(df.eq("")), np.array(starts[1:len(records)], dtype=int)


def _row_problems(df: pd.DataFrame, lines: np.ndarray, owner: np.ndarray) -> dict[int, tuple[int, str, int]]:
    """For each file (``owner``: the file index of each row) with a value that is not a valid value of its column:
    (its first such line, what is wrong there, how many such values the file has)."""
    first: dict[int, tuple[int, int, str]] = {}  # file -> (row position, line, what)
    count: dict[int, int] = {}
    for col in [c for c in COLUMNS if c in df.columns]:
        s, dtype = df[col], COLUMNS[col]
        text = s.astype(object).where(s.notna(), "").astype(str).str.strip()
        blank = text.str.lower().isin(_BLANK).to_numpy()
        if col in KEY or col == "status":
            bad = blank.copy()
            if col == "status":
                bad |= ~blank & ~text.isin(STATUSES).to_numpy()
        elif dtype in ("Int64", "float64"):
            num = pd.to_numeric(s.where(~blank), errors="coerce").astype("float64").to_numpy()
            bad = ~blank & np.isnan(num)
            if dtype == "Int64":
                with np.errstate(invalid="ignore"):
                    bad |= ~blank & ~np.isnan(num) & ~(np.isfinite(num) & (num == np.round(num)))
        elif dtype == "boolean":
            bad = ~blank & ~text.str.lower().isin(_BOOL_TEXT).to_numpy()
        else:
            continue
        pos = np.flatnonzero(bad)
        for fi in np.unique(owner[pos]):
            here = pos[owner[pos] == fi]
            count[fi] = count.get(fi, 0) + len(here)
            p = int(here[0])
            if fi not in first or p < first[fi][0]:
                first[fi] = (p, int(lines[p]), _what(col, dtype, text.iloc[p], bool(blank[p])))
    return {int(fi): (line, what, count[fi]) for fi, (_, line, what) in sorted(first.items())}


def _what(col: str, dtype: str, value: str, blank: bool) -> str:
    if blank:
        return f"no {col}"
    if col == "status":
        return f"status is {value!r}, not one of {', '.join(STATUSES)}"
    want = {"Int64": "a whole number", "float64": "a number", "boolean": "true or false"}[dtype]
    return f"{col} is {value!r}, not {want}"


def _where(path: Path, line: int, what: str, n: int) -> str:
    unit = "row" if path.suffix == ".parquet" else "line"
    return f"{unit} {line}: {what}" + (f" ({n} bad values in the file)" if n > 1 else "")


def _hidden(f: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in f.relative_to(root).parts)


def find_files(*paths: Union[str, Path], exclude: Sequence[Union[str, Path]] = ()
               ) -> tuple[list[Path], dict[str, list[Path]]]:
    """The results files under the given files or folders, and the files in those folders that were skipped, by
    reason (:func:`load` says which files are results files). A file named explicitly is always returned
    (``read_file`` then says what is wrong with it). Files under a folder of ``exclude`` (an output folder inside
    an input folder) are skipped, whatever they hold."""
    files: list[Path] = []
    skipped: dict[str, list[Path]] = {}
    out = [(Path(x), Path(x).resolve()) for x in exclude]
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.name.startswith(".") or not f.is_file():
                    continue  # temporary files of an atomic write, tool state
                if mine := next((str(x) for x, r in out if f.resolve().is_relative_to(r)), None):
                    skipped.setdefault(f"in the output folder {mine}", []).append(f)
                    continue
                if f.name in RUN_COMPANIONS:
                    continue
                if f.suffix not in ROW_SUFFIXES:
                    if not _hidden(f, p):
                        skipped.setdefault(NOT_TABLE, []).append(f)
                    continue
                why = _skip_reason(f)
                if why:
                    skipped.setdefault(why, []).append(f)
                else:
                    files.append(f)
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"no results at {p}")
    seen: set[Path] = set()
    unique = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]  # a file named twice
    return unique, skipped


def skipped_note(skipped: dict[str, Sequence[Union[str, Path]]]) -> str:
    """One line: how many files in the given folders were skipped, and why ('' when none)."""
    if not skipped:
        return ""
    n = sum(map(len, skipped.values()))
    parts = []
    for why, v in sorted(skipped.items(), key=lambda kv: -len(kv[1])):
        kinds = sorted({Path(f).suffix or "no suffix" for f in v}) if why == NOT_TABLE else []
        parts.append(f"{len(v)} {why}" + (f" ({', '.join(kinds[:6])}{', ...' if len(kinds) > 6 else ''})"
                                          if kinds else ""))
    return f"skipped {n} file{'s that hold' if n != 1 else ' that holds'} no results: " + "; ".join(parts)


def damaged_note(damaged: dict[Path, str], shown: int = 4) -> str:
    """One line: the damaged files ``load(skip_damaged=True)`` left out, and what is wrong with each ('' when
    none)."""
    if not damaged:
        return ""
    items = [f"{f} ({why})" for f, why in damaged.items()]
    more = f"; and {len(items) - shown} more" if len(items) > shown else ""
    n = len(items)
    return f"left out {n} damaged file{'s' if n != 1 else ''} (--skip-damaged): " + "; ".join(items[:shown]) + more


def load(*paths: Union[str, Path], skip_damaged: bool = False, exclude: Sequence[Union[str, Path]] = (),
         progress: Optional[Callable[[int, int, Path], None]] = None) -> pd.DataFrame:
    """Every row under the given files or folders (default: results/runs, the committed reference runs), as one
    DataFrame. Repeated runs are kept: the key is (run_id, row_id).

    Which files are results files: in a folder, a Parquet file, or a ``.csv`` file whose first line starts with
    the schema's header (``run_id,row_id,``). Files that are not are skipped and counted by reason in
    ``df.attrs["skipped"]`` (see :func:`skipped_note`): other suffixes (logs, ``.txt``, ``.json``, charts), empty
    ``.csv`` files, and ``.csv`` text whose first line is another header (nvidia-smi logs, calibration or report
    tables); so are files under a folder of ``exclude``. A ``.csv`` that is not UTF-8 text (binary, or NUL bytes)
    shows no header, so nothing tells it from a row file whose bytes were damaged: it is read, and is damaged.

    A results file is damaged when it cannot be read as rows of the schema: binary or undecodable, a row with more
    or fewer fields than the header (truncated), a value that does not parse as its column's type (``latency_ms``
    ``abc``; a whole number for ``Int64`` columns, true / false for ``boolean`` ones), a status not in
    :data:`STATUSES`, a row without run_id / row_id / status. A damaged file raises :class:`ResultsFileError`
    naming the file and the line; with ``skip_damaged`` it is left out instead and named, with what is wrong, in
    ``df.attrs["damaged"]`` (see :func:`damaged_note`). ``progress(i, n, path)`` is called after each of the ``n``
    files is read. ``df.attrs["files"]``: (file, number of rows) of each file read, in the order of the rows."""
    if not paths:
        paths = (REFERENCE_RUNS,)
    files, found_skipped = find_files(*paths, exclude=exclude)
    # attrs hold strings: pandas deep-copies attrs into every frame derived from this one, and copying Path objects
    # took a third of the analysis notebook's time
    skipped = {why: tuple(map(str, fs)) for why, fs in found_skipped.items()}
    read: list[tuple[Path, pd.DataFrame, np.ndarray]] = []
    errors: dict[Path, ResultsFileError] = {}
    for i, f in enumerate(files, 1):
        try:
            read.append((f, *_read_raw(f)))
        except ResultsFileError as e:
            errors[f] = e
        if progress is not None:
            progress(i, len(files), f)
    if read:
        frame = pd.concat([r[1] for r in read], ignore_index=True)
        lines = np.concatenate([r[2] for r in read])
        owner = np.repeat(np.arange(len(read)), [len(r[1]) for r in read])
        for fi, (line, what, n) in _row_problems(frame, lines, owner).items():
            errors[read[fi][0]] = _damaged(read[fi][0], _where(read[fi][0], line, what, n))
        if errors:
            kept = [i for i, r in enumerate(read) if r[0] not in errors]
            keep = np.isin(owner, kept)
            frame, owner = frame[keep].reset_index(drop=True), np.searchsorted(kept, owner[keep])
            read = [read[i] for i in kept]
    if errors and not skip_damaged:
        order = [f for f in files if f in errors]
        first = errors[order[0]]
        more = "" if len(order) == 1 else (f" ({len(order) - 1} more file{'s' if len(order) > 2 else ''} cannot be "
                                           f"read either: {', '.join(map(str, order[1:3]))}"
                                           f"{', ...' if len(order) > 3 else ''})")
        if not more:
            raise first
        if str(first).endswith(f": a damaged file; {DAMAGED_FIX}"):
            raise _damaged(order[0], first.reason, more)
        raise ResultsFileError(str(first) + more, order[0], first.reason)
    df = _typed(frame) if read else to_frame([])
    if read:
        dup = df.duplicated(list(KEY), keep=False).to_numpy()
        if dup.any():
            names = ", ".join(dict.fromkeys(str(read[o][0]) for o in owner[dup]))
            raise ResultsFileError(f"{int(dup.sum())} rows share a (run_id, row_id) key, in {names[:300]}: a "
                                   "results file copied twice (keep one copy)")
    df.attrs["skipped"] = skipped
    df.attrs["damaged"] = {f: errors[f].reason for f in files if f in errors}
    df.attrs["files"] = [(str(f), len(r)) for f, r, _ in read]
    return df


def _skip_reason(f: Path) -> str:
    """Why a file found in a folder is not a results file ('' when it may be one: a Parquet file, a CSV with the
    schema's header, or a CSV that is not text, which :func:`read_file` then calls damaged)."""
    if f.suffix == ".parquet":
        return ""
    try:
        with open(f, "rb") as fh:
            head = fh.read(8192)
    except OSError:
        return ""  # read_file says why it cannot be read
    if b"\x00" in head:
        return ""
    try:
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(head, final=len(head) < 8192)
    except UnicodeDecodeError:
        return ""
    if not text.strip() and len(head) < 8192:
        return "empty"
    if len(head) < 8192 and HEADER_START.startswith(text.strip()):
        return ""  # a results file cut inside its header: read_file calls it damaged
    return "" if text.lstrip("\r\n").startswith(HEADER_START) else "without the results header (other tables)"


# ---------------------------------------------------------------------------------------------------------------
# environments


def environment(device: Any, gpu_name: Any) -> Optional[str]:
    """The environment a row ran in, as a comparison must match it: ``CPU``, or the GPU model (with the device when
    it is not ``cuda``); None where the row does not say (a GPU device without a model: rows the launcher wrote for
    a job that never reported; rows without either column)."""
    dev = "" if device is None or pd.isna(device) else str(device).strip().lower()
    gpu = "" if gpu_name is None or pd.isna(gpu_name) else str(gpu_name).strip()
    if dev == "cpu" or gpu.lower() == "cpu":
        return "CPU"
    if not gpu:
        return None
    return gpu if dev in ("", "cuda") else f"{gpu} ({dev})"


def environments(df: pd.DataFrame) -> dict[str, dict[str, list[str]]]:
    """Environment (:func:`environment`) -> the runs and files (from ``df.attrs["files"]``, where ``df`` is as
    :func:`load` returned it) of its rows; rows that do not say where they ran are left out."""
    if df.empty:
        return {}
    env = [environment(d, g) for d, g in zip(df["device"], df["gpu_name"])]
    sizes = df.attrs.get("files") or []
    src = [f for f, n in sizes for _ in range(n)] if sum(n for _, n in sizes) == len(df) else [""] * len(df)
    out: dict[str, dict[str, list[str]]] = {}
    for e, run, f in zip(env, df["run_id"], src):
        if e is None:
            continue
        d = out.setdefault(e, {"runs": [], "files": []})
        if str(run) not in d["runs"]:
            d["runs"].append(str(run))
        if f and f not in d["files"]:
            d["files"].append(f)
    return out


def mixed_environments(sides: dict[str, pd.DataFrame]) -> str:
    """'' when the rows of every side (name -> rows as :func:`load` returned them) that say where they ran ran in
    one environment (:func:`environment`); else, on one line, the environments and where their rows came from
    (runs, files)."""

    def where(env: str, info: dict[str, list[str]]) -> str:
        runs, files = info["runs"], info["files"]
        text = f"run{'s' if len(runs) > 1 else ''} {', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}"
        if files:
            text += f"; {files[0]}" + (f" and {len(files) - 1} more file{'s' if len(files) > 2 else ''}"
                                       if len(files) > 1 else "")
        return f"{env} ({text})"

    envs = {name: environments(df) for name, df in sides.items() if df is not None}
    for name, e in envs.items():
        if len(e) > 1:
            return f"{name} mixes environments: " + " and ".join(where(k, v) for k, v in e.items())
    if len({k for e in envs.values() for k in e}) > 1:
        named = [name for name, e in envs.items() if e]
        return (f"{' and '.join(named)} ran in different environments: "
                + ", ".join(f"{name} on {where(k, v)}" for name, e in envs.items() for k, v in e.items()))
    return ""
