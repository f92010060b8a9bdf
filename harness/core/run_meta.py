"""A run folder's metadata file, ``<run_dir>/meta.json``: what ran, where and how, derived from the rows alone.

    python -m harness.core.run_meta results/runs/<run> [results/runs/<other> ...]

For a run folder (every results file under it, as ``harness.core.results.load`` reads them): its run ids, row count and
status counts, first and last timestamp, the commits (``git_sha`` and dirty flag, with their row counts), the
environment (GPU model and count, driver, hostname, Slurm job, Python / torch / CUDA / NCCL / Triton and the other
version columns) and the resolved configuration (shapes, precisions, directions, backends, timing presets and
counts, compile modes, EP sizes, tokens, routing, seeds, ...). Each environment and configuration column is under
``constant`` (one value over every row) or ``varies`` (its distinct values, sorted; null where some rows record
none). ``"derived_from": "rows"`` says that nothing else was read: the file holds no more than the rows do, and
rewriting it from the same rows gives the same bytes. The results loader never reads it (it reads ``.csv`` and
``.parquet`` files only).

The runner calls :func:`refresh_meta` on rank 0 at the end of every run (beside the rows, atomically); this command
writes it for runs that have none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import pandas as pd

from harness.core import results

META_NAME = "meta.json"
ENV_COLUMNS = ("device", "gpu_name", "num_gpus", "driver_version", "hostname", "slurm_job_id", "cuda_alloc_conf",
               *(c for c in results.COLUMNS if c.endswith("_version") and c != "driver_version"))
CONFIG_COLUMNS = ("config_hash", "backend", "backend_position", "shape", "num_experts", "local_experts",
                  "experts_override", "published_local_experts", "hidden", "ffn", "topk", "shared_expert",
                  "swiglu_limit", "precision", "scaling", "direction", "compiled", "compile_mode", "comm_sms",
                  "tokens_per_gpu", "ep_size", "num_nodes", "world_size", "routing", "seed", "timing_preset",
                  "num_warmup", "num_iters", "l2_flush", "align", "atol", "rtol")


def _plain(v: Any) -> Any:
    """A JSON value: None for a missing one, Python int / float / bool / str otherwise."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    return v.item() if hasattr(v, "item") else v  # numpy scalars


def _sorted_values(values: Sequence[Any]) -> list[Any]:
    present = sorted({v for v in values if v is not None}, key=lambda v: (type(v).__name__, v))
    return present + ([None] if any(v is None for v in values) else [])


def _columns(df: pd.DataFrame, columns: Sequence[str]) -> dict[str, dict[str, Any]]:
    constant: dict[str, Any] = {}
    varies: dict[str, list[Any]] = {}
    for c in columns:
        if c not in df:
            continue
        values = [_plain(v) for v in df[c].astype(object)]
        distinct = _sorted_values(values)
        if len(distinct) == 1:
            constant[c] = distinct[0]
        else:
            varies[c] = distinct
    return {"constant": constant, "varies": varies}


def run_meta(df: pd.DataFrame, run_dir: Union[str, Path, None] = None) -> dict[str, Any]:
    """The metadata of one run folder's rows (``df``: ``harness.core.results.load(run_dir)``); ``run_dir`` names it."""
    if df.empty:
        raise ValueError("no rows: nothing to derive a run's metadata from")
    t = df["timestamp"].dropna().astype(str)
    commits = []
    order = df.assign(_t=df["timestamp"].astype(str)).sort_values("_t", kind="stable")
    for (sha, dirty), g in order.groupby([order["git_sha"].astype(object).fillna("unknown"),
                                          order["git_dirty"].astype(object)], dropna=False, sort=False):
        commits.append({"git_sha": str(sha), "git_dirty": _plain(dirty), "rows": int(len(g))})
    status = df["status"].astype(object).fillna("missing").value_counts()
    return {
        "derived_from": "rows",
        "note": "derived from this folder's results files alone (harness.core.run_meta); the rows are the record",
        "run_dir": None if run_dir is None else Path(run_dir).name,
        "run_ids": sorted(df["run_id"].dropna().astype(str).unique()),
        "rows": int(len(df)),
        "status_counts": {str(k): int(v) for k, v in sorted(status.items())},
        "first_timestamp": min(t) if len(t) else None,
        "last_timestamp": max(t) if len(t) else None,
        "commits": commits,
        "environment": _columns(df, ENV_COLUMNS),
        "config": _columns(df, CONFIG_COLUMNS),
    }


def meta_text(meta: dict[str, Any]) -> str:
    """The file's text: indented JSON, keys in :func:`run_meta`'s order, a final newline."""
    return json.dumps(meta, indent=2, ensure_ascii=False) + "\n"


def write_meta(run_dir: Union[str, Path], df: Optional[pd.DataFrame] = None) -> Path:
    """Write ``<run_dir>/meta.json`` atomically (temp file + rename) from the rows under ``run_dir`` (or ``df``,
    already loaded from there). Raises ``ValueError`` where the folder holds no rows (``ResultsFileError`` for a
    damaged file)."""
    run_dir = Path(run_dir)
    df = results.load(run_dir) if df is None else df
    text = meta_text(run_meta(df, run_dir))
    path = run_dir / META_NAME
    tmp = run_dir / f".{META_NAME}.{uuid.uuid4().hex[:6]}.tmp"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path


def refresh_meta(run_dir: Union[str, Path]) -> Optional[Path]:
    """:func:`write_meta` for the runner, at the end of a run on rank 0: never raises (a run's rows matter more than
    its summary); a failure is one line on stderr. Returns the file, or None."""
    try:
        return write_meta(run_dir)
    except (OSError, ValueError) as e:
        print(f"mokbench: {Path(run_dir) / META_NAME} not written: {e}", file=sys.stderr, flush=True)
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m harness.core.run_meta", description=__doc__.split("\n\n")[0],
        epilog="Writes <run_dir>/meta.json (derived from the folder's rows alone; the results loader never reads "
               "it). exit codes: 0 written; 2 a path that is not a folder of results rows, or a damaged results file "
               "(nothing is written then)")
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, e.g. results/runs/<run>")
    a = ap.parse_args(argv)
    loaded = []
    try:
        for d in map(Path, a.run_dirs):
            if not d.is_dir():
                raise ValueError(f"{d}: not a folder (give a run folder, e.g. results/runs/<run>)")
            df = results.load(d)
            if df.empty:
                raise ValueError(f"{d}: no results rows in it (give a run folder, e.g. results/runs/<run>)")
            loaded.append((d, df))
    except (ValueError, FileNotFoundError) as e:
        print(f"harness.core.run_meta: {e}", file=sys.stderr)
        return 2
    for d, df in loaded:
        print(f"wrote {write_meta(d, df)} ({len(df)} rows)")
    return 0


if __name__ == "__main__":
    from harness.core.own_packages import exit_on_clash

    exit_on_clash()
    sys.exit(main())
