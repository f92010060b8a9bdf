"""The claims tables: does the published claim reproduce on these results?

For each panel (precision x direction) and shape, within one run (by default: the ``scope`` of :func:`prepare`), one
environment (GPU, EP size, tokens per GPU, nodes) and routing: each system's TFLOP/s per GPU, the fastest baseline,
and each fused kernel's speedup over it (:func:`claims_table`), the maximum per panel beside the published claim
(:func:`headline_table`), the rows not ok, the iteration counts and the GPU clocks. The published figure's values
(:func:`load_published`) are labelled so that they never pass for a measurement. Rows that ran several ranks on one
GPU (``shared_gpu``: correctness checks) are left out of every speed table, which says so (:func:`speed_rows`).
``harness.report`` writes these tables as Markdown and CSV, ``harness.report.plots`` draws them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import pandas as pd

from harness.core import results
from harness.core.backends import series_name
from harness.report.labels import (NOT_CONTENDERS, DIRECTION_ORDER, PRECISION_ORDER, SHAPE_ORDER, SYSTEM_ORDER,
                                   forward_kinds, in_order, is_anchor, is_baseline, is_fused, isna, scaling_variant,
                                   systems_in)

REPO_ROOT = Path(__file__).resolve().parents[2]
PUBLISHED_DIR = REPO_ROOT / "results" / "published"
PUBLISHED_FIGURE = PUBLISHED_DIR / "mok_gb300_figure.csv"
PUBLISHED_CLAIMS = PUBLISHED_DIR / "mok_gb300_claims.csv"

PUBLISHED_RUN_ID = "published:mok_gb300_figure"
PUBLISHED_ENV = {"gpu_name": "GB300 (published)", "ep_size": 64, "tokens_per_gpu": 2048, "routing": "uniform"}
READ_ERROR_TFLOPS = 3.0  # reading precision of the published chart

# mok_hopper rows measured on the CPU run its pure-torch twin (mok_kernels/mok_hopper/twin/), not the Triton kernel:
# the report renames their backend so that no table or chart draws them as the kernel
CPU_TWIN = {"mok_hopper": "mok_hopper_cpu_twin"}

# Speedups compare systems only within one run and one environment, and only on the same routing. ``run_started``
# (the run's first timestamp) orders the runs, newest first; with ``scope="pooled"`` (:func:`prepare`) every
# measured run becomes one labelled pseudo-run.
RUN_KEYS = ("run_started", "run_id")
ENV_KEYS = (*RUN_KEYS, "gpu_name", "ep_size", "tokens_per_gpu", "num_nodes")
SCOPES = ("run", "latest", "pooled")
CELL_KEYS = (*ENV_KEYS, "routing", "precision", "direction", "shape")


# ---------------------------------------------------------------------------------------------------------------
# published data: its own files, loaded with a label that never lets it pass for a measurement


def load_published(path: Union[str, Path, None] = None) -> pd.DataFrame:
    """The published figure as rows of the results schema, clearly labelled as published.

    ``gpu_name`` is ``GB300 (published)``, ``run_id`` is ``published:mok_gb300_figure``, ``timing_preset`` is
    ``published-figure`` and the extra column ``source`` says where each value was read. FLOPs and latency are
    implied from the published formula. The file keeps its own header, so ``harness.core.results.load`` never picks it
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
    from harness.core.roofline import layer_flops

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
    if isna(measured) or isna(published):
        return False
    norm = [re.sub(r"\(.*?\)|nvidia|\s+", " ", str(s).lower()).split() for s in (measured, published)]
    return bool(norm[1]) and all(tok in norm[0] for tok in norm[1])


def env_matches_published(env: dict[str, Any]) -> bool:
    """Same GPU model, EP size, tokens per GPU and routing as the published run."""
    return (same_gpu(env.get("gpu_name"), PUBLISHED_ENV["gpu_name"])
            and not isna(env.get("ep_size")) and int(env["ep_size"]) == PUBLISHED_ENV["ep_size"]
            and not isna(env.get("tokens_per_gpu")) and int(env["tokens_per_gpu"]) == PUBLISHED_ENV["tokens_per_gpu"]
            and str(env.get("routing", "uniform")) == PUBLISHED_ENV["routing"])


