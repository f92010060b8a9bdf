"""The Markdown of the reports: the claims tables, rows not ok, GPU clocks and the texts that say what a table
compares (``harness.report`` writes a full report with them, ``harness.report.summary`` the committed one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from harness.report.claims import ENV_KEYS, READ_ERROR_TFLOPS, fused_columns, published_counts
from harness.report.labels import env_label, is_anchor, isna, panel_label, shape_label, system_label
from harness.core.run_names import display_name

REPO_ROOT = Path(__file__).resolve().parents[2]


def rel_path(p: Path) -> str:
    """``p`` relative to the repository where it lies inside it, else as given."""
    try:
        return p.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(p)


def _fmt_tflops(v: Any) -> str:
    return "" if isna(v) else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}")


def _fmt_x(v: Any) -> str:
    return "" if isna(v) else f"{v:.2f}×"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[str(c).replace("|", "\\|") for c in r] for r in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


SCOPE_TEXT = {
    "run": "Scope: each run on its own. A speedup compares systems measured in the same run (same machine allocation, "
           "code and baseline builds); runs are listed newest first. `--pool` pools runs, `--scope latest` keeps each "
           "environment's latest run.",
    "latest": "Scope: for each environment, its latest run only. A speedup compares systems measured in that run.",
    "pooled": "**Scope: POOLED across runs** (`--pool`): each cell is the median over every run that measured it: "
              "kernel versions, machine allocations, compiled and eager baselines mixed. Not a comparison made in one "
              "run.",
}


METHOD_TEXT = (
    "TFLOP/s per GPU by the published formula 6·(T + T·topk)·H·I (×2 backward, ×3 fwd+bwd). Speedup = fused "
    "kernel / fastest ok baseline, computed only within one run, one environment (GPU, EP size, tokens per "
    "GPU, nodes) and routing. Anchors (marked \"(anchor)\": fused MoE layers a user could pick instead, "
    "Liger-Kernel, SonicMoE, LigerCute, DeepGEMM MegaMoE) are shown beside the baselines but never counted as "
    "one, so the published-claim verdicts stay against the baselines; where a run has anchors, \"× all\" is "
    "the fused kernel over the fastest of all (baselines and anchors). Rows of the MoK Hopper CPU twin ran the "
    "pure-torch twin on the CPU, not the kernel. Published values were read off the published figure (GB300 "
    f"NVL72, EP=64, 2048 tokens/GPU, ±{READ_ERROR_TFLOPS:.0f} TFLOP/s); they are shown beside measured ones, and "
    "a measured / published "
    "TFLOP/s ratio only where the environment matches. Cells show a status instead of a number when the row is "
    "not ok; — means no row.")


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
    out += [SCOPE_TEXT[scope], "", METHOD_TEXT, ""]
    out += [f"{n}." for n in claims.attrs.get("notes", [])] + ([""] if claims.attrs.get("notes") else [])
    if not headline.empty:
        out += ["## Headline: maximum speedup per panel", ""]
        rows = []
        for r in headline.to_dict("records"):
            env = env_label(r)
            rows.append([env, panel_label(r["precision"], r["direction"]), system_label(r["fused"]),
                         _fmt_x(r["max_speedup"]), shape_label(r["at_shape"]) if r["at_shape"] else "",
                         system_label(r["best_baseline"]) if r["best_baseline"] else "", r["cells_with_speedup"],
                         _fmt_x(r["published_max_speedup"]), _fmt_x(r["claimed_max_speedup"]),
                         "" if isna(r["measured_over_claim"]) else f"{r['measured_over_claim']:.2f}", r["verdict"]])
        out += [md_table(["environment", "panel", "fused kernel", "max speedup", "at shape", "over", "cells",
                           "published max (same shapes)", "README claim", "measured / claim", "verdict"], rows),
                ""]
        with_all = [r for r in headline.to_dict("records") if not isna(r.get("min_speedup_all"))]
        if with_all and claims["best_anchor"].astype(str).ne("").any():
            out += ["### Against the fastest of all (baselines and anchors)", ""]
            rows = [[env_label(r), panel_label(r["precision"], r["direction"]), system_label(r["fused"]),
                     _fmt_x(r["min_speedup_all"]), shape_label(r["min_all_at_shape"]),
                     system_label(r["min_all_over"]), _fmt_x(r["max_speedup_all"])] for r in with_all]
            out += [md_table(["environment", "panel", "fused kernel", "min speedup", "at shape", "over",
                               "max speedup"], rows), ""]
    out += claims_sections(claims)
    out += not_ok_section(not_ok)
    if timing is not None and not timing.empty:
        warm, iters = published_counts()
        out += ["## Iteration counts other than the published ones", "",
                f"The published timing is {warm} warmup and {iters} timed iterations per measurement; these ok rows "
                "were timed with other counts (their `timing_preset` is `custom`, or the preset they ran).", ""]
        rows = [[env_label(r), f"{r['num_warmup']} / {r['num_iters']}",
                 ", ".join(system_label(b) for b in r["backends"].split(", ")), str(r["rows"])]
                for r in timing.to_dict("records")]
        out += [md_table(["run and environment", "warmup / timed", "systems", "rows"], rows), ""]
    out += clocks_section(clocks)
    if charts:
        rel = [p.relative_to(out_dir).as_posix() if out_dir and p.is_relative_to(out_dir) else p.name
               for p in charts if p.suffix == ".png"]
        out += ["## Charts", ""] + [f"![{Path(r).stem}]({r})" for r in rel] + [""]
    return "\n".join(out)


def claims_sections(claims: pd.DataFrame, heading: str = "##") -> list[str]:
    """One claims table per run, environment and routing (each under a heading of level ``heading``: its
    environment; none where ``heading`` is empty), with the measured / published ratios where they apply."""
    out: list[str] = []
    if claims.empty:
        return out
    systems = [c.removeprefix("tflops_") for c in claims.columns if c.startswith("tflops_")]
    fused = fused_columns(claims)
    for key, g in claims.groupby([*ENV_KEYS, "routing"], dropna=False, sort=False):
        env = dict(zip([*ENV_KEYS, "routing"], key))
        here = [s for s in systems if not g[f"status_{s}"].eq("missing").all()]
        out += [f"{heading} {env_label(env)}", ""] if heading else []
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
                         r["baselines_ok"], *[_over(r, f, "") for f in fused if f in here],
                         *([system_label(r["best_overall"]) if r["best_overall"] else "none ok"]
                           if anchored else []),
                         *[_over(r, f, "all_") for f in all_cols],
                         system_label(r["published_best_baseline"]) if r["published_best_baseline"] else "",
                         _fmt_x(r["published_speedup"])])
        out += [md_table(header, rows), ""]
        ratio_cols = [c for c in g.columns if c.startswith("ratio_") and g[c].notna().any()]
        if g["env_matches_published"].any() and ratio_cols and (g["data"] == "measured").all():
            out += ["Measured / published TFLOP/s (same environment as the published figure):", ""]
            rrows = [[panel_label(r["precision"], r["direction"]), shape_label(r["shape"]),
                      *["" if isna(r[c]) else f"{r[c]:.2f}" for c in ratio_cols]]
                     for r in g.to_dict("records") if r["env_matches_published"]]
            out += [md_table(["panel", "shape", *[system_label(c.removeprefix("ratio_")) for c in ratio_cols]],
                              rrows), ""]
    return out


def _over(r: dict[str, Any], fused: str, kind: str) -> str:
    """A fused kernel's ``speedup_<kind><fused>``, naming the system it is over where that is not the cell's
    fastest (a cell with forwards of both kinds: each is over its own kind, ``claims.claims_table``)."""
    text = _fmt_x(r[f"speedup_{kind}{fused}"])
    over = r.get(f"over_{kind}{fused}", "")
    shown = r["best_overall"] if kind else r["best_baseline"]
    return f"{text} over {system_label(over)}" if text and over and over != shown else text


def not_ok_section(not_ok: pd.DataFrame, title: str = "## Rows not ok") -> list[str]:
    out = [title, ""]
    if not_ok.empty:
        return out + ["None: every row is ok.", ""]
    rows = [[env_label(r), panel_label(r["precision"], r["direction"]), shape_label(r["shape"]),
             system_label(r["backend"]), r["status"], r["error"], display_name(r["run_id"])]
            for r in not_ok.to_dict("records")]
    return out + [md_table(["environment", "panel", "shape", "system", "status", "error", "run"], rows), ""]


def clocks_section(clocks: Optional[pd.DataFrame], title: str = "## GPU clocks while timed") -> list[str]:
    if clocks is None or clocks.empty:
        return []
    out = [title, "",
           "Median (lowest) SM clock reading of the timed iterations on the slowest rank, mean board power, "
           "the share of that time the driver held the clocks down for the power limit (NVML), and one GPU's "
           "energy per call (power x latency). A row timed at a lower clock than another is slower for that "
           "reason too.", ""]
    rows = [[env_label(r), panel_label(r["precision"], r["direction"]), shape_label(r["shape"]),
             system_label(r["backend"]), f"{r['sm_clock_mhz']:.0f}"
             + ("" if isna(r["sm_clock_min_mhz"]) else f" ({r['sm_clock_min_mhz']:.0f})"),
             "" if isna(r["power_w"]) else f"{r['power_w']:.0f}",
             "" if isna(r["power_capped_fraction"]) else f"{100 * r['power_capped_fraction']:.0f}%",
             "" if isna(r.get("energy_mj")) else f"{r['energy_mj']:.0f}", display_name(r["run_id"])]
            for r in clocks.to_dict("records")]
    return out + [md_table(["environment", "panel", "shape", "system", "SM clock MHz", "power W", "power-capped",
                             "energy mJ", "run"], rows), ""]
