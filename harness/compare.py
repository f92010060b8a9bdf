"""Regression check between two sets of results, for gating a kernel change in CI.

    python -m harness.compare results/local/BASE_RUN results/local/NEW_RUN --backend mok_hopper
    python -m harness.compare BASE NEW --backend mok_hopper --aa BASE_RERUN        # noise from an A/A rerun
    python -m harness.compare BASE NEW --backend mok_hopper --normalize control --control nccl

Rows are matched on (config_hash, backend, direction); ``--backend`` judges only those backends' rows (a kernel
change on its own rows, not on baselines whose code did not change). Each matched row gets a relative ``change``
of its median latency (+ = slower) and a relative ``noise``: the largest of

* the p20-p80 spreads of the two sides (the gap their near edges allow),
* the spread of the medians of repeated runs of the row on one side (a side may hold several runs),
* the A/A noise of ``--aa``: a rerun of BASE's code on the same configurations; the row's own A/A change, and no
  less than the median A/A change of all rows (the machine's run-to-run noise),
* with ``--backend``: the largest change of the other backends' rows, whose code did not change (an A/A for free:
  two leases of one machine, or a CPU point run twice, differ by far more than one run's p20-p80 spread; a change
  no larger than unchanged code showed cannot be told from the machine),

times ``--noise-factor``. A row timed on the CPU whose only estimate is its p20-p80 spread is inconclusive: CPU
ranks share their cores with the OS, and a point run twice moved 2x between runs with spreads a third of that.
With ``--threshold`` T (default 5%), the verdict is

* ``regression``: slower by more than T and more than the noise; ``improvement``: the same, faster;
* ``inconclusive``: the noise exceeds T and the change is inside the noise: a change of the size that matters
  could hide in it (rerun on a quieter machine, give an A/A rerun, or normalise);
* ``unchanged``: otherwise (within T, on a measurement that resolves T);
* from the statuses: ``status change`` (ok -> not ok: fails), ``fixed``, ``still failing``, ``missing`` (in BASE
  only) and ``new`` (in NEW only).

``--normalize clock`` judges latency x SM clock (rows that recorded ``sm_clock_mhz``; assumes the layer's time
scales with the clock: a board held at a lower clock by its power limit is not read as a slower kernel);
``--normalize control --control B`` judges each row's latency over backend B's latency for the same configuration
and direction in the same side, so a machine or lease that slows every backend cancels (B's own code must not have
changed). A row that cannot be normalised (no clock, control not ok) is inconclusive.

Exit codes:
  0  no regression: every judged row unchanged, improved, fixed, new or still failing
  1  a regression, or a status change from ok (fails the gate)
  2  nothing to judge: bad arguments, an unreadable or damaged results file, or no rows matched
  3  inconclusive: no regression, but the noise of at least one judged row is too large to decide
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from harness import results
from harness.cli_args import ArgumentParser, dir_write_problem, fail, file_write_problem

KEY = ("config_hash", "backend", "direction")
CONTEXT = ("shape", "precision", "tokens_per_gpu", "ep_size", "routing", "gpu_name", "device")
VERDICT_ORDER = ("regression", "status change", "inconclusive", "missing", "improvement", "fixed", "still failing",
                 "unchanged", "new")
FAILING = ("regression", "status change")
JUDGED = ("regression", "status change", "inconclusive", "improvement", "fixed", "still failing", "unchanged")
NORMALIZE = ("none", "clock", "control")
CLOCK_WARN = 0.03  # relative SM-clock change between the two sides worth a warning
EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3


def pool(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (config_hash, backend, direction): median latency, p20 and p80 over ok rows, the
    spread of the per-run medians where the row was measured in several runs (``run_spread``: (max - min) /
    median), the median SM clock, and a status (``ok`` when any row is ok, else the most recent row's), with the
    context columns and row / run counts."""
    cols = [*KEY, *CONTEXT, "status", "error", "latency_ms", "p20_ms", "p80_ms", "run_spread", "num_runs",
            "tflops_per_gpu", "sm_clock_mhz", "git_sha", "num_rows"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    d = df.copy()
    if "sm_clock_mhz" not in d.columns:  # results written before the clock columns existed
        d["sm_clock_mhz"] = math.nan
    d["_g"] = d.groupby(list(KEY), dropna=False, sort=False).ngroup()
    d["_ok"] = (d["status"] == "ok").fillna(False) & d["latency_ms"].notna()
    last = d.sort_values(["_g", "timestamp"], na_position="first", kind="stable").drop_duplicates("_g", keep="last")
    out = last.set_index("_g")
    okd = d[d["_ok"]]
    ok = okd.groupby("_g").agg(latency_ms=("latency_ms", "median"), p20_ms=("latency_p20_ms", "median"),
                               p80_ms=("latency_p80_ms", "median"), tflops_per_gpu=("tflops_per_gpu", "median"),
                               sm_clock_mhz=("sm_clock_mhz", "median"), num_ok=("_ok", "size"),
                               num_runs=("run_id", "nunique"))
    per_run = okd.groupby(["_g", "run_id"])["latency_ms"].median().groupby(level=0)
    ok["run_spread"] = ((per_run.max() - per_run.min()) / per_run.median()).where(per_run.size() > 1)
    res = out[[*KEY, *CONTEXT]].join(ok)
    has_ok = res["num_ok"].fillna(0) > 0
    res["status"] = out["status"].astype(object).where(~has_ok, "ok").fillna("missing").astype(str)
    err = out["error"].astype(object).fillna("").map(lambda e: str(e).strip().splitlines()[0][:120] if str(e).strip()
                                                      else "")
    res["error"] = err.where(~has_ok, "")
    res["git_sha"] = out["git_sha"].astype(object).fillna("").astype(str)
    res["num_rows"] = d.groupby("_g").size()
    res["num_runs"] = res["num_runs"].fillna(0).astype(int)
    for c in ("latency_ms", "p20_ms", "p80_ms", "run_spread", "tflops_per_gpu", "sm_clock_mhz"):
        res[c] = res[c].astype("float64")
    return res.sort_index().reset_index(drop=True)[cols]


def compare(base: pd.DataFrame, new: pd.DataFrame, *, min_change: float = 0.05, noise_factor: float = 1.0,
            aa: Optional[pd.DataFrame] = None, normalize: str = "none", control: Optional[str] = None,
            backends: Sequence[str] = ()) -> pd.DataFrame:
    """The comparison table: one row per key in either side (of ``backends``, when given), with ``change``
    (relative change of the median latency, or of the normalised latency; + = slower), ``noise`` (relative; see
    the module docstring), ``noise_source`` (which estimate set it) and a ``verdict``. ``aa``: an A/A rerun of
    BASE. Sorted with the failing verdicts first."""
    if min_change < 0 or noise_factor < 0:
        raise ValueError("--threshold / min_change and --noise-factor must be >= 0")
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)} (got {normalize!r})")
    if (normalize == "control") != bool(control):
        raise ValueError("--normalize control needs --control BACKEND (an unchanged backend in both runs), and "
                         "--control goes only with --normalize control")
    b, n = pool(base), pool(new)
    a = pool(aa) if aa is not None else None
    cols = ["latency_ms", "p20_ms", "p80_ms", "run_spread", "num_runs", "tflops_per_gpu", "sm_clock_mhz", "status",
            "error", "git_sha", "num_rows"]
    m = b.merge(n, on=list(KEY), how="outer", suffixes=("_base", "_new"), indicator=True)
    for c in CONTEXT:
        m[c] = m[f"{c}_base"].combine_first(m[f"{c}_new"])
    gb, gn = m["gpu_name_base"], m["gpu_name_new"]
    m["env_differs"] = (gb.notna() & gn.notna() & (gb.astype(str) != gn.astype(str))).astype(bool)
    ctl = {side: _control_rows(t, control) for side, t in (("base", b), ("new", n), ("aa", a))} if control else {}
    aa_changes = _aa_changes(b, a, normalize, ctl, control) if a is not None else {}
    aa_floor = float(pd.Series(list(aa_changes.values())).abs().median()) if aa_changes else math.nan
    floors = {"A/A": aa_floor}
    records = m.to_dict("records")
    if backends:  # the backends not under test ran unchanged code: their changes are the run-to-run noise
        others = [_judge(r, min_change, noise_factor, normalize, ctl, control, math.nan, {})["change"]
                  for r in records if r["backend"] not in backends and r["backend"] != control]
        others = [abs(c) for c in others if pd.notna(c)]
        floors["other backends"] = max(others) if others else math.nan
    recs = []
    for r in records:
        rec = {k: r[k] for k in (*KEY, *CONTEXT)}
        rec.update({f"{c}_{side}": r.get(f"{c}_{side}") for c in cols for side in ("base", "new")})
        rec["env_differs"] = bool(r["env_differs"])
        cb, cn = r.get("sm_clock_mhz_base"), r.get("sm_clock_mhz_new")
        rec["clock_change"] = cn / cb - 1.0 if pd.notna(cb) and pd.notna(cn) and cb > 0 else math.nan
        key = tuple(r[k] for k in KEY)
        aa_row = aa_changes.get(key, math.nan)
        rec["aa_change"] = aa_row
        rec.update(_judge(r, min_change, noise_factor, normalize, ctl, control, aa_row, floors))
        recs.append(rec)
    out = pd.DataFrame(recs)
    if out.empty:
        return out
    if backends:
        out = out[out["backend"].isin(list(backends))]
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    out = out.assign(_rank=out["verdict"].map(rank))
    return out.sort_values(["_rank", "shape", "backend", "direction"], na_position="last").drop(
        columns="_rank").reset_index(drop=True)


