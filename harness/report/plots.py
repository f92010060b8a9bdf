"""Charts for reports (matplotlib, Agg canvas, PNG and SVG).

Every function takes a results table (``harness.core.results.load`` or ``to_frame``) and returns a
:class:`matplotlib.figure.Figure` drawn on an Agg canvas, without touching pyplot's global state; :func:`save` writes
it. Rows that are not ok are drawn as a status label (bars) or a cross on the axis (lines), never dropped.

* :func:`plot_panels`: the published figure's layout; panels = precision x direction, groups = shapes,
  bars = systems, each fused kernel labelled with its speedup over the fastest baseline.
* :func:`plot_sweep`: throughput vs ``tokens_per_gpu``, ``ep_size`` or ``routing`` (imbalance).
* :func:`plot_imbalance`: each backend's latency against the routing's measured expert imbalance.
* :func:`plot_roofline`: each system's latency against the layer's compute, HBM and link floors.
* :func:`plot_history`: one config's throughput across git SHAs, in commit-time order.

Rows that ran several ranks on one GPU (``shared_gpu``) measure no speed: every chart leaves them out and says how
many in its footnote (``harness.report.claims.speed_rows``).
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.core import backends
from harness.report import claims as C
from harness.report import labels as L
from harness.core.run_names import display_name

ANCHOR_HATCH = ".."  # anchors' bars are dotted: fused layers a user could pick, not baselines
# one backend's series of several variants in a run (claims.split_variants) share its colour: a hatch per variant,
# by its place in labels.SCALING_VARIANTS (the first plain), so that two series never look alike
VARIANT_HATCHES = (None, "//", "xx", "\\\\", "--", "++", "||")
SWEEP_AXES = ("tokens_per_gpu", "ep_size", "routing")
AXIS_LABELS = {"tokens_per_gpu": "tokens per GPU", "ep_size": "EP size", "routing": "routing"}
FLOOR_STYLE = {  # floor -> (label, color, linestyle)
    "compute_ms": ("compute floor (GEMM rate)", "#1f3b73", ":"),
    "memory_ms": ("HBM floor (weights + activations)", "#2b8a3e", "-."),
    "link_ms": ("NVLink floor (remote bytes)", "#862e9c", "--"),
    "roofline_ms": ("roofline (max of the floors)", "black", "-"),
}


def color(system: str) -> str:
    """The system's colour, from the backend registry (a fixed fallback colour for names it does not know)."""
    return backends.spec(system).color


def hatch(system: str) -> Optional[str]:
    """Anchors are drawn hatched, so that no chart passes them off as baselines; so are a backend's series of
    several variants in a run, each its own hatch (:data:`VARIANT_HATCHES`)."""
    if L.is_anchor(system):
        return ANCHOR_HATCH
    variant = backends.series_parts(system)[1]
    return VARIANT_HATCHES[L.variant_rank(variant) % len(VARIANT_HATCHES)] if variant else None


def new_figure(width: float, height: float) -> Figure:
    """A figure on an Agg canvas (no pyplot, no global backend switch) with constrained layout."""
    fig = Figure(figsize=(width, height), layout="constrained", dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, stem: Union[str, Path], formats: Sequence[str] = ("png", "svg"), dpi: int = 150) -> list[Path]:
    """Write ``<stem>.<fmt>`` for each format; returns the paths. Byte-stable for the same figure: no creation date
    in the metadata, and SVG element ids from a fixed salt (so a regenerated report changes only where a chart
    did)."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        p = stem.with_suffix(f".{fmt}")
        meta = {"Date": None} if fmt in ("svg", "pdf") else {}
        with matplotlib.rc_context({"svg.hashsalt": "mokbench"}):
            fig.savefig(p, dpi=dpi, format=fmt, metadata=meta)
        paths.append(p)
    return paths


MAX_WIDTH_IN = 14.0  # charts wider than this are unreadable at report size (14 in x 150 dpi = 2100 px)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")[:150]


def config_name(df: pd.DataFrame, config_hash: str) -> str:
    """A config as a reader names it: shape, precision, EP size, tokens per GPU, routing, GPU (from its rows)."""
    d = df[(df["config_hash"] == config_hash).fillna(False)]
    if d.empty:
        return str(config_hash)
    r = d.iloc[0]
    parts = [L.shape_label(r["shape"]), L.PRECISION_LABELS.get(r["precision"], str(r["precision"])),
             L.env_label(r.to_dict(), run=False)]
    return ", ".join(str(x) for x in parts)


def config_slug(df: pd.DataFrame, config_hash: str) -> str:
    """A file name for a config's charts: shape, precision, EP, tokens, routing, then the hash's first 6 digits (two
    configs may differ only in what the name leaves out, e.g. the SwiGLU limit)."""
    d = df[(df["config_hash"] == config_hash).fillna(False)]
    if d.empty:
        return slug(config_hash)
    r = d.iloc[0]
    routing = "" if L.isna(r["routing"]) or r["routing"] == "uniform" else f" {r['routing']}"
    return slug(f"{r['shape']} {r['precision']} ep{L.int_text(r['ep_size'])} "
                f"{L.int_text(r['tokens_per_gpu'])}tok{routing} {str(config_hash)[:6]}")


def _one_env(df: pd.DataFrame, env: Optional[dict[str, Any]], keys: Sequence[str] = (*C.ENV_KEYS, "routing")
             ) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The rows of one environment: ``env`` if given, else the only one present (ValueError if several)."""
    df = C.with_runs(df)
    if env is None:
        envs = df[list(keys)].drop_duplicates().to_dict("records")
        if len(envs) != 1:
            raise ValueError(f"{len(envs)} environments in the data; pick one with env= "
                             f"(see harness.report.claims.environments): {[L.env_label(e) for e in envs][:6]}")
        env = envs[0]
    return C.select_env(df, {k: env[k] for k in keys if k in env}), env


