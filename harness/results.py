"""The results schema, atomic writes and the loader.

One tidy row per (sweep point x backend x direction). Each job's rank 0 writes one file of its own under
``<results_dir>/<run_id>/``; the file is rewritten atomically (temp file + rename) as rows arrive, so a crash
never leaves a partial file, and no file of another job or run is ever touched. ``load`` merges every file it
finds and keeps repeated runs apart by ``(run_id, row_id)``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence, Union

import pandas as pd

if TYPE_CHECKING:
    from contract import Case

STATUSES = ("ok", "unsupported", "mismatch", "error", "oom", "timeout", "cancelled")

# column -> pandas dtype. The contract named in the harness-core issue, plus context columns.
COLUMNS: dict[str, str] = {
    "run_id": "string",
    "row_id": "string",
    "timestamp": "string",
    "git_sha": "string",
    "git_dirty": "boolean",
    "config_hash": "string",
    "backend": "string",
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
    "compiled": "boolean",
    "compile_mode": "string",
    "comm_sms": "Int64",
    "tokens_per_gpu": "Int64",
    "ep_size": "Int64",
    "num_nodes": "Int64",
    "world_size": "Int64",
    "routing": "string",
    "seed": "Int64",
    "expert_load_max_over_mean": "float64",
    "rank_load_max_over_mean": "float64",
    "empty_experts": "Int64",
    "status": "string",
    "error": "string",
    "latency_ms": "float64",
    "latency_p20_ms": "float64",
    "latency_p80_ms": "float64",
    "latency_min_ms": "float64",
    "latency_max_ms": "float64",
    "num_warmup": "Int64",
    "num_iters": "Int64",
    "setup_s": "float64",
    "backend_position": "Int64",  # where the backend ran in the process's order (0 = first; backend_order)
    # The GPUs over the timed iterations (NVML; harness.gpu_clocks): slowest SM clock, largest board power and
    # share of the time held below the requested clocks by the power / thermal limit.
    "sm_clock_mhz": "float64",
    "sm_clock_min_mhz": "float64",
    "power_w": "float64",
    "power_capped_fraction": "float64",
    "thermal_capped_fraction": "float64",
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
    "cuda_alloc_conf": "string",  # PYTORCH_CUDA_ALLOC_CONF in force (harness.env.cuda_alloc_conf)
    "triton_version": "string",
    "deepep_version": "string",
    "transformer_engine_version": "string",
    "megatron_core_version": "string",
    "mok_version": "string",
}

KEY = ("run_id", "row_id")


def new_row_id() -> str:
    return uuid.uuid4().hex[:12]


def base_row(case: Case, c: dict, *, run_id: str, config_hash: str, num_nodes: int, world_size: int,
             env: dict[str, Any]) -> dict[str, Any]:
    """The columns every row of a sweep point shares: the point (``case``, the resolved config ``c``), where it ran
    (``num_nodes``, ``world_size``) and the environment columns (``env``: :func:`harness.env.collect`)."""
    t = c["timing"]
    row = {
        "run_id": run_id,
        "config_hash": config_hash,
        "shape": case.shape,
        "num_experts": case.num_experts,
        "local_experts": case.local_experts,
        "experts_override": case.experts_override,
        "published_local_experts": case.published_local_experts,
        "hidden": case.hidden,
        "ffn": case.ffn,
        "topk": case.topk,
        "shared_expert": case.shared_expert,
        "swiglu_limit": case.swiglu_limit,
        "precision": case.precision,
        "tokens_per_gpu": case.tokens_per_gpu,
        "ep_size": case.ep_size,
        "num_nodes": num_nodes,
        "world_size": world_size,
        "routing": case.routing_label,
        "seed": case.seed,
        "timing_preset": t["name"],
        "l2_flush": t["l2_flush"],
        "align": t["align"],
        "atol": case.atol,
        "rtol": case.rtol,
        "comm_sms": case.comm_sms,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    row.update(env)
    return row


def make_row(base: dict, backend: str, direction: str, status: str, **kw: Any) -> dict[str, Any]:
    """One row: the point's shared columns (:func:`base_row`), the backend, direction and status, a fresh row id and
    timestamp, then ``kw`` (measurements, errors, notes)."""
    row = dict(base, backend=backend, direction=direction, status=status, row_id=new_row_id(),
               timestamp=pd.Timestamp.now(tz="UTC").isoformat())
    row.update(kw)
    return row


def job_file(results_dir: Union[str, Path], run_id: str, config_hash: str, fmt: str = "csv") -> Path:
    """A file name no other job can pick: time, config, host, pid and a random tag."""
    stamp = pd.Timestamp.now(tz="UTC").strftime("%Y%m%dT%H%M%S")
    name = f"{stamp}_{config_hash}_{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}.{fmt}"
    return Path(results_dir) / run_id / name


def to_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(list(rows))
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
    from harness.config import ConfigError

    p = Path(results_dir)
    existing = p
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            break
        existing = existing.parent
    fix = "give results_dir=<a folder you can write> (default results/runs)"
    if existing.exists() and not existing.is_dir():
        what = "is a file" if existing == p else f"is under {existing}, which is a file"
        raise ConfigError(f"results_dir={results_dir} {what}: {fix}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        where = "" if existing == p else f" (it would be made in {existing})"
        raise ConfigError(f"results_dir={results_dir} cannot be written{where}: {e.strerror or e}: {fix}") from None


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
    """A results file that cannot be read as one: the message names the file and what is wrong with it."""


REPO_RESULTS = Path(__file__).resolve().parent.parent / "results"
REFERENCE_RUNS = REPO_RESULTS / "runs"  # the measured runs the project commits (reports and notebook read these)
LOCAL_RUNS = REPO_RESULTS / "local"  # a user's own runs: harness.run's default results_dir, ignored by git
HEADER_START = "run_id,row_id,"


def read_file(path: Union[str, Path]) -> pd.DataFrame:
    """One results file (CSV or Parquet) as a typed frame. Raises :class:`ResultsFileError` naming the file when
    it is empty, not a results table of this schema (no ``run_id`` / ``row_id`` header), truncated (a row with
    fewer or more fields than the header) or has rows without a ``run_id`` / ``row_id``."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            df = pd.read_parquet(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise ResultsFileError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    else:
        df = _read_csv(path)
    if missing := [c for c in KEY if c not in df.columns]:
        raise ResultsFileError(f"{path}: not a results file: no {' / '.join(missing)} column")
    if len(df):
        blank = df[list(KEY)].isna().any(axis=1) | (df[list(KEY)].astype(str).apply(lambda s: s.str.strip()) == ""
                                                     ).any(axis=1)
        if blank.any():
            raise ResultsFileError(f"{path}: {int(blank.sum())} row(s) without a run_id / row_id (first at data row "
                                   f"{int(blank.to_numpy().argmax()) + 1}): a damaged or hand-edited file")
    return to_frame(df.to_dict("records"))


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ResultsFileError(f"{path}: not a CSV file (not UTF-8 text)") from None
    if not text.strip():
        raise ResultsFileError(f"{path}: empty file, no header and no rows")
    if "\x00" in text:
        raise ResultsFileError(f"{path}: not a CSV file (binary content)")
    try:
        records = list(csv.reader(io.StringIO(text)))  # quoted fields may hold newlines (error messages)
    except csv.Error as e:
        raise ResultsFileError(f"{path}: not a CSV file ({e})") from None
    while records and not records[-1]:
        records.pop()  # blank trailing lines
    header = records[0]
    if missing := [c for c in KEY if c not in header]:
        raise ResultsFileError(f"{path}: not a results file: its header has no {' / '.join(missing)} column "
                               f"(it starts '{','.join(header)[:60]}')")
    for i, rec in enumerate(records[1:], start=2):
        if len(rec) != len(header):
            raise ResultsFileError(f"{path}: line {i} has {len(rec)} fields, the header {len(header)}: a truncated "
                                   "or damaged file (rerun, or restore it)")
    return pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])