def _control_rows(t: Optional[pd.DataFrame], control: Optional[str]) -> dict[tuple, dict[str, Any]]:
    """(config_hash, direction) -> the control backend's pooled row, where it is ok."""
    if t is None or not control:
        return {}
    c = t[(t["backend"] == control) & (t["status"] == "ok") & t["latency_ms"].notna()]
    return {(r["config_hash"], r["direction"]): r for r in c.to_dict("records")}


def _value(lat: Any, clock: Any, ctl_lat: Any, normalize: str) -> float:
    """The judged quantity of one side: latency, latency x SM clock (cycles, up to a constant) or latency over the
    control's latency; NaN when it cannot be formed."""
    if lat is None or pd.isna(lat):
        return math.nan
    if normalize == "clock":
        return float(lat) * float(clock) if clock is not None and pd.notna(clock) and clock > 0 else math.nan
    if normalize == "control":
        return float(lat) / float(ctl_lat) if ctl_lat is not None and pd.notna(ctl_lat) and ctl_lat > 0 else math.nan
    return float(lat)


def _aa_changes(b: pd.DataFrame, a: pd.DataFrame, normalize: str, ctl: dict, control: Optional[str]
                ) -> dict[tuple, float]:
    """Per key: the A/A rerun's relative change against BASE (same normalisation), where both are ok."""
    m = b.merge(a, on=list(KEY), suffixes=("_base", "_aa"))
    m = m[(m["status_base"] == "ok") & (m["status_aa"] == "ok")]
    out = {}
    for r in m.to_dict("records"):
        ck = (r["config_hash"], r["direction"])
        vb = _value(r["latency_ms_base"], r["sm_clock_mhz_base"],
                    ctl.get("base", {}).get(ck, {}).get("latency_ms"), normalize)
        va = _value(r["latency_ms_aa"], r["sm_clock_mhz_aa"], ctl.get("aa", {}).get(ck, {}).get("latency_ms"),
                    normalize)
        if r["backend"] == control:
            continue  # the control over itself: 0 by construction
        if pd.notna(vb) and pd.notna(va) and vb > 0:
            out[tuple(r[k] for k in KEY)] = va / vb - 1.0
    return out