# ---------------------------------------------------------------------------------------------------------------
# scope: which rows are compared with which


def is_cpu_twin(df: pd.DataFrame) -> pd.Series:
    """mok_hopper rows timed on the CPU: the pure-torch twin ran, not the Triton kernel."""
    dev = df["device"].astype("string").fillna("").str.lower() if "device" in df else pd.Series("", index=df.index)
    notes = df["notes"].astype("string").fillna("") if "notes" in df else pd.Series("", index=df.index)
    return (df["backend"].isin(list(CPU_TWIN)) & ((dev == "cpu") | notes.str.contains("CPU twin"))).fillna(False)


def is_shared_gpu(df: pd.DataFrame) -> pd.Series:
    """Rows that ran several ranks on one GPU (``shared_gpu`` true): the ranks time-shared the device, so the rows
    check correctness and measure no speed. Rows without the column (files written before it) are not."""
    if "shared_gpu" not in df:
        return pd.Series(False, index=df.index)
    return df["shared_gpu"].astype("string").str.strip().str.lower().isin(["true", "1"]).fillna(False).astype(bool)


def shared_gpu_note(n: int) -> str:
    """The line every speed table and chart prints where it left ``n`` shared-GPU rows out ('' for none)."""
    if not n:
        return ""
    return (f"{n} row{'s' if n != 1 else ''} ran several ranks on one GPU (shared_gpu): correctness only, left out "
            "of speed tables")


