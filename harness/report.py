"""Claims table and report: does the published claim reproduce on these results?

    python -m harness.report                          # the committed runs -> results/REPORT.md, results/figures/
    python -m harness.report results/local            # your own runs -> results/local/reports/ (ignored by git)
    python -m harness.report results/runs --out /tmp/rep    # every committed run, every table and chart
    python -m harness.report results/runs --pool --out /tmp/pool    # the median over every run, labelled POOLED
    python -m harness.report results/runs/2026* --out /tmp/rep --calibration calib.csv
    python -m harness.report --include-published --no-measured --out /tmp/pub   # the published figure alone

With no paths and no ``--out``, the committed report: ``results/REPORT.md`` (the latest measured verdicts,
``harness.verdicts``, and the runs they cite), its headline charts in ``results/figures/`` (PNG) and the verdict
block of README.md; it takes no other option. Otherwise a full report into ``--out`` (default
``results/local/reports``): ``claims.md``, the CSVs and every chart.

For each panel (precision x direction) and shape, within one run (by default: ``--scope``), one environment (GPU, EP
size, tokens per GPU, nodes) and routing: each system's TFLOP/s per GPU, the fastest baseline, and each fused
kernel's speedup over it. The published figure's values (``results/published/``, read off the chart, GB300 NVL72,
EP=64, 2048 tokens/GPU) sit beside them; a measured / published ratio of TFLOP/s is given only where the environment
matches the published one. Rows that are not ok keep their status in the table and are listed with their error.

Python API: :func:`format_markdown`, :func:`write_report`, :func:`write_summary`; the tables they hold are
``harness.claims``'s (:func:`~harness.claims.load_published`, :func:`~harness.claims.claims_table`,
:func:`~harness.claims.headline_table`, ...) and ``harness.verdicts``'s, the names and order ``harness.labels``'s, the
charts ``harness.plots``'s.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import pandas as pd

from harness import results
from harness.cli_args import ArgumentParser, Progress, dir_write_problem, fail, is_inside
from harness.claims import (ENV_KEYS, PUBLISHED_CLAIMS, PUBLISHED_FIGURE, READ_ERROR_TFLOPS, SCOPES, claims_table,
                            clock_rows, fused_columns, headline_table, is_published, load_claims, load_published,
                            not_ok_rows, prepare, published_counts, select_env, timing_counts)
from harness.labels import NOT_CONTENDERS, env_label, is_anchor, isna, panel_label, shape_label, system_label

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = results.LOCAL_RUNS / "reports"  # a full report's folder, ignored by git
README = REPO_ROOT / "README.md"  # its verdict block is rewritten with the committed report


# ---------------------------------------------------------------------------------------------------------------
# Markdown


def _fmt_tflops(v: Any) -> str:
    return "" if isna(v) else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}")


def _fmt_x(v: Any) -> str:
    return "" if isna(v) else f"{v:.2f}×"


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


METHOD_TEXT = (
    "TFLOP/s per GPU by the published formula 6·(T + T·topk)·H·I (×2 backward, ×3 fwd+bwd). Speedup = fused "
    "kernel / fastest ok baseline, computed only within one run, one environment (GPU, EP size, tokens per "
    "GPU, nodes) and routing. Anchors (marked \"(anchor)\": fused MoE layers a user could pick instead, "
    "Liger-Kernel, SonicMoE, LigerCute, DeepGEMM MegaMoE) are shown beside the baselines but never counted as one, so the published-claim "
    "verdicts stay against the baselines; where a run has anchors, \"× all\" is the fused kernel over the "
    "fastest of all (baselines and anchors). Rows of the MoK Hopper CPU twin ran the pure-torch twin on the CPU, "
    "not the kernel. Published values were read off the published figure (GB300 NVL72, EP=64, 2048 tokens/GPU, "
    f"±{READ_ERROR_TFLOPS:.0f} TFLOP/s); they are shown beside measured ones, and a measured / published "
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
        out += [_md_table(["environment", "panel", "fused kernel", "max speedup", "at shape", "over", "cells",
                           "published max (same shapes)", "README claim", "measured / claim", "verdict"], rows),
                ""]
        with_all = [r for r in headline.to_dict("records") if not isna(r.get("min_speedup_all"))]
        if with_all and claims["best_anchor"].astype(str).ne("").any():
            out += ["### Against the fastest of all (baselines and anchors)", ""]
            rows = [[env_label(r), panel_label(r["precision"], r["direction"]), system_label(r["fused"]),
                     _fmt_x(r["min_speedup_all"]), shape_label(r["min_all_at_shape"]),
                     system_label(r["min_all_over"]), _fmt_x(r["max_speedup_all"])] for r in with_all]
            out += [_md_table(["environment", "panel", "fused kernel", "min speedup", "at shape", "over",
                               "max speedup"], rows), ""]
    out += _claims_sections(claims)
    out += _not_ok_section(not_ok)
    if timing is not None and not timing.empty:
        warm, iters = published_counts()
        out += ["## Iteration counts other than the published ones", "",
                f"The published timing is {warm} warmup and {iters} timed iterations per measurement; these ok rows "
                "were timed with other counts (their `timing_preset` is `custom`, or the preset they ran).", ""]
        rows = [[env_label(r), f"{r['num_warmup']} / {r['num_iters']}",
                 ", ".join(system_label(b) for b in r["backends"].split(", ")), str(r["rows"])]
                for r in timing.to_dict("records")]
        out += [_md_table(["run and environment", "warmup / timed", "systems", "rows"], rows), ""]
    out += _clocks_section(clocks)
    if charts:
        rel = [p.relative_to(out_dir).as_posix() if out_dir and p.is_relative_to(out_dir) else p.name
               for p in charts if p.suffix == ".png"]
        out += ["## Charts", ""] + [f"![{Path(r).stem}]({r})" for r in rel] + [""]
    return "\n".join(out)


def _claims_sections(claims: pd.DataFrame, heading: str = "##") -> list[str]:
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
                      *["" if isna(r[c]) else f"{r[c]:.2f}" for c in ratio_cols]]
                     for r in g.to_dict("records") if r["env_matches_published"]]
            out += [_md_table(["panel", "shape", *[system_label(c.removeprefix("ratio_")) for c in ratio_cols]],
                              rrows), ""]
    return out


def _not_ok_section(not_ok: pd.DataFrame, title: str = "## Rows not ok") -> list[str]:
    out = [title, ""]
    if not_ok.empty:
        return out + ["None: every row is ok.", ""]
    rows = [[env_label(r), panel_label(r["precision"], r["direction"]), shape_label(r["shape"]),
             system_label(r["backend"]), r["status"], r["error"], r["run_id"]] for r in not_ok.to_dict("records")]
    return out + [_md_table(["environment", "panel", "shape", "system", "status", "error", "run"], rows), ""]


def _clocks_section(clocks: Optional[pd.DataFrame], title: str = "## GPU clocks while timed") -> list[str]:
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
             "" if isna(r.get("energy_mj")) else f"{r['energy_mj']:.0f}", r["run_id"]]
            for r in clocks.to_dict("records")]
    return out + [_md_table(["environment", "panel", "shape", "system", "SM clock MHz", "power W", "power-capped",
                             "energy mJ", "run"], rows), ""]


# ---------------------------------------------------------------------------------------------------------------
# the report


def write_report(df: pd.DataFrame, out_dir: Union[str, Path] = DEFAULT_OUT, *,
                 published: Optional[pd.DataFrame] = None, readme_claims: Optional[pd.DataFrame] = None,
                 calibration: Optional[pd.DataFrame] = None, charts: bool = True,
                 formats: Sequence[str] = ("png", "svg"), history: Sequence[str] = (),
                 sources: str = "", scope: str = "run", progress: Optional[Progress] = None) -> dict[str, Path]:
    """Write ``claims.md``, ``claims.csv``, ``headline.csv``, ``not_ok.csv``, ``clocks.csv`` (where rows recorded
    a GPU clock) and (``charts=True``) every chart the data supports into ``out_dir``, comparing within each run
    (``scope``: see :func:`prepare`). ``history``: config hashes to draw a git-SHA history for (across runs, by
    nature). ``progress`` (a :class:`harness.cli_args.Progress`) is told each stage and chart. Returns name ->
    path."""
    progress = progress or Progress(enabled=False)
    progress.note(f"building the tables of {len(df)} rows")
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

        def on_chart(i: int, n: int, name: str) -> None:
            if i == 1:
                progress.start("rendering chart", n,
                               intro=f"rendering {n} chart{'s' if n != 1 else ''} ({', '.join(formats)}) into {out}")
            progress.step(i, n, name)

        drawn = plots.report_charts(df, out, calibration=calibration, formats=formats, history=history,
                                    history_rows=history_rows, progress=on_chart)
        for name, paths in drawn.items():
            chart_paths += paths
            for p in paths:
                written[p.name] = p
        if drawn:
            progress.close(f"rendered {len(drawn)} chart{'s' if len(drawn) != 1 else ''} ({len(chart_paths)} "
                           "files) in {s} s")
    md = out / "claims.md"
    md.write_text(format_markdown(claims, head, bad, sources=sources, charts=chart_paths, clocks=clocks,
                                  scope=scope, out_dir=out, timing=timing_counts(df)))
    written["claims.md"] = md
    return written


# ---------------------------------------------------------------------------------------------------------------
# the committed report: results/REPORT.md and its headline charts


SUMMARY_SCOPE = (
    "Each verdict compares systems measured in one run (same lease, code and baseline builds), never across runs. "
    "For each environment kind (GPU model, GPUs of the machine, EP size, tokens per GPU, nodes) and panel "
    "(precision x direction), the verdict table takes the newest run in which a contender (MoK Hopper; MoK where "
    "measured) and at least one baseline are ok on the same shape: the speedup is the contender's TFLOP/s over the "
    "fastest ok baseline's on each such shape of that run (min-max over the shapes), and over the fastest anchor "
    "where the run has anchors. Its flags say how that run compared them: `timing` (the timing preset, "
    "`published` only where every compared row ran the published iteration counts, else the preset and its "
    "warmup/timed counts), `baseline` (whether the fastest baseline ran eager or under torch.compile, and its mode) "
    "and `fp8` (the fastest baseline's fp8 GEMMs: real, with their path, or emulated: bf16 GEMMs on e4m3 values, "
    "which measure accuracy, not fp8 speed). The published claims are the published figure's maxima on GB300 NVL72 "
    "at EP 64 (MXFP8 where the panel here is Hopper's fp8): side by side, not a ratio.")


def format_summary(df: pd.DataFrame, verdicts: pd.DataFrame, block: str, charts: Sequence[str], *,
                   published: Optional[pd.DataFrame] = None) -> str:
    """results/REPORT.md: scope, the verdict table (``block``, between the markers), then for each environment kind
    the runs the verdicts cite (their ``charts``, file names under ``figures/``, and claims tables), the published
    figure's values, the rows not ok and the GPU clocks of those runs, and how to make a full report."""
    from harness.plots import chart_stem  # (matplotlib only where a report is written)
    from harness.verdicts import COMMAND, MARK_END, MARK_START, RUN_ENV_KEYS, cited_runs

    measured = df[~is_published(df)]
    d = prepare(measured, "run")
    runs = measured["run_id"].nunique()
    out = ["# MoE layer throughput: report", "",
           f"Generated by `{COMMAND}` from {_rel(results.REFERENCE_RUNS)}: {len(measured)} measured rows from "
           f"{runs} run{'s' if runs != 1 else ''}. Do not edit by hand: rerun the command.", "",
           SUMMARY_SCOPE, "", "## The latest measured verdicts", "", MARK_START, block, MARK_END, "",
           "## The runs behind the verdicts", "", METHOD_TEXT, ""]
    cited = cited_runs(verdicts)
    shown = []
    for kind in dict.fromkeys(c["kind"] for c in cited):
        out += [f"### {kind}", ""]
        for c in (c for c in cited if c["kind"] == kind):
            env = {k: c[k] for k in RUN_ENV_KEYS}
            rows = select_env(d, env)
            shown.append(rows)
            mine = verdicts[(verdicts["environment"] == kind) & (verdicts["run_id"] == c["run_id"])]
            out += [f"#### `{c['run_id']}`: the {', '.join(mine['panel'])} verdict{'s' if len(mine) > 1 else ''}", ""]
            stems = [chart_stem(k, env) for k in ("panels", "roofline")]
            out += [f"![{n.partition('_')[0]} of {c['run_id']}](figures/{n})" for n in charts
                    if Path(n).stem in stems]
            out += [""] + _claims_sections(claims_table(rows, published), heading="")
    if published is not None and len(published):
        out += ["## The published figure's values (published, not measured here)", "",
                "Read off the published figure (GB300 NVL72, EP 64, 2048 tokens/GPU, "
                f"±{READ_ERROR_TFLOPS:.0f} TFLOP/s): what the claims above come from.", ""]
        out += _claims_sections(claims_table(prepare(published, "run"), published), heading="")
    rows = pd.concat(shown, ignore_index=True) if shown else d.iloc[:0]
    out += _not_ok_section(not_ok_rows(rows), "## Rows not ok in these runs")
    out += _clocks_section(clock_rows(rows), "## GPU clocks while timed, in these runs")
    out += ["## Every run, every chart", "",
            "This report shows the runs the verdicts cite. A full report (claims tables, CSVs and every chart, PNG "
            f"and SVG) of every committed run: `{COMMAND} results/runs --out DIR`; of one run: "
            f"`{COMMAND} results/runs/<run> --out DIR`.", ""]
    return "\n".join(out)


