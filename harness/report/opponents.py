"""Each contender over its fastest opponent, like with like: what the verdicts lead with.

An **opponent** of a contender is a backend whose role is a baseline (published or not) or an anchor
(:func:`harness.report.labels.is_opponent`): never the reference, never another contender. A **cell** is one run,
environment (GPU, EP size, tokens per GPU, nodes), routing, precision, direction and shape, and, for forwards, the
forward kind (:func:`harness.report.labels.forward_kind`): a training forward (it keeps what its backward needs) is
paired with training forwards only, an inference forward (it saves nothing) with inference forwards only; the rows of
other directions pair as they are.

:func:`opponent_table` gives, per cell and contender ok in it: the fastest ok opponent and the contender's TFLOP/s
over its (the same FLOPs: the latency ratio inverted); the own-peak memory ratio, the contender's
``mem_peak_own_bytes`` over the same opponent's (NaN where either did not measure it); the fastest ok baseline and
the speedup over it (what the published claim compares); and, in a cell of another precision than bf16, the
fastest bf16 opponent of the same run, environment, routing, shape, direction and forward kind, and the speedup
over it. Each value is the median over the cell's ok rows of that backend (repeated rows of one run).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pandas as pd

from harness.core.results import own_peak_counts_graphs
from harness.report.claims import CELL_KEYS, norm_key, speed_rows, with_runs
from harness.report.labels import (NOT_CONTENDERS, SYSTEM_ORDER, forward_kinds, in_order, is_baseline, is_fused,
                                   is_opponent)

PAIR_KEYS = (*CELL_KEYS, "forward_kind")
MEMORY_COLUMN = "mem_peak_own_bytes"  # the backend's own peak: the only column a memory ratio reads
BF16 = "bf16"
COLUMNS = (*PAIR_KEYS, "contender", "tflops", "mem_peak_own_bytes", "opponent", "opponent_tflops", "speedup",
           "opponent_mem_peak_own_bytes", "memory_ratio", "opponents_ok", "baseline", "baseline_speedup",
           "bf16_opponent", "bf16_speedup")


def medians(df: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (:data:`PAIR_KEYS`) and backend of ``df``'s ok, timed rows (the reference and shared-GPU
    rows left out): the median ``tflops`` and own-peak memory (``mem_peak_own_bytes``, NaN where no row has it)."""
    d = with_runs(speed_rows(df)[0])
    d = d[~d["backend"].isin(NOT_CONTENDERS) & (d["status"] == "ok").fillna(False) & d["tflops_per_gpu"].notna()]
    cols = [*PAIR_KEYS, "backend", "tflops", MEMORY_COLUMN]
    if d.empty:
        return pd.DataFrame(columns=cols)
    mem = d[MEMORY_COLUMN].to_numpy(dtype="float64", na_value=np.nan) if MEMORY_COLUMN in d else np.full(len(d), np.nan)
    # rows of CUDA graph replays written before mem_graph_pool_bytes missed the graphs' memory (harness.measure.memory)
    kind = [c for c in ("compiled", "compile_mode", "mem_graph_pool_bytes") if c in d]
    counted = [own_peak_counts_graphs(r) for r in d[kind].to_dict("records")]
    d = d.assign(forward_kind=forward_kinds(d), _mem=np.where(counted, mem, np.nan))
    out = d.groupby([*PAIR_KEYS, "backend"], dropna=False, sort=False).agg(
        tflops=("tflops_per_gpu", "median"), mem=("_mem", "median")).reset_index()
    return out.rename(columns={"mem": MEMORY_COLUMN})[cols]


def _fastest(cell: dict[str, tuple[float, float]], keep: Any) -> Optional[str]:
    """The fastest backend of ``cell`` (backend -> (tflops, memory)) that ``keep`` accepts (registry order breaks a
    tie); None where there is none."""
    names = in_order([b for b in cell if keep(b)], SYSTEM_ORDER)
    return max(names, key=lambda b: cell[b][0]) if names else None


def opponent_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per cell and contender ok in it (:data:`COLUMNS`), from ``df``'s rows (prepared: ``claims.prepare``): the
    fastest opponent of the same cell and forward kind, the speedup and own-peak memory ratio over it, the fastest
    baseline and the speedup over it, and (precision other than bf16) the fastest bf16 opponent and the speedup over
    it. NaN (and '') where the cell has no such opponent."""
    med = medians(df)
    cells: dict[tuple, dict[str, tuple[float, float]]] = {}
    first: dict[tuple, dict[str, Any]] = {}
    for r in med.to_dict("records"):
        key = norm_key(tuple(r[k] for k in PAIR_KEYS))
        cells.setdefault(key, {})[r["backend"]] = (float(r["tflops"]), float(r[MEMORY_COLUMN]))
        first.setdefault(key, {k: r[k] for k in PAIR_KEYS})
    prec_at = PAIR_KEYS.index("precision")
    rows = []
    for key, cell in cells.items():
        opp = _fastest(cell, is_opponent)
        base = _fastest(cell, is_baseline)
        bf16_cell = cells.get(key[:prec_at] + (BF16,) + key[prec_at + 1:], {}) if key[prec_at] != BF16 else {}
        bf16 = _fastest(bf16_cell, is_opponent)
        for f in in_order([b for b in cell if is_fused(b)], SYSTEM_ORDER):
            tf, mem = cell[f]
            rec = dict(first[key], contender=f, tflops=tf, mem_peak_own_bytes=mem)
            rec.update(opponent=opp or "", opponent_tflops=cell[opp][0] if opp else math.nan,
                       speedup=tf / cell[opp][0] if opp else math.nan,
                       opponent_mem_peak_own_bytes=cell[opp][1] if opp else math.nan,
                       memory_ratio=mem / cell[opp][1] if opp and cell[opp][1] > 0 else math.nan,
                       opponents_ok=sum(1 for b in cell if is_opponent(b)),
                       baseline=base or "", baseline_speedup=tf / cell[base][0] if base else math.nan,
                       bf16_opponent=bf16 or "", bf16_speedup=tf / bf16_cell[bf16][0] if bf16 else math.nan)
            rows.append(rec)
    return pd.DataFrame(rows, columns=list(COLUMNS))
