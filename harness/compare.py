"""Regression check between two sets of results, for gating a kernel change in CI.

    python -m harness.compare results/runs/BASE_RUN results/runs/NEW_RUN
    python -m harness.compare base.csv new.csv --min-change 0.03 --history-dir /tmp/hist

Rows are matched on (config_hash, backend, direction). A slowdown is a regression when the median latency grew by
more than ``--min-change`` (default 5%) *and* by more than the noise the two runs show: the new run's p20 lies
above the base run's p80 (the near edges of the two p20-p80 spreads do not overlap, scaled by ``--noise-factor``).
A speedup past both thresholds is an improvement. A row that was ok and is not ok any more is a status change.
Where both sides recorded the GPU's SM clock while timed (``sm_clock_mhz``), ``clock_change`` gives its relative
change and the table warns when it moved by more than ``CLOCK_WARN`` (a power-capped board runs slower): the verdict
itself stays on latency.

Exit code: 0 when nothing regressed, 1 on a regression or a status change from ok, 2 when nothing could be compared
(or on bad arguments). Repeated runs on one side are pooled: the median of the medians, the lowest p20 and the
highest p80.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from harness import results

KEY = ("config_hash", "backend", "direction")
CONTEXT = ("shape", "precision", "tokens_per_gpu", "ep_size", "routing", "gpu_name")
VERDICT_ORDER = ("regression", "status change", "missing", "improvement", "fixed", "still failing", "unchanged",
                 "new")
FAILING = ("regression", "status change")
CLOCK_WARN = 0.03  # relative SM-clock change between the two sides worth a warning


def pool(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (config_hash, backend, direction): median latency over ok rows, lowest p20, highest p80, and a
    status (``ok`` when any row is ok, else the most recent row's), with the context columns and a row count."""
    cols = [*KEY, *CONTEXT, "status", "error", "latency_ms", "p20_ms", "p80_ms", "tflops_per_gpu", "sm_clock_mhz",
            "git_sha", "num_rows"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    d = df.copy()
    if "sm_clock_mhz" not in d.columns:  # results written before the clock columns existed
        d["sm_clock_mhz"] = math.nan
    d["_g"] = d.groupby(list(KEY), dropna=False, sort=False).ngroup()
    d["_ok"] = (d["status"] == "ok").fillna(False) & d["latency_ms"].notna()
    last = d.sort_values(["_g", "timestamp"], na_position="first", kind="stable").drop_duplicates("_g", keep="last")
    out = last.set_index("_g")
    ok = d[d["_ok"]].groupby("_g").agg(latency_ms=("latency_ms", "median"), p20_ms=("latency_p20_ms", "min"),
                                       p80_ms=("latency_p80_ms", "max"),
                                       tflops_per_gpu=("tflops_per_gpu", "median"),
                                       sm_clock_mhz=("sm_clock_mhz", "median"), num_ok=("_ok", "size"))
    res = out[[*KEY, *CONTEXT]].join(ok)
    has_ok = res["num_ok"].fillna(0) > 0
    res["status"] = out["status"].astype(object).where(~has_ok, "ok").fillna("missing").astype(str)
    err = out["error"].astype(object).fillna("").map(lambda e: str(e).strip().splitlines()[0][:120] if str(e).strip()
                                                      else "")
    res["error"] = err.where(~has_ok, "")
    res["git_sha"] = out["git_sha"].astype(object).fillna("").astype(str)
    res["num_rows"] = d.groupby("_g").size()
    for c in ("latency_ms", "p20_ms", "p80_ms", "tflops_per_gpu", "sm_clock_mhz"):
        res[c] = res[c].astype("float64")
    return res.sort_index().reset_index(drop=True)[cols]


def compare(base: pd.DataFrame, new: pd.DataFrame, *, min_change: float = 0.05, noise_factor: float = 1.0
            ) -> pd.DataFrame:
    """The comparison table: one row per key in either side, with ``change`` (relative change of the median
    latency, + = slower), ``noise`` (the relative gap the p20/p80 spreads allow) and a ``verdict``:
    regression, status change (ok -> not ok), missing (in BASE only), improvement, fixed, still failing,
    unchanged or new (in NEW only). Sorted with the failing verdicts first."""
    if min_change < 0 or noise_factor < 0:
        raise ValueError("min_change and noise_factor must be >= 0")
    b, n = pool(base), pool(new)
    cols = ["latency_ms", "p20_ms", "p80_ms", "tflops_per_gpu", "sm_clock_mhz", "status", "error", "git_sha",
            "num_rows"]
    m = b.merge(n, on=list(KEY), how="outer", suffixes=("_base", "_new"), indicator=True)
    for c in CONTEXT:
        m[c] = m[f"{c}_base"].combine_first(m[f"{c}_new"])
    gb, gn = m["gpu_name_base"], m["gpu_name_new"]
    m["env_differs"] = (gb.notna() & gn.notna() & (gb.astype(str) != gn.astype(str))).astype(bool)
    recs = []
    for r in m.to_dict("records"):
        rec = {k: r[k] for k in (*KEY, *CONTEXT)}
        rec.update({f"{c}_{side}": r.get(f"{c}_{side}") for c in cols for side in ("base", "new")})
        rec["env_differs"] = bool(r["env_differs"])
        cb, cn = r.get("sm_clock_mhz_base"), r.get("sm_clock_mhz_new")
        rec["clock_change"] = cn / cb - 1.0 if pd.notna(cb) and pd.notna(cn) and cb > 0 else math.nan
        rec.update(_judge(r, min_change, noise_factor))
        recs.append(rec)
    out = pd.DataFrame(recs)
    if out.empty:
        return out
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    out["_rank"] = out["verdict"].map(rank)
    return out.sort_values(["_rank", "shape", "backend", "direction"], na_position="last").drop(
        columns="_rank").reset_index(drop=True)


def _judge(r: dict[str, Any], min_change: float, noise_factor: float) -> dict[str, Any]:
    side = r["_merge"]
    if side == "left_only":
        return dict(change=math.nan, noise=math.nan, verdict="missing")
    if side == "right_only":
        return dict(change=math.nan, noise=math.nan, verdict="new")
    sb, sn = r["status_base"], r["status_new"]
    if sb == "ok" and sn != "ok":
        return dict(change=math.nan, noise=math.nan, verdict="status change")
    if sb != "ok" and sn == "ok":
        return dict(change=math.nan, noise=math.nan, verdict="fixed")
    if sb != "ok":
        return dict(change=math.nan, noise=math.nan, verdict="still failing")
    lb, ln = r["latency_ms_base"], r["latency_ms_new"]
    change = ln / lb - 1.0
    # the near edges of the two spreads: for a slowdown, base p80 above its median and new p20 below its median
    if change >= 0:
        gap = _edge(r["p80_ms_base"], lb, +1) + _edge(r["p20_ms_new"], ln, -1)
    else:
        gap = _edge(r["p20_ms_base"], lb, -1) + _edge(r["p80_ms_new"], ln, +1)
    noise = noise_factor * gap / lb
    past = abs(change) > min_change and abs(change) > noise
    verdict = ("regression" if change > 0 else "improvement") if past else "unchanged"
    return dict(change=change, noise=noise, verdict=verdict)


def _edge(q: Any, median: float, sign: int) -> float:
    """Distance from the median to a quantile on the given side (0 when the quantile is missing)."""
    if q is None or pd.isna(q):
        return 0.0
    return max(0.0, sign * (float(q) - median))


def failed(table: pd.DataFrame) -> bool:
    """Whether the comparison should fail a CI gate: a regression or a status change from ok."""
    return bool(len(table)) and bool(table["verdict"].isin(FAILING).any())


def format_table(table: pd.DataFrame, *, show_all: bool = False) -> str:
    """A fixed-width table for the terminal: every non-unchanged row (all rows with ``show_all``) and a summary."""
    if table.empty:
        return "nothing to compare"
    shown = table if show_all else table[table["verdict"] != "unchanged"]
    lines = []
    if len(shown):
        t = pd.DataFrame({
            "verdict": shown["verdict"].str.upper().where(shown["verdict"].isin(FAILING), shown["verdict"]),
            "config": shown["config_hash"].fillna(""),
            "shape": shown["shape"].fillna(""),
            "prec": shown["precision"].fillna(""),
            "dir": shown["direction"].fillna(""),
            "backend": shown["backend"].fillna(""),
            "base ms": shown["latency_ms_base"].map(_ms),
            "new ms": shown["latency_ms_new"].map(_ms),
            "change": shown["change"].map(lambda v: "" if pd.isna(v) else f"{v:+.1%}"),
            "noise": shown["noise"].map(lambda v: "" if pd.isna(v) else f"{v:.1%}"),
            "base status": shown["status_base"].fillna("-"),
            "new status": shown["status_new"].fillna("-"),
        })
        if shown["clock_change"].notna().any():
            t.insert(t.columns.get_loc("noise") + 1, "SM clock",
                     shown["clock_change"].map(lambda v: "" if pd.isna(v) else f"{v:+.1%}").to_numpy())
        lines.append(t.to_string(index=False))
        for r in shown.to_dict("records"):
            if r["verdict"] == "status change" and r.get("error_new"):
                lines.append(f"  {r['backend']}/{r['direction']} {r['config_hash']}: {r['error_new']}")
        if shown["env_differs"].any():
            lines.append("warning: some matched rows ran on different GPUs (gpu_name differs)")
        if (shown["clock_change"].abs() > CLOCK_WARN).any():
            lines.append(f"warning: some matched rows ran at SM clocks more than {CLOCK_WARN:.0%} apart (power or "
                         "thermal limits): part of their latency change may come from the clock")
    counts = table["verdict"].value_counts()
    summary = ", ".join(f"{counts[v]} {v}" for v in VERDICT_ORDER if v in counts)
    lines.append(f"{len(table)} compared: {summary}")
    lines.append("FAIL: regression or status change from ok" if failed(table) else "OK: no regression")
    return "\n".join(lines)


def _ms(v: Any) -> str:
    return "" if pd.isna(v) else f"{v:.4g}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="BASE results: a file or a folder")
    ap.add_argument("new", help="NEW results: a file or a folder")
    ap.add_argument("--min-change", type=float, default=0.05,
                    help="smallest relative latency change that can count (default 0.05 = 5%%)")
    ap.add_argument("--noise-factor", type=float, default=1.0,
                    help="scale on the p20/p80 noise band a change must exceed (default 1.0)")
    ap.add_argument("--all", action="store_true", help="also list unchanged rows")
    ap.add_argument("--csv", help="write the full comparison table to this CSV")
    ap.add_argument("--history-dir", help="write a history chart (PNG + SVG) per regressed or changed config, "
                                          "over the rows of both sides")
    a = ap.parse_args(argv)
    try:
        base, new = results.load(a.base), results.load(a.new)
        table = compare(base, new, min_change=a.min_change, noise_factor=a.noise_factor)
    except (FileNotFoundError, ValueError) as e:
        print(f"harness.compare: {e}", file=sys.stderr)
        return 2
    print(format_table(table, show_all=a.all))
    if a.csv:
        Path(a.csv).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(a.csv, index=False)
    if a.history_dir and len(table):
        from harness import plots

        both = pd.concat([base, new], ignore_index=True).drop_duplicates(list(results.KEY))
        hashes = table.loc[~table["verdict"].isin(("unchanged", "new", "missing")), "config_hash"].dropna().unique()
        for h in hashes:
            fig = plots.plot_history(both, str(h))
            for p in plots.save(fig, Path(a.history_dir) / f"history_{plots.slug(str(h))}"):
                print(p)
    matched = table["verdict"].isin(("regression", "improvement", "unchanged", "status change", "fixed",
                                     "still failing")).sum() if len(table) else 0
    if matched == 0:
        print("harness.compare: no rows matched on (config_hash, backend, direction)", file=sys.stderr)
        return 2
    return 1 if failed(table) else 0


if __name__ == "__main__":
    sys.exit(main())
