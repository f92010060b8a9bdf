"""The short table ``python -m harness.run`` prints, and the line after it: where the rows went, how to report them."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

# `routing` is the workload (uniform, zipf(s=1), hot_experts(...), hot_rank(...)): with `shape`, `precision`,
# `ep_size` and `tokens_per_gpu` it says which sweep point a row belongs to.
SHORT = ["backend", "shape", "precision", "routing", "direction", "ep_size", "tokens_per_gpu", "status", "latency_ms",
         "tflops_per_gpu", "dispatch_gb_s", "combine_gb_s", "max_abs_err", "rel_err"]


def format_rows(df: pd.DataFrame) -> str:
    cols = [c for c in SHORT if c in df]
    t = df[cols].copy()
    for c in ("latency_ms", "tflops_per_gpu", "dispatch_gb_s", "combine_gb_s"):
        if c in t:
            t[c] = t[c].map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
    for c in ("max_abs_err", "rel_err"):
        if c in t:
            t[c] = t[c].map(lambda v: "" if pd.isna(v) else f"{v:.2e}")
    text = t.fillna("").to_string(index=False)
    errs = df[df["status"] != "ok"]
    for _, r in errs.iterrows():
        text += f"\n  {r['backend']}/{r['direction']}: {r['status']}: {r['error']}"
    return text


def print_rows(df: pd.DataFrame, title: Optional[str] = None) -> None:
    print((f"{title}\n" if title else "") + format_rows(df), flush=True)


def report_command(run_dirs: Iterable[str]) -> str:
    """The command that turns these run folders into a claims table and charts (``harness.report``), into
    ``reports/<run id>`` beside the run folders (their ``results_dir``); for the committed ``results/runs``, into the
    ignored ``results/local/reports`` (the committed report, results/REPORT.md, is made from every committed run at
    once)."""
    from harness.core.results import REFERENCE_RUNS

    dirs = sorted({str(d) for d in run_dirs})
    name = Path(dirs[0]).name if len(dirs) == 1 else "sweep"
    parents = {Path(d).parent for d in dirs}
    parent = parents.pop() if len(parents) == 1 else None
    if parent is None or parent.resolve() == REFERENCE_RUNS.resolve():
        parent = Path("results/local")
    return shlex.join(["python", "-m", "harness.report", *dirs, "--out", str(parent / "reports" / name)])


def summary_line(df: pd.DataFrame, results_dir: str) -> str:
    """One line: how many rows went where (the run folder, one file per job), and the command that reports them."""
    dirs = sorted({str(Path(results_dir) / r) for r in df["run_id"].dropna().unique()})
    counts = df["status"].value_counts()
    statuses = ", ".join(f"{n} {s}" for s, n in counts.items())
    return f"mokbench: {len(df)} rows ({statuses}) in {', '.join(dirs)}; report: {report_command(dirs)}"


def point_title() -> Optional[str]:
    """``sweep point #N: <overrides>`` inside a Hydra multirun job (None otherwise), printed above its table."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import filter_overrides
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return None
        overrides = " ".join(filter_overrides(list(hc.overrides.task))) or "(defaults)"
        return f"sweep point #{hc.job.num}: {overrides}"
    except (ValueError, ImportError, AttributeError):
        return None
