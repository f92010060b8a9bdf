"""The short table ``python -m harness.run`` prints."""

from __future__ import annotations

import pandas as pd

SHORT = ["backend", "shape", "precision", "direction", "ep_size", "tokens_per_gpu", "status", "latency_ms",
         "tflops_per_gpu", "dispatch_gb_s", "combine_gb_s", "max_abs_err", "rel_err"]


def format_rows(df: pd.DataFrame) -> str:
    cols = [c for c in SHORT if c in df]
    t = df[cols].copy()
    for c in ("latency_ms", "tflops_per_gpu", "dispatch_gb_s", "combine_gb_s"):
        if c in t:
            t[c] = t[c].map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
    for c in ("max_abs_err", "rel_err"):
        if c in t:
            t[c] = t[c].map(lambda v: "" if pd.isna(v) else f"{v:.2e}")
    text = t.fillna("").to_string(index=False)
    errs = df[df["status"] != "ok"]
    for _, r in errs.iterrows():
        text += f"\n  {r['backend']}/{r['direction']}: {r['status']}: {r['error']}"
    return text


def print_rows(df: pd.DataFrame) -> None:
    print(format_rows(df), flush=True)