IMAGE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".pdf", ".gif")


def write_summary(df: pd.DataFrame, root: Union[str, Path] = results.REPO_RESULTS, *,
                  published: Optional[pd.DataFrame] = None, readme_claims: Optional[pd.DataFrame] = None,
                  readme: Union[str, Path, None] = None) -> dict[str, Path]:
    """Write ``<root>/REPORT.md`` and its headline charts (``plots.headline_set``, PNG) into ``<root>/figures``,
    removing any other image there (a chart of a run no verdict cites any more), and nothing else; where ``readme``
    is given and has the verdict markers, rewrite its block. ``root``: the results folder (results/, or a copy of
    it). Returns name -> path."""
    from harness import plots
    from harness.verdicts import block_of, rewrite_block, verdict_block, verdict_table

    root = Path(root)
    table = verdict_table(df, readme_claims)
    block = verdict_block(df, table=table)
    figures = root / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    paths = plots.draw_headline_charts(df, figures, table)
    for p in figures.iterdir():
        if p.suffix.lower() in IMAGE_SUFFIXES and p not in paths:
            p.unlink()
    written = {f"figures/{p.name}": p for p in paths}
    md = root / "REPORT.md"
    md.write_text(format_summary(df, table, block, [p.name for p in paths], published=published))
    written["REPORT.md"] = md
    if readme is not None and block_of(Path(readme).read_text()) is not None:
        rewrite_block(readme, block)
        written[Path(readme).name] = Path(readme)
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
    """A full report's folder when ``--out`` is not given: ``results/local/reports`` (ignored by git) for any input,
    the committed runs included; what the project commits from them is the summary (:func:`write_summary`)."""
    return results.LOCAL_RUNS / "reports"


