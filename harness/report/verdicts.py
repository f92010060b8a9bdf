"""The latest measured verdicts: one line per environment kind, panel and pairing, from the newest run that
measured it.

An environment kind is a GPU model, the number of GPUs of the machine, the EP size, tokens per GPU, nodes and routing;
a panel is a precision and direction; a pairing is what the panel's rows pair (``labels.pairs_label``): training
forwards with training forwards, inference forwards with inference forwards (``labels.forward_kind``), backwards as
they are. For each, :func:`verdict_table` takes the newest run (by its first timestamp) in which a contender
(``mok_hopper``, ``mok``; never the CPU twin) and at least one opponent (a baseline or an anchor,
``labels.is_opponent``) are ok on the same shape of that panel and pairing, and leads with the contender's speedup
over the fastest opponent of each such shape of that run (min-max over the shapes), naming it, with the own-peak
memory ratio over that same opponent (``mem_peak_own_bytes``) beside it; an fp8 panel adds the speedup over the
fastest bf16 opponent of the same run, shape, direction and forward kind (``harness.report.opponents``). Flags say how
the comparison was made: the timing preset and counts, whether the fastest opponent ran eager or compiled, and (fp8)
whether its GEMMs were real fp8 or emulated. The speedup over the fastest baseline (what the published claim
compares) and the published claim for the panel stand at the end, the claim labelled published (another GPU and EP
size: side by side, never a ratio). Rows that ran several ranks on one GPU (``shared_gpu``) check correctness only:
no verdict reads them, and the block says how many were left out.

:func:`format_verdicts` renders the table as Markdown; :func:`verdict_block` adds the legend and the line that says
where it comes from, and :func:`replace_block` / :func:`rewrite_block` put it between the
``<!-- verdicts:start -->`` and ``<!-- verdicts:end -->`` lines of a file (README.md, results/REPORT.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Union

import pandas as pd

from harness.core.backends import SERIES_SEP, base_name, series_name, series_parts
from harness.report.claims import (CPU_TWIN, ENV_KEYS, is_published, load_claims, prepare, published_counts, select_env,
                            speed_rows, with_runs)
from harness.report.labels import (DIRECTION_ORDER, FORWARD_KINDS, FUSED, NOT_CONTENDERS, SYSTEM_ORDER, forward_kinds,
                            in_order, int_text, isna, is_opponent, pairs_label, panel_label, scaling_variant,
                            system_label)
from harness.report.opponents import MEMORY_COLUMN, opponent_table
from harness.core.run_names import display_name

# the contenders a verdict is about, in registry order (the CPU twin ran pure torch on a CPU, not the kernel)
CONTENDERS = tuple(f for f in FUSED if f not in CPU_TWIN.values())
KIND_KEYS = ("gpu_name", "num_gpus", "ep_size", "tokens_per_gpu", "num_nodes", "routing")
RUN_ENV_KEYS = (*ENV_KEYS, "routing")  # one run's environment: what a chart or claims table of the run selects
VERDICT_PRECISIONS = ("bf16", "fp8", "mxfp8")  # the table's panel order: BF16, FP8, then MXFP8
# Hopper has no MXFP8: its fp8 (1x128 / 128x128 block-scaled e4m3) is the counterpart of the published MXFP8 panels,
# so an fp8 verdict shows the published MXFP8 claim, labelled with its precision
PUBLISHED_COUNTERPART = {"fp8": "mxfp8"}
MARK_START = "<!-- verdicts:start -->"
MARK_END = "<!-- verdicts:end -->"
COMMAND = "python3 -m harness.report"
ERRATA = "ERRATA.md"  # beside a committed run's rows: something found wrong with the run after it was committed

COLUMNS = (*KIND_KEYS, "environment", "precision", "direction", "forward_kind", "pairs", "panel", "contender",
           "run_id", "run_started", "shapes", "speedup_min", "speedup_max", "fastest_opponents", "memory_shapes",
           "memory_ratio_min", "memory_ratio_max", "bf16_shapes", "bf16_speedup_min", "bf16_speedup_max",
           "fastest_bf16_opponents", "baseline_shapes", "baseline_speedup_min", "baseline_speedup_max",
           "fastest_baselines", "timing", "opponent_compile", "fp8", "baseline_compile", "baseline_fp8",
           "published_claim", "published_claim_panel")


def kind_label(rec: dict[str, Any]) -> str:
    """``2x NVIDIA H200, EP 2, 2048 tokens/GPU`` (then the nodes where more than one, a routing other than uniform)."""
    gpu = "unknown GPU" if isna(rec.get("gpu_name")) else str(rec["gpu_name"])
    parts = [f"{int_text(rec.get('num_gpus'))}x {gpu}", f"EP {int_text(rec.get('ep_size'))}",
             f"{int_text(rec.get('tokens_per_gpu'))} tokens/GPU"]
    if not isna(rec.get("num_nodes")) and int(rec["num_nodes"]) != 1:
        parts.append(f"{int(rec['num_nodes'])} nodes")
    if not isna(rec.get("routing")) and rec["routing"] != "uniform":
        parts.append(f"routing {rec['routing']}")
    return ", ".join(parts)


def timing_label(preset: Any, warmup: Any, iters: Any, published: tuple[int, int]) -> str:
    """``published`` for the published preset at its counts; else the preset and its counts, ``custom 20/50``."""
    name = "unrecorded" if isna(preset) or not str(preset) else str(preset)
    counts = None if isna(warmup) or isna(iters) else (int(warmup), int(iters))
    if name == "published" and counts in (None, published):
        return "published"
    return name if counts is None else f"{name} {counts[0]}/{counts[1]}"


def compile_label(compiled: Any, mode: Any) -> str:
    """``eager``, ``compiled (<compile_mode>)`` (``compiled`` where the mode is not recorded) or ``unrecorded``."""
    if isna(compiled):
        return "unrecorded"
    if not bool(compiled):
        return "eager"
    return "compiled" if isna(mode) or not str(mode) else f"compiled ({mode})"


def fp8_label(scaling: Any) -> str:
    """``emulated`` (bf16 GEMMs on e4m3 values: accuracy, not fp8 speed), else ``real (<path>)`` by the path's short
    name (``labels.scaling_variant``: rowwise, DeepGEMM, scaled_mm loop, TE blockwise, ...)."""
    if isna(scaling) or not str(scaling) or str(scaling) == "none":
        return "unrecorded"
    variant = scaling_variant(scaling)
    return "emulated" if variant == "emulated" or "emulated" in str(scaling) else f"real ({variant})"


def _distinct(values: Any) -> str:
    return ", ".join(dict.fromkeys(str(v) for v in values)) or "unrecorded"


def _run_kinds(d: pd.DataFrame) -> dict[tuple, Any]:
    """A run environment's number of GPUs (the machine's; the largest its rows record)."""
    n = d.groupby(list(RUN_ENV_KEYS), dropna=False, sort=False)["num_gpus"].max()
    return {_key(k): v for k, v in n.items()}


def _key(k: Any) -> tuple:
    k = k if isinstance(k, tuple) else (k,)
    return tuple(None if isna(v) else (int(v) if isinstance(v, float) and v.is_integer() else v) for v in k)


def _claim_lookup(claims: Optional[pd.DataFrame]) -> dict[tuple[str, str], float]:
    if claims is None:
        claims = load_claims()
    return {(str(r["precision"]), str(r["direction"])): float(r["claimed_max_speedup"])
            for r in claims.to_dict("records") if not isna(r["claimed_max_speedup"])}


def verdict_table(df: pd.DataFrame, claims: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """The latest measured verdicts of ``df``'s measured rows (published rows are left out): per environment kind,
    panel, forward kind and contender (:data:`COLUMNS`), the newest run that has the contender and an opponent of the
    same forward kind ok on each shape; one verdict row per such run (a campaign of one run per shape gives one row
    a shape). ``claims``: the published claims (default ``load_claims()``). Shared-GPU rows (``claims.speed_rows``) are
    left out; ``attrs["notes"]`` says how many."""
    measured, note = speed_rows(df[~is_published(df)] if len(df) else df)
    out = _verdicts(measured, claims)
    out.attrs["notes"] = [note] if note else []
    return out


def _verdicts(measured: pd.DataFrame, claims: Optional[pd.DataFrame]) -> pd.DataFrame:
    """:func:`verdict_table` of measured rows that hold no shared-GPU row."""
    if measured.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    d = prepare(measured, "run")
    d = d[~d["backend"].isin(NOT_CONTENDERS)]
    pairs = opponent_table(d)
    # (a contender's inference forwards are a series of their own where its run has both kinds: claims.prepare)
    # a contender at its default options: a run that compares its options (weights=plain against tiled) is a study
    # of the contender, reported in that run's own report, and gives no verdict
    pairs = pairs[pairs["contender"].map(base_name).isin(CONTENDERS) & pairs["speedup"].notna()
                  & ~pairs["contender"].map(_options_series).astype(bool)]
    if pairs.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    gpus = _run_kinds(d)
    claimed = _claim_lookup(claims)
    published = published_counts()
    # per environment kind, panel, forward kind, contender and shape: the newest run that measured the pair (runs of
    # one point each, as a campaign of one run per shape, then give a verdict row each)
    newest: dict[tuple, tuple[str, str, pd.Series]] = {}
    panel_keys = [*RUN_ENV_KEYS, "precision", "direction", "forward_kind", "contender"]
    for key, g in pairs.groupby(panel_keys, dropna=False, sort=False):
        env = dict(zip(panel_keys, key))
        n_gpus = gpus.get(_key(tuple(env[k] for k in RUN_ENV_KEYS)))
        kind = tuple(n_gpus if k == "num_gpus" else env[k] for k in KIND_KEYS)
        slot = (_key(kind), env["precision"], env["direction"], env["forward_kind"], env["contender"])
        order = ("" if isna(env["run_started"]) else str(env["run_started"]), str(env["run_id"]))
        for _, r in g.iterrows():
            cell = (*slot, r["shape"])
            if cell not in newest or order > newest[cell][:2]:
                newest[cell] = (*order, r)
    runs: dict[tuple, list[pd.Series]] = {}
    for cell, (_, run_id, r) in newest.items():
        runs.setdefault((*cell[:-1], run_id), []).append(r)
    rows = [_verdict_row(pd.DataFrame(rs), d, key[0], claimed, published) for key, rs in runs.items()]
    out = pd.DataFrame(rows, columns=list(COLUMNS))
    return _sorted(out).reset_index(drop=True)


def _spread(values: pd.Series, names: pd.Series, prefix: str) -> dict[str, Any]:
    """``<prefix>_min``, ``<prefix>_max`` over ``values``' numbers, how many, and ``names`` where they are (registry
    order): one ratio of a verdict row."""
    ok = values.notna()
    v = values[ok]
    return {f"{prefix}_min": float(v.min()) if v.size else math.nan,
            f"{prefix}_max": float(v.max()) if v.size else math.nan,
            "_n": int(v.size), "_names": ", ".join(in_order(names[ok], SYSTEM_ORDER))}


def _verdict_row(g: pd.DataFrame, d: pd.DataFrame, kind: tuple, claimed: dict[tuple[str, str], float],
                 published: tuple[int, int]) -> dict[str, Any]:
    """One verdict: ``g`` holds the ``harness.report.opponents`` rows (one per shape) of one run, environment, panel,
    forward kind and contender where the contender has a fastest opponent; ``d`` the prepared rows they come
    from."""
    first = g.iloc[0].to_dict()
    f = first["contender"]  # its series name in ``d``
    rec: dict[str, Any] = dict(zip(KIND_KEYS, kind))
    prec, direction, fkind = str(first["precision"]), str(first["direction"]), str(first["forward_kind"])
    rec.update(environment=kind_label(rec), precision=prec, direction=direction, forward_kind=fkind,
               pairs=pairs_label(direction, fkind), panel=panel_label(prec, direction), contender=_contender(f),
               run_id=first["run_id"], run_started=first["run_started"])
    s = _spread(g["speedup"], g["opponent"], "speedup")
    rec.update(shapes=s.pop("_n"), fastest_opponents=s.pop("_names"), **s)
    m = _spread(g["memory_ratio"], g["opponent"], "memory_ratio")
    rec.update(memory_shapes=m.pop("_n"), **{k: v for k, v in m.items() if not k.startswith("_")})
    b = _spread(g["bf16_speedup"], g["bf16_opponent"], "bf16_speedup")
    rec.update(bf16_shapes=b.pop("_n"), fastest_bf16_opponents=b.pop("_names"), **b)
    base = _spread(g["baseline_speedup"], g["baseline"], "baseline_speedup")
    rec.update(baseline_shapes=base.pop("_n"), fastest_baselines=base.pop("_names"), **base)
    rows = select_env(d, {k: first[k] for k in RUN_ENV_KEYS})
    rows = rows[(rows["precision"] == prec) & (rows["direction"] == direction) & (rows["status"] == "ok")
                & rows["shape"].isin(list(g["shape"]))]
    rows = rows[(forward_kinds(rows) == fkind).to_numpy(dtype=bool)]
    compared = rows[rows["backend"].map(lambda x: x == f or is_opponent(x)).astype(bool)]
    rec["timing"] = _distinct(timing_label(p, w, i, published) for p, w, i in
                              zip(compared["timing_preset"], compared["num_warmup"], compared["num_iters"]))
    for col, name in (("opponent", "opponent_compile"), ("baseline", "baseline_compile")):
        best = pd.concat([rows[(rows["shape"] == r["shape"]) & (rows["backend"] == r[col])]
                          for r in g.to_dict("records")])
        rec[name] = _distinct(compile_label(c, m) for c, m in zip(best["compiled"], best["compile_mode"]))
        rec[name.replace("compile", "fp8")] = ("" if prec == "bf16" else
                                                _distinct(fp8_label(sc) for sc in best["scaling"]))
    rec["fp8"] = rec.pop("opponent_fp8")
    claim_prec = prec if (prec, direction) in claimed else PUBLISHED_COUNTERPART.get(prec, prec)
    rec["published_claim"] = claimed.get((claim_prec, direction), math.nan)
    rec["published_claim_panel"] = panel_label(claim_prec, direction) if (claim_prec, direction) in claimed else ""
    return rec


def _options_series(series: str) -> bool:
    """Whether a series is one of a backend's option variants (``mok_hopper · weights=plain``:
    ``claims.options_variants``)."""
    return any("=" in part for part in series_parts(series)[1].split(SERIES_SEP))


def _contender(series: str) -> str:
    """The contender a verdict names: its series (``mok_hopper · weights=plain``, where one run measured it under
    several options), less the forward-kind split, which the ``pairs`` column already says."""
    base, variant = series_parts(series)
    variant = SERIES_SEP.join(v for v in variant.split(SERIES_SEP) if v != "inference")
    return series_name(base, variant) if variant else base


def _sorted(table: pd.DataFrame) -> pd.DataFrame:
    def key(i: Any) -> tuple:
        r = table.loc[i]
        kind = tuple((1, "") if isna(r[k]) else (0, f"{r[k]!s:>12}") for k in KIND_KEYS)
        prec = VERDICT_PRECISIONS.index(r["precision"]) if r["precision"] in VERDICT_PRECISIONS else 99
        dire = DIRECTION_ORDER.index(r["direction"]) if r["direction"] in DIRECTION_ORDER else 99
        fk = FORWARD_KINDS.index(r["forward_kind"]) if r["forward_kind"] in FORWARD_KINDS else 99
        base, variant = series_parts(r["contender"])
        return (r["routing"] != "uniform", kind, prec, dire, fk, SYSTEM_ORDER.index(base), variant)

    return table.loc[sorted(table.index, key=key)]


def cited_runs(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The run environments (:data:`RUN_ENV_KEYS`, with ``kind``: the environment kind's label) the verdict table
    cites, each once: by environment kind in the table's order, newest run first."""
    seen: dict[tuple, dict[str, Any]] = {}
    for kind, g in table.groupby("environment", sort=False):
        for r in g.sort_values("run_started", ascending=False, kind="stable").to_dict("records"):
            seen.setdefault((kind, r["run_id"]), {"kind": kind, "run_id": r["run_id"], "run_started": r["run_started"],
                                                 **{k: r[k] for k in KIND_KEYS if k in RUN_ENV_KEYS}})
    return list(seen.values())


