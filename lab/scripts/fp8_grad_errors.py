"""Per-tensor fp8 errors of the nccl baseline at EP=1 against a float32 and the bf16 reference.

For each shape, the harness inputs are made once; the reference layer runs once in bf16 (the harness's gate) and
once in float32 (the same math on float32 copies of the inputs); then nccl runs eagerly with each fp8 GEMM path
(and bf16, for scale) and every one of the 9 tensors is compared with both. Prints one line per (shape, path,
tensor) and writes them to OUT/fp8_grad_errors.csv. Usage (GPU machine, repo root, after scripts/gpu_env.sh):
    python lab/scripts/fp8_grad_errors.py OUT glm_5_2 qwen3_5_397b
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from baselines import fp8_gemm  # noqa: E402
from baselines.nccl import NcclBackend  # noqa: E402
from baselines.options import ExpertGemmOptions  # noqa: E402
from harness.check import TENSOR_NAMES, errors, run_once  # noqa: E402
from harness.config import CONFIG_DIR, register_configs  # noqa: E402
from harness.inputs import make_inputs  # noqa: E402
from harness.point import make_case  # noqa: E402
from harness.reference import ReferenceBackend  # noqa: E402

PATHS = ("bf16", "emulated", *fp8_gemm.FP8_GEMM_PATHS)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of this script (tiny shape)
TOKENS = 2048 if DEVICE == "cuda" else 64


def case_for(shape: str, **kw):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"shape={shape}", "precision=fp8", "compile=false",
                                                         f"device={DEVICE}", f"workload.tokens_per_gpu={TOKENS}"])
    return dataclasses.replace(make_case(cfg, ep_size=1, device=DEVICE), **kw)


def as_fp32(inputs):
    """Float32 copies of the layer's inputs; the upstream gradient stays bf16 (the reference's output is bf16)."""
    return dataclasses.replace(inputs, **{f.name: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
                                          for f in dataclasses.fields(inputs) if f.name != "grad_out_TH"
                                          for v in [getattr(inputs, f.name)]})


def main(out: str, shapes: list[str]) -> None:
    register_configs()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    if DEVICE == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.group.WORLD
    rows = []
    for shape in shapes:
        case = case_for(shape)
        inputs = make_inputs(case, 0, torch.device(DEVICE))
        refs = {}
        for name, inp in (("bf16", inputs), ("fp32", None)):
            b = ReferenceBackend(dataclasses.replace(case, precision="bf16"), group)
            inp = inp if inp is not None else as_fp32(inputs)
            b.setup(inp)
            refs[name] = run_once(b, inp, True)
            del b, inp
            gc.collect()
            torch.cuda.empty_cache() if DEVICE == "cuda" else None
        for path in PATHS:
            c = dataclasses.replace(case, precision="bf16") if path == "bf16" else case
            opts = ExpertGemmOptions(fp8_gemm="auto" if path == "bf16" else path)
            why = NcclBackend.unsupported_reason(c, opts)
            if why:
                print(f"{shape} {path}: unsupported: {why}", flush=True)
                rows.append({"shape": shape, "path": path, "tensor": "-", "note": why})
                continue
            b = NcclBackend(c, group, opts)
            b.setup(inputs)
            got = run_once(b, inputs, True)
            label = b.info()["scaling"]
            for t in TENSOR_NAMES:
                if refs["bf16"].get(t) is None:
                    continue
                r = {"shape": shape, "path": path, "tensor": t,
                     "ref_absmax": float(refs["fp32"][t].abs().max()) if refs["fp32"][t].numel() else 0.0}
                for ref in ("fp32", "bf16"):
                    a, rel = errors(got[t], refs[ref][t])
                    r[f"absmax_vs_{ref}"], r[f"rel_l1_vs_{ref}"] = a, rel
                r["note"] = label
                rows.append(r)
                print(f"{shape:14s} {path:9s} {t:10s} |ref| {r['ref_absmax']:9.4g}"
                      f"  vs fp32: abs {r['absmax_vs_fp32']:9.4g}"
                      f" rel {r['rel_l1_vs_fp32']:.4f}  vs bf16 ref: abs {r['absmax_vs_bf16']:9.4g}"
                      f" rel {r['rel_l1_vs_bf16']:.4f}", flush=True)
            del b, got
            gc.collect()
            torch.cuda.empty_cache() if DEVICE == "cuda" else None
        del inputs, refs
        gc.collect()
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    Path(out).mkdir(parents=True, exist_ok=True)
    keys = ["shape", "path", "tensor", "ref_absmax", "absmax_vs_fp32", "rel_l1_vs_fp32", "absmax_vs_bf16",
            "rel_l1_vs_bf16", "note"]
    with open(Path(out) / "fp8_grad_errors.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print("fp8 paths here: " + "; ".join(f"{p} {fp8_gemm.path_unavailable(p, DEVICE) or 'ok'}"
                                         for p in fp8_gemm.FP8_GEMM_PATHS))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["glm_5_2", "qwen3_5_397b"])
