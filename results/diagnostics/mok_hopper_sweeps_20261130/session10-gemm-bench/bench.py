"""Standalone: glm_5_2 rank-0 grouped up/down GEMMs at EP=2, 2048 tokens/GPU: our kernels vs a plain persistent
Triton kernel with and without Hopper warp specialisation (Triton 3.6 autoWS, num_warps=4 -> 1 producer + 2 consumer
warpgroups)."""
import json, os, sys, time, statistics, subprocess
from dataclasses import replace
import torch, triton
sys.path.insert(0, os.path.dirname(__file__))
from wsk import up_ws_kernel, down_ws_kernel, up_ws_half_kernel
from kernels.mok_hopper import triton_kernels as tk
from kernels.mok_hopper.schedule import build_schedule, capacity_rows
from triton.tools.tensor_descriptor import TensorDescriptor

torch.manual_seed(0)
dev = torch.device(os.environ.get("DEV", "cuda"))
NSM = torch.cuda.get_device_properties(0).multi_processor_count if dev.type == "cuda" else 2
P, T, K, E = 2, int(os.environ.get("T", 2048)), int(os.environ.get("K", 8)), 256
H, I = int(os.environ.get("H", 6144)), int(os.environ.get("I", 2048))
E = int(os.environ.get("E", 256))
L = E // P
idx = torch.stack([torch.rand(T, E, device=dev).topk(K, dim=1).indices for _ in range(P)]).reshape(P, T * K).to(torch.int32)
R = capacity_rows(ep=P, tokens=T, topk=K, local_experts=L, block_m=128)
a = (torch.randn(R, H, device=dev) * 0.5).to(torch.bfloat16)
w13 = (torch.randn(L, 2 * I, H, device=dev) * 0.02).to(torch.bfloat16)
w2 = (torch.randn(L, H, I, device=dev) * 0.02).to(torch.bfloat16)
h = torch.zeros(R, I, device=dev, dtype=torch.bfloat16)
out = torch.zeros(R, H, device=dev, dtype=torch.bfloat16)
scheds = {}
for name, half, tail in (("full", False, 0), ("half", True, 0), ("tail32", True, 32)):
    scheds[name] = build_schedule(idx, rank=0, local_experts=L, block_m=128, capacity=R, half_tiles=half, tail_rows=tail)
res = {"gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "triton": triton.__version__, "torch": torch.__version__, "H": H, "I": I, "L": L,
       "routed": int(scheds["full"].counts_L.sum()), "R": R}
for n, s in scheds.items():
    nt = int(s.num_tiles)
    res[f"tiles_{n}"] = nt
    res[f"mma_rows_{n}"] = int(s.tile_row_M1[nt])
print(res, flush=True)
up_bytes = L * 2 * I * H * 2
down_bytes = L * H * I * 2

def desc(t, blk):
    return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), blk)

def ours_up(cfg, s):
    return lambda: tk.up_swiglu(a, None, w13, None, h, None, s.tile_expert_M, s.tile_row_M1, s.chunk_tiles_C1,
                                limit=None, cfg=cfg, programs=NSM)

def simple_up(s, ws, stages, bn=128, nprog=NSM, gm=4):
    ad, wd = desc(a, [128, 64]), desc(w13, [bn, 64])
    nt = int(s.num_tiles)
    def f():
        up_ws_kernel[(nprog,)](ad, wd, h, s.tile_expert_M, s.tile_row_M1, nt, I, H, BM=128, BN=bn, BK=64,
                               STAGES=stages, NP=nprog, GROUP_M=gm, WS=ws, num_warps=4 if ws else 8)
    return f

def simple_up_half(s, ws, stages):
    ad, ah, wd = desc(a, [128, 64]), desc(a, [64, 64]), desc(w13, [128, 64])
    nt = int(s.num_tiles)
    def f():
        up_ws_half_kernel[(NSM,)](ad, ah, wd, h, s.tile_expert_M, s.tile_row_M1, nt, I, H, BM=128, BN=128, BK=64,
                                  STAGES=stages, NP=NSM, GROUP_M=4, WS=ws, num_warps=4 if ws else 8)
    return f

