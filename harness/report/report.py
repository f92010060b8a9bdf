"""Claims table and report: does the published claim reproduce on these results?

    python -m harness.report                          # the committed runs -> results/REPORT.md, results/figures/
    python -m harness.report results/local            # your own runs -> results/local/reports/ (ignored by git)
    python -m harness.report results/runs --out /tmp/rep    # every committed run, every table and chart
    python -m harness.report results/runs --pool --out /tmp/pool    # the median over every run, labelled POOLED
    python -m harness.report results/runs/2026* --out /tmp/rep --calibration calib.csv
    python -m harness.report --include-published --no-measured --out /tmp/pub   # the published figure alone

With no paths and no ``--out``, the committed report: ``results/REPORT.md`` (the latest measured verdicts,
``harness.report.verdicts``, and the runs they cite), its headline charts in ``results/figures/`` (PNG) and the verdict
block of README.md; it takes no other option. Otherwise a full report into ``--out`` (default
``results/local/reports``): ``claims.md``, the CSVs and every chart.

For each panel (precision x direction) and shape, within one run (by default: ``--scope``), one environment (GPU, EP
size, tokens per GPU, nodes) and routing: each system's TFLOP/s per GPU, the fastest baseline, and each fused
kernel's speedup over it. The published figure's values (``results/published/``, read off the chart, GB300 NVL72,
EP=64, 2048 tokens/GPU) sit beside them; a measured / published ratio of TFLOP/s is given only where the environment
matches the published one. Rows that are not ok keep their status in the table and are listed with their error.

Python API: :func:`format_markdown`, :func:`write_report`, :func:`write_summary`; the tables they hold are
``harness.report.claims``'s (:func:`~harness.report.claims.load_published`, :func:`~harness.report.claims.claims_table`,
:func:`~harness.report.claims.headline_table`, ...) and ``harness.report.verdicts``'s, the names and order
``harness.report.labels``'s, the charts ``harness.report.plots``'s.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

import pandas as pd

from harness.core import results
from harness.core.tool_args import ArgumentParser, Progress, dir_write_problem, fail, is_inside
from harness.report.claims import (PUBLISHED_CLAIMS, PUBLISHED_FIGURE, SCOPES, claims_table, clock_rows, headline_table,
                            is_published, load_claims, load_published, not_ok_rows, prepare, timing_counts)
from harness.report.labels import NOT_CONTENDERS
from harness.report.markdown import format_markdown
from harness.report.markdown import rel_path as _rel
from harness.report.summary import (IMAGE_SUFFIXES, README, format_summary, main_summary, readme_markers,
                                    summary_conflict, write_summary)

__all__ = ["DEFAULT_OUT", "IMAGE_SUFFIXES", "chart_formats", "default_out", "format_markdown", "format_summary",
           "main", "write_report", "write_summary"]

DEFAULT_OUT = results.LOCAL_RUNS / "reports"  # a full report's folder, ignored by git


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
    nature). ``progress`` (a :class:`harness.core.tool_args.Progress`) is told each stage and chart. Returns name ->
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
        from harness.report import plots

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


def _describe(df: pd.DataFrame, paths: Sequence[str], with_published: bool, skipped: str = "") -> str:
    measured = df[~is_published(df)] if len(df) else df
    parts = [f"{len(measured)} measured rows from {measured['run_id'].nunique()} runs"
             + (f" ({', '.join(map(str, paths))})" if paths else f" ({_rel(results.REFERENCE_RUNS)})")]
    if with_published:
        parts.append("plus the published figure's values as their own environment, GPU 'GB300 (published)'")
    if skipped:
        parts.append(skipped)
    return "Data: " + "; ".join(parts) + "."


def default_out(paths: Sequence[str], measured: bool = True) -> Path:
    """A full report's folder when ``--out`` is not given: ``results/local/reports`` (ignored by git) for any input,
    the committed runs included; what the project commits from them is the summary (:func:`write_summary`)."""
    return results.LOCAL_RUNS / "reports"


TOOL = "harness.report"


def _parser() -> ArgumentParser:
    """The command line of ``python -m harness.report``."""
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
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    summary = not a.paths and not a.out  # the committed report: results/REPORT.md, its charts, README's block
    if summary and (why := summary_conflict(a) or readme_markers(README)):
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
            from harness.core.roofline import load_calibration

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
        return main_summary(df, published, readme_claims, skipped, README)
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

    from harness.report.plots import new_figure

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
    from harness.core.own_packages import exit_on_clash

    exit_on_clash()
    sys.exit(main())