SUMMARY_ONLY_DEFAULTS = {"scope": "run", "calibration": None, "published": str(PUBLISHED_FIGURE),
                         "claims": str(PUBLISHED_CLAIMS), "no_published": False, "include_published": False,
                         "no_measured": False, "no_charts": False, "formats": "png,svg", "history": None,
                         "skip_damaged": False}


def _summary_conflict(a: Any) -> str:
    """Why the options cannot make the committed report (no paths, no --out): it is made from the committed runs
    and the published files alone, so that README.md's block and results/REPORT.md always match them ('' if they
    can)."""
    given = ["--scope/--pool" if k == "scope" else "--" + k.replace("_", "-")
             for k, v in SUMMARY_ONLY_DEFAULTS.items() if getattr(a, k) != v]
    if not given:
        return ""
    return (f"{', '.join(given)} make{'s' if len(given) == 1 else ''} a full report: add --out DIR (the committed "
            "report, results/REPORT.md, takes no options)")


def _readme_markers(readme: Path) -> str:
    """'' where README.md's verdict markers are well formed or absent; else why not."""
    from harness.verdicts import block_of

    try:
        block_of(readme.read_text()) if readme.exists() else None
    except ValueError as e:
        return f"{_rel(readme)}: {e}"
    return ""


TOOL = "harness.report"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = ArgumentParser(
        prog="python -m harness.report", description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 report written; 2 bad arguments, an output that cannot be written, an unreadable or "
               "damaged results file, or no rows. Progress goes to stderr: a bar on a terminal, else plain lines.")
    ap.add_argument("paths", nargs="*", help="result files or folders (default: results/runs, the committed "
                                             "reference runs; your own runs are under results/local)")
    ap.add_argument("--out", help="output folder of a full report (default: results/local/reports; its files are "
                                  "never read as input); with no paths and no --out: the committed report, "
                                  "results/REPORT.md")
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
    ap.add_argument("--skip-damaged", action="store_true",
                    help="leave out damaged result files (binary, truncated, a value not of its column's type), "
                         "naming them, instead of refusing them")
    ap.add_argument("--no-charts", action="store_true", help="tables only")
    ap.add_argument("--formats", default="png,svg", help="chart formats, comma-separated (default: png,svg)")
    ap.add_argument("--history", nargs="*", default=None, metavar="CONFIG_HASH",
                    help="draw throughput across git SHAs for these configs (no hash: every config with >1 SHA)")
    a = ap.parse_args(argv)
    summary = not a.paths and not a.out  # the committed report: results/REPORT.md, its charts, README's block
    if summary and (why := _summary_conflict(a) or _readme_markers(README)):
        print(f"harness.report: {why}", file=sys.stderr)
        return 2

    progress = Progress()
    frames = []
    notes: list[str] = []
    try:
        out = Path(a.out) if a.out else (results.REPO_RESULTS if summary else default_out(a.paths, not a.no_measured))
        if summary:  # results/REPORT.md and results/figures, beside the committed runs it reads
            if why := dir_write_problem(out):
                raise ValueError(f"{_rel(out)} {why}: the committed report is written there")
        else:
            _check_out(out, bool(a.out), [] if a.no_measured else (a.paths or [str(results.REFERENCE_RUNS)]))
        formats = [] if a.no_charts else chart_formats(a.formats)
        calibration = None
        if a.calibration:
            from harness.roofline import load_calibration

            calibration = load_calibration(a.calibration)
        published = None if a.no_published and not a.include_published else load_published(a.published)
        readme_claims = None if a.no_published else load_claims(a.claims)
        if not a.no_measured:
            measured = results.load(*a.paths, skip_damaged=a.skip_damaged, exclude=[] if summary else [out],
                                    progress=progress.reader("reading results files"))
            notes = [n for n in (results.skipped_note(measured.attrs.get("skipped", {})),
                                 results.damaged_note(measured.attrs.get("damaged", {}))) if n]
            if is_published(measured).any():
                raise ValueError("rows labelled published found among result files; refusing to treat them as "
                                 "measured")
            frames.append(measured)
        if a.include_published:
            frames.append(published)
        df = pd.concat(frames, ignore_index=True) if frames else results.to_frame([])
        if df.empty:
            where = ", ".join(a.paths) or _rel(results.REFERENCE_RUNS)
            raise ValueError(f"no rows to report in {where}" + (f" ({'; '.join(notes)})" if notes else "")
                             + "; pass result files or folders, or --include-published")
        history: Sequence[str] = ()
        if a.history is not None:
            history = a.history or _configs_with_history(df)
            _check_history(df, a.history)
    except (FileNotFoundError, ValueError, OSError) as e:
        progress.close()
        return fail(TOOL, e)
    if not a.no_measured:
        files = len(measured.attrs.get("files", []))
        runs = measured["run_id"].nunique()
        progress.note(f"read {len(measured)} rows of {runs} run{'s' if runs != 1 else ''} from {files} "
                      f"file{'s' if files != 1 else ''}")
    skipped = "; ".join(notes)
    if summary:
        return _main_summary(df, published, readme_claims, skipped)
    written = write_report(df, out, published=None if a.no_published else published, readme_claims=readme_claims,
                           calibration=calibration, charts=not a.no_charts, formats=formats, history=history,
                           sources=_describe(df, a.paths, a.include_published, skipped), scope=a.scope,
                           progress=progress)
    text = written["claims.md"].read_text()
    if "## Headline" in text:
        print(text[text.index("## Headline"):].split("\n## ", 1)[0].rstrip() + "\n")
    for note in notes:
        print(note)
    print(f"wrote {len(written)} files to {out}: {', '.join(sorted(written))}")
    return 0


