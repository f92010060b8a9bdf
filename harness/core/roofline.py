"""The layer's floors: how fast one MoE layer could possibly run on the measured machine.

Three resources bound a layer: the tensor cores (FLOPs over the measured dense GEMM rate), HBM (expert weights and
activations over the measured HBM bandwidth) and the scale-up link (remote bytes over the measured NVLink rate).
``layer_floors`` turns one results row plus the three calibrated rates into the three times and their max, the
roofline. It is a pure function (no I/O, no torch) so the harness core can import it to fill ``roofline_ms`` /
``roofline_fraction``; the frame helpers below it look the rates up for a whole results table.

Byte counts are deliberately rough lower bounds:

* weights: ``3 * local_experts * hidden * ffn * bytes_per_weight`` (2 for bf16, 1 for fp8 / mxfp8, scales ignored)
  plus the shared expert's ``3 * hidden * ffn * 2`` (always bf16);
* activations: ``tokens_per_gpu * hidden * 2 * (2 + 2 * topk)`` (x in, out, routed rows in and out);
* remote: ``dispatch_bytes + combine_bytes`` (bytes sent to other ranks, one forward).

The backward has its own bytes (:func:`backward_bytes`): the weights read once (at the precision's
bytes), their gradients written once (bf16 in every precision), X read (2 bytes an element, 1 in fp8: the form a
training forward saves it in), H read (the pre-SwiGLU gate/up rows of every routed and shared row, bf16: recompute
off), the output gradient read and dX written (bf16). A forward plus backward (fwd_bwd) moves both.

FLOPs scale with the direction (:data:`PASSES`): x1 / x2 / x3 for fwd / bwd / fwd_bwd (the published formula);
remote bytes x1 / x1 / x2 (a backward runs the combine and the dispatch once each, reversed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import pandas as pd

BYTES_PER_WEIGHT = {"bf16": 2, "fp8": 1, "mxfp8": 1}
SHARED_EXPERT_BYTES = 2  # the shared expert stays bf16 in every precision
GRAD_BYTES = 2  # weight gradients, the output gradient, dX and the saved H are bf16 in every precision

# direction -> (FLOPs, remote bytes) multipliers relative to one forward
PASSES: dict[str, tuple[int, int]] = {"fwd": (1, 1), "bwd": (2, 1), "fwd_bwd": (3, 2)}

BOUNDS = ("compute", "memory", "link")


def _num(v: Any) -> Optional[float]:
    """A finite float, or None for missing values (None, NaN, pd.NA, empty strings)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _get(row: Mapping[str, Any], key: str) -> Optional[float]:
    return _num(row.get(key))


def _shared(row: Mapping[str, Any]) -> bool:
    v = row.get("shared_expert")
    if v is None or (isinstance(v, float) and math.isnan(v)) or str(v) in ("<NA>", "nan", ""):
        return True  # every published shape has one
    return str(v).strip().lower() in ("true", "1")


def layer_flops(row: Mapping[str, Any]) -> Optional[float]:
    """FLOPs per GPU: the ``flops_per_gpu`` column, else 6*(T + T*topk)*H*I scaled by direction."""
    flops = _get(row, "flops_per_gpu")
    if flops is not None:
        return flops
    t, h, i, k = (_get(row, c) for c in ("tokens_per_gpu", "hidden", "ffn", "topk"))
    if None in (t, h, i, k):
        return None
    rows = t * k + (t if _shared(row) else 0)
    return 6.0 * rows * h * i * PASSES.get(str(row.get("direction")), PASSES["fwd"])[0]


def _weights(local: float, h: float, i: float, bpw: float, shared: bool) -> float:
    return 3 * local * h * i * bpw + (3 * h * i * SHARED_EXPERT_BYTES if shared else 0)