def _rel_spread(r: dict[str, Any], side: str) -> tuple[float, float]:
    """(below, above): the relative distance from the median to p20 and to p80 (0 where missing)."""
    med = r.get(f"latency_ms_{side}")
    if med is None or pd.isna(med) or med <= 0:
        return 0.0, 0.0
    return _edge(r.get(f"p20_ms_{side}"), med, -1) / med, _edge(r.get(f"p80_ms_{side}"), med, +1) / med


def _judge(r: dict[str, Any], min_change: float, noise_factor: float, normalize: str, ctl: dict,
           control: Optional[str], aa_row: float, floors: dict[str, float]) -> dict[str, Any]:
    nothing = dict(change=math.nan, noise=math.nan, noise_source="", basis="")
    side = r["_merge"]
    if side == "left_only":
        return dict(nothing, verdict="missing")
    if side == "right_only":
        return dict(nothing, verdict="new")
    sb, sn = r["status_base"], r["status_new"]
    if sb == "ok" and sn != "ok":
        return dict(nothing, verdict="status change")
    if sb != "ok" and sn == "ok":
        return dict(nothing, verdict="fixed")
    if sb != "ok":
        return dict(nothing, verdict="still failing")
    ck = (r["config_hash"], r["direction"])
    cb, cn = ctl.get("base", {}).get(ck), ctl.get("new", {}).get(ck)
    if r["backend"] == control:  # the yardstick: its own change is 0 by construction
        return dict(nothing, basis="control", verdict="unchanged")
    vb = _value(r["latency_ms_base"], r["sm_clock_mhz_base"], cb["latency_ms"] if cb else None, normalize)
    vn = _value(r["latency_ms_new"], r["sm_clock_mhz_new"], cn["latency_ms"] if cn else None, normalize)
    basis = {"none": "latency", "clock": "latency x SM clock", "control": f"latency / {control}"}[normalize]
    if not (pd.notna(vb) and pd.notna(vn) and vb > 0):
        why = "no SM clock recorded" if normalize == "clock" else "control not ok on both sides"
        return dict(nothing, basis=f"{basis}: {why}", verdict="inconclusive")
    change = vn / vb - 1.0
    # the near edges of the two p20-p80 spreads (for a slowdown: BASE above its median, NEW below its median), and
    # with a control, the control's own spreads too (its noise enters the ratio)
    lo_b, hi_b = _rel_spread(r, "base")
    lo_n, hi_n = _rel_spread(r, "new")
    if normalize == "control":
        clo_b, chi_b = _rel_spread({f"{k}_base": v for k, v in cb.items()}, "base")
        clo_n, chi_n = _rel_spread({f"{k}_new": v for k, v in cn.items()}, "new")
        lo_b, hi_b, lo_n, hi_n = lo_b + chi_b, hi_b + clo_b, lo_n + chi_n, hi_n + clo_n
    spread = hi_b + lo_n * (1 + change) if change >= 0 else lo_b + hi_n * (1 + change)
    estimates = {"p20-p80": spread}
    reruns = [x for x in (r.get("run_spread_base"), r.get("run_spread_new")) if x is not None and pd.notna(x)]
    if reruns:
        estimates["reruns"] = max(reruns)
    if pd.notna(aa_row):
        estimates["A/A"] = abs(aa_row)
    for name, floor in floors.items():
        if pd.notna(floor):
            estimates[name] = max(estimates.get(name, 0.0), floor)
    source = max(estimates, key=estimates.__getitem__)
    noise = noise_factor * estimates[source]
    if set(estimates) == {"p20-p80"} and _on_cpu(r):
        # ranks on CPU cores share them with the OS: one run's p20-p80 says nothing of the next run (a tiny point
        # run twice moved 2x); without a run-to-run estimate its latency decides nothing
        return dict(change=change, noise=math.nan, noise_source="unknown (CPU: give --aa)", basis=basis,
                    verdict="inconclusive")
    if noise > min_change and abs(change) <= noise:
        verdict = "inconclusive"
    elif abs(change) > max(min_change, noise):
        verdict = "regression" if change > 0 else "improvement"
    else:
        verdict = "unchanged"
    return dict(change=change, noise=noise, noise_source=source, basis=basis, verdict=verdict)