def _main_summary(df: pd.DataFrame, published: pd.DataFrame, claims: pd.DataFrame, skipped: str) -> int:
    from harness.verdicts import block_of

    readme = README if README.exists() and block_of(README.read_text()) is not None else None
    written = write_summary(df, results.REPO_RESULTS, published=published, readme_claims=claims, readme=readme)
    print(block_of(written["REPORT.md"].read_text()) + "\n")
    if skipped:
        print(skipped)
    charts = [n for n in written if n.startswith("figures/")]
    print(f"wrote {_rel(written['REPORT.md'])} and {len(charts)} charts in {_rel(results.REPO_RESULTS / 'figures')}"
          + (f"; the verdict block of {_rel(README)}" if readme else
             f"; {_rel(README)} has no verdict markers, its block was not written"))
    return 0


def _check_out(out: Path, given: bool, inputs: Sequence[str]) -> None:
    """Raise ValueError (one line, with the fix) unless the report can be written into ``out``: a folder that can
    be written (or made), that is not an input folder and holds none (its files would be read as input). An output
    folder inside an input folder is fine: :func:`results.load` leaves its files out."""
    what = f"--out {out}" if given else f"the output folder {out}"
    if why := dir_write_problem(out):
        raise ValueError(f"{what} {why}; give --out <a folder you can write>")
    for p in inputs:
        if Path(p).is_dir() and is_inside(p, out):
            rel = "is" if Path(p).resolve() == out.resolve() else "holds"
            raise ValueError(f"{what} {rel} the input folder {p}: the report would be written among the rows it "
                             "reads; give --out another folder")


