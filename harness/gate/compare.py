"""Regression check between two sets of results, for gating a kernel change in CI.

    python -m harness.compare results/local/BASE_RUN results/local/NEW_RUN --backend mok_hopper
    python -m harness.compare BASE BASE_RERUN NEW --backend mok_hopper     # BASE measured twice: both are BASE
    python -m harness.compare BASE NEW --backend mok_hopper --aa BASE_RERUN  # the same verdict: --aa adds to BASE
    python -m harness.compare BASE NEW --backend mok_hopper --normalize control --control nccl
    python -m harness.gate main WORKTREE --backend mok_hopper   # runs both sides in interleaved rounds, then this

Rows are matched on (config_hash, backend, direction) (``--across-options``: on the point without the backends'
options, for a change that moves an option's default: :mod:`harness.gate.across`); ``--backend`` judges only those
backends' rows (a kernel change on its own rows, not on baselines whose code did not change). Each side is a set of
runs (``run_id``); each run gives one sample per row, its median latency. The change is estimated in log space,
log(NEW / BASE), so that swapping the sides flips its sign and nothing else, with an interval at ``--confidence``
(default 95%):

* ``rounds``: several runs a side, paired by round (run ids ending in ``-r<k>`` with the same rounds on both sides,
  as ``harness.gate`` names them, or the same runs on both sides): the mean of the per-round log ratios and a
  Student-t interval from their spread (a machine that drifts between rounds moves both runs of a round);
* ``reruns``: several runs on one side or both, not paired: the difference of the sides' mean log latencies and a
  pooled-variance Student-t interval; an A/A rerun of BASE (``--aa``) is one more BASE run, so it makes no
  difference whether a run is given as BASE or as ``--aa``;
* ``p20-p80``: one run a side: the near edges of the two p20-p80 spreads bound the change. On the CPU that bound
  says nothing of the next run (a point run twice moved 2x, with spreads a third of that): such a CPU row is
  inconclusive unless the other backends give an estimate (next);
* ``other backends`` (with ``--backend``): the backends not judged ran unchanged code; their largest change beyond
  their own run-to-run interval (their whole change, with one run a side) is the machine's, and widens every
  judged row's interval to at least that;
* ``same runs``: the same runs on both sides: the change is 0 exactly.

The interval's half-widths are scaled by ``--noise-factor``. With ``--threshold`` T (default 5%), t = log(1 + T):

* ``regression``: NEW / BASE > 1 + T and the interval lies above 0 (beyond T and outside the noise of both
  sides); ``improvement``: NEW / BASE < 1 / (1 + T) and the interval lies below 0;
* ``unchanged``: 1 / (1 + T) <= NEW / BASE <= 1 + T on a measurement that resolves T (neither half of the
  interval is wider than a factor 1 + T);
* ``inconclusive``: otherwise: a change of the size that matters could hide in the noise (run more rounds with
  ``harness.gate``, rerun on a quieter machine, or normalise);
* from the statuses: ``status change`` (ok -> not ok: fails), ``fixed``, ``still failing``, ``missing`` (in BASE
  only) and ``new`` (in NEW only).

``--normalize clock`` judges latency x SM clock (rows that recorded ``sm_clock_mhz``; assumes the layer's time
scales with the clock: a board held at a lower clock by its power limit is not read as a slower kernel);
``--normalize control --control B`` judges each run's latency over backend B's latency for the same configuration
and direction in the same run, so a machine allocation that slows every backend cancels (B's own code must
not have changed). A row that cannot be normalised (no clock, control not ok) is inconclusive.

Exit codes:
  0  no regression: every judged row unchanged, improved, fixed, new or still failing
  1  a regression, or a status change from ok (fails the gate)
  2  nothing to judge: bad arguments, an unreadable or damaged results file, or no rows matched
  3  inconclusive: no regression, but the noise of at least one judged row is too large to decide
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from harness.core import results
from harness.gate.across import match_across_options
from harness.core.tool_args import ArgumentParser, dir_write_problem, fail, file_write_problem

KEY = ("config_hash", "backend", "direction")
CONTEXT = ("shape", "precision", "tokens_per_gpu", "ep_size", "routing", "gpu_name", "device")
VERDICT_ORDER = ("regression", "status change", "inconclusive", "missing", "improvement", "fixed", "still failing",
                 "unchanged", "new")
FAILING = ("regression", "status change")
JUDGED = ("regression", "status change", "inconclusive", "improvement", "fixed", "still failing", "unchanged")
NORMALIZE = ("none", "clock", "control")
CLOCK_WARN = 0.03  # relative SM-clock change between the two sides worth a warning
EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3
ROUND = re.compile(r"[-_]r(\d+)$")  # the round of a run id, as harness.gate names them: <name>-<side>-r<k>
ACROSS_HELP = ("match rows on the point without the backends' options (for a change that flips an option's default, "
               "whose rows hash differently on the two sides); NEW's rows take the hashes of BASE's")
THRESHOLD_RULE = ("a percentage with %% (5%%) or a fraction (0.05); a bare number above 1 is refused as ambiguous; "
                  "0 <= T < 100%%")


def parse_fraction(text: str, what: str, *, low_open: bool = False) -> float:
    """A fraction written as a percentage (``5%``) or as a fraction (``0.05``), in [0, 1) (``low_open``: (0, 1)).
    Raises ValueError naming ``what`` and the fix: a bare number above 1 (``5``) could mean 5% or 500%."""
    s = str(text).strip()
    pct = s.endswith("%")
    try:
        v = float(s[:-1] if pct else s)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number: write a percentage such as 5% or a fraction such as "
                         "0.05") from None
    if not math.isfinite(v):
        raise ValueError(f"{what} {text!r} is not a finite number")
    if not pct and v > 1:
        raise ValueError(f"{what} {s} is ambiguous (5 could be 5% or 500%): write {s}% or {v / 100:g}")
    frac = v / 100 if pct else v
    if frac < 0 or frac >= 1 or (low_open and frac == 0):
        lo = "above 0%" if low_open else "at least 0%"
        raise ValueError(f"{what} {text} is out of range: it must be {lo} and below 100% (e.g. 5% or 0.05)")
    return frac


def t_quantile(confidence: float, df: int) -> float:
    """The two-sided Student-t quantile: P(|T| < q) = confidence for ``df`` degrees of freedom (df >= 1), by
    bisection on the closed form of the distribution for whole degrees of freedom (Abramowitz & Stegun 26.7)."""
    def inside(t: float) -> float:
        th = math.atan(t / math.sqrt(df))
        s, c = math.sin(th), math.cos(th)
        term = acc = 1.0
        if df % 2:
            for k in range(1, (df - 1) // 2):
                term *= c * c * (2 * k) / (2 * k + 1)
                acc += term
            return (2 / math.pi) * (th + (s * c * acc if df > 1 else 0.0))
        for k in range(1, df // 2):
            term *= c * c * (2 * k - 1) / (2 * k)
            acc += term
        return s * acc

    lo, hi = 0.0, 1e7
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if inside(mid) < confidence else (lo, mid)
    return hi


def pool(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (config_hash, backend, direction): median latency, p20 and p80 over ok rows, the median SM
    clock, and a status (``ok`` when any row is ok, else the most recent row's), with the context columns and row
    / run counts. What the table shows of a side; the verdict is taken from :func:`run_samples`."""
    cols = [*KEY, *CONTEXT, "status", "error", "latency_ms", "p20_ms", "p80_ms", "num_runs", "tflops_per_gpu",
            "sm_clock_mhz", "git_sha", "num_rows"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    d = _with_clock(df)
    d["_g"] = d.groupby(list(KEY), dropna=False, sort=False).ngroup()
    d["_ok"] = (d["status"] == "ok").fillna(False) & d["latency_ms"].notna()
    last = d.sort_values(["_g", "timestamp"], na_position="first", kind="stable").drop_duplicates("_g", keep="last")
    out = last.set_index("_g")
    okd = d[d["_ok"]]
    ok = okd.groupby("_g").agg(latency_ms=("latency_ms", "median"), p20_ms=("latency_p20_ms", "median"),
                               p80_ms=("latency_p80_ms", "median"), tflops_per_gpu=("tflops_per_gpu", "median"),
                               sm_clock_mhz=("sm_clock_mhz", "median"), num_ok=("_ok", "size"),
                               num_runs=("run_id", "nunique"))
    res = out[[*KEY, *CONTEXT]].join(ok)
    has_ok = res["num_ok"].fillna(0) > 0
    res["status"] = out["status"].astype(object).where(~has_ok, "ok").fillna("missing").astype(str)
    err = out["error"].astype(object).fillna("").map(lambda e: str(e).strip().splitlines()[0][:120] if str(e).strip()
                                                      else "")
    res["error"] = err.where(~has_ok, "")
    res["git_sha"] = out["git_sha"].astype(object).fillna("").astype(str)
    res["num_rows"] = d.groupby("_g").size()
    res["num_runs"] = res["num_runs"].fillna(0).astype(int)
    for c in ("latency_ms", "p20_ms", "p80_ms", "tflops_per_gpu", "sm_clock_mhz"):
        res[c] = res[c].astype("float64")
    return res.sort_index().reset_index(drop=True)[cols]


def _with_clock(df: pd.DataFrame) -> pd.DataFrame:
    d = df.copy()
    if "sm_clock_mhz" not in d.columns:  # results written before the clock columns existed
        d["sm_clock_mhz"] = math.nan
    return d


def run_samples(df: pd.DataFrame, normalize: str = "none", control: Optional[str] = None
                ) -> dict[tuple, dict[str, tuple[float, float, float]]]:
    """Per (config_hash, backend, direction): run_id -> (log value, down, up) of each run's ok rows: the log of its
    median latency (x its SM clock, or over the control's median latency in the same run), and the log distances
    from it down to the p20 edge and up to the p80 edge (with a control, its spread adds to both). Runs whose value
    cannot be formed (no clock, control not ok in that run) are left out."""
    if df.empty:
        return {}
    d = _with_clock(df)
    d = d[(d["status"] == "ok").fillna(False) & d["latency_ms"].notna() & (d["latency_ms"] > 0)]
    g = d.groupby([*KEY, "run_id"], dropna=False).agg(lat=("latency_ms", "median"), p20=("latency_p20_ms", "median"),
                                                      p80=("latency_p80_ms", "median"),
                                                      clock=("sm_clock_mhz", "median")).reset_index()
    g["down"] = [_gap(lat, p20) for lat, p20 in zip(g["lat"], g["p20"])]
    g["up"] = [_gap(p80, lat) for lat, p80 in zip(g["lat"], g["p80"])]
    g["v"] = g["lat"].map(math.log)
    if normalize == "clock":
        g["v"] = [v + math.log(c) if pd.notna(c) and c > 0 else math.nan for v, c in zip(g["v"], g["clock"])]
    elif normalize == "control":
        ctl = g[g["backend"] == control][["config_hash", "direction", "run_id", "v", "down", "up"]]
        g = g.merge(ctl, on=["config_hash", "direction", "run_id"], how="left", suffixes=("", "_c"))
        g["v"] = g["v"] - g["v_c"]
        g["down"], g["up"] = g["down"] + g["up_c"], g["up"] + g["down_c"]
    out: dict[tuple, dict[str, tuple[float, float, float]]] = {}
    for r in g[g["v"].notna()].to_dict("records"):
        out.setdefault(tuple(r[k] for k in KEY), {})[str(r["run_id"])] = (r["v"], r["down"], r["up"])
    return out


def _gap(hi: Any, lo: Any) -> float:
    """log(hi / lo), at least 0; 0 where either is missing."""
    if hi is None or lo is None or pd.isna(hi) or pd.isna(lo) or hi <= 0 or lo <= 0:
        return 0.0
    return max(0.0, math.log(float(hi) / float(lo)))


def pairs(base_runs: Sequence[str], new_runs: Sequence[str]) -> list[tuple[str, str]]:
    """How the runs of the two sides pair up: the same runs on both sides pair with themselves; runs whose ids end
    in ``-r<k>`` with the same set of rounds on both sides (one run per round a side) pair by round; else none."""
    if set(base_runs) == set(new_runs):
        return [(r, r) for r in sorted(base_runs)]
    rb, rn = ({int(m.group(1)): r for r in runs if (m := ROUND.search(r))} for runs in (base_runs, new_runs))
    if len(rb) != len(base_runs) or len(rn) != len(new_runs) or set(rb) != set(rn):
        return []
    return [(rb[k], rn[k]) for k in sorted(rb)]


def estimate(base: dict[str, tuple[float, float, float]], new: dict[str, tuple[float, float, float]],
             confidence: float) -> dict[str, Any]:
    """The log change of one row and the log distances from it down and up to its interval's edges: ``est``,
    ``below``, ``above``, ``source`` (see the module docstring), ``paired``, ``run_to_run`` (whether the interval
    comes from several runs) and the run counts. Swapping ``base`` and ``new`` negates ``est`` and swaps
    ``below`` and ``above``."""
    nb, nn = len(base), len(new)
    res = dict(n_base=nb, n_new=nn, paired=False, run_to_run=True)
    p = pairs(list(base), list(new))
    if p:
        d = [new[j][0] - base[i][0] for i, j in p]
        if all(x == 0 for x in d):
            return dict(res, est=0.0, below=0.0, above=0.0, source="same runs", paired=True)
        if len(d) >= 2:
            m = sum(d) / len(d)
            sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
            h = t_quantile(confidence, len(d) - 1) * sd / math.sqrt(len(d))
            return dict(res, est=m, below=h, above=h, source="rounds", paired=True)
    xb, xn = [v[0] for v in base.values()], [v[0] for v in new.values()]
    mb, mn = sum(xb) / nb, sum(xn) / nn
    if nb + nn >= 3:
        df = nb + nn - 2
        ss = sum((x - mb) ** 2 for x in xb) + sum((x - mn) ** 2 for x in xn)
        h = t_quantile(confidence, df) * math.sqrt(ss / df * (1 / nb + 1 / nn))
        return dict(res, est=mn - mb, below=h, above=h, source="reruns")
    (_, db, ub), (_, dn, un) = next(iter(base.values())), next(iter(new.values()))
    # one run a side: NEW at its lower edge against BASE at its upper edge bounds the change from below
    return dict(res, est=mn - mb, below=ub + dn, above=db + un, source="p20-p80", run_to_run=False)


def check_options(min_change: float, noise_factor: float, normalize: str, control: Optional[str],
                  confidence: float) -> None:
    """Raises ValueError naming the option when :func:`compare`'s options cannot work together."""
    if not 0 <= min_change < 1 or noise_factor < 0:
        raise ValueError("--threshold / min_change must be in [0, 1) and --noise-factor >= 0")
    if not 0 < confidence < 1:
        raise ValueError("--confidence must be above 0% and below 100%")
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)} (got {normalize!r})")
    if (normalize == "control") != bool(control):
        raise ValueError("--normalize control needs --control BACKEND (an unchanged backend in both runs), and "
                         "--control goes only with --normalize control")