def _on_cpu(r: dict[str, Any]) -> bool:
    return str(r.get("device") or "").lower() == "cpu"


def _edge(q: Any, median: float, sign: int) -> float:
    """Distance from the median to a quantile on the given side (0 when the quantile is missing)."""
    if q is None or pd.isna(q):
        return 0.0
    return max(0.0, sign * (float(q) - median))


def failed(table: pd.DataFrame) -> bool:
    """Whether the comparison should fail a CI gate: a regression or a status change from ok."""
    return bool(len(table)) and bool(table["verdict"].isin(FAILING).any())


def matched(table: pd.DataFrame) -> int:
    """How many rows were judged (present on both sides)."""
    return int(table["verdict"].isin(JUDGED).sum()) if len(table) else 0


def exit_code(table: pd.DataFrame) -> int:
    """0 ok, 1 regression / status change, 2 nothing matched, 3 inconclusive (see the module docstring)."""
    if matched(table) == 0:
        return EXIT_USAGE
    if failed(table):
        return EXIT_REGRESSION
    if (table["verdict"] == "inconclusive").any():
        return EXIT_INCONCLUSIVE
    return EXIT_OK


def verdict_line(table: pd.DataFrame) -> str:
    """The one overall verdict, with its exit code."""
    code = exit_code(table)
    if code == EXIT_USAGE:
        return "NO MATCH: no rows present in both BASE and NEW on (config_hash, backend, direction) (exit 2)"
    if code == EXIT_REGRESSION:
        return "FAIL: regression or status change from ok (exit 1)"
    if code == EXIT_INCONCLUSIVE:
        n = int((table["verdict"] == "inconclusive").sum())
        return (f"INCONCLUSIVE: no regression found, but {n} row{'s' if n != 1 else ''} too noisy to decide "
                "(rerun, give --aa, or --normalize) (exit 3)")
    return "OK: no regression (exit 0)"


