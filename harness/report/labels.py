"""Names and order for reports and charts: the systems' labels, roles and order (from the backend registry,
:data:`harness.core.backends.REGISTRY`), the shapes' order and labels (from ``configs/shape/*.yaml``, through
:func:`harness.config.schema.shape_table`), the precisions and directions; and the small helpers that format them.

``harness.report.claims`` (the tables), ``harness.report.plots`` (the charts) and ``harness.report`` (the Markdown
report) all read them from here, so that a new backend or shape touches one place: its registry entry or its config
file.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import pandas as pd

from harness.core.backends import REGISTRY, base_name, names_with_role, role, series_parts, spec
from harness.config.schema import shape_table
from harness.core.run_names import display_name

# Backend names, labels and roles come from the one registry (harness.core.backends.REGISTRY)
FUSED = names_with_role("contender")
ANCHORS = names_with_role("anchor")
NOT_CONTENDERS = names_with_role("reference")
SYSTEM_ORDER = tuple(k for k in REGISTRY if k not in NOT_CONTENDERS)
# Shapes: those with a `display_order` in their config, in that order (the published figure's), and every label
_SHAPES = shape_table()
SHAPE_ORDER = tuple(n for n, s in _SHAPES.items() if s["display_order"] is not None)
SHAPE_LABELS = {n: s["label"] for n, s in _SHAPES.items() if s["label"]}
PRECISION_ORDER = ("mxfp8", "fp8", "bf16")
PRECISION_LABELS = {"bf16": "BF16", "fp8": "FP8", "mxfp8": "MXFP8"}
DIRECTION_ORDER = ("fwd", "bwd", "fwd_bwd")
DIRECTION_LABELS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "fwd+bwd"}


def is_fused(backend: str) -> bool:
    """A contender: a fused kernel whose speedups the report computes."""
    return role(backend) == "contender"


def is_baseline(backend: str) -> bool:
    """A baseline (published, or HybridEP+PyTorch, or an out-of-tree backend): the speedups and the published-claim
    verdicts are computed over the fastest of these."""
    return role(backend) in ("published baseline", "baseline")


def is_anchor(backend: str) -> bool:
    """An anchor (Liger, SonicMoE): shown beside the baselines, never counted as one."""
    return role(backend) == "anchor"


def is_opponent(backend: str) -> bool:
    """An opponent of the contenders: a baseline (published or not) or an anchor; never the reference, never another
    contender. The verdicts' headline is a contender over the fastest opponent of its cell."""
    return is_baseline(backend) or is_anchor(backend)


# What a forward row timed (``forward_kind``): a training forward keeps what its backward needs, an inference forward
# saves nothing. Rows written before the column get it from here: these backends' forwards are inference forwards,
# and so is any row whose ``backend_options`` hold ``forward=inference`` (mok_hopper's forward-only layer).
FORWARD_KINDS = ("training", "inference")
INFERENCE_BACKENDS = ("deepgemm_megamoe", "flashinfer")
FORWARD_KIND_LABELS = {"training": "training forwards", "inference": "inference forwards"}


def forward_kind(row: Any) -> str:
    """A forward row's kind, ``training`` or ``inference``: its ``forward_kind`` column where set, else derived for
    rows written before the column (:data:`INFERENCE_BACKENDS`, ``forward=inference`` in ``backend_options``,
    ``training`` otherwise). '' for a row of another direction: backward rows pair as they are. ``row``: a mapping
    (a dict, a pandas row). The one place that says which forwards pair with which."""
    if str(row.get("direction", "")) != "fwd":
        return ""
    kind = row.get("forward_kind")
    if not isna(kind) and str(kind).strip():
        return str(kind).strip()
    opts = row.get("backend_options")
    pairs = set() if isna(opts) else {p.strip() for p in str(opts).split(",")}
    if base_name(str(row.get("backend", ""))) in INFERENCE_BACKENDS or "forward=inference" in pairs:
        return "inference"
    return "training"


def forward_kinds(df: pd.DataFrame) -> pd.Series:
    """:func:`forward_kind` of each row of ``df`` (a string Series on its index)."""
    return pd.Series([forward_kind(r) for r in df.to_dict("records")], index=df.index, dtype="string")


def pairs_label(direction: str, kind: str) -> str:
    """What a comparison pairs: ``training forwards``, ``inference forwards``, else the direction's label
    (``backward``, ``fwd+bwd``): rows of that direction pair as they are."""
    return FORWARD_KIND_LABELS.get(kind, kind) if kind else DIRECTION_LABELS.get(direction, direction)


def system_label(backend: str) -> str:
    return spec(backend).label


# A run whose rows of one backend and precision differ in ``scaling`` (e.g. nccl with fp8_gemm=rowwise and with
# fp8_gemm=blockwise) is reported as one series per variant (claims.prepare), named by the first marker found in
# the row's ``scaling`` (the texts baselines/fp8_gemm.py and baselines/te_common.py write; tests/test_fp8_gemm.py
# checks each path's text against this table). Order matters: the scaled_mm loop's text also names DeepGEMM.
SCALING_VARIANTS = (("per-expert loop", "scaled_mm loop"), ("torch._scaled_grouped_mm", "rowwise"),
                    ("DeepGEMM", "DeepGEMM"), ("emulated", "emulated"), ("Float8BlockScaling", "TE blockwise"),
                    ("Float8CurrentScaling", "TE tensorwise"), ("DelayedScaling", "TE delayed"),
                    ("MXFP8BlockScaling", "TE MXFP8"))