# ---------------------------------------------------------------------------------------------------------------
# Markdown


def _range(lo: float, hi: float, n: int) -> str:
    if n == 0 or isna(lo):
        return "—"
    span = f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}×"
    return f"{span} ({n} shape{'s' if n != 1 else ''})"


def _labels(keys: str) -> str:
    return ", ".join(system_label(k) for k in keys.split(", ") if k)


def errata_runs(run_ids: Any, root: Union[str, Path, None] = None) -> set[str]:
    """The run ids among ``run_ids`` whose folder under ``root`` (default: the committed runs) holds an
    :data:`ERRATA` file."""
    from harness.core.results import REFERENCE_RUNS

    base = Path(root) if root is not None else REFERENCE_RUNS
    return {str(r) for r in run_ids if not isna(r) and (base / str(r) / ERRATA).is_file()}


def format_verdicts(table: pd.DataFrame, errata: Any = ()) -> str:
    """The verdict table as Markdown (a contender column only where the table has more than one contender); a run in
    ``errata`` is marked, so that no verdict is read without its run's errata."""
    if table.empty:
        return "No verdict: no run has a contender and an opponent ok on the same shape."
    several = table["contender"].nunique() > 1
    header = ["environment", "panel", "pairs", *(["contender"] if several else []), "× fastest opponent",
              "fastest opponent", "own-peak memory × opponent", "× fastest bf16 opponent", "run", "timing",
              "opponent compile", "fp8", "× fastest baseline", "published claim (GB300, EP 64, max over shapes)"]
    rows = []
    for r in table.to_dict("records"):
        bf16 = "—"
        if r["bf16_shapes"]:
            bf16 = (_range(r["bf16_speedup_min"], r["bf16_speedup_max"], r["bf16_shapes"])
                    + f" over {_labels(r['fastest_bf16_opponents'])}")
        base = "—"
        if r["baseline_shapes"]:
            base = (_range(r["baseline_speedup_min"], r["baseline_speedup_max"], r["baseline_shapes"])
                    + f" over {_labels(r['fastest_baselines'])}")
            if r["fastest_baselines"] != r["fastest_opponents"]:  # the flags describe the opponent: its own
                base += f"; {r['baseline_compile']}" + (f", fp8 {r['baseline_fp8']}" if r["baseline_fp8"] else "")
        claim = "—"
        if not isna(r["published_claim"]):
            other = r["published_claim_panel"] != r["panel"]
            claim = f"{r['published_claim']:.2f}× (published{', ' + r['published_claim_panel'] if other else ''})"
        rows.append([r["environment"], r["panel"], r["pairs"], *([system_label(r["contender"])] if several else []),
                     _range(r["speedup_min"], r["speedup_max"], r["shapes"]), _labels(r["fastest_opponents"]),
                     _range(r["memory_ratio_min"], r["memory_ratio_max"], r["memory_shapes"]), bf16,
                     f"`{display_name(r['run_id'])}`" + (f" (see its {ERRATA})" if r["run_id"] in errata else ""),
                     r["timing"],
                     r["opponent_compile"], r["fp8"] or "—", base, claim])
    esc = [[str(c).replace("|", "\\|") for c in r] for r in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in esc[1:]])