def chart_formats(text: str) -> list[str]:
    """The formats of ``--formats`` (comma-separated), each one matplotlib can save here (a tiny figure is saved
    to memory in each); ValueError (one line, listing the formats it knows) otherwise."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from harness.plots import new_figure

    known = sorted(FigureCanvasAgg.get_supported_filetypes())
    fmts = list(dict.fromkeys(f.strip().lower().lstrip(".") for f in text.split(",") if f.strip()))
    fig = new_figure(1.0, 1.0)
    fig.subplots().set_title("x")  # text: some writers need a tool only to lay text out (pgf: LaTeX)

    def problem(fmt: str) -> str:
        try:
            fig.savefig(io.BytesIO(), format=fmt)
        except Exception as e:  # noqa: BLE001 - a writer that needs a missing tool (LaTeX for pgf, ...)
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return ""

    def fix() -> str:
        usable = [f for f in known if not problem(f)]
        return f"give one or more of {', '.join(usable)}, comma-separated (default png,svg), or --no-charts"

    if not fmts:
        raise ValueError(f"--formats {text!r} names no format; {fix()}")
    if unknown := [f for f in fmts if f not in known]:
        raise ValueError(f"--formats: matplotlib cannot save {', '.join(unknown)}; {fix()}")
    for f in fmts:
        if why := problem(f):
            raise ValueError(f"--formats: {f} cannot be saved here ({why}); {fix()}")
    return fmts


def _check_history(df: pd.DataFrame, hashes: Sequence[str]) -> None:
    """Raise ValueError (one line) when a config of ``--history`` has no rows to draw, naming the configs that
    have a history."""
    have = set(df.loc[~df["backend"].isin(NOT_CONTENDERS), "config_hash"].dropna().astype(str))
    unknown = [h for h in hashes if h not in have]
    if not unknown:
        return
    many = _configs_with_history(df)
    listing = ", ".join(many[:8]) + (f", ... ({len(many)} in all)" if len(many) > 8 else "")
    fix = (f"the configs with a history (rows at more than one git SHA): {listing}; or --history alone draws them"
           if many else "no config here has rows at more than one git SHA; give a config_hash of these rows")
    which = "this config" if len(unknown) == 1 else "these configs"
    raise ValueError(f"--history {' '.join(unknown)}: no rows of {which} to draw; {fix}")


def _configs_with_history(df: pd.DataFrame) -> list[str]:
    n = df.dropna(subset=["config_hash"]).groupby("config_hash")["git_sha"].nunique()
    return sorted(n[n > 1].index)


if __name__ == "__main__":
    sys.exit(main())
