"""Session 11, standalone on one H200: our routed up / down GEMMs alone at rank 0 of EP=2 (2048 tokens/GPU, uniform
routing from the real schedule), the v10 default (tiled weights) against v11's fused gate/up MMA and a few tile
knobs, interleaved rounds with an A/A control. Errors: max |got - torch| / max |torch| over four experts' rows."""
import json, os, statistics, sys
from dataclasses import replace
import torch, triton
from kernels.mok_hopper import triton_kernels as tk
from kernels.mok_hopper.api import default_tile
from kernels.mok_hopper.schedule import build_schedule, capacity_rows

torch.manual_seed(0)
dev = torch.device("cuda")
NSM = torch.cuda.get_device_properties(0).multi_processor_count
P, T = 2, 2048
H, I, E, K = (int(os.environ.get(k, d)) for k, d in (("H", 6144), ("I", 2048), ("E", 256), ("K", 8)))
L = E // P
base = default_tile(precision="bf16", device=dev, hidden=H, ffn=I, rows_per_expert=P * T * K / E)
base = replace(base, up_fused=False, shared_sms=0)
idx = torch.stack([torch.rand(T, E, device=dev).topk(K, dim=1).indices for _ in range(P)]).reshape(P, T * K).to(torch.int32)
R = capacity_rows(ep=P, tokens=T, topk=K, local_experts=L, block_m=128)
a = (torch.randn(R, H, device=dev) * 0.5).to(torch.bfloat16)
w13 = (torch.randn(L, 2 * I, H, device=dev) * 0.02).to(torch.bfloat16)
w2 = (torch.randn(L, H, I, device=dev) * 0.02).to(torch.bfloat16)
h = torch.zeros(R, I, device=dev, dtype=torch.bfloat16)
comb = torch.zeros(P * T * K, H, device=dev, dtype=torch.bfloat16)
delta = torch.tensor([p * T * K * H for p in range(P)], device=dev, dtype=torch.int64)
s = build_schedule(idx, rank=0, local_experts=L, block_m=128, capacity=R, half_tiles=base.half_tiles,
                   tail_rows=base.tail_rows)
res = {"gpu": torch.cuda.get_device_name(0), "triton": triton.__version__, "torch": torch.__version__, "H": H, "I": I,
       "L": L, "K": K, "base": repr(base), "routed": int(s.counts_L.sum()), "mma_rows": int(s.tile_row_M1[int(s.num_tiles)])}
print(res, flush=True)
up_bytes, down_bytes = L * 2 * I * H * 2, L * H * I * 2
W = {}
def wt(kind, cfg):
    key = (kind, cfg.up_n if kind != "down" else cfg.down_n, cfg.up_k if kind != "down" else cfg.down_k)
    if key not in W:
        W[key] = {"up": lambda: tk.tile_weights(w13, cfg.up_n, cfg.up_k), "gu": lambda: tk.tile_weights_gu(w13, cfg.up_n, cfg.up_k),
                  "down": lambda: tk.tile_weights(w2, cfg.down_n, cfg.down_k)}[kind]()
    return W[key]
def up(cfg):
    w = wt("gu" if cfg.up_fused else "up", cfg)
    return lambda: tk.up_swiglu(a, None, w, None, h, None, s.tile_expert_M, s.tile_row_M1, s.chunk_tiles_C1,
                                limit=None, cfg=cfg, programs=NSM)
def down(cfg):
    w = wt("down", cfg)
    return lambda: tk.down_push(h, None, w, None, s.tile_expert_M, s.tile_row_M1, s.chunk_tiles_C1, s.row_code_R, None,
                                comb, delta, slots_per_rank=T * K, cfg=cfg, programs=NSM)
V = {
    "up v10 (tiled)": (up(base), up_bytes),
    "up v10 again": (up(base), up_bytes),
    "up fused (v11)": (up(replace(base, up_fused=True)), up_bytes),
    "up fused 3 stages": (up(replace(base, up_fused=True, up_stages=3)), up_bytes),
    "up fused gm8": (up(replace(base, up_fused=True, group_m=8)), up_bytes),
    "up v10 gm8": (up(replace(base, group_m=8)), up_bytes),
    "down v10 (tiled)": (down(base), down_bytes),
    "down v10 again": (down(base), down_bytes),
    "down 256 x 4": (down(replace(base, down_n=256, down_stages=4)), down_bytes),
    "down 8 stages": (down(replace(base, down_stages=8)), down_bytes),
    "down gm8": (down(replace(base, group_m=8)), down_bytes),
}
ONLY = [v for v in os.environ.get("ONLY", "").split(";") if v]
if ONLY:
    V = {k: v for k, v in V.items() if any(o in k for o in ONLY)}
te, tr = s.tile_expert_M.tolist(), s.tile_row_M1.tolist()
starts = {}
for m in range(int(s.num_tiles)):
    starts.setdefault(te[m], tr[m])
counts = s.counts_L.tolist()
up(base)(); torch.cuda.synchronize(); h_ref = h.clone()
def check(name):
    errs = []
    for e in (0, 1, L // 2, L - 1):
        r0, c = starts[e], counts[e]
        if name.startswith("up"):
            x = a[r0:r0 + c].float(); g = x @ w13[e, :I].float().T; u = x @ w13[e, I:].float().T
            ref, got = g * torch.sigmoid(g) * u, h[r0:r0 + c].float()
        else:
            ref, got = h_ref[r0:r0 + c].float() @ w2[e].float().T, comb[s.row_code_R[r0:r0 + c].long()].float()
        errs.append(float((got - ref).abs().max() / ref.abs().max()))
    return max(errs)
errs = {}
for name, (f, _) in V.items():
    try:
        h.copy_(h_ref) if name.startswith("down") else h.zero_(); comb.zero_()
        f(); torch.cuda.synchronize()
        errs[name] = check(name)
    except Exception as ex:
        errs[name] = "FAIL " + str(ex)[:300]
    print("check", name, errs[name], flush=True)
ROUNDS = int(os.environ.get("ROUNDS", 9))
times = {k: [] for k in V}
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
for r in range(ROUNDS):
    for name, (f, nbytes) in V.items():
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
for name, (f, nbytes) in V.items():
    if not times[name]:
        rows.append(dict(variant=name, err=errs[name])); continue
    med = statistics.median(times[name])
    rows.append(dict(variant=name, ms=round(med, 4), min_ms=round(min(times[name]), 4), max_ms=round(max(times[name]), 4),
                     weight_TBps=round(nbytes / med / 1e9, 3), err=errs[name], times=[round(t, 4) for t in times[name]]))
    print(f"{name:22s} {med:7.4f} ms  [{min(times[name]):.4f}-{max(times[name]):.4f}]  {nbytes/med/1e9:6.3f} TB/s  err {errs[name]}", flush=True)
res["rows"] = rows
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"bench11_H{H}_I{I}_E{E}.json"), "w"), indent=1)