def _speed_env(df: pd.DataFrame, env: Optional[dict[str, Any]], keys: Sequence[str] = (*C.ENV_KEYS, "routing")
               ) -> tuple[pd.DataFrame, dict[str, Any], str]:
    """:func:`_one_env` of ``df``'s speed rows (shared-GPU rows left out), and the note on the shared-GPU rows of that
    environment ('' where none)."""
    df = C.with_runs(df)
    shared = C.is_shared_gpu(df)
    if shared.all() and len(df):
        raise ValueError(f"no rows to draw: {C.shared_gpu_note(int(shared.sum()))}")
    rows, env = _one_env(df[~shared], env, keys)
    n = len(C.select_env(df[shared], {k: env[k] for k in keys if k in env})) if shared.any() else 0
    return rows, env, C.shared_gpu_note(n)


def _caption(*parts: str) -> str:
    """A footnote of several sentences (empty parts left out)."""
    return " ".join(p.rstrip(".") + "." for p in parts if p)


Legend = tuple[Sequence[Any], Sequence[str]]


def finish(fig: Figure, title: str, handles: Sequence[Any] = (), labels: Sequence[str] = (), *,
           notes: Sequence[str] = (), ncol: int = 6, extra_legend: Optional[Legend] = None,
           max_notes: int = 4, caption: str = "") -> None:
    """Title and legend(s) in a band above the axes, the footnotes (``caption``, then the not-ok list) in a band
    below; the constrained layout keeps the axes between them (sizes in inches, so they hold at any figure size).
    Legends get as many columns as fit the figure's width (at most ``ncol``); ``extra_legend`` goes on its own
    rows under the first."""
    width, height = fig.get_size_inches()
    lines = [caption] if caption else []
    if notes:
        shown = list(notes[:max_notes]) + ([f"... and {len(notes) - max_notes} more"] if len(notes) > max_notes
                                             else [])
        lines.append("Not ok (drawn as a status, no value): " + "; ".join(shown))
    text = "\n".join(textwrap.fill(line, width=max(40, int(width * 15))) for line in lines)
    title = textwrap.fill(title, width=max(30, int(width * 9.5)))
    y_in = 0.4 + 0.22 * title.count("\n")  # top of the next band, inches from the top
    fig.text(0.5, 1 - 0.08 / height, title, ha="center", va="top", fontsize=12.5)
    for hs, ls in ((handles, labels), extra_legend or ((), ())):
        if not ls:
            continue
        widest = max(0.075 * len(lab) + 0.55 for lab in ls)  # inches per column at fontsize 9.5
        cols = max(1, min(ncol, len(ls), int((width - 0.3) / widest)))
        fig.legend(list(hs), list(ls), loc="upper center", bbox_to_anchor=(0.5, 1 - y_in / height), ncol=cols,
                   frameon=False, fontsize=9.5, handlelength=1.8, columnspacing=1.4)
        y_in += 0.3 * math.ceil(len(ls) / cols)
    bottom_in = 0.08 + (0.16 * (text.count("\n") + 1) + 0.08 if text else 0)
    top_in = y_in + 0.05
    fig.get_layout_engine().set(rect=(0, bottom_in / height, 1, 1 - (top_in + bottom_in) / height))  # l, b, w, h
    if text:
        fig.text(0.01, 0.06 / height, text, fontsize=8, color="#555555", ha="left", va="bottom")


def _not_ok_note(r: dict[str, Any], *extra: str) -> str:
    where = " ".join(x for x in (L.system_label(r["backend"]), *extra) if x)
    return f"{where}: {r['status']}"


# ---------------------------------------------------------------------------------------------------------------
# the published layout


def plot_panels(df: pd.DataFrame, env: Optional[dict[str, Any]] = None, title: Optional[str] = None) -> Figure:
    """Four-panel grouped bars (rows: precision, columns: direction) for one environment, like the published
    figure; each fused kernel's bar carries its speedup over the fastest baseline of its group."""
    df = df[~df["backend"].isin(L.NOT_CONTENDERS)]
    df, env, shared = _speed_env(df, env)
    agg = C.aggregate(df)
    by_cell = _by_cell(agg)
    claims = C.claims_table(df).set_index(["precision", "direction", "shape"])
    systems, precisions, directions, shapes, fig, axes, width = _panel_grid(agg, extra_height=1.0)
    notes: list[str] = []
    for i, prec in enumerate(precisions):
        for j, direction in enumerate(directions):
            ax = axes[i][j]
            cell = agg[(agg["precision"] == prec) & (agg["direction"] == direction)]
            any_ok = bool(cell["tflops_per_gpu"].notna().any())
            top = float(cell["tflops_p20"].max()) if any_ok else 1.0
            for k, s in enumerate(systems):
                for g, shape in enumerate(shapes):
                    r = by_cell.get((prec, direction, shape, s))
                    if r is None:
                        continue
                    x = g - 0.42 + width * (k + 0.5)
                    if r["status"] == "ok" and not L.isna(r["tflops_per_gpu"]):
                        y = r["tflops_per_gpu"]
                        err = [[max(0.0, y - r["tflops_p80"])], [max(0.0, r["tflops_p20"] - y)]]
                        ax.bar(x, y, width * 0.92, color=color(s), zorder=2, yerr=err, capsize=2,
                               hatch=hatch(s), edgecolor="white" if hatch(s) else None,
                               error_kw=dict(elinewidth=0.9, ecolor="#333333", capthick=0.9, zorder=3))
                        text = _speedup_text(claims, s, (prec, direction, shape))
                        if text:
                            ax.text(x, max(y, r["tflops_p20"]) + top * 0.015, text, ha="center",
                                    va="bottom", fontsize=8.5, fontweight="bold", color="#222222", zorder=3)
                    else:
                        ax.bar(x, top * 0.04, width * 0.92, color="white", edgecolor=color(s), hatch="////",
                               linewidth=0.8, zorder=2)
                        ax.text(x, top * 0.06, r["status"], rotation=90, ha="center", va="bottom", fontsize=7.5,
                                color="#444444", zorder=3)
                        notes.append(_not_ok_note(r, L.shape_label(shape), L.panel_label(prec, direction)))
            ax.set_title(L.panel_label(prec, direction), fontsize=12, fontweight="bold")
            _shape_ticks(ax, shapes)
            ax.set_ylim(0, top * 1.16)
            ax.grid(axis="y", alpha=0.3, zorder=0)
            ax.set_axisbelow(True)
            if not any_ok:  # nothing measured: no value axis to read
                _no_ok_panel(ax)
            elif j == 0 or len(directions) * len(precisions) > 1:
                ax.set_ylabel("TFLOP/s per GPU (whiskers: p20-p80)", fontsize=9)
    caption = L.run_caption(df)
    if any(L.is_anchor(s) for s in systems):
        caption = ("Dotted bars: anchors (fused MoE layers a user could pick), not baselines; a fused kernel's label "
                   "is its speedup over the fastest baseline, then over the fastest of all. " + caption).strip()
    finish(fig, title or f"Expert-parallel MoE layer throughput — {L.env_label(env)}",
           [_patch(s) for s in systems], [L.system_label(s) for s in systems], notes=notes, ncol=len(systems),
           caption=_caption(caption, shared))
    return fig