def legend(table: pd.DataFrame) -> str:
    """What the verdict table's ratios are, and why a memory ratio reads — where one does."""
    text = ("× fastest opponent: the contender's TFLOP/s over the fastest ok opponent's (a baseline or an anchor, "
            "never another contender) on the same shape of the same run, min-max over the run's shapes; `pairs` "
            "says which rows pair: a training forward (it keeps what its backward needs) only with training "
            "forwards, an inference forward (it saves nothing) only with inference forwards, backwards as they are. "
            f"Own-peak memory: the contender's `{MEMORY_COLUMN}` over the same opponent's on those shapes")
    if len(table) and (table["memory_shapes"] < table["shapes"]).any():
        text += (f"; — where that run did not measure it (rows written before the `{MEMORY_COLUMN}` column, or a "
                 "row without it)")
    text += (". × fastest bf16 opponent (fp8 panels): the contender's fp8 TFLOP/s over the fastest bf16 opponent's "
             "of the same run, shape, direction and forward kind; — where the run has no bf16 opponent row. "
             "× fastest baseline: over the fastest baseline alone, what the published claim compares (with its "
             "compile state, and fp8 GEMMs, where it is not the fastest opponent).")
    return text


def newest_date(df: pd.DataFrame) -> str:
    """The date (YYYY-MM-DD) the newest measured run started (its first timestamp; "unknown" where none); shared-GPU
    rows measure no speed and do not count."""
    measured = speed_rows(df[~is_published(df)] if len(df) else df)[0]
    if measured.empty:
        return "unknown"
    t = with_runs(measured)["run_started"].dropna().astype(str)
    return max(t)[:10] if len(t) else "unknown"