def variant_rank(variant: str) -> int:
    """A variant's place in :data:`SCALING_VARIANTS` (after them all for a name not in it)."""
    names = [name for _, name in SCALING_VARIANTS]
    return names.index(variant) if variant in names else len(names)


def scaling_variant(scaling: Any) -> str:
    """The short name of a row's ``scaling`` (:data:`SCALING_VARIANTS`; else the text's first 24 characters)."""
    text = "" if isna(scaling) else str(scaling)
    return next((name for mark, name in SCALING_VARIANTS if mark in text), text[:24] or "unrecorded")


def _ok_others(df: pd.DataFrame) -> pd.DataFrame:
    """The ``ok`` rows of baselines and anchors (what a caption on how the baselines ran reads)."""
    return df[(df["status"] == "ok") & df["backend"].map(lambda b: is_baseline(b) or is_anchor(b)).astype(bool)]


def _per_system(d: pd.DataFrame, values: Any) -> list[str]:
    """``<label> <v1 + v2 ...>`` for each system of ``d`` (published order, then by name): ``values(rows)`` of its
    rows, each distinct value once in order of first appearance."""
    present = set(d["backend"])
    return [f"{system_label(b)} {' + '.join(dict.fromkeys(values(d[d['backend'] == b])))}"
            for b in [x for x in SYSTEM_ORDER if x in present] + sorted(present - set(SYSTEM_ORDER))]


def compile_caption(df: pd.DataFrame) -> str:
    """How the baselines' PyTorch compute ran in these rows (``ok`` rows that record it; modes in order of first
    appearance), e.g. ``torch.compile: NCCL+PyTorch max-autotune; DeepEP+TE eager``. A system with both eager and
    compiled rows lists both: the aggregate's medians mix them."""
    if "compiled" not in df or "compile_mode" not in df:
        return ""
    d = _ok_others(df)
    d = d[d["compiled"].notna()]  # NA: not recorded
    parts = _per_system(d, lambda rows: [str(m) if bool(c) and not isna(m) and str(m) else "eager"
                                         for c, m in zip(rows["compiled"], rows["compile_mode"])])
    return "torch.compile: " + "; ".join(parts) if parts else ""


def fp8_caption(df: pd.DataFrame) -> str:
    """Which fp8 GEMM path each baseline and anchor ran in these rows (``ok`` rows of a precision other than bf16
    that record ``scaling``; :func:`scaling_variant` names), e.g. ``fp8 GEMMs: NCCL+PyTorch rowwise``. A series
    already named by its variant (a run with several, :func:`claims.split_variants`) says it in its own label and is
    left out; a system with several paths lists them all."""
    if "scaling" not in df or "precision" not in df:
        return ""
    d = _ok_others(df)
    d = d[~d["backend"].map(lambda b: bool(series_parts(b)[1])).astype(bool) & d["precision"].astype(str).ne("bf16")
          & d["scaling"].notna() & d["scaling"].astype(str).ne("")]
    parts = _per_system(d, lambda rows: [scaling_variant(sc) for sc in rows["scaling"]])
    return "fp8 GEMMs: " + "; ".join(parts) if parts else ""


def run_caption(df: pd.DataFrame) -> str:
    """A chart's footnote on how the baselines ran: :func:`compile_caption`, then :func:`fp8_caption`."""
    return ". ".join(x for x in (compile_caption(df), fp8_caption(df)) if x)


def shape_label(shape: str) -> str:
    """``kimi_k2_7`` -> ``Kimi K2.7``; an experts-per-GPU override keeps its suffix (``Kimi K2.7 @6epg``)."""
    base, _, suffix = str(shape).partition("@")
    return SHAPE_LABELS.get(base, base) + (f" @{suffix}" if suffix else "")


def panel_label(precision: str, direction: str) -> str:
    return f"{PRECISION_LABELS.get(precision, precision)} {DIRECTION_LABELS.get(direction, direction)}"


def env_label(env: dict[str, Any], *, run: bool = True) -> str:
    """``run · GPU · EP n · t tokens/GPU · n node(s)[ · routing r]`` (the run by its display name,
    :mod:`harness.core.run_names`); ``run=False`` leaves the run out."""
    gpu = env.get("gpu_name")
    parts = [display_name(env["run_id"])] if run and not isna(env.get("run_id")) else []
    parts += ["unknown GPU" if isna(gpu) else str(gpu), f"EP {int_text(env.get('ep_size'))}",
             f"{int_text(env.get('tokens_per_gpu'))} tokens/GPU"]
    if not isna(env.get("num_nodes")):
        parts.append(f"{int_text(env['num_nodes'])} node{'s' if int_text(env['num_nodes']) != '1' else ''}")
    if not isna(env.get("routing")) and env.get("routing") != "uniform":
        parts.append(f"routing {env['routing']}")
    return " · ".join(parts)


def in_order(values: Iterable[Any], order: Sequence[str]) -> list[Any]:
    """``values`` in ``order`` (a shape's ``@`` suffix and a series' variant sort with their base name)."""
    vals = list(dict.fromkeys(v for v in values if not isna(v)))
    rank = {v: i for i, v in enumerate(order)}
    return sorted(vals, key=lambda v: (rank.get(base_name(str(v).partition("@")[0]), len(rank)), str(v)))


def systems_in(df: pd.DataFrame) -> list[str]:
    """Contending systems present, baselines first, fused kernels last (the published order)."""
    present = [b for b in df["backend"].dropna().unique() if b not in NOT_CONTENDERS]
    return in_order(present, SYSTEM_ORDER)


def isna(v: Any) -> bool:
    try:
        return v is None or bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def int_text(v: Any) -> str:
    return "?" if isna(v) else str(int(v))
