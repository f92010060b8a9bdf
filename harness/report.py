"""Claims table and report: does the published claim reproduce on these results?

    python -m harness.report                          # the committed runs (results/runs) -> results/reports/
    python -m harness.report results/local            # your own runs -> results/local/reports/ (ignored by git)
    python -m harness.report results/runs --pool      # the median over every run, labelled POOLED
    python -m harness.report results/runs/2026* --out /tmp/rep --calibration calib.csv
    python -m harness.report --include-published --no-measured   # the published figure alone, as a check

For each panel (precision x direction) and shape, within one run (by default: ``--scope``), one environment (GPU, EP
size, tokens per GPU, nodes) and routing: each system's TFLOP/s per GPU, the fastest baseline, and each fused
kernel's speedup over it. The published figure's values (``results/published/``, read off the chart, GB300 NVL72, EP=64, 2048 tokens/GPU) sit
beside them; a measured / published ratio of TFLOP/s is given only where the environment matches the published
one. Rows that are not ok keep their status in the table and are listed with their error.

Python API: :func:`load_published`, :func:`load_claims`, :func:`aggregate`, :func:`claims_table`,
:func:`headline_table`, :func:`not_ok_rows`, :func:`format_markdown`, :func:`write_report`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import pandas as pd

from harness import results
from harness.backends import REGISTRY, names_with_role, role

REPO_ROOT = Path(__file__).resolve().parent.parent
PUBLISHED_DIR = REPO_ROOT / "results" / "published"
PUBLISHED_FIGURE = PUBLISHED_DIR / "mok_gb300_figure.csv"
PUBLISHED_CLAIMS = PUBLISHED_DIR / "mok_gb300_claims.csv"
DEFAULT_OUT = REPO_ROOT / "results" / "reports"

PUBLISHED_RUN_ID = "published:mok_gb300_figure"
PUBLISHED_ENV = {"gpu_name": "GB300 (published)", "ep_size": 64, "tokens_per_gpu": 2048, "routing": "uniform"}
READ_ERROR_TFLOPS = 3.0  # reading precision of the published chart

# Backend names, labels and roles come from the one registry (harness.backends.REGISTRY)
FUSED = names_with_role("contender")
ANCHORS = names_with_role("anchor")
# mok_hopper rows measured on the CPU run its pure-torch twin (kernels/mok_hopper/twin.py), not the Triton kernel:
# the report renames their backend so that no table or chart draws them as the kernel
CPU_TWIN = {"mok_hopper": "mok_hopper_cpu_twin"}
NOT_CONTENDERS = names_with_role("reference")
SYSTEM_ORDER = tuple(k for k in REGISTRY if k not in NOT_CONTENDERS)
SYSTEM_LABELS = {k: s.label for k, s in REGISTRY.items()}
SHAPE_ORDER = ("kimi_k2_7", "glm_5_2", "qwen3_5_397b", "deepseek_v4_pro")
SHAPE_LABELS = {"kimi_k2_7": "Kimi K2.7", "glm_5_2": "GLM 5.2", "qwen3_5_397b": "Qwen3.5-397B",
                "deepseek_v4_pro": "DeepSeek V4 Pro"}
PRECISION_ORDER = ("mxfp8", "fp8", "bf16")
PRECISION_LABELS = {"bf16": "BF16", "fp8": "FP8", "mxfp8": "MXFP8"}
DIRECTION_ORDER = ("fwd", "bwd", "fwd_bwd")
DIRECTION_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "fwd+bwd"}

# Speedups compare systems only within one run and one environment, and only on the same routing. ``run_started``
# (the run's first timestamp) orders the runs, newest first; with ``scope="pooled"`` (:func:`prepare`) every
# measured run becomes one labelled pseudo-run.
RUN_KEYS = ("run_started", "run_id")
ENV_KEYS = (*RUN_KEYS, "gpu_name", "ep_size", "tokens_per_gpu", "num_nodes")
SCOPES = ("run", "latest", "pooled")
CELL_KEYS = (*ENV_KEYS, "routing", "precision", "direction", "shape")


# ---------------------------------------------------------------------------------------------------------------
# names and order


def is_fused(backend: str) -> bool:
    """A contender: a fused kernel whose speedups the report computes."""
    return role(backend) == "contender"


def is_baseline(backend: str) -> bool:
    """A baseline (published, or HybridEP+PyTorch, or an out-of-tree backend): the speedups and the published-claim
    verdicts are computed over the fastest of these."""
    return role(backend) in ("published baseline", "baseline")


def is_anchor(backend: str) -> bool:
    """An anchor (Liger, SonicMoE): shown beside the baselines, never counted as one."""
    return role(backend) == "anchor"


def system_label(backend: str) -> str:
    return SYSTEM_LABELS.get(backend, backend)


def compile_caption(df: pd.DataFrame) -> str:
    """How the baselines' PyTorch compute ran in these rows (``ok`` rows that record it; modes in order of first
    appearance), e.g. ``torch.compile: NCCL+PyTorch max-autotune; DeepEP+TE eager``. A system with both eager and
    compiled rows lists both: the aggregate's medians mix them."""
    if "compiled" not in df or "compile_mode" not in df:
        return ""
    others = df["backend"].map(lambda b: is_baseline(b) or is_anchor(b))
    d = df[(df["status"] == "ok") & others & df["compiled"].notna()]  # NA: not recorded
    parts = []
    for b in [x for x in SYSTEM_ORDER if x in set(d["backend"])] + sorted(set(d["backend"]) - set(SYSTEM_ORDER)):
        rows = d[d["backend"] == b]
        modes = [str(m) if bool(c) and not _isna(m) and str(m) else "eager"
                 for c, m in zip(rows["compiled"], rows["compile_mode"])]
        parts.append(f"{system_label(b)} {' + '.join(dict.fromkeys(modes))}")
    return "torch.compile: " + "; ".join(parts) if parts else ""