def simple_down(s, ws, stages, bn=128):
    hd, wd = desc(h, [128, 64]), desc(w2, [bn, 64])
    nt = int(s.num_tiles)
    def f():
        down_ws_kernel[(NSM,)](hd, wd, out, s.tile_expert_M, s.tile_row_M1, nt, I, H, BM=128, BN=bn, BK=64,
                               STAGES=stages, NP=NSM, GROUP_M=4, WS=ws, num_warps=4 if ws else 8)
    return f

glm = replace(tk.TileConfig(), tail_rows=32)
w13t = tk.tile_weights(w13, glm.up_n, glm.up_k)
w2t = tk.tile_weights(w2, glm.down_n, glm.down_k)
comb = torch.zeros(P * T * K, H, device=dev, dtype=torch.bfloat16)
delta = torch.tensor([p * T * K * H for p in range(P)], device=dev, dtype=torch.int64)

def ours_up_t(cfg, s):
    return lambda: tk.up_swiglu(a, None, w13t, None, h, None, s.tile_expert_M, s.tile_row_M1, s.chunk_tiles_C1,
                                limit=None, cfg=replace(cfg, w_tiled=True), programs=NSM)

def ours_down(cfg, s, tiled=False):
    return lambda: tk.down_push(h, None, w2t if tiled else w2, None, s.tile_expert_M, s.tile_row_M1, s.chunk_tiles_C1,
                                s.row_code_R, None, comb, delta, slots_per_rank=T * K,
                                cfg=replace(cfg, w_tiled=tiled), programs=NSM)

variants = {
    "ours up default(tail32) tiled": (ours_up_t(glm, scheds["tail32"]), up_bytes),
    "ours up default(tail32) again": (ours_up(glm, scheds["tail32"]), up_bytes),
    "ours up full tiled": (ours_up_t(replace(glm, tail_rows=0, half_tiles=False), scheds["full"]), up_bytes),
    "ours down default(tail32)": (ours_down(glm, scheds["tail32"]), down_bytes),
    "ours down default(tail32) tiled": (ours_down(glm, scheds["tail32"], True), down_bytes),
    "ours down full": (ours_down(replace(glm, tail_rows=0, half_tiles=False), scheds["full"]), down_bytes),
    "ours down full tiled": (ours_down(replace(glm, tail_rows=0, half_tiles=False), scheds["full"], True), down_bytes),
    "ours up default(tail32)": (ours_up(glm, scheds["tail32"]), up_bytes),
    "ours up half": (ours_up(replace(glm, tail_rows=0), scheds["half"]), up_bytes),
    "ours up full": (ours_up(replace(glm, tail_rows=0, half_tiles=False), scheds["full"]), up_bytes),
}
for st in (3, 4):
    variants[f"simple up full s{st}"] = (simple_up(scheds["full"], False, st), up_bytes)
    variants[f"WS up full s{st}"] = (simple_up(scheds["full"], True, st), up_bytes)
variants["WS up full s4 bn64"] = (simple_up(scheds["full"], True, 4, bn=64), up_bytes)
variants["WS up full s4 gm8"] = (simple_up(scheds["full"], True, 4, gm=8), up_bytes)
variants["WS up half s2"] = (simple_up_half(scheds["half"], True, 2), up_bytes)
variants["simple up half s2"] = (simple_up_half(scheds["half"], False, 2), up_bytes)
for st in (4, 6):
    variants[f"simple down full s{st}"] = (simple_down(scheds["full"], False, st), down_bytes)
    variants[f"WS down full s{st}"] = (simple_down(scheds["full"], True, st), down_bytes)
variants["WS down full s3 bn256"] = (simple_down(scheds["full"], True, 3, bn=256), down_bytes)

