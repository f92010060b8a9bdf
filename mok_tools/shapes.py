"""The layer shapes of the benchmark tools, from the harness's one table of them (``configs/shape/*.yaml``)."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

from contract import Case
from harness.config.schema import load_group_option, shape_table, to_container
from harness.config.point import make_case


def published_shapes() -> list[str]:
    """The shapes of the published figure: every ``configs/shape/*.yaml`` with ``published_local_experts``, in the
    harness's display order (:func:`harness.config.schema.shape_table`, the order of the report)."""
    return [n for n, s in shape_table().items() if s["published_local_experts"] is not None]


def shape_config(name: str) -> dict[str, Any]:
    """``configs/shape/<name>.yaml`` as a dict; ``name@Nepg`` sets ``local_experts`` to N (N experts per GPU, as
    ``shape.local_experts=N`` does in the harness). Raises ``harness.config.schema.ConfigError`` for an unknown
    shape."""
    base, _, per_gpu = name.partition("@")
    shape = to_container(load_group_option("shape", base))
    if per_gpu:
        shape["local_experts"] = int(per_gpu.removesuffix("epg"))
    return shape


def make_shape_case(shape: dict[str, Any], *, ep_size: int, device: str, tokens: int, precision: str,
                    seed: Optional[int] = None) -> Case:
    """A harness :class:`Case` for one shape (uniform routing, the workload's seed unless given), validated as the
    harness validates it (``harness.config.schema.ConfigError`` names what does not fit, e.g. experts over ranks)."""
    workload = to_container(load_group_option("workload", "uniform"))
    workload["tokens_per_gpu"] = tokens
    if seed is not None:
        workload["seed"] = seed
    cfg = {"shape": shape, "workload": workload, "precision": to_container(load_group_option("precision", precision)),
           "compile": False}
    return make_case(cfg, ep_size=ep_size, device=device)


def shape_dims(names: Sequence[str]) -> list[tuple[int, int, int]]:
    """(H, I, K) of each named shape, without repeats (what the anchors' precompiles need: their kernels depend on
    these at most). Raises KeyError naming the unknown shapes."""
    table = shape_table()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"unknown shape(s) {unknown}; known: {sorted(table)}")
    dims: list[tuple[int, int, int]] = []
    for n in names:
        d = (int(table[n]["hidden"]), int(table[n]["ffn"]), int(table[n]["topk"]))
        if d not in dims:
            dims.append(d)
    return dims


def precompile_inputs(prog: str, cache_env: str, reader: str, shapes: str, workers: int
                      ) -> Optional[tuple[str, list[tuple[int, int, int]]]]:
    """The checks every precompile tool (``mok_tools.liger_precompile``, ``mok_tools.sonic_precompile``) makes
    first: ``cache_env`` names the cache folder (``reader`` loads its kernels from it), ``shapes`` are known and
    ``workers`` is at least 1. Returns (cache folder, the shapes' (H, I, K)), or None after one line on stderr
    naming the fix (the tool then exits with code 2, before anything is compiled)."""
    cache = os.environ.get(cache_env)
    if not cache:
        print(f"{prog}: set {cache_env} (the folder {reader} will load the compiled kernels from); nothing was "
              "compiled", file=sys.stderr)
        return None
    try:
        dims = shape_dims([s for s in shapes.split(",") if s])
    except KeyError as e:
        print(f"{prog}: {e.args[0]}", file=sys.stderr)
        return None
    if workers < 1:
        print(f"{prog}: --workers must be at least 1", file=sys.stderr)
        return None
    return cache, dims
