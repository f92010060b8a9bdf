"""Small synthetic results tables for the report, plot and compare tests (built with harness.core.results.to_frame).

Numbers are made up but shaped like real ones: a deterministic TFLOP/s per (system, shape, precision, direction),
latency and FLOPs consistent with it, p20 / p80 spreads, remote byte counts and calibration columns.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Iterable, Optional

import pandas as pd

from harness.core import results

# name -> (num_experts, hidden, ffn, topk)
SHAPES = {"kimi_k2_7": (384, 7168, 2048, 8), "glm_5_2": (256, 6144, 2048, 8), "qwen3_5_397b": (512, 4096, 1024, 10),
          "deepseek_v4_pro": (384, 7168, 3072, 6)}
SYSTEM_FACTOR = {"nccl": 0.50, "deepep": 0.55, "deepep_te": 0.40, "hybridep_megatron": 0.60, "hybridep": 0.58,
                 "mok": 1.00, "mok_hopper": 0.90}
SHAPE_FACTOR = {"kimi_k2_7": 1.0, "glm_5_2": 0.95, "qwen3_5_397b": 0.45, "deepseek_v4_pro": 1.1}
PREC_FACTOR = {"bf16": 1.0, "fp8": 1.5, "mxfp8": 1.6}
DIR_FACTOR = {"fwd": 1.0, "bwd": 1.6, "fwd_bwd": 1.4}
H200 = {"gpu_name": "NVIDIA H200", "calib_hbm_gb_s": 4300.0, "calib_link_gb_s": 360.0}
CPU = {"device": "cpu", "gpu_name": "cpu"}  # as harness.measure.env.collect("cpu") records a CPU run
H100 = {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3"}
GEMM_TFLOPS = {"bf16": 800.0, "fp8": 1500.0, "mxfp8": 1500.0}  # synthetic "measured" dense GEMM rates


def config_hash(**kw: Any) -> str:
    blob = repr(sorted((k, str(v)) for k, v in kw.items()))
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def tflops_for(backend: str, shape: str, precision: str, direction: str, tokens_per_gpu: int = 4096,
               ep_size: int = 8, routing: str = "uniform") -> float:
    """A deterministic, plausible TFLOP/s per GPU."""
    t = 500.0 * SYSTEM_FACTOR[backend] * SHAPE_FACTOR[shape] * PREC_FACTOR[precision] * DIR_FACTOR[direction]
    t *= (tokens_per_gpu / 4096) ** 0.15 * (8 / ep_size) ** 0.1
    if routing != "uniform":
        t *= 0.8 if backend.startswith("mok") else 0.7
    return t


def row(backend: str, shape: str = "qwen3_5_397b", precision: str = "bf16", direction: str = "fwd", *,
        tokens_per_gpu: int = 4096, ep_size: int = 8, routing: str = "uniform", status: str = "ok",
        tflops: Optional[float] = None, spread: float = 0.02, run_id: str = "run-a", git_sha: str = "aaaaaaa1",
        timestamp: str = "2026-12-01T00:00:00+00:00", env: Optional[dict[str, Any]] = None, **extra: Any
        ) -> dict[str, Any]:
    """One results row; not-ok rows carry no timing, as the harness writes them."""
    env = dict(H200 if env is None else env)
    e, h, i, k = SHAPES[shape]
    flops = 6.0 * (tokens_per_gpu * k + tokens_per_gpu) * h * i * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[direction]
    rec: dict[str, Any] = dict(
        run_id=run_id, timestamp=timestamp, git_sha=git_sha, git_dirty=False, backend=backend, shape=shape,
        num_experts=e, local_experts=e // ep_size, hidden=h, ffn=i, topk=k, shared_expert=True, precision=precision,
        direction=direction, tokens_per_gpu=tokens_per_gpu, ep_size=ep_size, num_nodes=max(1, ep_size // 8),
        world_size=ep_size, routing=routing, status=status,
        config_hash=config_hash(shape=shape, precision=precision, tokens_per_gpu=tokens_per_gpu, ep_size=ep_size,
                                routing=routing, gpu=env.get("gpu_name")),
        row_id=hashlib.sha1(repr((run_id, backend, shape, precision, direction, tokens_per_gpu, ep_size, routing,
                                  git_sha, env.get("gpu_name"))).encode()).hexdigest()[:12],
        expert_load_max_over_mean={"uniform": 1.1}.get(routing, 2.5 if "zipf" in routing else 4.0),
    )
    rec.update(env)
    if "calib_hbm_gb_s" in env and "calib_gemm_tflops" not in env:
        rec["calib_gemm_tflops"] = GEMM_TFLOPS[precision]
    if status == "ok" and backend != "reference":  # the reference is ground truth, not timed
        tf = tflops if tflops is not None else tflops_for(backend, shape, precision, direction, tokens_per_gpu,
                                                          ep_size, routing)
        lat = flops / (tf * 1e12) * 1e3
        rows_remote = tokens_per_gpu * k * (ep_size - 1) / ep_size
        rec.update(latency_ms=lat, latency_p20_ms=lat * (1 - spread), latency_p80_ms=lat * (1 + spread),
                   flops_per_gpu=flops, tflops_per_gpu=tf, tokens_per_s_per_gpu=tokens_per_gpu / lat * 1e3,
                   dispatch_bytes=int(rows_remote * h * (1 if precision != "bf16" else 2)),
                   combine_bytes=int(rows_remote * h * 2))
    elif status != "ok":
        rec["error"] = extra.pop("error", f"synthetic {status}")
    rec.update(extra)
    return rec


def grid(backends: Iterable[str], shapes: Iterable[str] = tuple(SHAPES), precisions: Iterable[str] = ("bf16",),
         directions: Iterable[str] = ("fwd", "bwd"), **kw: Any) -> list[dict[str, Any]]:
    return [row(b, s, p, d, **kw) for b, s, p, d in itertools.product(backends, shapes, precisions, directions)]


def measured_h200() -> pd.DataFrame:
    """An H200 EP=8 sweep point set: four baselines and our fused kernel, bf16 and fp8, with failures.

    * deepep_te fp8 on Qwen is ``oom`` (both directions), mok_hopper bf16 bwd on GLM is a ``mismatch``;
    * hybridep_megatron has no fp8 rows at all (a missing system);
    * the reference is present (ok, untimed) and must never count as a contender.
    """
    rows = grid(["nccl", "deepep", "deepep_te", "hybridep_megatron", "mok_hopper"], precisions=("bf16",))
    rows += grid(["nccl", "deepep", "deepep_te", "mok_hopper"], precisions=("fp8",))
    rows = [r for r in rows if not (r["backend"] == "deepep_te" and r["precision"] == "fp8"
                                    and r["shape"] == "qwen3_5_397b")
            and not (r["backend"] == "mok_hopper" and r["precision"] == "bf16" and r["shape"] == "glm_5_2"
                     and r["direction"] == "bwd")]
    rows += [row("deepep_te", "qwen3_5_397b", "fp8", d, status="oom", error="OutOfMemoryError: CUDA out of memory")
             for d in ("fwd", "bwd")]
    rows.append(row("mok_hopper", "glm_5_2", "bf16", "bwd", status="mismatch",
                    error="worst abs-max 3.1 (tol 0.5) on d_w_down"))
    rows += [row("reference", s, "bf16", "fwd", notes="ground truth, not timed") for s in SHAPES]
    return results.to_frame(rows)


def sweeps_h200() -> pd.DataFrame:
    """Tokens-per-GPU, EP-size and routing sweeps on the Qwen and Kimi shapes (bf16 fwd), one oom point."""
    rows = []
    for b, s in itertools.product(["nccl", "deepep", "mok_hopper"], ["qwen3_5_397b", "kimi_k2_7"]):
        for t in (1024, 2048, 4096, 8192, 16384):
            if b == "mok_hopper" and s == "kimi_k2_7" and t == 16384:
                rows.append(row(b, s, tokens_per_gpu=t, status="oom", run_id="sweep"))
            else:
                rows.append(row(b, s, tokens_per_gpu=t, run_id="sweep"))
        for ep in (2, 4, 16):
            rows.append(row(b, s, ep_size=ep, run_id="sweep"))
        for r in ("zipf(s=1)", "hot_experts(f=0.125,x4)"):
            rows.append(row(b, s, routing=r, run_id="sweep"))
    return results.to_frame(rows)


def mixed_environments() -> pd.DataFrame:
    """Baselines measured only on an H100 EP=8 and the fused kernel only on an H200 EP=8 (plus an H200 nccl)."""
    h100 = {"gpu_name": "NVIDIA H100 80GB HBM3"}
    rows = [row(b, "qwen3_5_397b", env=h100, run_id="h100") for b in ("nccl", "deepep")]
    rows += [row("mok_hopper", "qwen3_5_397b", run_id="h200"), row("nccl", "qwen3_5_397b", run_id="h200")]
    return results.to_frame(rows)


PUBLISHED_TIMING = {"timing_preset": "published", "num_warmup": 500, "num_iters": 100}


def verdict_run(run_id: str, timestamp: str, backends: Iterable[str], shapes: Iterable[str] = ("qwen3_5_397b",),
                precisions: Iterable[str] = ("bf16",), directions: Iterable[str] = ("fwd", "bwd"), *,
                num_gpus: int = 1, ep_size: int = 1, tflops: Optional[dict[str, float]] = None,
                per_backend: Optional[dict[str, dict[str, Any]]] = None, **kw: Any) -> list[dict[str, Any]]:
    """One run's rows for the verdict tests: every backend x shape x precision x direction ok on a machine of
    ``num_gpus`` H200s, eager, timed with the published preset and counts unless ``kw`` (every row) or
    ``per_backend`` (backend -> columns) says otherwise; ``tflops``: backend -> TFLOP/s (needed for backends
    without a ``SYSTEM_FACTOR``, e.g. the anchors)."""
    env = dict(H200, num_gpus=num_gpus, device="cuda")
    out = []
    for b, s, p, d in itertools.product(backends, shapes, precisions, directions):
        cols = dict(PUBLISHED_TIMING, compiled=False, scaling="none" if p == "bf16" else None)
        cols.update(kw)
        cols.update((per_backend or {}).get(b, {}))
        out.append(row(b, s, p, d, run_id=run_id, timestamp=timestamp, ep_size=ep_size, env=env,
                       tflops=(tflops or {}).get(b), **cols))
    return out


def shared_gpu(rows: Iterable[dict[str, Any]], speedup: float = 10.0, **extra: Any) -> list[dict[str, Any]]:
    """Copies of ``rows`` as rows that ran several ranks on one GPU (``shared_gpu`` true, one GPU, their own row ids),
    timed ``speedup`` times faster: any speed table, chart or comparison that read them would change. ``extra``:
    columns to set on every copy (e.g. another ``run_id``)."""
    out = []
    for r in rows:
        n = dict(r, shared_gpu=True, num_gpus=1, row_id=hashlib.sha1(("shared", r["row_id"]).__repr__().encode())
                 .hexdigest()[:12], **extra)
        if n.get("tflops_per_gpu") is not None:
            for c in ("latency_ms", "latency_p20_ms", "latency_p80_ms"):
                n[c] = r[c] / speedup
            n["tflops_per_gpu"] = r["tflops_per_gpu"] * speedup
        out.append(n)
    return out