def speed_rows(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """``df`` without its shared-GPU rows (:func:`is_shared_gpu`), and the note that says how many were left out
    ('' where none): what every speed table (claims, headline, verdicts, clocks, iteration counts), chart
    (``harness.report.plots``) and regression check (``harness.compare``) reads."""
    shared = is_shared_gpu(df)
    if not shared.any():
        return df, ""
    kept = df[~shared]
    kept.attrs = dict(df.attrs)
    return kept, shared_gpu_note(int(shared.sum()))


def with_runs(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with the ``run_started`` column (each run's first timestamp) that orders runs; unchanged if present."""
    if "run_started" in df.columns:
        return df
    d = df.copy()
    t = d["timestamp"].astype("string") if "timestamp" in d else pd.Series(pd.NA, index=d.index, dtype="string")
    d["run_started"] = t.groupby(d["run_id"].astype("string").fillna(""), dropna=False).transform("min")
    return d


def split_variants(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of one backend, run and precision that ran different variants renamed to one series per variant
    (``backends.series_name``), so that no table or chart takes one median over two variants: where their ``scaling``
    differs (nccl's fp8 GEMM paths, TE's fp8 recipes; named by ``labels.scaling_variant``), and where some ran eager
    and others compiled (a run with nccl both eager and compiled: ``eager``, ``compiled <mode>``), and where their
    ``backend_options`` differ (:func:`options_variants`: ``weights=plain``). Backends with one
    variant a run and precision, published rows, and rows that record neither (e.g. a failure before the backend was
    set up) keep their names."""
    if df.empty:
        return df
    d = df.copy()
    scaling = (d["scaling"] if "scaling" in d else pd.Series("", index=d.index)).fillna("").astype(str)
    compiled = d["compiled"] if "compiled" in d else pd.Series(pd.NA, index=d.index)
    mode = (d["compile_mode"] if "compile_mode" in d else pd.Series("", index=d.index)).fillna("").astype(str)
    compile_text = pd.Series([("" if isna(c) else f"compiled {m}".strip() if bool(c) else "eager")
                              for c, m in zip(compiled, mode)], index=d.index)
    published = is_published(d).to_numpy()
    keys = pd.Series(d[["run_id", "backend", "precision"]].astype(str).agg("\x1f".join, axis=1).to_numpy())
    parts = []
    for text, label in ((scaling, scaling_variant), (compile_text, str)):
        keep = ~published & text.ne("").to_numpy()
        counts = text[keep].groupby(keys[keep].to_numpy()).nunique()
        varies = keep & keys.map(counts).fillna(0).gt(1).to_numpy()
        parts.append([label(t) if v else "" for t, v in zip(text.to_numpy(), varies)])
    parts.append(options_variants(d, keys, published))
    names = [" ".join(filter(None, p)) for p in zip(*parts)]
    if any(names):
        backend = d["backend"].astype(object).to_numpy().copy()
        backend = [series_name(b, n) if n else b for b, n in zip(backend, names)]
        d["backend"] = pd.array(backend, dtype="string")
    return d


def options_variants(d: pd.DataFrame, keys: pd.Series, published) -> list[str]:
    """Each row's ``backend_options`` that differ among the rows of its group (``keys``: run, backend, precision),
    as ``field=value`` pairs ('' where none differ): a run with ``mok_hopper.weights=tiled`` and ``weights=plain``
    reports ``weights=tiled`` and ``weights=plain`` apart. A field missing from some rows (written before the option
    existed) varies only among the rows that record it; ``forward=inference`` is left to
    :func:`split_forward_kinds`, which names that series."""
    text = (d["backend_options"] if "backend_options" in d else pd.Series("", index=d.index)).astype(object)
    opts = [{} if p or isna(t) else dict(kv.split("=", 1) for kv in str(t).split(",") if "=" in kv)
            for t, p in zip(text, published)]
    for o in opts:
        if o.get("forward") == "inference":
            del o["forward"]
    seen: dict[str, dict[str, set]] = {}
    for k, o in zip(keys, opts):
        for f, v in o.items():
            seen.setdefault(k, {}).setdefault(f, set()).add(v)
    varying = {k: [f for f, vs in fields.items() if len(vs) > 1] for k, fields in seen.items()}
    return [",".join(f"{f}={o[f]}" for f in varying.get(k, ()) if f in o) for k, o in zip(keys, opts)]


def split_forward_kinds(df: pd.DataFrame) -> pd.DataFrame:
    """A backend whose forward rows of one run are of both kinds (``labels.forward_kind``: mok_hopper's training
    forward and its ``forward=inference`` one) gets its inference forwards renamed to a series of their own
    (``backends.series_name(backend, "inference")``), so that no table or chart takes one median over a forward that
    keeps its activations and one that saves nothing. Other backends keep their names."""
    if df.empty:
        return df
    d = df.copy()
    kind = forward_kinds(d)
    fwd = kind.ne("").to_numpy(dtype=bool) & ~is_published(d).to_numpy(dtype=bool)
    keys = d[["run_id", "backend"]].astype(str).agg("\x1f".join, axis=1)
    counts = kind[fwd].groupby(keys[fwd].to_numpy()).nunique()
    split = fwd & keys.map(counts).fillna(0).gt(1).to_numpy() & kind.eq("inference").to_numpy(dtype=bool)
    if split.any():
        backend = d["backend"].astype(object).to_numpy().copy()
        backend[split] = [series_name(b, "inference") for b in backend[split]]
        d["backend"] = pd.array(backend, dtype="string")
    return d


def prepare(df: pd.DataFrame, scope: str = "run") -> pd.DataFrame:
    """The rows a report compares, for a scope:

    * ``run`` (default): every run on its own: a speedup compares systems measured in the same run;
    * ``latest``: for each environment (GPU, EP size, tokens per GPU, nodes, routing), only its most recent run;
    * ``pooled``: every measured run as one pseudo-run labelled ``POOLED over N runs``: the median over runs of
      different code, machine allocations and baseline builds, an explicit choice (``--pool``).

    CPU-twin rows of mok_hopper are renamed (:data:`CPU_TWIN`); a backend whose rows of one run and precision differ
    in ``scaling`` becomes one series per variant (:func:`split_variants`), one whose forwards of one run are of both
    kinds one series per kind (:func:`split_forward_kinds`); ``source_run_id`` keeps each row's own run."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)} (got {scope!r})")
    d = df.copy()
    twin = is_cpu_twin(d)
    if twin.any():
        d["backend"] = d["backend"].astype(object).where(~twin, d["backend"].map(CPU_TWIN)).astype("string")
    d = split_forward_kinds(split_variants(d))
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
    """The distinct (run, environment, routing) combinations of ``df``'s speed rows (:func:`speed_rows`: the charts
    and tables drawn per environment time nothing from ranks that shared a GPU): runs newest first, then a stable
    order."""
    keys = [*ENV_KEYS, "routing"]
    envs = with_runs(speed_rows(df)[0])[keys].drop_duplicates().to_dict("records")
    envs = sorted(envs, key=lambda e: tuple("" if isna(e[k]) else f"{e[k]!s:>12}" for k in keys[1:]))
    return sorted(envs, key=lambda e: "" if isna(e["run_started"]) else str(e["run_started"]), reverse=True)


def select_env(df: pd.DataFrame, env: dict[str, Any]) -> pd.DataFrame:
    """The rows of ``df`` in one environment (NA-aware)."""
    if "run_started" in env:
        df = with_runs(df)
    mask = pd.Series(True, index=df.index)
    for k, v in env.items():
        mask &= df[k].isna() if isna(v) else (df[k] == v).fillna(False)
    return df[mask]


def claims_table(df: pd.DataFrame, published: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """The wide claims table: one row per (environment, routing, precision, direction, shape).

    Columns: the cell keys; ``tflops_<system>`` and ``status_<system>`` per contending system (status ``missing``
    where the system has no row in that cell); ``best_baseline`` / ``best_baseline_tflops`` (fastest ok baseline);
    ``baselines_ok`` ("3/4": ok baselines / baselines seen in this environment); ``best_anchor`` /
    ``best_anchor_tflops`` (fastest ok anchor); ``best_overall`` / ``best_overall_tflops`` (fastest ok system that
    is not a contender: baselines and anchors); ``speedup_<fused>`` per fused kernel over the fastest baseline (what
    the published-claim verdicts use) and ``speedup_all_<fused>`` over the fastest of all, each over forwards of the
    fused kernel's own kind only (``labels.forward_kind``: like with like), ``over_<fused>`` / ``over_all_<fused>``
    naming the system each is over (the cell's ``best_baseline`` / ``best_overall`` where the cell holds one kind of
    forward); then the published
    side: ``published_best_baseline``, ``published_speedup`` (MoK / best, from the
    figure's readings), ``env_matches_published`` and, only where it does, ``ratio_<system>`` = measured /
    published TFLOP/s. Shared-GPU rows are left out (:func:`speed_rows`); ``table.attrs["notes"]`` says how many.
    """
    df, note = speed_rows(df)
    agg = aggregate(with_runs(df)[~df["backend"].isin(NOT_CONTENDERS)])
    kinds = _cell_kinds(df)
    systems = systems_in(agg)
    fused = [s for s in systems if is_fused(s)]
    pub = _published_cells(published) if published is not None else {}
    pub_systems = in_order({b for cell in pub.values() for b in cell}, SYSTEM_ORDER)
    base_seen: dict[tuple, set] = {}
    for key, g in agg.groupby([*ENV_KEYS, "routing"], dropna=False, sort=False):
        base_seen[norm_key(key)] = {b for b in g["backend"] if is_baseline(b)}
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
                if is_baseline(s) and r["status"] == "ok" and not isna(r["tflops_per_gpu"])}
        best = max(base, key=base.__getitem__) if base else None
        rec["best_baseline"] = best or ""
        rec["best_baseline_tflops"] = base[best] if best else math.nan
        seen = base_seen[norm_key(tuple(rec[k] for k in (*ENV_KEYS, "routing")))]
        rec["baselines_ok"] = f"{len(base)}/{len(seen)}"
        anchors = {s: r["tflops_per_gpu"] for s, r in by.items()
                   if is_anchor(s) and r["status"] == "ok" and not isna(r["tflops_per_gpu"])}
        best_anchor = max(anchors, key=anchors.__getitem__) if anchors else None
        rec["best_anchor"] = best_anchor or ""
        rec["best_anchor_tflops"] = anchors[best_anchor] if best_anchor else math.nan
        every = {**base, **anchors}
        best_all = max(every, key=every.__getitem__) if every else None
        rec["best_overall"] = best_all or ""
        rec["best_overall_tflops"] = every[best_all] if best_all else math.nan
        kind = kinds.get(norm_key(key), {})
        for f in fused:
            r = by.get(f)
            ok = r is not None and r["status"] == "ok" and not isna(r["tflops_per_gpu"])
            # like with like: a fused kernel's forward over forwards of its own kind (labels.forward_kind)
            same = [s for s in every if kind.get(s, "") == kind.get(f, "")]
            b = max((s for s in same if s in base), key=base.__getitem__, default=None)
            a = max(same, key=every.__getitem__, default=None)
            rec[f"speedup_{f}"] = r["tflops_per_gpu"] / base[b] if ok and b else math.nan
            rec[f"speedup_all_{f}"] = r["tflops_per_gpu"] / every[a] if ok and a else math.nan
            rec[f"over_{f}"], rec[f"over_all_{f}"] = (b or "", a or "") if ok else ("", "")
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
            rec[f"ratio_{s}"] = mine / p[s] if match and s in p and not isna(mine) else math.nan
        rows.append(rec)
    table = pd.DataFrame(rows)
    if not table.empty:
        table = _int_columns(_sort_cells(table).reset_index(drop=True))
    table.attrs["notes"] = [note] if note else []
    return table


def _cell_kinds(df: pd.DataFrame) -> dict[tuple, dict[str, str]]:
    """Cell (:data:`CELL_KEYS`, normalised) -> backend -> the forward kind of its rows there (``labels.forward_kind``;
    '' for other directions). After :func:`prepare` a backend's rows of one cell are of one kind."""
    if df.empty:
        return {}
    d = with_runs(df)
    out: dict[tuple, dict[str, str]] = {}
    for key, b, k in zip(d[list(CELL_KEYS)].itertuples(index=False, name=None), d["backend"], forward_kinds(d)):
        out.setdefault(norm_key(key), {}).setdefault(b, k)
    return out


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


def norm_key(key: Any) -> tuple:
    """A cell's key as a plain tuple that compares equal across dtypes: NaN as None, whole floats as ints."""
    key = key if isinstance(key, tuple) else (key,)
    return tuple(None if isna(k) else (int(k) if isinstance(k, float) and k.is_integer() else k) for k in key)


def _sort_cells(table: pd.DataFrame) -> pd.DataFrame:
    def pos(v: Any, order: Sequence[str]) -> tuple[int, str]:
        base = str(v).partition("@")[0]
        return (order.index(base) if base in order else len(order), str(v))

    def key(i: Any) -> tuple:
        r = table.loc[i]
        env = tuple("" if isna(r[k]) else f"{r[k]!s:>12}" for k in ENV_KEYS[1:])
        return (env, (r["routing"] != "uniform", str(r["routing"])), pos(r["precision"], PRECISION_ORDER),
                pos(r["direction"], DIRECTION_ORDER), pos(r["shape"], SHAPE_ORDER))

    order = sorted(table.index, key=key)
    order = sorted(order, key=lambda i: "" if isna(table.loc[i, "run_started"]) else str(table.loc[i, "run_started"]),
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
    anchors) and ``min_all_at_shape`` / ``min_all_over`` where the smallest one is (the verdicts never use them).
    ``attrs["notes"]``: the claims table's (shared-GPU rows left out)."""
    notes = list(claims.attrs.get("notes", []))
    if claims.empty:
        out = pd.DataFrame()
        out.attrs["notes"] = notes
        return out
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
                rec.update(max_speedup=float(s.max()), at_shape=at["shape"],
                           best_baseline=at.get(f"over_{f}", at["best_baseline"]))
            else:
                rec.update(max_speedup=math.nan, at_shape="", best_baseline="")
            rec["cells_with_speedup"] = f"{int(s.notna().sum())}/{len(g)}"
            sa = g[f"speedup_all_{f}"] if f"speedup_all_{f}" in g else pd.Series(dtype="float64")
            if sa.notna().any():
                lo = g.loc[sa.idxmin()]
                rec.update(min_speedup_all=float(sa.min()), max_speedup_all=float(sa.max()),
                           min_all_at_shape=lo["shape"], min_all_over=lo.get(f"over_all_{f}", lo["best_overall"]))
            else:
                rec.update(min_speedup_all=math.nan, max_speedup_all=math.nan, min_all_at_shape="", min_all_over="")
            rec["published_max_speedup"] = float(pub_max["published_speedup"]) if pub_max is not None else math.nan
            rec["published_at_shape"] = pub_max["shape"] if pub_max is not None else ""
            rec["claimed_max_speedup"] = claimed.get((rec["precision"], rec["direction"]), math.nan)
            comparable = bool(g["env_matches_published"].any()) and f == "mok"
            rec["data"] = g["data"].iloc[0]
            rec["env_matches_published"] = comparable
            rec["measured_over_claim"] = (rec["max_speedup"] / rec["claimed_max_speedup"]
                                          if comparable and not isna(rec["claimed_max_speedup"]) else math.nan)
            rec["verdict"] = _verdict(rec, comparable)
            rows.append(rec)
    out = _int_columns(pd.DataFrame(rows))
    out.attrs["notes"] = notes
    return out


def _verdict(rec: dict[str, Any], comparable: bool) -> str:
    if isna(rec["max_speedup"]):
        return "no speedup measured"
    if isna(rec["claimed_max_speedup"]):
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
    from harness.config.schema import load_group_option

    t = load_group_option("timing", "published")
    return int(t.num_warmup), int(t.num_iters)


def timing_counts(df: pd.DataFrame) -> pd.DataFrame:
    """The ok rows timed with other iteration counts than the published preset's: one line per run and
    environment and (num_warmup, num_iters), with the systems and how many rows; newest run first. Shared-GPU rows
    (:func:`speed_rows`) are no timing and are left out."""
    cols = [*ENV_KEYS, "num_warmup", "num_iters", "backends", "rows"]
    warm, iters = published_counts()
    d = with_runs(speed_rows(df)[0])
    ok = d[(d["status"] == "ok") & d["num_iters"].notna()]
    other = ok[(ok["num_warmup"] != warm) | (ok["num_iters"] != iters)]
    if other.empty:
        return pd.DataFrame(columns=cols)
    other = other.sort_values("run_started", ascending=False, kind="stable")
    keys = [*ENV_KEYS, "num_warmup", "num_iters"]
    out = other.groupby(keys, dropna=False, sort=False).agg(
        backends=("backend", lambda b: ", ".join(in_order(b, SYSTEM_ORDER))), rows=("status", "size")).reset_index()
    return _int_columns(out[cols])


CLOCK_COLUMNS = ("sm_clock_mhz", "sm_clock_min_mhz", "power_w", "power_capped_fraction")


def clock_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The GPU clock each ok row was timed at (rows that recorded one: GPU runs since the clock columns exist), and
    ``energy_mj``: one GPU's energy per layer call, its mean board power times the latency (W x ms = mJ); at a
    power limit this, not the latency, is what a faster layer spends. Shared-GPU rows (:func:`speed_rows`) are left
    out."""
    cols = [*CELL_KEYS, "backend", *CLOCK_COLUMNS, "latency_ms", "energy_mj"]
    if "sm_clock_mhz" not in df.columns:
        return pd.DataFrame(columns=cols)
    df = speed_rows(df)[0]
    ok = with_runs(df)[(df["status"] == "ok") & df["sm_clock_mhz"].notna()].copy()
    if "source_run_id" in ok:  # pooled: the row's own run
        ok["run_id"] = ok["source_run_id"]
    if "power_w" in ok.columns and "latency_ms" in ok.columns:
        ok["energy_mj"] = ok["power_w"] * ok["latency_ms"]
    return ok[[c for c in cols if c in ok.columns]].reset_index(drop=True)
