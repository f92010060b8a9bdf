"""The R-sized buffers of mok_hopper by formula (docs/mok_hopper.md, "Memory"), old capacity (127 padding rows an
expert) against the current one (63, half tiles), EP=1, 2048 tokens: python3 lab/diagnostics/2026-12-07-kernel-memory/r_rows.py"""
import math
shapes = {"kimi_k2_7": (384, 7168, 2048, 8), "glm_5_2": (256, 6144, 2048, 8), "qwen3_5_397b": (512, 4096, 1024, 10),
          "deepseek_v4_pro": (384, 7168, 3072, 6), "glm_5_2@16": (16, 6144, 2048, 8)}
T, BM = 2048, 128
def cap(L, TK, pad):
    return -(-(TK + min(L, TK) * pad) // BM) * BM
GB = 1e9
print("| shape | L | T·K | R old (127/expert) | R new (63/expert) | R new / T·K | weight copy bf16 GB | setup R rows bf16 old→new GB | bwd bf16 R scratch old→new GB | setup R rows fp8 old→new GB | bwd fp8 R scratch old→new GB |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for name, (L, H, I, K) in shapes.items():
    TK = T * K
    Ro, Rn = cap(L, TK, 127), cap(L, TK, 63)
    def setup_bf16(R): return R*H*2 + R*I*2 + R*2*I*2 + R*4 + (R+1)*4 + (4*R//BM+1)*4 + (R//64)*4
    def setup_fp8(R): return R*H + R*(H//128)*4 + R*I + R*(I//64)*4 + R*2*I*2 + R*4 + (R+1)*4 + (4*R//BM+1)*4 + (R//64)*4
    def bwd_bf16(R, reuse): return R*13 + R*2*I*2 + (0 if reuse else R*I*2) + R*(I//128)*4 + R*4
    def bwd_fp8(R):
        RP = (-(-R // 128) + L) * 128
        return (R*H + R*(H//128)*4 + R*2*I*2 + R*2*I + R*(2*I//128)*4 + R*I*2 + R*(I//128)*4 + R*4
                + (2*I + H)*RP + (RP//128)*(2*I + H)*4 + (H + I)*RP + (RP//128)*(H + I)*4)
    wc = 3*L*I*H*2
    print(f"| {name} | {L} | {TK} | {Ro} | {Rn} | {Rn/TK:.2f} | {wc/GB:.3f} | {setup_bf16(Ro)/GB:.3f} → {setup_bf16(Rn)/GB:.3f} | "
          f"{bwd_bf16(Ro, False)/GB:.3f} → {bwd_bf16(Rn, True)/GB:.3f} | {setup_fp8(Ro)/GB:.3f} → {setup_fp8(Rn)/GB:.3f} | "
          f"{bwd_fp8(Ro)/GB:.3f} → {bwd_fp8(Rn)/GB:.3f} |")