def _speedup_text(claims: pd.DataFrame, system: str, cell: tuple[str, str, str]) -> str:
    """A fused kernel's label: its speedup over the fastest baseline, and under it (where the run has anchors and
    the fastest of all is another system) over the fastest of all."""
    if not L.is_fused(system):
        return ""
    v = claims[f"speedup_{system}"].get(cell) if f"speedup_{system}" in claims else None
    if v is None or L.isna(v):
        return ""
    text = f"{v:.2f}×"
    va = claims[f"speedup_all_{system}"].get(cell) if f"speedup_all_{system}" in claims else None
    anchored = "best_anchor" in claims and str(claims["best_anchor"].get(cell, "")) not in ("", "nan")
    if anchored and va is not None and not L.isna(va) and abs(va - v) > 5e-3:
        text += f"\n{va:.2f}× all"
    return text


def _shape_ticks(ax, shapes: Sequence[str]) -> None:
    labels = [L.shape_label(s) for s in shapes]
    crowded = len(shapes) > 5
    ax.set_xticks(range(len(shapes)), labels, fontsize=9.5, rotation=25 if crowded else 0,
                  ha="right" if crowded else "center")
    ax.set_xlim(-0.55, len(shapes) - 0.45)


def _no_ok_panel(ax) -> None:
    """A panel where no row is ok: no value axis (a 0-1 scale would read as measured zeros), and a note."""
    ax.set_yticks([])
    ax.grid(False)
    ax.text(0.5, 0.55, "no ok row: nothing measured\n(status of each system at its bar)", transform=ax.transAxes,
            ha="center", va="center", fontsize=10, color="#555555")


def _by_cell(frame: pd.DataFrame) -> dict[tuple, dict[str, Any]]:
    """Rows keyed by (precision, direction, shape, backend)."""
    return {(r["precision"], r["direction"], r["shape"], r["backend"]): r for r in frame.to_dict("records")}


def _panel_grid(agg: pd.DataFrame, extra_height: float):
    """The published layout's axes: systems, panel rows (precision) and columns (direction), shape groups, the
    figure with one subplot per panel, and the bar width."""
    systems = L.systems_in(agg)
    precisions = L.in_order(agg["precision"], L.PRECISION_ORDER)
    directions = L.in_order(agg["direction"], L.DIRECTION_ORDER)
    shapes = L.in_order(agg["shape"], L.SHAPE_ORDER)
    width = _panels_width(len(directions), len(shapes))
    if width <= MAX_WIDTH_IN or len(directions) == 1:
        fig = new_figure(min(width, MAX_WIDTH_IN), 3.9 * len(precisions) + extra_height)
        axes = fig.subplots(len(precisions), len(directions), squeeze=False)
    else:  # too wide side by side: one panel per row, (precision, direction) in reading order
        fig = new_figure(min(_panels_width(1, len(shapes)), MAX_WIDTH_IN),
                         3.9 * len(precisions) * len(directions) + extra_height)
        flat = fig.subplots(len(precisions) * len(directions), 1, squeeze=False)[:, 0]
        axes = [list(flat[i * len(directions):(i + 1) * len(directions)]) for i in range(len(precisions))]
    return systems, precisions, directions, shapes, fig, axes, 0.84 / max(len(systems), 1)


def _panels_width(ncols: int, nshapes: int) -> float:
    """Figure width (inches) for panels of grouped bars: 6.4 in per panel for the four published shapes."""
    return max(9.0, ncols * max(3.2, 1.45 * nshapes + 0.6) + 0.6)


def _patch(system: str):
    from matplotlib.patches import Patch

    return Patch(facecolor=color(system), label=L.system_label(system), hatch=hatch(system),
                 edgecolor="white" if hatch(system) else None)


# ---------------------------------------------------------------------------------------------------------------
# sweeps