def format_table(table: pd.DataFrame, *, show_all: bool = False) -> str:
    """A fixed-width table for the terminal: every row not unchanged (all rows with ``show_all``), a summary and
    the one verdict line."""
    if table.empty:
        return verdict_line(table)
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
            "from": shown["noise_source"].fillna(""),
            "base status": shown["status_base"].fillna("-"),
            "new status": shown["status_new"].fillna("-"),
        })
        if shown["clock_change"].notna().any():
            t.insert(t.columns.get_loc("from") + 1, "SM clock",
                     shown["clock_change"].map(lambda v: "" if pd.isna(v) else f"{v:+.1%}").to_numpy())
        lines.append(t.to_string(index=False))
        bases = sorted({b for b in shown["basis"].fillna("") if b and b != "control"})
        if bases and bases != ["latency"]:
            lines.append("change of: " + "; ".join(bases))
        for r in shown.to_dict("records"):
            if r["verdict"] == "status change" and r.get("error_new"):
                lines.append(f"  {r['backend']}/{r['direction']} {r['config_hash']}: {r['error_new']}")
        if shown["env_differs"].any():
            lines.append("warning: some matched rows ran on different GPUs (gpu_name differs)")
        if (shown["clock_change"].abs() > CLOCK_WARN).any():
            lines.append(f"warning: some matched rows ran at SM clocks more than {CLOCK_WARN:.0%} apart (power or "
                         "thermal limits): part of their latency change may come from the clock "
                         "(--normalize clock judges latency x clock)")
    counts = table["verdict"].value_counts()
    summary = ", ".join(f"{counts[v]} {v}" for v in VERDICT_ORDER if v in counts)
    lines.append(f"{len(table)} compared: {summary}")
    lines.append(verdict_line(table))
    return "\n".join(lines)


def _ms(v: Any) -> str:
    return "" if pd.isna(v) else f"{v:.4g}"


def _load(path: str, what: str, skip_damaged: bool = False) -> pd.DataFrame:
    """The rows of one side (``what``: BASE, NEW, ...); ValueError (one line) when it has none."""
    df = results.load(path, skip_damaged=skip_damaged)
    if df.empty:
        notes = [n for n in (results.skipped_note(df.attrs.get("skipped", {})),
                             results.damaged_note(df.attrs.get("damaged", {}))) if n]
        raise results.ResultsFileError(f"{what} {path}: no results rows" + (f" ({'; '.join(notes)})" if notes else ""))
    return df