def shape_label(shape: str) -> str:
    """``kimi_k2_7`` -> ``Kimi K2.7``; an experts-per-GPU override keeps its suffix (``Kimi K2.7 @6epg``)."""
    base, _, suffix = str(shape).partition("@")
    return SHAPE_LABELS.get(base, base) + (f" @{suffix}" if suffix else "")


def panel_label(precision: str, direction: str) -> str:
    return f"{PRECISION_LABELS.get(precision, precision)} {DIRECTION_LABELS.get(direction, direction)}"


def env_label(env: dict[str, Any], *, run: bool = True) -> str:
    """``run · GPU · EP n · t tokens/GPU · n node(s)[ · routing r]``; ``run=False`` leaves the run out."""
    gpu = env.get("gpu_name")
    parts = [str(env["run_id"])] if run and not _isna(env.get("run_id")) else []
    parts += ["unknown GPU" if _isna(gpu) else str(gpu), f"EP {_int(env.get('ep_size'))}",
             f"{_int(env.get('tokens_per_gpu'))} tokens/GPU"]
    if not _isna(env.get("num_nodes")):
        parts.append(f"{_int(env['num_nodes'])} node{'s' if _int(env['num_nodes']) != '1' else ''}")
    if not _isna(env.get("routing")) and env.get("routing") != "uniform":
        parts.append(f"routing {env['routing']}")
    return " · ".join(parts)


def _order(values: Iterable[Any], order: Sequence[str]) -> list[Any]:
    vals = list(dict.fromkeys(v for v in values if not _isna(v)))
    rank = {v: i for i, v in enumerate(order)}
    return sorted(vals, key=lambda v: (rank.get(str(v).partition("@")[0], len(rank)), str(v)))


def systems_in(df: pd.DataFrame) -> list[str]:
    """Contending systems present, baselines first, fused kernels last (the published order)."""
    present = [b for b in df["backend"].dropna().unique() if b not in NOT_CONTENDERS]
    return _order(present, SYSTEM_ORDER)


def _isna(v: Any) -> bool:
    try:
        return v is None or bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def _int(v: Any) -> str:
    return "?" if _isna(v) else str(int(v))


# ---------------------------------------------------------------------------------------------------------------
# published data: its own files, loaded with a label that never lets it pass for a measurement


def load_published(path: Union[str, Path, None] = None) -> pd.DataFrame:
    """The published figure as rows of the results schema, clearly labelled as published.

    ``gpu_name`` is ``GB300 (published)``, ``run_id`` is ``published:mok_gb300_figure``, ``timing_preset`` is
    ``published-figure`` and the extra column ``source`` says where each value was read. FLOPs and latency are
    implied from the published formula. The file keeps its own header, so ``harness.results.load`` never picks it
    up as a measurement.
    """
    path = Path(path) if path else PUBLISHED_FIGURE
    raw = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    need = {"source", "gpu_name", "ep_size", "tokens_per_gpu", "precision", "direction", "shape", "backend",
            "tflops_per_gpu"}
    if missing := need - set(raw.columns):
        raise ValueError(f"{path}: not a published-values file, missing columns {', '.join(sorted(missing))}")
    if raw.columns[0] == "run_id":
        raise ValueError(f"{path}: looks like a measured results file, not published values")
    rows = []
    for i, r in enumerate(raw.to_dict("records")):
        row = dict(r)
        row.update(run_id=PUBLISHED_RUN_ID, row_id=f"pub{i:04d}", status="ok", timing_preset="published-figure",
                   notes=r["source"])
        rows.append(row)
    df = results.to_frame(rows)
    from harness.roofline import layer_flops

    df["flops_per_gpu"] = [layer_flops(r) for r in df.to_dict("records")]
    df["flops_per_gpu"] = pd.to_numeric(df["flops_per_gpu"], errors="coerce").astype("float64")
    df["latency_ms"] = df["flops_per_gpu"] / (df["tflops_per_gpu"] * 1e12) * 1e3
    return df


def load_claims(path: Union[str, Path, None] = None) -> pd.DataFrame:
    """The README's headline maxima: one row per panel (precision, direction, claimed_max_speedup, source)."""
    df = pd.read_csv(Path(path) if path else PUBLISHED_CLAIMS, dtype={"precision": "string", "direction": "string",
                                                                    "source": "string"})
    df["claimed_max_speedup"] = pd.to_numeric(df["claimed_max_speedup"], errors="coerce").astype("float64")
    return df


def is_published(df: pd.DataFrame) -> pd.Series:
    """Rows that come from :func:`load_published` (never measurements)."""
    return df["run_id"].astype("string").fillna("").str.startswith("published:")


def same_gpu(measured: Any, published: Any) -> bool:
    """Whether a measured ``gpu_name`` names the published GPU model (``NVIDIA GB300`` vs ``GB300 (published)``)."""
    if _isna(measured) or _isna(published):
        return False
    norm = [re.sub(r"\(.*?\)|nvidia|\s+", " ", str(s).lower()).split() for s in (measured, published)]
    return bool(norm[1]) and all(tok in norm[0] for tok in norm[1])


def env_matches_published(env: dict[str, Any]) -> bool:
    """Same GPU model, EP size, tokens per GPU and routing as the published run."""
    return (same_gpu(env.get("gpu_name"), PUBLISHED_ENV["gpu_name"])
            and not _isna(env.get("ep_size")) and int(env["ep_size"]) == PUBLISHED_ENV["ep_size"]
            and not _isna(env.get("tokens_per_gpu")) and int(env["tokens_per_gpu"]) == PUBLISHED_ENV["tokens_per_gpu"]
            and str(env.get("routing", "uniform")) == PUBLISHED_ENV["routing"])


# ---------------------------------------------------------------------------------------------------------------
# scope: which rows are compared with which


def is_cpu_twin(df: pd.DataFrame) -> pd.Series:
    """mok_hopper rows timed on the CPU: the pure-torch twin ran, not the Triton kernel."""
    dev = df["device"].astype("string").fillna("").str.lower() if "device" in df else pd.Series("", index=df.index)
    notes = df["notes"].astype("string").fillna("") if "notes" in df else pd.Series("", index=df.index)
    return (df["backend"].isin(list(CPU_TWIN)) & ((dev == "cpu") | notes.str.contains("CPU twin"))).fillna(False)