# correctness: each variant's rows of four experts against torch, on its own schedule
def starts_of(s):
    te, tr = s.tile_expert_M.tolist(), s.tile_row_M1.tolist()
    st = {}
    for m in range(int(s.num_tiles)):
        st.setdefault(te[m], tr[m])
    return st, s.counts_L.tolist()
def check_up(s):
    starts, counts = starts_of(s)
    errs = []
    for e in (0, 1, L // 2, L - 1):
        r0, c = starts[e], counts[e]
        x = a[r0:r0 + c].float()
        g = x @ w13[e, :I].float().T
        u = x @ w13[e, I:].float().T
        ref = g * torch.sigmoid(g) * u
        errs.append(float((h[r0:r0 + c].float() - ref).abs().max() / ref.abs().max()))
    return max(errs)
def check_comb(s):
    starts, counts = starts_of(s)
    errs = []
    for e in (0, 1, L // 2, L - 1):
        r0, c = starts[e], counts[e]
        ref = h[r0:r0 + c].float() @ w2[e].float().T
        codes = s.row_code_R[r0:r0 + c].long()
        errs.append(float((comb[codes].float() - ref).abs().max() / ref.abs().max()))
    return max(errs)
def check_down(s):
    starts, counts = starts_of(s)
    errs = []
    for e in (0, 1, L // 2, L - 1):
        r0, c = starts[e], counts[e]
        ref = h[r0:r0 + c].float() @ w2[e].float().T
        errs.append(float((out[r0:r0 + c].float() - ref).abs().max() / ref.abs().max()))
    return max(errs)

ONLY = [v for v in os.environ.get("ONLY", "").split(";") if v]
if ONLY:
    variants = {k: variants[k] for k in ONLY if k in variants}
sched_of = {k: ("tail32" if "tail32" in k else "half" if " half" in k else "full") for k in variants}
times = {k: [] for k in variants}
ROUNDS = int(os.environ.get('ROUNDS', 5))
errs = {}
for name, (f, _) in variants.items():
    try:
        h.zero_(); out.zero_(); comb.zero_()
        if "down" in name:
            sk = sched_of[name]
            ours_up(replace(glm, tail_rows=32 if sk == "tail32" else 0, half_tiles=sk != "full"), scheds[sk])()
        f(); torch.cuda.synchronize() if dev.type == 'cuda' else None
        sk = sched_of[name]
        errs[name] = (check_comb if name.startswith("ours down") else check_down if "down" in name else check_up)(scheds[sk])
    except Exception as ex:
        errs[name] = "FAIL " + str(ex)[:300]
    print("check", name, errs[name], flush=True)
print("errs", errs, flush=True)
if not ROUNDS:
    sys.exit(0 if not any(isinstance(v, str) or v is None or v > 0.02 for v in errs.values()) else 3)
ROUNDS = int(os.environ.get("ROUNDS", 5))
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if ROUNDS else None
for r in range(ROUNDS):
    for name, (f, nbytes) in variants.items():
        if isinstance(errs[name], str):
            continue
        for _ in range(3):
            f()
        ev[0].record()
        for _ in range(10):
            f()
        ev[1].record(); torch.cuda.synchronize()
        times[name].append(ev[0].elapsed_time(ev[1]) / 10)
rows = []
for name, (f, nbytes) in variants.items():
    if not times[name]:
        rows.append(dict(variant=name, err=errs[name])); continue
    med = statistics.median(times[name])
    rows.append(dict(variant=name, ms=round(med, 4), min_ms=round(min(times[name]), 4), max_ms=round(max(times[name]), 4),
                     weight_TBps=round(nbytes / med / 1e9, 3), err=errs[name]))
    print(f"{name:32s} {med:7.4f} ms  [{min(times[name]):.4f}-{max(times[name]):.4f}]  {nbytes/med/1e9:6.3f} TB/s  err {errs[name]}", flush=True)
res["rows"] = rows
out_dir = os.environ.get("OUT", "/tmp")
json.dump(res, open(os.path.join(out_dir, f"wsbench_H{H}_I{I}_E{E}.json"), "w"), indent=1)