def sweep_axes_present(df: pd.DataFrame) -> list[str]:
    """The sweep axes along which some (system, panel, shape, fixed rest) has more than one value."""
    out = []
    df = C.with_runs(df)
    for x in SWEEP_AXES:
        fixed = [k for k in (*C.ENV_KEYS, "routing") if k != x and not (x == "ep_size" and k == "num_nodes")]
        n = df.groupby([*fixed, "precision", "direction", "shape", "backend"], dropna=False)[x].nunique()
        if len(n) and n.max() > 1:
            out.append(x)
    return out


def _routing_order(df: pd.DataFrame) -> list[str]:
    """Routing labels from balanced to most imbalanced (by the measured expert load max/mean)."""
    imb = df.groupby("routing", dropna=True)["expert_load_max_over_mean"].mean()
    labels = list(df["routing"].dropna().unique())
    return sorted(labels, key=lambda r: (r != "uniform", imb.get(r, math.inf) if not L.isna(imb.get(r)) else 0, r))


def _facet_grid(agg: pd.DataFrame, fixed: list[str], max_cols: int, size: tuple[float, float]):
    """The sweep charts' layout: the environment keys among ``fixed`` that vary in ``agg`` (a line each), one
    subplot per (precision, direction, shape) in panel order, at most ``max_cols`` a row of ``size`` inches each.
    Returns (varying, facets, figure, axes, ncols)."""
    varying = [k for k in fixed if agg[k].nunique(dropna=False) > 1 and k != "run_started"]
    facets = list(agg[["precision", "direction", "shape"]].drop_duplicates().itertuples(index=False, name=None))
    facets.sort(key=lambda k: (L.PRECISION_ORDER.index(k[0]) if k[0] in L.PRECISION_ORDER else 9,
                               L.DIRECTION_ORDER.index(k[1]) if k[1] in L.DIRECTION_ORDER else 9,
                               _shape_pos(k[2]), str(k[2])))
    ncols = min(len(facets), max_cols)
    nrows = math.ceil(len(facets) / ncols)
    fig = new_figure(size[0] * ncols + 0.4, size[1] * nrows + 1.1)
    return varying, facets, fig, fig.subplots(nrows, ncols, squeeze=False), ncols


LINE_STYLES = ("-", "--", ":", "-.")  # one per remaining environment of a sweep chart's subplot