def compare(base: pd.DataFrame, new: pd.DataFrame, *, min_change: float = 0.05, noise_factor: float = 1.0,
            aa: Optional[pd.DataFrame] = None, normalize: str = "none", control: Optional[str] = None,
            backends: Sequence[str] = (), confidence: float = 0.95) -> pd.DataFrame:
    """The comparison table: one row per key in either side (of ``backends``, when given), with ``change``
    (NEW / BASE - 1 of the latency, or of the normalised latency; + = slower), its interval ``change_low`` ..
    ``change_high``, ``noise`` (the wider half of the interval, as a factor - 1), ``noise_source`` (see the module
    docstring), the run counts and a ``verdict``. ``aa``: A/A reruns of BASE, pooled with BASE as BASE runs.
    ``min_change``: the threshold T as a fraction. Sorted with the failing verdicts first."""
    check_options(min_change, noise_factor, normalize, control, confidence)
    if aa is not None and len(aa):
        base = pd.concat([base, aa], ignore_index=True)
    b, n = pool(base), pool(new)
    sb, sn = run_samples(base, normalize, control), run_samples(new, normalize, control)
    cols = ["latency_ms", "p20_ms", "p80_ms", "num_runs", "tflops_per_gpu", "sm_clock_mhz", "status", "error",
            "git_sha", "num_rows"]
    m = b.merge(n, on=list(KEY), how="outer", suffixes=("_base", "_new"), indicator=True)
    for c in CONTEXT:
        m[c] = m[f"{c}_base"].combine_first(m[f"{c}_new"])
    gb, gn = m["gpu_name_base"], m["gpu_name_new"]
    m["env_differs"] = (gb.notna() & gn.notna() & (gb.astype(str) != gn.astype(str))).astype(bool)
    records = m.to_dict("records")
    ests = {}
    for r in records:
        key = tuple(r[k] for k in KEY)
        if r["_merge"] == "both" and r["status_base"] == "ok" and r["status_new"] == "ok" and key in sb \
                and key in sn and r["backend"] != control:
            ests[key] = estimate(sb[key], sn[key], confidence)
    floor = math.nan
    if backends:  # the backends not under test ran unchanged code: their changes beyond their noise are the machine's
        others = [max(0.0, abs(e["est"]) - (max(e["below"], e["above"]) if e["run_to_run"] else 0.0))
                  for k, e in ests.items() if k[1] not in backends]
        floor = max(others) if others else math.nan
    recs = []
    for r in records:
        rec = {k: r[k] for k in (*KEY, *CONTEXT)}
        rec.update({f"{c}_{side}": r.get(f"{c}_{side}") for c in cols for side in ("base", "new")})
        rec["env_differs"] = bool(r["env_differs"])
        cb, cn = r.get("sm_clock_mhz_base"), r.get("sm_clock_mhz_new")
        rec["clock_change"] = cn / cb - 1.0 if pd.notna(cb) and pd.notna(cn) and cb > 0 else math.nan
        rec.update(_judge(r, ests.get(tuple(r[k] for k in KEY)), min_change, noise_factor, normalize, control,
                          floor))
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