def with_runs(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with the ``run_started`` column (each run's first timestamp) that orders runs; unchanged if present."""
    if "run_started" in df.columns:
        return df
    d = df.copy()
    t = d["timestamp"].astype("string") if "timestamp" in d else pd.Series(pd.NA, index=d.index, dtype="string")
    d["run_started"] = t.groupby(d["run_id"].astype("string").fillna(""), dropna=False).transform("min")
    return d


def prepare(df: pd.DataFrame, scope: str = "run") -> pd.DataFrame:
    """The rows a report compares, for a scope:

    * ``run`` (default): every run on its own: a speedup compares systems measured in the same run;
    * ``latest``: for each environment (GPU, EP size, tokens per GPU, nodes, routing), only its most recent run;
    * ``pooled``: every measured run as one pseudo-run labelled ``POOLED over N runs``: the median over runs of
      different code, leases and baseline builds, an explicit choice (``--pool``).

    CPU-twin rows of mok_hopper are renamed (:data:`CPU_TWIN`); ``source_run_id`` keeps each row's own run."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)} (got {scope!r})")
    d = df.copy()
    twin = is_cpu_twin(d)
    if twin.any():
        d["backend"] = d["backend"].astype(object).where(~twin, d["backend"].map(CPU_TWIN)).astype("string")
    d["source_run_id"] = d["run_id"]
    d = with_runs(d.drop(columns=["run_started"], errors="ignore"))
    measured = ~is_published(d)
    if scope == "latest" and measured.any():
        keys = [k for k in ENV_KEYS if k not in RUN_KEYS] + ["routing"]
        m = d[measured]
        latest = m.groupby(keys, dropna=False)["run_started"].transform("max")
        keep = pd.Series(True, index=d.index)
        keep[m.index] = (m["run_started"] == latest).fillna(True)
        d = d[keep]
    elif scope == "pooled" and measured.any():
        m = d[measured]
        n = m["run_id"].nunique()
        d.loc[measured, "run_id"] = f"POOLED over {n} run{'s' if n != 1 else ''}"
        d.loc[measured, "run_started"] = m["run_started"].max()
    return d


# ---------------------------------------------------------------------------------------------------------------
# tables


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per cell and backend: the median TFLOP/s and latency over its ok rows (repeated runs), and a status:
    ``ok`` when any row is ok and timed, else the status of the most recent row, with its error."""
    cols = [*CELL_KEYS, "backend"]
    df = with_runs(df)
    d = df[[*cols, "tflops_per_gpu", "latency_ms", "latency_p20_ms", "latency_p80_ms", "status", "error",
            "timestamp"]].copy()
    d["_g"] = d.groupby(cols, dropna=False, sort=False).ngroup()
    d["_ok"] = (d["status"] == "ok").fillna(False) & d["tflops_per_gpu"].notna()
    last = d.sort_values(["_g", "timestamp"], na_position="first", kind="stable").drop_duplicates("_g", keep="last")
    out = last.set_index("_g")[cols].copy()
    # the TFLOP/s at each row's p80 and p20 latency (no spread recorded: its median)
    d["_lo"] = (d["tflops_per_gpu"] * d["latency_ms"] / d["latency_p80_ms"]).fillna(d["tflops_per_gpu"])
    d["_hi"] = (d["tflops_per_gpu"] * d["latency_ms"] / d["latency_p20_ms"]).fillna(d["tflops_per_gpu"])
    ok = d[d["_ok"]].groupby("_g").agg(tflops_per_gpu=("tflops_per_gpu", "median"),
                                       tflops_p80=("_lo", "min"), tflops_p20=("_hi", "max"),
                                       latency_ms=("latency_ms", "median"), num_ok=("_ok", "size"))
    out = out.join(ok)
    out["num_ok"] = out["num_ok"].fillna(0).astype(int)
    has_ok = out["num_ok"] > 0
    lst = last.set_index("_g")
    out["status"] = lst["status"].astype(object).where(~has_ok, "ok").fillna("missing").astype(str)
    out["error"] = lst["error"].astype(object).where(~has_ok, "").fillna("").astype(str)
    out["num_rows"] = d.groupby("_g").size()
    out = out.sort_index().reset_index(drop=True)
    for c in ("tflops_per_gpu", "tflops_p80", "tflops_p20", "latency_ms"):
        out[c] = out[c].astype("float64")
    # the spread never excludes the median (a single sample has p20 = p80 = median, up to rounding)
    out["tflops_p80"] = out[["tflops_p80", "tflops_per_gpu"]].min(axis=1, skipna=False)
    out["tflops_p20"] = out[["tflops_p20", "tflops_per_gpu"]].max(axis=1, skipna=False)
    return out[[*cols, "tflops_per_gpu", "tflops_p80", "tflops_p20", "latency_ms", "status", "error", "num_rows",
                "num_ok"]]


def environments(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The distinct (run, environment, routing) combinations in ``df``: runs newest first, then a stable order."""
    keys = [*ENV_KEYS, "routing"]
    envs = with_runs(df)[keys].drop_duplicates().to_dict("records")
    envs = sorted(envs, key=lambda e: tuple("" if _isna(e[k]) else f"{e[k]!s:>12}" for k in keys[1:]))
    return sorted(envs, key=lambda e: "" if _isna(e["run_started"]) else str(e["run_started"]), reverse=True)


def select_env(df: pd.DataFrame, env: dict[str, Any]) -> pd.DataFrame:
    """The rows of ``df`` in one environment (NA-aware)."""
    if "run_started" in env:
        df = with_runs(df)
    mask = pd.Series(True, index=df.index)
    for k, v in env.items():
        mask &= df[k].isna() if _isna(v) else (df[k] == v).fillna(False)
    return df[mask]


def claims_table(df: pd.DataFrame, published: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """The wide claims table: one row per (environment, routing, precision, direction, shape).

    Columns: the cell keys; ``tflops_<system>`` and ``status_<system>`` per contending system (status ``missing``
    where the system has no row in that cell); ``best_baseline`` / ``best_baseline_tflops`` (fastest ok baseline);
    ``baselines_ok`` ("3/4": ok baselines / baselines seen in this environment); ``best_anchor`` /
    ``best_anchor_tflops`` (fastest ok anchor); ``best_overall`` / ``best_overall_tflops`` (fastest ok system that
    is not a contender: baselines and anchors); ``speedup_<fused>`` per fused kernel over the fastest baseline (what
    the published-claim verdicts use) and ``speedup_all_<fused>`` over the fastest of all; then the published
    side: ``published_best_baseline``, ``published_speedup`` (MoK / best, from the
    figure's readings), ``env_matches_published`` and, only where it does, ``ratio_<system>`` = measured /
    published TFLOP/s.
    """
    agg = aggregate(with_runs(df)[~df["backend"].isin(NOT_CONTENDERS)])
    systems = systems_in(agg)
    fused = [s for s in systems if is_fused(s)]
    pub = _published_cells(published) if published is not None else {}
    pub_systems = _order({b for cell in pub.values() for b in cell}, SYSTEM_ORDER)
    base_seen: dict[tuple, set] = {}
    for key, g in agg.groupby([*ENV_KEYS, "routing"], dropna=False, sort=False):
        base_seen[_norm(key)] = {b for b in g["backend"] if is_baseline(b)}
    rows = []
    for key, g in agg.groupby(list(CELL_KEYS), dropna=False, sort=False):
        rec: dict[str, Any] = dict(zip(CELL_KEYS, key))
        rec["data"] = "published" if str(rec["gpu_name"]) == PUBLISHED_ENV["gpu_name"] else "measured"
        by = {r["backend"]: r for r in g.to_dict("records")}
        for s in systems:
            r = by.get(s)
            rec[f"tflops_{s}"] = r["tflops_per_gpu"] if r else math.nan
            rec[f"status_{s}"] = r["status"] if r else "missing"
        base = {s: r["tflops_per_gpu"] for s, r in by.items()
                if is_baseline(s) and r["status"] == "ok" and not _isna(r["tflops_per_gpu"])}
        best = max(base, key=base.__getitem__) if base else None
        rec["best_baseline"] = best or ""
        rec["best_baseline_tflops"] = base[best] if best else math.nan
        seen = base_seen[_norm(tuple(rec[k] for k in (*ENV_KEYS, "routing")))]
        rec["baselines_ok"] = f"{len(base)}/{len(seen)}"
        anchors = {s: r["tflops_per_gpu"] for s, r in by.items()
                   if is_anchor(s) and r["status"] == "ok" and not _isna(r["tflops_per_gpu"])}
        best_anchor = max(anchors, key=anchors.__getitem__) if anchors else None
        rec["best_anchor"] = best_anchor or ""
        rec["best_anchor_tflops"] = anchors[best_anchor] if best_anchor else math.nan
        every = {**base, **anchors}
        best_all = max(every, key=every.__getitem__) if every else None
        rec["best_overall"] = best_all or ""
        rec["best_overall_tflops"] = every[best_all] if best_all else math.nan
        for f in fused:
            r = by.get(f)
            ok = r is not None and r["status"] == "ok" and not _isna(r["tflops_per_gpu"])
            rec[f"speedup_{f}"] = r["tflops_per_gpu"] / base[best] if ok and best else math.nan
            rec[f"speedup_all_{f}"] = r["tflops_per_gpu"] / every[best_all] if ok and best_all else math.nan
        p = pub.get((rec["precision"], rec["direction"], str(rec["shape"])), {})
        pbase = {s: v for s, v in p.items() if is_baseline(s)}
        pbest = max(pbase, key=pbase.__getitem__) if pbase else None
        rec["published_best_baseline"] = pbest or ""
        rec["published_best_baseline_tflops"] = pbase[pbest] if pbest else math.nan
        rec["published_mok_tflops"] = p.get("mok", math.nan)
        rec["published_speedup"] = p["mok"] / pbase[pbest] if pbest and "mok" in p else math.nan
        match = bool(p) and env_matches_published(rec)
        rec["env_matches_published"] = match
        for s in pub_systems:  # (for the published values themselves this is a consistency check: 1.00)
            mine = rec.get(f"tflops_{s}", math.nan)
            rec[f"ratio_{s}"] = mine / p[s] if match and s in p and not _isna(mine) else math.nan
        rows.append(rec)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    return _int_columns(_sort_cells(table).reset_index(drop=True))


def _int_columns(table: pd.DataFrame) -> pd.DataFrame:
    for c in ("ep_size", "tokens_per_gpu", "num_nodes"):
        if c in table:
            table[c] = pd.to_numeric(table[c], errors="coerce").round().astype("Int64")
    return table


def _published_cells(published: pd.DataFrame) -> dict[tuple[str, str, str], dict[str, float]]:
    cells: dict[tuple[str, str, str], dict[str, float]] = {}
    ok = published[(published["status"] == "ok") & published["tflops_per_gpu"].notna()]
    for r in ok.to_dict("records"):
        cells.setdefault((r["precision"], r["direction"], str(r["shape"])), {})[r["backend"]] = r["tflops_per_gpu"]
    return cells


def _norm(key: Any) -> tuple:
    key = key if isinstance(key, tuple) else (key,)
    return tuple(None if _isna(k) else (int(k) if isinstance(k, float) and k.is_integer() else k) for k in key)


def _sort_cells(table: pd.DataFrame) -> pd.DataFrame:
    def pos(v: Any, order: Sequence[str]) -> tuple[int, str]:
        base = str(v).partition("@")[0]
        return (order.index(base) if base in order else len(order), str(v))

    def key(i: Any) -> tuple:
        r = table.loc[i]
        env = tuple("" if _isna(r[k]) else f"{r[k]!s:>12}" for k in ENV_KEYS[1:])
        return (env, (r["routing"] != "uniform", str(r["routing"])), pos(r["precision"], PRECISION_ORDER),
                pos(r["direction"], DIRECTION_ORDER), pos(r["shape"], SHAPE_ORDER))

    order = sorted(table.index, key=key)
    order = sorted(order, key=lambda i: "" if _isna(table.loc[i, "run_started"]) else str(table.loc[i, "run_started"]),
                   reverse=True)  # stable: runs newest first, the rest in order
    return table.loc[order]


def fused_columns(claims: pd.DataFrame) -> list[str]:
    """The fused kernels of a claims table (its ``speedup_<fused>`` columns)."""
    return [c.removeprefix("speedup_") for c in claims.columns
            if c.startswith("speedup_") and not c.startswith("speedup_all_")]


def headline_table(claims: pd.DataFrame, readme_claims: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Per environment, panel and fused kernel: the maximum measured speedup over the fastest baseline and its
    shape, beside the published figure's maximum and the README claim. ``measured_over_claim`` is set only where
    the environment matches the published one (otherwise the numbers are side by side, not compared). Where the
    claims table has anchors: ``min_speedup_all`` / ``max_speedup_all`` over the fastest of all (baselines and
    anchors) and ``min_all_at_shape`` / ``min_all_over`` where the smallest one is (the verdicts never use them)."""
    if claims.empty:
        return pd.DataFrame()
    fused = fused_columns(claims)
    claimed = {}
    if readme_claims is not None:
        claimed = {(r["precision"], r["direction"]): r["claimed_max_speedup"] for r in readme_claims.to_dict("records")}
    rows = []
    panel_keys = [*ENV_KEYS, "routing", "precision", "direction"]
    for key, g in claims.groupby(panel_keys, dropna=False, sort=False):
        rec0 = dict(zip(panel_keys, key))
        pub = g[g["published_speedup"].notna()]
        pub_max = pub.loc[pub["published_speedup"].idxmax()] if len(pub) else None
        for f in fused:
            s = g[f"speedup_{f}"]
            if s.notna().sum() == 0 and g[f"status_{f}"].eq("missing").all():
                continue
            rec = dict(rec0, fused=f)
            if s.notna().any():
                at = g.loc[s.idxmax()]
                rec.update(max_speedup=float(s.max()), at_shape=at["shape"], best_baseline=at["best_baseline"])
            else:
                rec.update(max_speedup=math.nan, at_shape="", best_baseline="")
            rec["cells_with_speedup"] = f"{int(s.notna().sum())}/{len(g)}"
            sa = g[f"speedup_all_{f}"] if f"speedup_all_{f}" in g else pd.Series(dtype="float64")
            if sa.notna().any():
                lo = g.loc[sa.idxmin()]
                rec.update(min_speedup_all=float(sa.min()), max_speedup_all=float(sa.max()),
                           min_all_at_shape=lo["shape"], min_all_over=lo["best_overall"])
            else:
                rec.update(min_speedup_all=math.nan, max_speedup_all=math.nan, min_all_at_shape="", min_all_over="")
            rec["published_max_speedup"] = float(pub_max["published_speedup"]) if pub_max is not None else math.nan
            rec["published_at_shape"] = pub_max["shape"] if pub_max is not None else ""
            rec["claimed_max_speedup"] = claimed.get((rec["precision"], rec["direction"]), math.nan)
            comparable = bool(g["env_matches_published"].any()) and f == "mok"
            rec["data"] = g["data"].iloc[0]
            rec["env_matches_published"] = comparable
            rec["measured_over_claim"] = (rec["max_speedup"] / rec["claimed_max_speedup"]
                                          if comparable and not _isna(rec["claimed_max_speedup"]) else math.nan)
            rec["verdict"] = _verdict(rec, comparable)
            rows.append(rec)
    return _int_columns(pd.DataFrame(rows))


def _verdict(rec: dict[str, Any], comparable: bool) -> str:
    if _isna(rec["max_speedup"]):
        return "no speedup measured"
    if _isna(rec["claimed_max_speedup"]):
        return "no published claim for this panel"
    if not comparable:
        return "different environment or system: side by side only"
    if rec["data"] == "published":
        return "published values (consistency check, not a measurement)"
    # reading precision: +-3 TFLOP/s on each bar of a ~200-1600 TFLOP/s chart is about 2% on the ratio
    return "reproduces" if rec["max_speedup"] >= rec["claimed_max_speedup"] * 0.97 else "below the claim"


def not_ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Every row whose status is not ok, with its error (first line, 160 characters)."""
    bad = with_runs(df)[df["status"].fillna("missing") != "ok"]
    cols = [*CELL_KEYS, "backend", "status", "error", "row_id"]
    out = bad[cols].copy()
    if "source_run_id" in bad:  # pooled: the row's own run
        out["run_id"] = bad["source_run_id"]
    out["error"] = out["error"].fillna("").map(lambda e: str(e).strip().splitlines()[0][:160] if str(e).strip()
                                                else "")
    return out.reset_index(drop=True)


def published_counts() -> tuple[int, int]:
    """(warmup, timed) iterations of the published timing preset (configs/timing/published.yaml)."""
    from harness.config import load_group_option

    t = load_group_option("timing", "published")
    return int(t.num_warmup), int(t.num_iters)


def timing_counts(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows timed with other iteration counts than the published preset's: one line per run and
    environment and (num_warmup, num_iters), with the systems and how many rows; newest run first."""
    cols = [*ENV_KEYS, "num_warmup", "num_iters", "backends", "rows"]
    warm, iters = published_counts()
    d = with_runs(df)
    ok = d[(d["status"] == "ok") & d["num_iters"].notna()]
    other = ok[(ok["num_warmup"] != warm) | (ok["num_iters"] != iters)]
    if other.empty:
        return pd.DataFrame(columns=cols)
    other = other.sort_values("run_started", ascending=False, kind="stable")
    keys = [*ENV_KEYS, "num_warmup", "num_iters"]
    out = other.groupby(keys, dropna=False, sort=False).agg(
        backends=("backend", lambda b: ", ".join(_order(b, SYSTEM_ORDER))), rows=("status", "size")).reset_index()
    return _int_columns(out[cols])


CLOCK_COLUMNS = ("sm_clock_mhz", "sm_clock_min_mhz", "power_w", "power_capped_fraction")


def clock_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The GPU clock each ok row was timed at (rows that recorded one: GPU runs since the clock columns exist), and
    ``energy_mj``: one GPU's energy per layer call, its mean board power times the latency (W x ms = mJ); at a
    power limit this, not the latency, is what a faster layer spends."""
    cols = [*CELL_KEYS, "backend", *CLOCK_COLUMNS, "latency_ms", "energy_mj"]
    if "sm_clock_mhz" not in df.columns:
        return pd.DataFrame(columns=cols)
    ok = with_runs(df)[(df["status"] == "ok") & df["sm_clock_mhz"].notna()].copy()
    if "source_run_id" in ok:  # pooled: the row's own run
        ok["run_id"] = ok["source_run_id"]
    if "power_w" in ok.columns and "latency_ms" in ok.columns:
        ok["energy_mj"] = ok["power_w"] * ok["latency_ms"]
    return ok[[c for c in cols if c in ok.columns]].reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------------
# Markdown


def _fmt_tflops(v: Any) -> str:
    return "" if _isna(v) else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}")


def _fmt_x(v: Any) -> str:
    return "" if _isna(v) else f"{v:.2f}×"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[str(c).replace("|", "\\|") for c in r] for r in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


SCOPE_TEXT = {
    "run": "Scope: each run on its own. A speedup compares systems measured in the same run (same lease, code and "
           "baseline builds); runs are listed newest first. `--pool` pools runs, `--scope latest` keeps each "
           "environment's latest run.",
    "latest": "Scope: for each environment, its latest run only. A speedup compares systems measured in that run.",
    "pooled": "**Scope: POOLED across runs** (`--pool`): each cell is the median over every run that measured it: "
              "kernel versions, leases, compiled and eager baselines mixed. Not a comparison made in one run.",
}


def format_markdown(claims: pd.DataFrame, headline: pd.DataFrame, not_ok: pd.DataFrame, *,
                    sources: str = "", charts: Sequence[Path] = (), clocks: Optional[pd.DataFrame] = None,
                    scope: str = "run", out_dir: Optional[Path] = None,
                    timing: Optional[pd.DataFrame] = None) -> str:
    """The report as Markdown: headline maxima, one claims table per run and environment, rows not ok, iteration
    counts other than the published ones (``timing``: :func:`timing_counts`, where any), the GPU clocks the rows
    were timed at (``clocks``: :func:`clock_rows`, where any), chart links (relative to ``out_dir``)."""
    out = ["# MoE layer throughput: claims table", ""]
    if sources:
        out += [sources, ""]
    out += [SCOPE_TEXT[scope], ""]
    out += [
        "TFLOP/s per GPU by the published formula 6·(T + T·topk)·H·I (×2 backward, ×3 fwd+bwd). Speedup = fused "
        "kernel / fastest ok baseline, computed only within one run, one environment (GPU, EP size, tokens per "
        "GPU, nodes) and routing. Anchors (marked \"(anchor)\": fused MoE layers a user could pick instead, "
        "Liger-Kernel and SonicMoE) are shown beside the baselines but never counted as one, so the published-claim "
        "verdicts stay against the baselines; where a run has anchors, \"× all\" is the fused kernel over the "
        "fastest of all (baselines and anchors). Rows of the MoK Hopper CPU twin ran the pure-torch twin on the CPU, "
        "not the "
        "kernel. Published values were read off the published figure (GB300 NVL72, EP=64, 2048 tokens/GPU, "
        f"±{READ_ERROR_TFLOPS:.0f} TFLOP/s); they are shown beside measured ones, and a measured / published "
        "TFLOP/s ratio only where the environment matches. Cells show a status instead of a number when the row is "
        "not ok; — means no row.", ""]
    if not headline.empty:
        out += ["## Headline: maximum speedup per panel", ""]
        rows = []
        for r in headline.to_dict("records"):
            env = env_label(r)
            rows.append([env, panel_label(r["precision"], r["direction"]), system_label(r["fused"]),
                         _fmt_x(r["max_speedup"]), shape_label(r["at_shape"]) if r["at_shape"] else "",
                         system_label(r["best_baseline"]) if r["best_baseline"] else "", r["cells_with_speedup"],
                         _fmt_x(r["published_max_speedup"]), _fmt_x(r["claimed_max_speedup"]),
                         "" if _isna(r["measured_over_claim"]) else f"{r['measured_over_claim']:.2f}", r["verdict"]])
        out += [_md_table(["environment", "panel", "fused kernel", "max speedup", "at shape", "over", "cells",
                           "published max (same shapes)", "README claim", "measured / claim", "verdict"], rows),
                ""]
        with_all = [r for r in headline.to_dict("records") if not _isna(r.get("min_speedup_all"))]
        if with_all and claims["best_anchor"].astype(str).ne("").any():
            out += ["### Against the fastest of all (baselines and anchors)", ""]
            rows = [[env_label(r), panel_label(r["precision"], r["direction"]), system_label(r["fused"]),
                     _fmt_x(r["min_speedup_all"]), shape_label(r["min_all_at_shape"]),
                     system_label(r["min_all_over"]), _fmt_x(r["max_speedup_all"])] for r in with_all]
            out += [_md_table(["environment", "panel", "fused kernel", "min speedup", "at shape", "over",
                               "max speedup"], rows), ""]
    if not claims.empty:
        systems = [c.removeprefix("tflops_") for c in claims.columns if c.startswith("tflops_")]
        fused = fused_columns(claims)
        for key, g in claims.groupby([*ENV_KEYS, "routing"], dropna=False, sort=False):
            env = dict(zip([*ENV_KEYS, "routing"], key))
            here = [s for s in systems if not g[f"status_{s}"].eq("missing").all()]
            out += [f"## {env_label(env)}", ""]
            anchored = any(is_anchor(s) for s in here)
            all_cols = [f for f in fused if f in here] if anchored else []
            header = ["panel", "shape", *[system_label(s) for s in here], "best baseline", "baselines ok",
                      *[f"{system_label(f)} ×" for f in fused if f in here],
                      *(["fastest of all"] if anchored else []), *[f"{system_label(f)} × all" for f in all_cols],
                      "published best", "published MoK ×"]
            rows = []
            for r in g.to_dict("records"):
                cells = [_fmt_tflops(r[f"tflops_{s}"]) if r[f"status_{s}"] == "ok"
                         else ("—" if r[f"status_{s}"] == "missing" else r[f"status_{s}"]) for s in here]
                rows.append([panel_label(r["precision"], r["direction"]), shape_label(r["shape"]), *cells,
                             system_label(r["best_baseline"]) if r["best_baseline"] else "none ok",
                             r["baselines_ok"], *[_fmt_x(r[f"speedup_{f}"]) for f in fused if f in here],
                             *([system_label(r["best_overall"]) if r["best_overall"] else "none ok"]
                               if anchored else []),
                             *[_fmt_x(r[f"speedup_all_{f}"]) for f in all_cols],
                             system_label(r["published_best_baseline"]) if r["published_best_baseline"] else "",
                             _fmt_x(r["published_speedup"])])
            out += [_md_table(header, rows), ""]
            ratio_cols = [c for c in g.columns if c.startswith("ratio_") and g[c].notna().any()]
            if g["env_matches_published"].any() and ratio_cols and (g["data"] == "measured").all():
                out += ["Measured / published TFLOP/s (same environment as the published figure):", ""]
                rrows = [[panel_label(r["precision"], r["direction"]), shape_label(r["shape"]),
                          *["" if _isna(r[c]) else f"{r[c]:.2f}" for c in ratio_cols]]
                         for r in g.to_dict("records") if r["env_matches_published"]]
                out += [_md_table(["panel", "shape", *[system_label(c.removeprefix("ratio_")) for c in ratio_cols]],
                                  rrows), ""]
    out += ["## Rows not ok", ""]
    if not_ok.empty:
        out += ["None: every row is ok.", ""]
    else:
        rows = [[env_label(r), panel_label(r["precision"], r["direction"]), shape_label(r["shape"]),
                 system_label(r["backend"]), r["status"], r["error"], r["run_id"]] for r in not_ok.to_dict("records")]
        out += [_md_table(["environment", "panel", "shape", "system", "status", "error", "run"], rows), ""]
    if timing is not None and not timing.empty:
        warm, iters = published_counts()
        out += ["## Iteration counts other than the published ones", "",
                f"The published timing is {warm} warmup and {iters} timed iterations per measurement; these ok rows "
                "were timed with other counts (their `timing_preset` is `custom`, or the preset they ran).", ""]
        rows = [[env_label(r), f"{r['num_warmup']} / {r['num_iters']}",
                 ", ".join(system_label(b) for b in r["backends"].split(", ")), str(r["rows"])]
                for r in timing.to_dict("records")]
        out += [_md_table(["run and environment", "warmup / timed", "systems", "rows"], rows), ""]
    if clocks is not None and not clocks.empty:
        out += ["## GPU clocks while timed", "",
                "Median (lowest) SM clock reading of the timed iterations on the slowest rank, mean board power, "
                "the share of that time the driver held the clocks down for the power limit (NVML), and one GPU's "
                "energy per call (power x latency). A row timed at a lower clock than another is slower for that "
                "reason too.", ""]
        rows = [[env_label(r), panel_label(r["precision"], r["direction"]), shape_label(r["shape"]),
                 system_label(r["backend"]), f"{r['sm_clock_mhz']:.0f}"
                 + ("" if _isna(r["sm_clock_min_mhz"]) else f" ({r['sm_clock_min_mhz']:.0f})"),
                 "" if _isna(r["power_w"]) else f"{r['power_w']:.0f}",
                 "" if _isna(r["power_capped_fraction"]) else f"{100 * r['power_capped_fraction']:.0f}%",
                 "" if _isna(r.get("energy_mj")) else f"{r['energy_mj']:.0f}", r["run_id"]]
                for r in clocks.to_dict("records")]
        out += [_md_table(["environment", "panel", "shape", "system", "SM clock MHz", "power W", "power-capped",
                           "energy mJ", "run"], rows), ""]
    if charts:
        rel = [p.relative_to(out_dir).as_posix() if out_dir and p.is_relative_to(out_dir) else p.name
               for p in charts if p.suffix == ".png"]
        out += ["## Charts", ""] + [f"![{Path(r).stem}]({r})" for r in rel] + [""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------
# the report


def write_report(df: pd.DataFrame, out_dir: Union[str, Path] = DEFAULT_OUT, *,
                 published: Optional[pd.DataFrame] = None, readme_claims: Optional[pd.DataFrame] = None,
                 calibration: Optional[pd.DataFrame] = None, charts: bool = True,
                 formats: Sequence[str] = ("png", "svg"), history: Sequence[str] = (),
                 sources: str = "", scope: str = "run") -> dict[str, Path]:
    """Write ``claims.md``, ``claims.csv``, ``headline.csv``, ``not_ok.csv``, ``clocks.csv`` (where rows recorded
    a GPU clock) and (``charts=True``) every chart the data supports into ``out_dir``, comparing within each run
    (``scope``: see :func:`prepare`). ``history``: config hashes to draw a git-SHA history for (across runs, by
    nature). Returns name -> path."""
    history_rows = prepare(df, "pooled")
    df = prepare(df, scope)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    claims = claims_table(df, published)
    head = headline_table(claims, readme_claims)
    bad = not_ok_rows(df)
    clocks = clock_rows(df)
    written: dict[str, Path] = {}
    for name, table in (("claims", claims), ("headline", head), ("not_ok", bad), ("clocks", clocks)):
        if name == "clocks" and table.empty:
            continue  # no row recorded a clock (CPU runs, runs before the clock columns)
        p = out / f"{name}.csv"
        table.to_csv(p, index=False)
        written[f"{name}.csv"] = p
    chart_paths: list[Path] = []
    if charts:
        from harness import plots

        for name, paths in plots.report_charts(df, out, calibration=calibration, formats=formats,
                                               history=history, history_rows=history_rows).items():
            chart_paths += paths
            for p in paths:
                written[p.name] = p
    md = out / "claims.md"
    md.write_text(format_markdown(claims, head, bad, sources=sources, charts=chart_paths, clocks=clocks,
                                  scope=scope, out_dir=out, timing=timing_counts(df)))
    written["claims.md"] = md
    return written


def _describe(df: pd.DataFrame, paths: Sequence[str], with_published: bool, skipped: str = "") -> str:
    measured = df[~is_published(df)] if len(df) else df
    parts = [f"{len(measured)} measured rows from {measured['run_id'].nunique()} runs"
             + (f" ({', '.join(map(str, paths))})" if paths else f" ({_rel(results.REFERENCE_RUNS)})")]
    if with_published:
        parts.append("plus the published figure's values as their own environment, GPU 'GB300 (published)'")
    if skipped:
        parts.append(skipped)
    return "Data: " + "; ".join(parts) + "."


def _rel(p: Path) -> str:
    try:
        return p.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(p)


def default_out(paths: Sequence[str], measured: bool = True) -> Path:
    """``results/reports`` (committed) for a report of the committed reference runs (``results/runs``, the default
    input); ``results/local/reports`` (ignored by git) for anything else, so that a report of your own runs never
    lands in the committed folder unless ``--out`` says so."""
    ref = results.REFERENCE_RUNS.resolve()
    inputs = [Path(p).resolve() for p in paths] or [ref]
    if measured and all(p == ref or p.is_relative_to(ref) for p in inputs):
        return DEFAULT_OUT
    return results.LOCAL_RUNS / "reports"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m harness.report", description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 report written; 2 bad arguments, an unreadable or damaged results file, or no rows")
    ap.add_argument("paths", nargs="*", help="result files or folders (default: results/runs, the committed "
                                             "reference runs; your own runs are under results/local)")
    ap.add_argument("--out", help="output folder (default: results/reports for the reference runs, else "
                                  "results/local/reports)")
    scope = ap.add_mutually_exclusive_group()
    scope.add_argument("--scope", choices=SCOPES, default="run",
                       help="run: each run on its own (default); latest: each environment's latest run; pooled: "
                            "the median over all runs, labelled as pooled")
    scope.add_argument("--pool", dest="scope", action="store_const", const="pooled",
                       help="same as --scope pooled: pool every run (labelled POOLED in every table and chart)")
    ap.add_argument("--calibration", help="calibration CSV with calib_gemm_tflops, calib_hbm_gb_s, calib_link_gb_s "
                                          "(optionally keyed by gpu_name, precision) for the roofline chart")
    ap.add_argument("--published", default=str(PUBLISHED_FIGURE), help="published figure values (CSV)")
    ap.add_argument("--claims", default=str(PUBLISHED_CLAIMS), help="published headline claims (CSV)")
    ap.add_argument("--no-published", action="store_true", help="leave the published values out")
    ap.add_argument("--include-published", action="store_true",
                    help="also report the published values as their own environment (labelled published)")
    ap.add_argument("--no-measured", action="store_true", help="read no result files (with --include-published)")
    ap.add_argument("--no-charts", action="store_true", help="tables only")
    ap.add_argument("--formats", default="png,svg", help="chart formats (default: png,svg)")
    ap.add_argument("--history", nargs="*", default=None, metavar="CONFIG_HASH",
                    help="draw throughput across git SHAs for these configs (no hash: every config with >1 SHA)")
    a = ap.parse_args(argv)

    frames = []
    skipped = ""
    try:
        if not a.no_measured:
            measured = results.load(*a.paths)
            skipped = results.skipped_note(measured.attrs.get("skipped", {}))
            if is_published(measured).any():
                raise ValueError("rows labelled published found among result files; refusing to treat them as "
                                 "measured")
            frames.append(measured)
        published = None if a.no_published and not a.include_published else load_published(a.published)
    except (FileNotFoundError, ValueError) as e:
        print(f"harness.report: {e}", file=sys.stderr)
        return 2
    if a.include_published:
        frames.append(published)
    df = pd.concat(frames, ignore_index=True) if frames else results.to_frame([])
    if df.empty:
        where = ", ".join(a.paths) or _rel(results.REFERENCE_RUNS)
        print(f"harness.report: no rows to report in {where}" + (f" ({skipped})" if skipped else "")
              + " (pass result files or folders, or --include-published)", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else default_out(a.paths, not a.no_measured)
    calibration = None
    if a.calibration:
        from harness.roofline import load_calibration

        calibration = load_calibration(a.calibration)
    history: Sequence[str] = ()
    if a.history is not None:
        history = a.history or _configs_with_history(df)
    written = write_report(df, out, published=None if a.no_published else published,
                           readme_claims=None if a.no_published else load_claims(a.claims),
                           calibration=calibration, charts=not a.no_charts,
                           formats=[f.strip() for f in a.formats.split(",") if f.strip()], history=history,
                           sources=_describe(df, a.paths, a.include_published, skipped), scope=a.scope)
    text = written["claims.md"].read_text()
    if "## Headline" in text:
        print(text[text.index("## Headline"):].split("\n## ", 1)[0].rstrip() + "\n")
    if skipped:
        print(skipped)
    print(f"wrote {len(written)} files to {out}: {', '.join(sorted(written))}")
    return 0


def _configs_with_history(df: pd.DataFrame) -> list[str]:
    n = df.dropna(subset=["config_hash"]).groupby("config_hash")["git_sha"].nunique()
    return sorted(n[n > 1].index)


if __name__ == "__main__":
    sys.exit(main())