def speed_sides(sides: dict[str, Optional[pd.DataFrame]]) -> tuple[list[Optional[pd.DataFrame]], dict[str, str]]:
    """Each side's rows without those that ran several ranks on one GPU (``shared_gpu``: correctness checks, no
    speed to compare), in order, and per side the note that says how many were left out. ValueError (one line) where
    that leaves a side with no row."""
    from harness.claims import speed_rows

    kept: list[Optional[pd.DataFrame]] = []
    notes: dict[str, str] = {}
    for side, df in sides.items():
        if df is None:
            kept.append(None)
            continue
        rows, note = speed_rows(df)
        if note and rows.empty:
            raise ValueError(f"{side} has no rows to compare: its {note}")
        kept.append(rows)
        if note:
            notes[side] = note
    return kept, notes


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = ArgumentParser(
        prog="python -m harness.compare", description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 no regression; 1 regression or status change from ok; 2 bad arguments, an output that "
               "cannot be written, unreadable or damaged input, rows of different environments, or no rows matched; "
               "3 inconclusive (too noisy to decide, no regression)")
    ap.add_argument("base", help="BASE results: a file or a folder")
    ap.add_argument("new", help="NEW results: a file or a folder")
    ap.add_argument("--backend", "-b", action="append", default=[], metavar="NAME",
                    help="judge only this backend's rows (repeat or comma-separate for several); default: all")
    ap.add_argument("--threshold", "--min-change", dest="min_change", type=float, default=0.05,
                    help="smallest relative latency change that matters (default 0.05 = 5%%)")
    ap.add_argument("--noise-factor", type=float, default=1.0,
                    help="scale on the noise a change must exceed (default 1.0)")
    ap.add_argument("--aa", metavar="RERUN", help="an A/A rerun of BASE (same code and configurations): its "
                                                  "change against BASE is the run-to-run noise")
    ap.add_argument("--normalize", choices=NORMALIZE, default="none",
                    help="judge latency (none), latency x SM clock (clock), or latency over --control's latency "
                         "in the same run (control)")
    ap.add_argument("--control", metavar="NAME", help="the unchanged backend for --normalize control")
    ap.add_argument("--all", action="store_true", help="also list unchanged rows")
    ap.add_argument("--csv", help="write the full comparison table to this CSV")
    ap.add_argument("--history-dir", help="write a history chart (PNG + SVG) per regressed or changed config, "
                                          "over the rows of both sides")
    ap.add_argument("--skip-damaged", action="store_true",
                    help="leave out damaged result files (binary, truncated, a value not of its column's type), "
                         "naming them, instead of refusing them")
    ap.add_argument("--mixed-env", action="store_true",
                    help="compare rows of different environments (CPU and GPU, GPU models, devices) within a side or "
                         "across BASE and NEW; refused without it")
    a = ap.parse_args(argv)
    backends = [x.strip() for b in a.backend for x in b.split(",") if x.strip()]
    try:
        for opt, value, why in (("--csv", a.csv, a.csv and file_write_problem(a.csv)),
                                ("--history-dir", a.history_dir, a.history_dir and dir_write_problem(a.history_dir))):
            if why:
                raise ValueError(f"{opt} {value} {why}; give a path you can write")
        base, new = _load(a.base, "BASE", a.skip_damaged), _load(a.new, "NEW", a.skip_damaged)
        aa = _load(a.aa, "A/A rerun", a.skip_damaged) if a.aa else None
        (base, new, aa), shared_notes = speed_sides({"BASE": base, "NEW": new, "the A/A rerun": aa})
        for name in [*backends, *([a.control] if a.control else [])]:
            if not ((base["backend"] == name).any() or (new["backend"] == name).any()):
                raise ValueError(f"backend {name!r} has no rows in BASE or NEW (backends there: "
                                 f"{', '.join(sorted(set(base['backend'].dropna()) | set(new['backend'].dropna())))})")
        sides = {"BASE": base, "NEW": new, **({"the A/A rerun": aa} if aa is not None else {})}
        if not a.mixed_env and (mix := results.mixed_environments(sides)):
            raise ValueError(f"{mix}; compare runs of one environment, or pass --mixed-env to compare them anyway")
        if a.normalize == "clock":
            for side, df in sides.items():
                judged = df[(df["status"] == "ok").fillna(False) & df["latency_ms"].notna()
                            & (df["backend"].isin(backends) if backends else True)]
                if len(judged) and not judged["sm_clock_mhz"].notna().any():
                    envs = ", ".join(results.environments(judged)) or "rows of an unknown environment"
                    raise ValueError(f"--normalize clock: no ok row of {side} recorded an SM clock ({envs}: "
                                     "sm_clock_mhz is read on GPUs only); drop --normalize clock, or use "
                                     "--normalize control --control BACKEND")
        table = compare(base, new, min_change=a.min_change, noise_factor=a.noise_factor, aa=aa,
                        normalize=a.normalize, control=a.control, backends=backends)
    except (FileNotFoundError, ValueError) as e:
        return fail("harness.compare", e)
    if matched(table) == 0:
        return fail("harness.compare", verdict_line(table) + (f" for backend {', '.join(backends)}" if backends
                                                               else ""))
    for side, df in sides.items():
        for note in (results.skipped_note(df.attrs.get("skipped", {})),
                     results.damaged_note(df.attrs.get("damaged", {})), shared_notes.get(side, "")):
            if note:
                print(f"{side}: {note}")
    print(format_table(table, show_all=a.all or bool(backends)))
    if a.csv:
        Path(a.csv).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(a.csv, index=False)
    if a.history_dir and len(table):
        from harness import plots

        both = pd.concat([base, new], ignore_index=True).drop_duplicates(list(results.KEY))
        hashes = table.loc[~table["verdict"].isin(("unchanged", "new", "missing")), "config_hash"].dropna().unique()
        for h in hashes:
            fig = plots.plot_history(both, str(h))
            for p in plots.save(fig, Path(a.history_dir) / f"history_{plots.config_slug(both, str(h))}"):
                print(p)
    return exit_code(table)


if __name__ == "__main__":
    sys.exit(main())
