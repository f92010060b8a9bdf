"""Display names of runs: ``<what>_<hardware>_<yyyymmdd>`` (e.g. ``mok_hopper-fp8-fwd_h200x1_20261204``).

    python -m harness.core.run_names [--check]

A run's rows carry its ``run_id``, which is also its folder under results/runs and never changes (the rows are the
record). Reports, charts and the README's verdict block print a run's display name instead: the ``name`` that
``results/runs/names.csv`` (columns ``run_id,name``) gives its run id, else the run id itself. A run id of that form
(new runs get one by default, :func:`default_run_id`) is its own name and needs no row; the table names the others.

The table is derived from the committed rows alone: for each run id, what ran (the contender or the backends,
the precisions, the directions, the shape where there is one), on which hardware (GPU model and count from the
rows' ``gpu_name`` / ``num_gpus``, ``cpu`` for CPU rows) and on which UTC day (its first row). Two runs that would
get the same name are told apart by a suffix ``-2``, ``-3``, ... in the order they started. ``--check`` exits 1
where the committed table differs from the derived one (the test suite runs it).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import pandas as pd

from harness.core import results

CONTENDERS = ("mok_hopper", "mok")  # the systems this project measures; any other backend is an opponent
DIRECTION_ORDER = ("fwd", "bwd")
NAME_FORM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*_[a-z0-9]+(x\d+)?_\d{8}(-[A-Za-z0-9]+)*")
_GPU_MODEL = re.compile(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b")


def hardware(gpu_name: Any, num_gpus: Any) -> str:
    """``h200x1``, ``h100x2``, ``gb300x4``: the GPU model (lower case) and count; ``cpu`` for CPU rows."""
    name = "" if gpu_name is None or pd.isna(gpu_name) else str(gpu_name)
    if not name or name.lower() == "cpu":
        return "cpu"
    m = _GPU_MODEL.search(name)
    model = m.group(1).lower() if m else re.sub(r"[^a-z0-9]", "", name.lower().replace("nvidia", "")) or "gpu"
    n = 1 if num_gpus is None or pd.isna(num_gpus) else int(num_gpus)
    return f"{model}x{n}"


def what(backends: Iterable[str], precisions: Iterable[str], directions: Iterable[str],
         shapes: Iterable[str] = ()) -> str:
    """``mok_hopper-fp8-fwd``: the contenders measured (else the one backend, else ``baselines``), the precisions,
    the directions, and the shape where the run measured one (``@`` written ``-``)."""
    backends = sorted({str(b) for b in backends})
    contenders = [c for c in CONTENDERS if c in backends]
    head = "-".join(contenders) if contenders else (backends[0] if len(backends) == 1 else "baselines")
    dirs = sorted({str(d) for d in directions}, key=lambda d: (DIRECTION_ORDER + (d,)).index(d))
    shapes = sorted({str(s) for s in shapes})
    one_shape = [shapes[0].replace("@", "-")] if len(shapes) == 1 else []
    return "-".join([head, *sorted({str(p) for p in precisions}), *dirs, *one_shape])


def derived_name(rows: pd.DataFrame) -> str:
    """The display name of one run's rows, before any suffix that tells two runs apart."""
    def values(col: str) -> list[Any]:
        return list(rows[col].dropna().unique()) if col in rows else []

    gpus = pd.to_numeric(rows["num_gpus"], errors="coerce").max() if "num_gpus" in rows else None
    device = values("device")
    gpu = values("gpu_name")
    hw = "cpu" if device == ["cpu"] or not gpu else hardware(sorted(map(str, gpu))[0], gpus)
    day = pd.to_datetime(rows["timestamp"].dropna().astype(str), utc=True, format="ISO8601").min()
    return (f"{what(values('backend'), values('precision'), values('direction'), values('shape'))}_{hw}_"
            f"{day:%Y%m%d}")


def derive_names(df: pd.DataFrame) -> dict[str, str]:
    """Every run id of ``df`` (rows of many runs) not of the form (:data:`NAME_FORM`) and its display name:
    :func:`derived_name`, with ``-2``, ``-3``, ... where an earlier run, or a run id of the form, has that name."""
    df = df[df["run_id"].notna()]
    started = df.assign(_t=df["timestamp"].astype(str)).groupby(df["run_id"].astype(str))["_t"].min()
    taken = {r for r in started.index if NAME_FORM.fullmatch(r)}
    names: dict[str, str] = {}
    for run_id in sorted(started.index, key=lambda r: (started[r], r)):
        if run_id in taken:
            continue
        base = derived_name(df[df["run_id"].astype(str) == run_id])
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        names[run_id] = name
    return dict(sorted(names.items()))