def backward_bytes(t: float, h: float, i: float, k: float, local: float, precision: str,
                   shared: bool) -> tuple[float, float]:
    """(weight bytes, activation bytes) a backward must move through HBM at the least: the weights read once and
    their bf16 gradients written once; X read (bf16, or e4m3 in fp8), the bf16 pre-SwiGLU H of every routed and
    shared row read (recompute off), the output gradient read and dX written (bf16)."""
    bpw = BYTES_PER_WEIGHT.get(precision, 2)
    weight = _weights(local, h, i, bpw, shared) + 3 * local * h * i * GRAD_BYTES + (
        3 * h * i * GRAD_BYTES if shared else 0)
    x_bytes = 1 if precision in ("fp8", "mxfp8") else 2
    rows = t * k + (t if shared else 0)
    act = t * h * x_bytes + rows * 2 * i * GRAD_BYTES + 2 * t * h * GRAD_BYTES
    return weight, act


def layer_bytes(row: Mapping[str, Any]) -> dict[str, Optional[float]]:
    """Weight, activation and remote bytes per GPU for the row's direction (None where an input is missing): the
    forward's, :func:`backward_bytes`, or both for fwd_bwd."""
    t, h, i, k = (_get(row, c) for c in ("tokens_per_gpu", "hidden", "ffn", "topk"))
    local = _get(row, "local_experts")
    if local is None:
        e, ep = _get(row, "num_experts"), _get(row, "ep_size")
        local = e / ep if e is not None and ep else None
    direction = str(row.get("direction"))
    _, link_x = PASSES.get(direction, PASSES["fwd"])
    precision = str(row.get("precision"))
    weights: list[Optional[float]] = []
    acts: list[Optional[float]] = []
    if direction != "bwd":  # the forward's (fwd, fwd_bwd, and a row of no known direction)
        bpw = BYTES_PER_WEIGHT.get(precision, 2)
        weights.append(_weights(local, h, i, bpw, _shared(row)) if None not in (local, h, i) else None)
        acts.append(t * h * 2 * (2 + 2 * k) if None not in (t, h, k) else None)
    if direction in ("bwd", "fwd_bwd"):
        w_b, a_b = backward_bytes(t, h, i, k, local, precision, _shared(row)) if None not in (t, h, i, k, local) \
            else (None, None)
        weights.append(w_b)
        acts.append(a_b)
    weight = None if None in weights else sum(weights)
    act = None if None in acts else sum(acts)
    d, c = _get(row, "dispatch_bytes"), _get(row, "combine_bytes")
    remote = (d + c) * link_x if d is not None and c is not None else None
    return {"weight_bytes": weight, "activation_bytes": act, "remote_bytes": remote}


def layer_floors(row: Mapping[str, Any], gemm_tflops: Optional[float], hbm_gb_s: Optional[float],
                 link_gb_s: Optional[float]) -> dict[str, Any]:
    """The three floors of one row, in ms, and their max (``roofline_ms``) with the resource that sets it.

    ``gemm_tflops`` is the measured dense GEMM rate (TFLOP/s), ``hbm_gb_s`` and ``link_gb_s`` measured bandwidths
    (GB/s, 1e9 bytes). A floor whose inputs or rate are missing is None and left out of the max; ``roofline_ms``
    is None when no floor is known. ``roofline_fraction`` = roofline_ms / latency_ms where the row has a latency.
    """
    flops = layer_flops(row)
    b = layer_bytes(row)
    gemm, hbm, link = _num(gemm_tflops), _num(hbm_gb_s), _num(link_gb_s)
    mem_bytes = None
    if b["weight_bytes"] is not None or b["activation_bytes"] is not None:
        mem_bytes = (b["weight_bytes"] or 0.0) + (b["activation_bytes"] or 0.0)
    compute_ms = flops / (gemm * 1e12) * 1e3 if flops is not None and gemm else None
    memory_ms = mem_bytes / (hbm * 1e9) * 1e3 if mem_bytes is not None and hbm else None
    link_ms = b["remote_bytes"] / (link * 1e9) * 1e3 if b["remote_bytes"] is not None and link else None
    times = {"compute": compute_ms, "memory": memory_ms, "link": link_ms}
    known = {k: v for k, v in times.items() if v is not None}
    roof = max(known.values()) if known else None
    bound = max(known, key=known.__getitem__) if known else None
    lat = _get(row, "latency_ms")
    return {
        "flops": flops,
        **b,
        "compute_ms": compute_ms,
        "memory_ms": memory_ms,
        "link_ms": link_ms,
        "roofline_ms": roof,
        "bound": bound,
        "roofline_fraction": roof / lat if roof is not None and lat else None,
    }


