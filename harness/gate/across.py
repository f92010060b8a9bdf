"""Matching rows across a change of the backends' options (``harness.compare`` / ``harness.gate --across-options``).

A row's ``config_hash`` holds the backends' options wherever they can change a measurement, so a change that flips
an option's default (a kernel's new default layout, say) gives the two sides' rows different hashes and nothing to
match. Asked for, the rows are matched on the point without the options: every configuration column of the row
(shape, sizes, precision, direction, tokens, ranks, routing, compile mode, timing, ...) except ``config_hash``,
``backend_options`` and the descriptive ``scaling`` text. A NEW row then takes the hash of the BASE row it matches,
so the table reads in BASE's hashes, and one line per matched pair says which options differ.

Refused (ValueError, one line) where one side holds rows of two option sets at one point: which of them stands for
the side would be a guess.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import pandas as pd

from harness.core.run_meta import CONFIG_COLUMNS

IGNORED = ("config_hash", "backend_position", "backend_options", "scaling")
POINT_COLUMNS = tuple(c for c in CONFIG_COLUMNS if c not in IGNORED)


def point_keys(df: pd.DataFrame) -> pd.Series:
    """Per row, a digest of its configuration columns without the backends' options (see the module docstring)."""
    cols = [c for c in POINT_COLUMNS if c in df.columns]

    def digest(row) -> str:
        text = "|".join(f"{c}={'' if pd.isna(row[c]) else row[c]}" for c in cols)
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    if df.empty:
        return pd.Series([], dtype=object, index=df.index)
    return df[cols].apply(digest, axis=1)


def _one_option_set(df: pd.DataFrame, keys: pd.Series, side: str) -> None:
    hashes = df.assign(_pk=keys).groupby("_pk")["config_hash"].nunique()
    if (hashes > 1).any():
        pk = hashes[hashes > 1].index[0]
        rows = df[keys == pk]
        opts = sorted(set(rows["backend_options"].fillna("").astype(str)))
        raise ValueError(f"--across-options: {side} holds rows of {hashes[pk]} configurations at one point "
                         f"({rows['shape'].iloc[0]} {rows['precision'].iloc[0]} {rows['direction'].iloc[0]}; "
                         f"backend options: {' | '.join(opts) or 'none'}): give each side the rows of one option set")


def match_across_options(base: pd.DataFrame, new: pd.DataFrame, aa: Optional[pd.DataFrame] = None
                         ) -> tuple[pd.DataFrame, pd.DataFrame, Optional[pd.DataFrame], list[str]]:
    """BASE, NEW and the A/A rerun with NEW's (and the rerun's) ``config_hash`` replaced by the hash of the BASE row
    at the same point, and the lines that say what was matched: one per NEW hash that took a BASE hash, naming both
    sides' backend options."""
    kb = point_keys(base)
    _one_option_set(base, kb, "BASE")
    to_base = dict(zip(kb, base["config_hash"]))
    lines, out = [], []
    for df, side in ((new, "NEW"), (aa, "the A/A rerun")):
        if df is None:
            out.append(None)
            continue
        k = point_keys(df)
        _one_option_set(df, k, side)
        mapped = k.map(to_base)
        df = df.copy()
        old = df["config_hash"]
        df["config_hash"] = mapped.where(mapped.notna(), old)
        for was, h in sorted(set(zip(old[mapped.notna()], mapped[mapped.notna()]))):
            if was != h:
                lines.append(f"across options: {side}'s {was} judged as BASE's {h}{_option_change(base, df, h)}")
        out.append(df)
    return base, out[0], out[1], lines


def _option_change(base: pd.DataFrame, df: pd.DataFrame, h: str) -> str:
    """``; <backend>: <BASE options> -> <side's options>`` for each backend whose options differ at hash ``h``."""
    parts = []
    b, n = base[base["config_hash"] == h], df[df["config_hash"] == h]
    for backend in sorted(set(b["backend"].dropna()) & set(n["backend"].dropna())):
        ob = b.loc[b["backend"] == backend, "backend_options"].fillna("").astype(str).iloc[0]
        on = n.loc[n["backend"] == backend, "backend_options"].fillna("").astype(str).iloc[0]
        if ob != on:
            parts.append(f"{backend}: {ob or 'none'} -> {on or 'none'}")
    return "; " + "; ".join(parts) if parts else ""