def _facets(agg: pd.DataFrame, facets: list[tuple], axes):
    """Each subplot of a sweep chart in order: (its index, its axes, its (precision, direction, shape), its rows)."""
    ncols = len(axes[0])
    for n, (prec, direction, shape) in enumerate(facets):
        g = agg[(agg["precision"] == prec) & (agg["direction"] == direction) & (agg["shape"] == shape)]
        yield n, axes[n // ncols][n % ncols], (prec, direction, shape), g


def _facet_lines(g: pd.DataFrame, varying: list[str]):
    """Each line of one subplot: (line style, legend label, backend, its rows), a line per backend and per
    environment among ``varying`` (the style tells the environments apart, the colour the backends)."""
    contexts = g[varying].drop_duplicates().to_dict("records") if varying else [{}]
    for ci, ctx in enumerate(contexts):
        gc = C.select_env(g, ctx) if ctx else g
        for s in L.systems_in(gc):
            label = L.system_label(s) + (" · " + ", ".join(_ctx(k, ctx[k]) for k in varying) if ctx else "")
            yield LINE_STYLES[ci % len(LINE_STYLES)], label, s, gc[gc["backend"] == s]


def _close_grid(axes, used: int, agg: pd.DataFrame, fixed: list[str], varying: list[str]) -> str:
    """Hide the grid's unused subplots; the title's text of the environment that stays the same."""
    nrows, ncols = len(axes), len(axes[0])
    for n in range(used, nrows * ncols):
        axes[n // ncols][n % ncols].set_visible(False)
    const = [k for k in fixed if k not in varying and k != "run_started"]
    return ", ".join(_ctx(k, agg[k].iloc[0]) for k in const if not L.isna(agg[k].iloc[0]))


def plot_sweep(df: pd.DataFrame, x: str, title: Optional[str] = None) -> Figure:
    """Throughput (TFLOP/s per GPU) vs one sweep axis: ``tokens_per_gpu``, ``ep_size`` or ``routing``.

    Subplots: one per (panel, shape) in which the axis varies; one line per system (and per remaining environment
    where that varies too, e.g. two GPUs). Routing is ordered by measured expert imbalance."""
    if x not in SWEEP_AXES:
        raise ValueError(f"x must be one of {', '.join(SWEEP_AXES)} (got {x!r})")
    df, shared = C.speed_rows(C.with_runs(df[~df["backend"].isin(L.NOT_CONTENDERS)]))
    fixed = [k for k in (*C.ENV_KEYS, "routing") if k != x and not (x == "ep_size" and k == "num_nodes")]
    agg = C.aggregate(df)
    # keep the lines that are a sweep along x (points of other sweeps have one value of x per line)
    lines = agg.groupby([*fixed, "precision", "direction", "shape", "backend"], dropna=False)[x].transform("nunique")
    agg = agg[lines > 1]
    if agg.empty:
        raise ValueError(f"nothing varies along {x} in these rows" + (f" ({shared})" if shared else ""))
    varying, facets, fig, axes, ncols = _facet_grid(agg, fixed, 4, (4.6, 3.6))
    cats = _routing_order(df[df["routing"].isin(agg["routing"])]) if x == "routing" else None
    notes: list[str] = []
    legend: dict[str, Any] = {}
    for n, ax, (prec, direction, shape), g in _facets(agg, facets, axes):
        for style, label, s, line in _facet_lines(g, varying):
            xs = line[x].map(cats.index) if cats else line[x].astype("float64")
            line = line.assign(_x=xs.to_numpy()).sort_values("_x")
            ok = line[(line["status"] == "ok") & line["tflops_per_gpu"].notna()]
            (h,) = ax.plot(ok["_x"], ok["tflops_per_gpu"], marker="o", ms=4, color=color(s),
                           linestyle=style, label=label)
            legend.setdefault(label, h)
            for r in line[line["status"] != "ok"].to_dict("records"):
                ax.plot(r["_x"], 0, marker="x", ms=7, mew=2, color=color(s), clip_on=False, zorder=4)
                notes.append(_not_ok_note(r, L.shape_label(shape), f"{x}={r[x]}"))
        ax.set_title(f"{L.panel_label(prec, direction)} · {L.shape_label(shape)}", fontsize=10)
        if cats:
            ax.set_xticks(range(len(cats)), cats, rotation=25, ha="right", fontsize=8)
            ax.set_xlim(-0.3, len(cats) - 0.7)
        else:
            ax.set_xscale("log", base=2)
            vals = sorted(agg[x].dropna().unique())
            ax.set_xticks([float(v) for v in vals], [str(int(v)) for v in vals], fontsize=8)
            ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_xlabel(AXIS_LABELS[x] + (" (balanced → imbalanced)" if x == "routing" else ""), fontsize=9)
        if n % ncols == 0:
            ax.set_ylabel("TFLOP/s per GPU")
    env_txt = _close_grid(axes, len(facets), agg, fixed, varying)
    finish(fig, title or f"Throughput vs {AXIS_LABELS[x]}" + (f" — {env_txt}" if env_txt else ""),
           list(legend.values()), list(legend.keys()), notes=notes, ncol=5, caption=_caption(shared))
    return fig


def plot_imbalance(df: pd.DataFrame, title: Optional[str] = None) -> Figure:
    """Latency (ms) against the routing's expert imbalance, from a routing sweep: x is each routing's
    ``expert_load_max_over_mean`` (the median over its rows), one line per backend (and per remaining environment
    where that varies too), one subplot per (panel, shape) in which the routing varies. Rows of several routing steps
    add their slowest step's median (``latency_step_max_ms``) as an open triangle above the point."""
    df, shared = C.speed_rows(C.with_runs(df[~df["backend"].isin(L.NOT_CONTENDERS)]))
    df = df.assign(**{c: np.nan for c in ("expert_load_max_over_mean", "latency_step_max_ms") if c not in df})
    fixed = [k for k in C.ENV_KEYS if k != "routing"]
    keys = [*C.CELL_KEYS, "backend"]
    agg = C.aggregate(df)
    extra = df.groupby(keys, dropna=False)[["expert_load_max_over_mean", "latency_step_max_ms"]].median()
    agg = agg.merge(extra.reset_index(), on=keys, how="left")
    lines = agg.groupby([*fixed, "precision", "direction", "shape", "backend"], dropna=False)["routing"]
    agg = agg[(lines.transform("nunique") > 1) & agg["expert_load_max_over_mean"].notna()]
    if agg.empty:
        raise ValueError("no routing sweep with measured imbalance in these rows" + (f" ({shared})" if shared else ""))
    varying, facets, fig, axes, ncols = _facet_grid(agg, fixed, 3, (5.2, 4.0))
    notes: list[str] = []
    legend: dict[str, Any] = {}
    for n, ax, (prec, direction, shape), g in _facets(agg, facets, axes):
        for style, label, s, line in _facet_lines(g, varying):
            line = line.sort_values("expert_load_max_over_mean")
            ok = line[(line["status"] == "ok") & line["latency_ms"].notna()]
            (h,) = ax.plot(ok["expert_load_max_over_mean"], ok["latency_ms"], marker="o", ms=4, color=color(s),
                           linestyle=style, label=label)
            legend.setdefault(label, h)
            worst = ok[ok["latency_step_max_ms"].notna()]
            if len(worst):
                ax.plot(worst["expert_load_max_over_mean"], worst["latency_step_max_ms"], linestyle="none",
                        marker="^", ms=6, mfc="none", color=color(s))
            for r in line[line["status"] != "ok"].to_dict("records"):
                ax.plot(r["expert_load_max_over_mean"], 0, marker="x", ms=7, mew=2, color=color(s), clip_on=False,
                        zorder=4)
                notes.append(_not_ok_note(r, L.shape_label(shape), str(r["routing"])))
        for label, x in g.groupby("routing")["expert_load_max_over_mean"].median().sort_values().items():
            ax.axvline(x, color="0.85", lw=0.8, zorder=0)
            ax.annotate(str(label), (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                        va="top", ha="right", color="0.35")
        ax.set_title(f"{L.panel_label(prec, direction)} · {L.shape_label(shape)}", fontsize=10)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the routing labels along the top
        ax.grid(alpha=0.3)
        ax.set_xlabel("expert load max / mean (routing imbalance)", fontsize=9)
        if n % ncols == 0:
            ax.set_ylabel("latency (ms, median)")
    env_txt = _close_grid(axes, len(facets), agg, fixed, varying)
    steps_note = "open triangles: the slowest routing step's median (rows of several routing steps)" \
        if agg["latency_step_max_ms"].notna().any() else ""
    finish(fig, title or "Latency vs routing imbalance" + (f" — {env_txt}" if env_txt else ""),
           list(legend.values()), list(legend.keys()), notes=notes, ncol=5, caption=_caption(steps_note, shared))
    return fig


def _ctx(key: str, value: Any) -> str:
    """A context value as a reader would say it: ``EP 8``, ``2048 tokens/GPU``, ``2 nodes``."""
    if L.isna(value):
        return f"{key} unknown"
    if key == "run_started":
        return f"run of {str(value)[:16]}"
    if key == "ep_size":
        return f"EP {int(value)}"
    if key == "tokens_per_gpu":
        return f"{int(value)} tokens/GPU"
    if key == "num_nodes":
        return f"{int(value)} node{'s' if int(value) != 1 else ''}"
    return str(value)


def _shape_pos(shape: str) -> int:
    base = str(shape).partition("@")[0]
    return L.SHAPE_ORDER.index(base) if base in L.SHAPE_ORDER else len(L.SHAPE_ORDER)


# ---------------------------------------------------------------------------------------------------------------
# roofline


def has_floors(df: pd.DataFrame, calibration: Optional[pd.DataFrame] = None) -> bool:
    """Whether the rows carry (or the calibration table gives) anything to draw floors from."""
    from harness.core.roofline import CALIB_COLUMNS

    if calibration is not None and len(calibration):
        return True
    cols = [c for c in (*CALIB_COLUMNS, "roofline_ms") if c in df]
    return bool(cols) and bool(df[cols].notna().any().any())


def plot_roofline(df: pd.DataFrame, calibration: Optional[pd.DataFrame] = None,
                  env: Optional[dict[str, Any]] = None, title: Optional[str] = None) -> Figure:
    """Each system's measured latency (bars) against the layer's floors (ticks across each bar): compute
    (FLOPs / measured GEMM rate), HBM (weights + activations / measured HBM bandwidth), NVLink (remote bytes /
    measured link bandwidth) and their max, the roofline. The label over a bar is roofline / latency."""
    from harness.core.roofline import floors_frame

    df = df[~df["backend"].isin(L.NOT_CONTENDERS)]
    df, env, shared = _speed_env(df, env)
    fl = floors_frame(df, calibration)
    # a row may carry the harness' own roofline_ms without the rates
    fl["floor_roofline_ms"] = fl["floor_roofline_ms"].fillna(fl["roofline_ms"])
    ok = fl[(fl["status"] == "ok") & fl["latency_ms"].notna()]
    cells = [*C.CELL_KEYS, "backend"]
    med = ok.groupby(cells, dropna=False, sort=False)[
        ["latency_ms", "floor_compute_ms", "floor_memory_ms", "floor_link_ms", "floor_roofline_ms"]].median()
    med = med.reset_index()
    agg = C.aggregate(df)
    by_cell, by_med = _by_cell(agg), _by_cell(med)
    systems, precisions, directions, shapes, fig, axes, width = _panel_grid(agg, extra_height=1.2)
    notes: list[str] = []
    drawn: set[str] = set()
    for i, prec in enumerate(precisions):
        for j, direction in enumerate(directions):
            ax = axes[i][j]
            cell = med[(med["precision"] == prec) & (med["direction"] == direction)]
            ticks: dict[str, list[tuple[float, float, float]]] = {}
            vals = cell[["latency_ms", "floor_roofline_ms"]].to_numpy(dtype="float64")
            vals = vals[np.isfinite(vals)]
            top = float(vals.max()) if vals.size and vals.max() > 0 else 1.0
            for k, s in enumerate(systems):
                for g, shape in enumerate(shapes):
                    x = g - 0.42 + width * (k + 0.5)
                    r = by_med.get((prec, direction, shape, s))
                    if r is not None:
                        ax.bar(x, r["latency_ms"], width * 0.92, color=color(s), alpha=0.85, zorder=2, hatch=hatch(s),
                               edgecolor="white" if hatch(s) else None)
                        for col in FLOOR_STYLE:
                            v = r[f"floor_{col}"]
                            if not L.isna(v):
                                ticks.setdefault(col, []).append((v, x - width / 2, x + width / 2))
                        if not L.isna(r["floor_roofline_ms"]):
                            frac = r["floor_roofline_ms"] / r["latency_ms"]
                            ax.text(x, r["latency_ms"] + top * 0.015, f"{frac:.0%}", ha="center", va="bottom",
                                    fontsize=7.5, zorder=4)
                        continue
                    r = by_cell.get((prec, direction, shape, s))
                    if r is not None and r["status"] != "ok":
                        ax.text(x, top * 0.02, r["status"], rotation=90, ha="center", va="bottom", fontsize=7.5,
                                color="#444444")
                        notes.append(_not_ok_note(r, L.shape_label(shape), L.panel_label(prec, direction)))
            for col, (label, c, ls) in FLOOR_STYLE.items():  # the roofline as a wide pale band, floors on top
                if ticks.get(col):
                    y, x0, x1 = zip(*ticks[col])
                    roof = col == "roofline_ms"
                    ax.hlines(y, x0, x1, colors=c, linestyles=ls, linewidth=5 if roof else 1.8,
                              alpha=0.45 if roof else 1, zorder=3 if roof else 4)
                    drawn.add(col)
            ax.set_title(L.panel_label(prec, direction), fontsize=12, fontweight="bold")
            _shape_ticks(ax, shapes)
            ax.set_ylim(0, top * 1.14)
            if cell.empty:
                _no_ok_panel(ax)
            ax.grid(axis="y", alpha=0.3, zorder=0)
            ax.set_axisbelow(True)
            if j == 0:
                ax.set_ylabel("latency (ms), lower is better")
    from matplotlib.lines import Line2D

    floors = [Line2D([], [], color=c, linestyle=ls, linewidth=5 if col == "roofline_ms" else 2,
                     alpha=0.45 if col == "roofline_ms" else 1) for col, (_, c, ls) in FLOOR_STYLE.items()
              if col in drawn]
    floor_labels = [label for col, (label, _, _) in FLOOR_STYLE.items() if col in drawn]
    default = f"Latency against the layer's floors — {L.env_label(env)} — label over a bar: roofline / latency"
    if not drawn:
        default += " (no calibration rates matched: floors not drawn)"
    finish(fig, title or default, [_patch(s) for s in systems], [L.system_label(s) for s in systems], notes=notes,
           extra_legend=(floors, floor_labels), caption=_caption(L.run_caption(df), shared))
    return fig


# ---------------------------------------------------------------------------------------------------------------
# history


def plot_history(df: pd.DataFrame, config_hash: Optional[str] = None, title: Optional[str] = None) -> Figure:
    """One config's throughput across git SHAs (ordered by the earliest timestamp of each SHA): one subplot per
    direction, one line per backend (side by side within a SHA, so markers never stack), whiskers from the p20 /
    p80 latencies; a SHA where a backend has no ok row is a cross of its colour under the axis, its status in the
    footnote. The title names the config (shape, precision, environment), not its hash alone."""
    hashes = df["config_hash"].dropna().unique()
    if config_hash is None:
        if len(hashes) != 1:
            raise ValueError(f"{len(hashes)} configs in the data; pick one with config_hash=")
        config_hash = str(hashes[0])
    d, shared = C.speed_rows(df[(df["config_hash"] == config_hash).fillna(False)
                                & ~df["backend"].isin(L.NOT_CONTENDERS)].copy())
    if d.empty:
        raise ValueError(f"no rows for config {config_hash}" + (f" ({shared})" if shared else ""))
    d["git_sha"] = d["git_sha"].fillna("unknown")
    d["_t"] = pd.to_datetime(d["timestamp"], utc=True, errors="coerce", format="ISO8601")
    order = d.groupby("git_sha")["_t"].min().sort_values(na_position="first").index.tolist()
    dirty = d.groupby("git_sha")["git_dirty"].agg(lambda s: bool(s.fillna(False).any()))
    ticks = [f"{sha[:7]}{'+' if dirty.get(sha) else ''}" for sha in order]
    directions = L.in_order(d["direction"], L.DIRECTION_ORDER)
    per = min(MAX_WIDTH_IN / len(directions), max(4.5, 1.2 + 0.45 * len(order)))
    fig = new_figure(per * len(directions), 4.6)
    axes = fig.subplots(1, len(directions), squeeze=False)[0]
    systems = L.systems_in(d)
    dodge = {s: (k - (len(systems) - 1) / 2) * min(0.6 / max(len(systems), 1), 0.15) for k, s in enumerate(systems)}
    notes: list[str] = []
    handles: dict[str, Any] = {}
    for ax, direction in zip(axes, directions):
        dd = d[d["direction"] == direction]
        top = 0.0
        for s in systems:
            rows = dd[dd["backend"] == s]
            xs, ys, lo, hi, bad = [], [], [], [], []
            for i, sha in enumerate(order):
                r = rows[(rows["git_sha"] == sha)]
                ok = r[(r["status"] == "ok") & r["tflops_per_gpu"].notna()]
                if len(ok):
                    y = float(ok["tflops_per_gpu"].median())
                    lat = float(ok["latency_ms"].median())
                    p20 = float(ok["latency_p20_ms"].min()) if ok["latency_p20_ms"].notna().any() else lat
                    p80 = float(ok["latency_p80_ms"].max()) if ok["latency_p80_ms"].notna().any() else lat
                    xs.append(i + dodge[s])
                    ys.append(y)
                    lo.append(max(0.0, y - y * lat / p80))
                    hi.append(max(0.0, y * lat / p20 - y))
                    top = max(top, y + hi[-1])
                elif len(r):
                    xs.append(i + dodge[s])
                    ys.append(math.nan)
                    lo.append(0.0)
                    hi.append(0.0)
                    bad.append(i + dodge[s])
                    notes.append(f"{L.system_label(s)} {L.DIRECTION_LABELS.get(direction, direction)} at {sha[:7]}: "
                                 f"{r['status'].iloc[-1]}")
            if xs:
                h = ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4.5, capsize=2.5, lw=1.3, color=color(s),
                                label=L.system_label(s))
                handles.setdefault(L.system_label(s), h)
            if bad:  # under the axis, one row per backend, so crosses of several backends never overlap
                from matplotlib.transforms import blended_transform_factory

                tr = blended_transform_factory(ax.transData, ax.transAxes)
                ax.plot(bad, [-0.02] * len(bad), transform=tr, marker="x", ms=6, mew=1.8, ls="none", color=color(s),
                        clip_on=False, zorder=4)
        ax.set_xticks(range(len(order)), ticks, rotation=45 if len(order) > 6 else 0,
                      ha="right" if len(order) > 6 else "center", fontsize=8.5)
        ax.set_xlim(-0.6, len(order) - 0.4)
        ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
        if top == 0:
            _no_ok_panel(ax)
        ax.grid(alpha=0.3)
        ax.set_title(L.DIRECTION_LABELS.get(direction, direction), fontsize=11)
        ax.set_xlabel("git SHA, oldest → newest (+ = dirty tree; × = not ok)", fontsize=9)
    axes[0].set_ylabel("TFLOP/s per GPU (whiskers: p20-p80)")
    finish(fig, title or f"History of {config_name(d, config_hash)} (config {str(config_hash)[:6]})",
           list(handles.values()), list(handles.keys()), notes=notes, ncol=6, max_notes=6, caption=_caption(shared))
    return fig


# ---------------------------------------------------------------------------------------------------------------
# every chart a report can draw


def report_charts(df: pd.DataFrame, out_dir: Union[str, Path], *, calibration: Optional[pd.DataFrame] = None,
                  formats: Sequence[str] = ("png", "svg"), history: Sequence[str] = (),
                  history_rows: Optional[pd.DataFrame] = None,
                  progress: Optional[Callable[[int, int, str], None]] = None) -> dict[str, list[Path]]:
    """Draw and save every chart the data supports: panels and roofline per run and environment, each sweep axis
    that varies within a run, and the history of each config in ``history`` (over ``history_rows``, default
    ``df``: a history spans runs by nature). ``progress(i, n, name)`` is called before chart ``i`` of ``n`` is
    drawn. Returns chart name -> written files."""
    out = Path(out_dir)
    charts = chart_plan(df, calibration=calibration, history=history, history_rows=history_rows)
    written: dict[str, list[Path]] = {}
    for i, (name, draw) in enumerate(charts, 1):
        if progress is not None:
            progress(i, len(charts), name)
        written[name] = _save_close(draw(), out / name, formats)
    return written


def chart_plan(df: pd.DataFrame, *, calibration: Optional[pd.DataFrame] = None, history: Sequence[str] = (),
               history_rows: Optional[pd.DataFrame] = None) -> list[tuple[str, Callable[[], Figure]]]:
    """The charts :func:`report_charts` draws, in order: (file stem, a function that draws it)."""
    plan: list[tuple[str, Callable[[], Figure]]] = []
    contenders = C.with_runs(df[~df["backend"].isin(L.NOT_CONTENDERS)])
    speed = contenders[~C.is_shared_gpu(contenders)]  # what is drawn; the charts get every row and note the rest
    if speed.empty:
        return plan
    for env in C.environments(speed):
        plan.append((chart_stem("panels", env), lambda env=env: plot_panels(contenders, env)))
    multi = speed["run_id"].nunique() > 1
    for run in speed["run_id"].dropna().unique():
        rows = contenders[contenders["run_id"] == run]
        for x in sweep_axes_present(speed[speed["run_id"] == run]):
            name = f"sweep_{x}" + (f"_{slug(display_name(run))}" if multi else "")
            plan.append((name, lambda rows=rows, x=x: plot_sweep(rows, x)))
            if x == "routing":  # the same sweep's latency against the measured imbalance
                plan.append(("imbalance" + (f"_{slug(display_name(run))}" if multi else ""),
                             lambda rows=rows: plot_imbalance(rows)))
    measured = contenders[~C.is_published(contenders)]
    timed = measured[~C.is_shared_gpu(measured)]
    if len(timed) and has_floors(timed, calibration):
        for env in C.environments(timed):
            if not has_floors(C.select_env(timed, env), calibration):
                continue
            plan.append((chart_stem("roofline", env), lambda env=env: plot_roofline(measured, calibration, env)))
    hist = df if history_rows is None else history_rows
    drawable = set(C.speed_rows(hist)[0]["config_hash"].dropna().astype(str))
    for h in history:
        if str(h) in drawable:  # (a config of shared-GPU rows alone has no speed to draw)
            plan.append((f"history_{config_slug(hist, h)}", lambda h=h: plot_history(hist, h)))
    return plan


def chart_stem(kind: str, env: dict[str, Any]) -> str:
    """The file name (no suffix) of one run environment's ``panels`` or ``roofline`` chart."""
    return f"{kind}_{slug(L.env_label(env))}"


# ---------------------------------------------------------------------------------------------------------------
# the headline charts: the committed report's only images


HEADLINE_MAX_IMAGES = 10  # the committed report's images: the newest cited runs' charts, at most this many


def headline_set(df: pd.DataFrame, verdicts: Optional[pd.DataFrame] = None
                 ) -> tuple[list[tuple[str, str, dict[str, Any]]], pd.DataFrame]:
    """The headline charts of ``df``'s measured rows, as (file name, chart kind, run environment), and the rows they
    draw: for each run the verdict table cites (``harness.report.verdicts.cited_runs``), newest first and at most
    :data:`HEADLINE_MAX_IMAGES` images, its panels chart and, where its rows carry floors, its roofline chart, both
    PNG. The one definition of the committed report's images
    (``results/figures``). ``verdicts``: the verdict table of ``df``, where already made."""
    from harness.report import verdicts as V

    table = V.verdict_table(df) if verdicts is None else verdicts
    rows = C.prepare(df[~C.is_published(df)] if len(df) else df, "run")
    rows = rows[~rows["backend"].isin(L.NOT_CONTENDERS)]
    out = []
    cited = sorted(V.cited_runs(table), key=lambda c: str(c.get("run_started") or ""), reverse=True)
    for run in cited:  # newest first, while the images fit HEADLINE_MAX_IMAGES
        env = {k: run[k] for k in V.RUN_ENV_KEYS}
        charts = [(chart_stem("panels", env) + ".png", "panels", env)]
        if has_floors(C.select_env(rows, env)):
            charts.append((chart_stem("roofline", env) + ".png", "roofline", env))
        if len(out) + len(charts) > HEADLINE_MAX_IMAGES:
            break
        out += charts
    return out, rows


def headline_charts(df: pd.DataFrame, verdicts: Optional[pd.DataFrame] = None) -> list[str]:
    """The file names of the headline charts of ``df`` (:func:`headline_set`)."""
    return [name for name, _, _ in headline_set(df, verdicts)[0]]


def draw_headline_charts(df: pd.DataFrame, out_dir: Union[str, Path],
                         verdicts: Optional[pd.DataFrame] = None) -> list[Path]:
    """Draw :func:`headline_set`'s charts into ``out_dir`` (PNG only); returns the files written."""
    charts, rows = headline_set(df, verdicts)
    written = []
    for name, kind, env in charts:
        fig = plot_panels(rows, env) if kind == "panels" else plot_roofline(rows, None, env)
        written += _save_close(fig, Path(out_dir) / Path(name).stem, ("png",))
    return written


def _save_close(fig: Figure, stem: Path, formats: Sequence[str]) -> list[Path]:
    try:
        return save(fig, stem, formats)
    finally:
        fig.clear()