def _judge(r: dict[str, Any], e: Optional[dict[str, Any]], min_change: float, noise_factor: float, normalize: str,
           control: Optional[str], floor: float) -> dict[str, Any]:
    nothing = dict(change=math.nan, change_low=math.nan, change_high=math.nan, noise=math.nan, noise_source="",
                   basis="", n_base=0, n_new=0, paired=False)
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
    if r["backend"] == control:  # the yardstick: its own change is 0 by construction
        return dict(nothing, basis="control", verdict="unchanged")
    basis = {"none": "latency", "clock": "latency x SM clock", "control": f"latency / {control}"}[normalize]
    if e is None:
        why = "no SM clock recorded" if normalize == "clock" else "control not ok on both sides"
        return dict(nothing, basis=f"{basis}: {why}", verdict="inconclusive")
    est, below, above, source = e["est"], e["below"], e["above"], e["source"]
    counts = dict(n_base=e["n_base"], n_new=e["n_new"], paired=e["paired"], basis=basis, change=math.expm1(est))
    if pd.notna(floor) and floor > max(below, above):
        source = "other backends"
    if pd.notna(floor):
        below, above = max(below, floor), max(above, floor)
    if source == "p20-p80" and _on_cpu(r):
        # ranks on CPU cores share them with the OS: one run's p20-p80 says nothing of the next run (a tiny point
        # run twice moved 2x); without a run-to-run estimate its latency decides nothing
        return dict(nothing, **counts, noise_source="unknown (CPU: one run a side; use harness.gate)",
                    verdict="inconclusive")
    below, above = noise_factor * below, noise_factor * above
    lo, hi, t = est - below, est + above, math.log1p(min_change)
    if est > t and lo > 0:
        verdict = "regression"
    elif est < -t and hi < 0:
        verdict = "improvement"
    elif abs(est) <= t and max(below, above) <= t:
        verdict = "unchanged"
    else:
        verdict = "inconclusive"
    return dict(counts, change_low=math.expm1(lo), change_high=math.expm1(hi), noise=math.expm1(max(below, above)),
                noise_source=source, verdict=verdict)


