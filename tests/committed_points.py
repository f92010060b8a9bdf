"""A committed row's point, rebuilt from its columns: for rows written before rows stored their configuration
(``point_config``). tests/test_config_hash.py and tests/data/find_hash_knobs.py (which found the launch settings the
columns do not hold) share it; it reads only what every version of ``harness.config.schema`` has."""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from harness.config.schema import ConfigError, load_group_option, to_container


def value(v: Any) -> Any:
    """A row's cell as a plain Python value (None for a missing one)."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    return v.item() if hasattr(v, "item") else v


def routing_parts(label: str) -> dict:
    """The workload fields a ``routing`` column's label names (``zipf(s=1)`` -> routing zipf, exponent 1)."""
    if label == "uniform":
        return dict(name="uniform", routing="uniform")
    if m := re.fullmatch(r"zipf\(s=(.*)\)", label):
        return dict(name="zipf", routing="zipf", zipf_exponent=float(m[1]))
    if m := re.fullmatch(r"hot_experts\(f=(.*),x(.*)\)", label):
        return dict(name="hot_experts", routing="hot_experts", hot_fraction=float(m[1]), hot_ratio=float(m[2]))
    m = re.fullmatch(r"hot_rank\(r=(.*),x(.*)\)", label)
    assert m, label
    return dict(name="hot_rank", routing="hot_rank", hot_rank=int(m[1]), hot_ratio=float(m[2]))


def row_config(r: pd.Series, knobs: dict) -> dict:
    """The resolved configuration of a committed row as its run's command line gave it: its columns, the config files
    of its shape / workload / precision, and the launch settings ``knobs`` (ep_size given or not, compile,
    compile_mode, comm_sms given or not, and the then top-level fp8_gemm / te_fp8_recipe / mok_hopper_forward)."""
    rp = routing_parts(r["routing"])
    wl = to_container(load_group_option("workload", rp["name"]))
    wl.update(rp, tokens_per_gpu=int(r["tokens_per_gpu"]), seed=int(r["seed"]))
    prec = to_container(load_group_option("precision", r["precision"]))
    prec.update(atol=float(r["atol"]), rtol=float(r["rtol"]))
    name = r["shape"].split("@")[0]
    try:
        shape = to_container(load_group_option("shape", name))
    except ConfigError:
        shape = dict(to_container(load_group_option("shape", "custom")), name=name)
    if shape["num_experts"] == "???":
        shape["num_experts"] = int(r["num_experts"])
    pl, sl = value(r["published_local_experts"]), value(r["swiglu_limit"])
    shape.update(hidden=int(r["hidden"]), ffn=int(r["ffn"]), topk=int(r["topk"]),
                 shared_expert=bool(r["shared_expert"]),
                 local_experts=int(r["local_experts"]) if r["experts_override"] else None,
                 published_local_experts=None if pl is None else int(pl),
                 swiglu_limit=None if sl is None else float(sl))
    return dict(shape=shape, workload=wl, precision=prec, device=r["device"], ranks_per_gpu=1,
                ep_size=int(r["ep_size"]) if knobs["ep_size_given"] else None, compile=knobs["compile"],
                compile_mode=knobs["compile_mode"], comm_sms=value(r["comm_sms"]) if knobs["comm_sms_given"] else None,
                fp8_gemm=knobs["fp8_gemm"], te_fp8_recipe=knobs["te_fp8_recipe"],
                mok_hopper_forward=knobs["mok_hopper_forward"])