def names_text(names: dict[str, str]) -> str:
    return "run_id,name\n" + "".join(f"{r},{n}\n" for r, n in sorted(names.items()))


@functools.lru_cache(maxsize=4)
def _read(path: str, mtime: float) -> dict[str, str]:
    with open(path, newline="") as f:
        return {row["run_id"]: row["name"] for row in csv.DictReader(f)}


def load_names(path: Union[str, Path, None] = None) -> dict[str, str]:
    """The table ``run_id -> name`` (``results/runs/names.csv`` by default; empty where there is none)."""
    p = Path(path) if path is not None else results.REFERENCE_RUNS / results.RUN_NAMES
    try:
        return dict(_read(str(p), p.stat().st_mtime))
    except FileNotFoundError:
        return {}


def display_name(run_id: Any) -> str:
    """The name a report prints for ``run_id``: its name in the table, else the run id itself."""
    if run_id is None or (not isinstance(run_id, str) and pd.isna(run_id)):
        return ""
    return load_names().get(str(run_id), str(run_id))


def run_id_of(name: str) -> str:
    """The run id (folder under results/runs) of a display name or run id: the inverse of :func:`display_name`."""
    by_name = {n: r for r, n in load_names().items()}
    return by_name.get(name, name)


def run_dir_of(name: str, root: Union[str, Path, None] = None) -> Path:
    """The committed run folder (under ``root``, default results/runs) whose rows carry the run of ``name`` (a display
    name or a run id): the folder whose ``meta.json`` lists that run id."""
    base = Path(root) if root is not None else results.REFERENCE_RUNS
    run_id = run_id_of(name)
    for meta in sorted(base.glob("*/meta.json")):
        if run_id in json.loads(meta.read_text()).get("run_ids", []):
            return meta.parent
    raise FileNotFoundError(f"no run folder under {base} holds run {name}")


def sweep_run_id(device: str, sweep_dir: str) -> str:
    """The run id the jobs of one sweep share where none is given: ``sweep_<hardware>_<yyyymmdd>-<hhmmss>``, the time
    of the sweep's folder (the same in every job of the sweep; a folder not named by a time gives its last 14 letters
    and digits). ``device``: the configuration's (``auto``: a GPU where ``nvidia-smi`` sees one)."""
    tail = "".join(ch for ch in sweep_dir if ch.isalnum())[-14:]
    stamp = f"{tail[:8]}-{tail[8:]}" if len(tail) == 14 and tail.isdigit() else tail
    names = _gpu_names("cuda") if device in ("cuda", "auto") else []
    # a GPU sweep planned where no GPU is seen (a Slurm login node): its jobs take the planned id, "gpu"
    hw = hardware(names[0], len(names)) if names else "gpu" if device == "cuda" else "cpu"
    return f"sweep_{hw}_{stamp}"


def _gpu_names(device: str) -> list[str]:
    """Every GPU's name from ``nvidia-smi`` (no CUDA context in this process); none without one."""
    if device != "cuda":
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return [n.strip() for n in out.stdout.strip().splitlines() if n.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        return []


def gpu_model(device: str) -> Optional[str]:
    """The first GPU's name from ``nvidia-smi`` (no CUDA context in this process: the ranks it spawns own the GPUs);
    None without one."""
    names = _gpu_names(device)
    return names[0] if names else None


def default_run_id(c: dict, num_gpus: int, gpu_name: Optional[str], now: Optional[pd.Timestamp] = None) -> str:
    """A new run's id where none is given: ``<what>_<hardware>_<yyyymmdd>-<hhmmss>-<4 hex>`` (the time of day and
    4 random hex digits keep two runs of one day apart)."""
    now = pd.Timestamp.now(tz="UTC") if now is None else now
    hw = "cpu" if c.get("device") == "cpu" else hardware(gpu_name or "gpu", num_gpus)
    w = what(c.get("backends") or [], [c["precision"]["name"]], c.get("directions") or [],
             [c["shape"]["name"]] if c.get("shape", {}).get("name") else [])
    return f"{w}_{hw}_{now:%Y%m%d}-{now:%H%M%S}-{os.urandom(2).hex()}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.core.run_names", description=__doc__.split("\n\n")[0],
                                 epilog="exit codes: 0 written (or, with --check, up to date); 1 --check found the "
                                        "table out of date")
    ap.add_argument("--runs", default=str(results.REFERENCE_RUNS), help="the folder of run folders (default: "
                                                                        "results/runs)")
    ap.add_argument("--check", action="store_true", help="compare with the committed table; write nothing")
    a = ap.parse_args(argv)
    runs = Path(a.runs)
    text = names_text(derive_names(results.load(runs)))
    path = runs / results.RUN_NAMES
    if a.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run `python -m harness.core.run_names`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