def find_files(*paths: Union[str, Path]) -> tuple[list[Path], dict[str, list[Path]]]:
    """The results files under the given files or folders, and the files in those folders that were skipped, by
    reason. A file named explicitly is always returned (``read_file`` then says what is wrong with it); in a folder,
    CSVs without the schema's header (reports, published values, diagnostics) and empty CSVs are skipped."""
    files: list[Path] = []
    skipped: dict[str, list[Path]] = {}
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.suffix not in (".csv", ".parquet") or f.name.startswith(".") or not f.is_file():
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
    """One line: how many CSVs in the given folders were skipped, and why ('' when none)."""
    if not skipped:
        return ""
    n = sum(map(len, skipped.values()))
    return f"skipped {n} file{'s' if n != 1 else ''} that hold no results: " + "; ".join(
        f"{len(v)} {why}" for why, v in sorted(skipped.items(), key=lambda kv: -len(kv[1])))


def load(*paths: Union[str, Path]) -> pd.DataFrame:
    """Every row under the given files or folders (default: results/runs, the committed reference runs), as one
    DataFrame. Repeated runs are kept: the key is (run_id, row_id). A damaged file raises
    :class:`ResultsFileError` naming it; ``df.attrs["skipped"]`` maps each reason a file in a folder was skipped
    to those files' paths, as strings: pandas deep-copies ``attrs`` into every frame derived from this one, and
    copying ``Path`` objects took a third of the analysis notebook's time (see :func:`skipped_note`)."""
    if not paths:
        paths = (REFERENCE_RUNS,)
    files, found_skipped = find_files(*paths)
    skipped = {why: tuple(map(str, fs)) for why, fs in found_skipped.items()}
    frames = [read_file(f) for f in files]
    if not frames:
        df = to_frame([])
        df.attrs["skipped"] = skipped
        return df
    df = pd.concat(frames, ignore_index=True)
    dup = df.duplicated(list(KEY), keep=False)
    if dup.any():
        where = pd.Series([f for f, fr in zip(files, frames) for _ in range(len(fr))])[dup.to_numpy()]
        names = ", ".join(dict.fromkeys(map(str, where)))
        raise ResultsFileError(f"{int(dup.sum())} rows share a (run_id, row_id) key, in {names[:300]}: a results "
                               "file copied twice (keep one copy)")
    df.attrs["skipped"] = skipped
    return df


def _skip_reason(f: Path) -> str:
    """Why a file found in a folder is not a results file ('' when it is one: a CSV with the schema's header, or
    a Parquet file)."""
    if f.suffix == ".parquet":
        return ""
    try:
        with open(f, encoding="utf-8") as fh:
            head = fh.readline()
    except UnicodeDecodeError:
        return "not text"
    if not head.strip():
        return "empty"
    return "" if head.startswith(HEADER_START) else "without the results header (other tables)"
