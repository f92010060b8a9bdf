import os
import triton, triton.language as tl
from kernels.mok_hopper.triton_kernels import _mma
UP = tl.constexpr(os.environ.get('TRITON_INTERPRET') == '1')

@triton.jit
def up_ws_kernel(a_desc, w_desc, h_ptr, tile_expert_ptr, tile_row_ptr, n_tiles, I, H,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 NP: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr):
    n_n = I // BN
    n_work = n_tiles * n_n
    for wk in tl.range(tl.program_id(0), n_work, NP, warp_specialize=WS):
        grp = wk // (GROUP_M * n_n)
        first = grp * GROUP_M
        gm = tl.minimum(n_tiles - first, GROUP_M)
        m = first + (wk % (GROUP_M * n_n)) % gm
        n = (wk % (GROUP_M * n_n)) // gm
        e = tl.load(tile_expert_ptr + m)
        row0 = tl.load(tile_row_ptr + m)
        row1 = tl.load(tile_row_ptr + m + 1)
        g_at = e * 2 * I + n * BN
        u_at = g_at + I
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, H, BK, num_stages=STAGES):
            a = a_desc.load([row0, k0])
            wg = w_desc.load([g_at, k0]).T
            wu = w_desc.load([u_at, k0]).T
            acc_g = _mma(a, wg, acc_g, UP)
            acc_u = _mma(a, wu, acc_u, UP)
        hv = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        rows = row0 + tl.arange(0, BM)
        cols = n * BN + tl.arange(0, BN)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], hv.to(tl.bfloat16), mask=(rows < row1)[:, None])


@triton.jit
def down_ws_kernel(h_desc, w_desc, out_ptr, tile_expert_ptr, tile_row_ptr, n_tiles, I, H,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                   NP: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr):
    n_n = H // BN
    n_work = n_tiles * n_n
    for wk in tl.range(tl.program_id(0), n_work, NP, warp_specialize=WS):
        grp = wk // (GROUP_M * n_n)
        first = grp * GROUP_M
        gm = tl.minimum(n_tiles - first, GROUP_M)
        m = first + (wk % (GROUP_M * n_n)) % gm
        n = (wk % (GROUP_M * n_n)) // gm
        e = tl.load(tile_expert_ptr + m)
        row0 = tl.load(tile_row_ptr + m)
        row1 = tl.load(tile_row_ptr + m + 1)
        w_at = e * H + n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in tl.range(0, I, BK, num_stages=STAGES):
            a = h_desc.load([row0, k0])
            w = w_desc.load([w_at, k0]).T
            acc = _mma(a, w, acc, UP)
        rows = row0 + tl.arange(0, BM)
        cols = n * BN + tl.arange(0, BN)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], acc.to(tl.bfloat16), mask=(rows < row1)[:, None])


@triton.jit
def _up_body(a_desc, w_desc, h_ptr, row0, row1, g_at, u_at, n, I, H, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, STAGES: tl.constexpr):
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, H, BK, num_stages=STAGES):
        a = a_desc.load([row0, k0])
        wg = w_desc.load([g_at, k0]).T
        wu = w_desc.load([u_at, k0]).T
        acc_g = _mma(a, wg, acc_g, UP)
        acc_u = _mma(a, wu, acc_u, UP)
    hv = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    rows = row0 + tl.arange(0, BM)
    cols = n * BN + tl.arange(0, BN)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], hv.to(tl.bfloat16), mask=(rows < row1)[:, None])


@triton.jit
def up_ws_half_kernel(a_desc, a_half, w_desc, h_ptr, tile_expert_ptr, tile_row_ptr, n_tiles, I, H,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                      NP: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr):
    n_n = I // BN
    n_work = n_tiles * n_n
    for wk in tl.range(tl.program_id(0), n_work, NP, warp_specialize=WS):
        grp = wk // (GROUP_M * n_n)
        first = grp * GROUP_M
        gm = tl.minimum(n_tiles - first, GROUP_M)
        m = first + (wk % (GROUP_M * n_n)) % gm
        n = (wk % (GROUP_M * n_n)) // gm
        e = tl.load(tile_expert_ptr + m)
        row0 = tl.load(tile_row_ptr + m)
        row1 = tl.load(tile_row_ptr + m + 1)
        g_at = e * 2 * I + n * BN
        u_at = g_at + I
        if row1 - row0 < BM:
            _up_body(a_half, w_desc, h_ptr, row0, row1, g_at, u_at, n, I, H, BM // 2, BN, BK, STAGES)
        if row1 - row0 >= BM:
            _up_body(a_desc, w_desc, h_ptr, row0, row1, g_at, u_at, n, I, H, BM, BN, BK, STAGES)