# ---------------------------------------------------------------------------------------------------------------
# frames: calibration lookup and floors for every row

CALIB_COLUMNS = ("calib_gemm_tflops", "calib_hbm_gb_s", "calib_link_gb_s")


def load_calibration(path: Union[str, Path]) -> pd.DataFrame:
    """A calibration CSV: the three rates (``calib_gemm_tflops``, ``calib_hbm_gb_s``, ``calib_link_gb_s``, or the
    same without ``calib_``), optionally keyed by ``gpu_name`` and ``precision`` (blank matches every row)."""
    raw = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    out = pd.DataFrame({k: raw[k].astype("string") if k in raw else pd.Series(pd.NA, index=raw.index,
                                                                             dtype="string")
                        for k in ("gpu_name", "precision")})
    for col in CALIB_COLUMNS:
        src = col if col in raw else col.removeprefix("calib_")
        out[col] = pd.to_numeric(raw[src], errors="coerce") if src in raw else float("nan")
    if out[list(CALIB_COLUMNS)].isna().all().all():
        raise ValueError(f"{path}: no calibration rates found; expected columns {', '.join(CALIB_COLUMNS)}")
    return out


def attach_calibration(df: pd.DataFrame, calibration: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """A copy of ``df`` with the ``calib_*`` columns filled where a row lacks them: first from the calibration
    table, then from other rows of the same GPU and precision that carry rates. Within a source the most specific
    match wins (GPU and precision, then GPU, then a blank key); ties take the median."""
    out = df.copy()
    have = [c for c in CALIB_COLUMNS if c in out]
    own = out.loc[out[have].notna().any(axis=1), ["gpu_name", "precision", *have]] if have else None
    for col in CALIB_COLUMNS:
        if col not in out:
            out[col] = float("nan")
        out[col] = pd.to_numeric(out[col], errors="coerce").astype("float64")
    for source in (calibration, own):
        if source is None or source.empty:
            continue
        for col in CALIB_COLUMNS:
            if col not in source:
                continue
            cand = source[source[col].notna()]
            if cand.empty:
                continue
            for idx in out.index[out[col].isna()]:
                val = _lookup(cand, col, out.at[idx, "gpu_name"], out.at[idx, "precision"])
                if val is not None:
                    out.at[idx, col] = val
    return out


def _lookup(cand: pd.DataFrame, col: str, gpu: Any, precision: Any) -> Optional[float]:
    def matches(key: str, value: Any) -> pd.Series:
        k = cand[key].astype("string")
        return k.isna() | (k == ("" if pd.isna(value) else str(value)))

    ok = cand[matches("gpu_name", gpu) & matches("precision", precision)]
    if ok.empty:
        return None
    score = ok["gpu_name"].notna().astype(int) * 2 + ok["precision"].notna().astype(int)
    best = ok.loc[score == score.max(), col]
    return float(best.median())


def floors_frame(df: pd.DataFrame, calibration: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """:func:`layer_floors` for every row (after :func:`attach_calibration`), as columns ``floor_*`` beside the
    row's own; ``floor_roofline_fraction`` = roofline / measured latency."""
    cal = attach_calibration(df, calibration)
    recs = [layer_floors(r, r["calib_gemm_tflops"], r["calib_hbm_gb_s"], r["calib_link_gb_s"])
            for r in cal.to_dict("records")]
    floors = pd.DataFrame.from_records(recs, index=cal.index, columns=list(_FLOOR_KEYS))
    floors = floors.rename(columns={k: f"floor_{k}" for k in floors.columns})
    for c in floors.columns:
        if c != "floor_bound":
            floors[c] = pd.to_numeric(floors[c], errors="coerce").astype("float64")
    return pd.concat([cal, floors], axis=1)


_FLOOR_KEYS = ("flops", "weight_bytes", "activation_bytes", "remote_bytes", "compute_ms", "memory_ms", "link_ms",
               "roofline_ms", "bound", "roofline_fraction")