def verdict_block(df: pd.DataFrame, claims: Optional[pd.DataFrame] = None,
                  table: Optional[pd.DataFrame] = None) -> str:
    """What goes between the markers: the verdict table of ``df`` (or ``table``, already made from it), each run
    with errata marked (:func:`errata_runs`), its :func:`legend`, and one line that says how it is made and the date
    of the newest run.
    Depends only on the rows and the committed runs' errata files. Where shared-GPU rows were left out, a line
    says how many."""
    table = verdict_table(df, claims) if table is None else table
    errata = errata_runs(table["run_id"]) if len(table) else set()
    note = speed_rows(df[~is_published(df)] if len(df) else df)[1]
    return (f"{format_verdicts(table, errata)}\n\n" + (f"{legend(table)}\n\n" if len(table) else "")
            + (f"{note}.\n\n" if note else "")
            + f"Generated by `{COMMAND}` from results/runs (newest run: {newest_date(df)}); do not edit by hand.")


def block_of(text: str) -> Optional[str]:
    """The text between the marker lines (None where the file has neither marker); ValueError where they are
    malformed: one without the other, more than one pair, or the end before the start."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip() == MARK_START]
    ends = [i for i, ln in enumerate(lines) if ln.strip() == MARK_END]
    if not starts and not ends:
        return None
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"needs one '{MARK_START}' line and, after it, one '{MARK_END}' line (found "
                         f"{len(starts)} and {len(ends)})")
    return "\n".join(lines[starts[0] + 1:ends[0]]).strip("\n")


def replace_block(text: str, block: str) -> str:
    """``text`` with the lines between the markers replaced by ``block`` (ValueError where it has no markers or
    malformed ones: :func:`block_of`)."""
    if block_of(text) is None:
        raise ValueError(f"has no '{MARK_START}' / '{MARK_END}' lines")
    lines = text.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.strip() == MARK_START)
    end = next(i for i, ln in enumerate(lines) if ln.strip() == MARK_END)
    return "".join(lines[:start + 1]) + block.strip("\n") + "\n" + "".join(lines[end:])


def rewrite_block(path: Union[str, Path], block: str) -> bool:
    """Replace the block in the file at ``path`` (:func:`replace_block`); True where its text changed."""
    p = Path(path)
    old = p.read_text()
    new = replace_block(old, block)
    if new != old:
        p.write_text(new)
    return new != old