def _on_cpu(r: dict[str, Any]) -> bool:
    return str(r.get("device") or "").lower() == "cpu"


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
                "(run more rounds with harness.gate, rerun on a quieter machine, or --normalize) (exit 3)")
    return "OK: no regression (exit 0)"


def no_match_line(base: pd.DataFrame, new: pd.DataFrame, backends: Sequence[str] = ()) -> str:
    """NO MATCH, with the backends judged and the backends each side holds (what to run or judge instead)."""
    judged = f" of backend {', '.join(backends)}" if backends else ""

    def names(df: pd.DataFrame) -> list[str]:
        return sorted(set(df["backend"].dropna().astype(str))) if len(df) and "backend" in df else []

    nb, nn = names(base), names(new)
    line = (f"NO MATCH: no rows{judged} present in both BASE and NEW on (config_hash, backend, direction) (exit 2); "
            f"BASE holds {', '.join(nb) or 'no rows'}; NEW holds {', '.join(nn) or 'no rows'}")
    both = set(nb) & set(nn)
    if both & set(backends) if backends else both:
        line += ("; where the change flips a backend option's default, its rows hash differently: judge them with "
                 "--across-options")
    return line


def format_table(table: pd.DataFrame, *, show_all: bool = False) -> str:
    """A fixed-width table for the terminal: every row not unchanged (all rows with ``show_all``), a summary and
    the one verdict line. ``change`` is NEW / BASE - 1 with its interval; ``runs`` the runs a side."""
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
            "interval": [_interval(lo, hi) for lo, hi in zip(shown["change_low"], shown["change_high"])],
            "noise": shown["noise"].map(lambda v: "" if pd.isna(v) else f"{v:.1%}"),
            "from": shown["noise_source"].fillna(""),
            "runs": [_runs(nb, nn, p) for nb, nn, p in zip(shown["n_base"], shown["n_new"], shown["paired"])],
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


def _interval(lo: Any, hi: Any) -> str:
    return "" if pd.isna(lo) or pd.isna(hi) else f"[{lo:+.1%}, {hi:+.1%}]"


def _runs(nb: Any, nn: Any, paired: Any) -> str:
    if not nb or not nn or pd.isna(nb) or pd.isna(nn):
        return ""
    return f"{int(nb)}+{int(nn)}" + (" paired" if paired else "")


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
    from harness.report.claims import speed_rows

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


def _load_side(paths: Sequence[str], what: str, skip_damaged: bool = False) -> pd.DataFrame:
    """The rows of one side given as several results paths (each read by :func:`_load`), as one frame."""
    frames = [_load(p, what, skip_damaged) for p in paths]
    if len(frames) == 1:
        return frames[0]
    df = pd.concat(frames, ignore_index=True).drop_duplicates(list(results.KEY))  # a path named twice
    skipped: dict[str, list] = {}
    for f in frames:
        for why, files in f.attrs.get("skipped", {}).items():
            skipped.setdefault(why, []).extend(files)
    df.attrs["skipped"] = skipped
    return df


def _parser() -> ArgumentParser:
    """The command line of ``python -m harness.compare``."""
    ap = ArgumentParser(
        prog="python -m harness.compare", description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 no regression; 1 regression or status change from ok; 2 bad arguments, an output that "
               "cannot be written, unreadable or damaged input, rows of different environments, or no rows matched; "
               "3 inconclusive (too noisy to decide, no regression)")
    ap.add_argument("base", nargs="+", help="BASE results: a file or a folder; several: each holds runs of BASE's "
                                            "code (all are BASE)")
    ap.add_argument("new", help="NEW results: a file or a folder")
    ap.add_argument("--backend", "-b", action="append", default=[], metavar="NAME",
                    help="judge only this backend's rows (repeat or comma-separate for several); default: all")
    ap.add_argument("--threshold", "--min-change", dest="min_change", default="5%", metavar="T",
                    help="smallest latency change that matters, NEW / BASE beyond 1 + T or below 1 / (1 + T) "
                         f"(default 5%%): {THRESHOLD_RULE}")
    ap.add_argument("--confidence", default="95%", metavar="C",
                    help="confidence of the change's interval (default 95%%; written like --threshold)")
    ap.add_argument("--noise-factor", type=float, default=1.0,
                    help="scale on the interval's half-widths (default 1.0)")
    ap.add_argument("--aa", metavar="RERUN", action="append", default=[],
                    help="an A/A rerun of BASE (same code and configurations): one more BASE run (repeatable)")
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
    ap.add_argument("--across-options", action="store_true", help=ACROSS_HELP)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    backends = [x.strip() for b in a.backend for x in b.split(",") if x.strip()]
    try:
        min_change = parse_fraction(a.min_change, "--threshold")
        confidence = parse_fraction(a.confidence, "--confidence", low_open=True)
        for opt, value, why in (("--csv", a.csv, a.csv and file_write_problem(a.csv)),
                                ("--history-dir", a.history_dir, a.history_dir and dir_write_problem(a.history_dir))):
            if why:
                raise ValueError(f"{opt} {value} {why}; give a path you can write")
        base, new = _load_side(a.base, "BASE", a.skip_damaged), _load(a.new, "NEW", a.skip_damaged)
        aa = _load_side(a.aa, "A/A rerun", a.skip_damaged) if a.aa else None
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
        across = []
        if a.across_options:
            base, new, aa, across = match_across_options(base, new, aa)
        table = compare(base, new, min_change=min_change, noise_factor=a.noise_factor, aa=aa,
                        normalize=a.normalize, control=a.control, backends=backends, confidence=confidence)
    except (FileNotFoundError, ValueError) as e:
        return fail("harness.compare", e)
    for line in across:
        print(line)
    if matched(table) == 0:
        return fail("harness.compare", no_match_line(base if aa is None else pd.concat([base, aa]), new, backends))
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
        from harness.report import plots

        both = pd.concat([base, new], ignore_index=True).drop_duplicates(list(results.KEY))
        hashes = table.loc[~table["verdict"].isin(("unchanged", "new", "missing")), "config_hash"].dropna().unique()
        for h in hashes:
            fig = plots.plot_history(both, str(h))
            for p in plots.save(fig, Path(a.history_dir) / f"history_{plots.config_slug(both, str(h))}"):
                print(p)
    return exit_code(table)


if __name__ == "__main__":
    from harness.core.own_packages import exit_on_clash

    exit_on_clash()
    sys.exit(main())
