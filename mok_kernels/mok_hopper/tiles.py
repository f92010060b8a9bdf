"""Tile configuration and its heuristics: :class:`TileConfig` (launch parameters of every kernel),
:func:`default_tile` (the tile a layer uses unless given one), :func:`launch_programs` (programs per launch),
:func:`ready_granule`. Plain Python: nothing here needs Triton. Why each default is what it is, with the
measurements, is in the journal, lab/perf-notes.md ("The default tiles and why")."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

FLAT_DOWN_MAX_WASTE = 0.05  # extra MMA rows per routed row that the flattened down loop may add (default_tile)
PAIR_MIN_FRACTION = 0.2  # experts ending in a full + a half tile above which default_tile gives them tails (bf16)
TAIL_ROWS = 32  # default_tile's tails there (16 and 32 measured on glm_5_2, lab/perf-notes.md v9)
DOWN_HALVES_MAX_FULL = 0.05  # fp8: experts with more than BM/2 rows (a full tile) below which default_tile runs the
# down GEMM as 64-row items at two programs an SM (fp8_down_halves; a full tile's weights are then read twice)
SHARED_SMS = 24  # SMs of the shared expert beside the routed up GEMM (16-40 swept on 2xH200, lab/perf-notes.md v8)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters. ``gemm_programs``/``pull_programs`` 0 = derived from the SM count."""

    block_m: int = 128  # rows per tile; the schedule pads every expert to a multiple of it
    up_n: int = 128  # gate and up columns per tile (two accumulators of block_m x up_n)
    up_k: int = 64
    up_stages: int = 4  # 4 x 48 KB in flight per SM (3 streamed weights 5% slower on 2xH200, lab/perf-notes.md v5)
    up_warps: int = 8
    down_n: int = 128
    down_k: int = 64
    down_stages: int = 6
    down_warps: int = 8
    pull_rows: int = 4  # rows per pull step (each step loads whole rows)
    pull_warps: int = 16
    comm_sms: int = 24  # SMs left to the pull kernel while GEMMs run (GEMM grid = SMs - comm_sms)
    pull_programs: int = 0  # 0: comm_sms
    gemm_programs: int = 0  # 0: SMs - comm_sms
    num_chunks: int = 1  # pull / GEMM pipeline chunks (1: the pulls overlap the shared expert only; measured best)
    group_m: int = 4  # row tiles per work group (see _tile_order)
    tma: bool = True  # GEMM operands through TMA tensor descriptors (Hopper's bulk copy engine) instead of pointers
    half_tiles: bool = True  # an expert's last tile is block_m / 2 rows when its rest fits (less MMA on padding)
    ready_flags: bool = True  # the up GEMM waits per row granule for the pull (no stream-level wait)
    shared_last: bool = False  # the shared expert after the routed GEMMs (every SM) instead of beside the pull
    shared_sms: int = 0  # > 0 (CUDA, ready flags, 1 chunk): the shared expert on this many SMs of its own stream,
    # beside the routed up GEMM instead of before it, then one more up launch on those SMs (lab/perf-notes.md v8; 0:
    # before the up GEMM, beside the pull; default_tile sets api.SHARED_SMS)
    flat_down: bool = False  # down GEMM: one flattened, software-pipelined loop over (item, K step) (half tiles
    # then run at block_m rows): the next item's loads overlap this item's epilogue (Triton's ``flatten``)
    flat_up: bool = False  # the same for the up GEMM; needs ready_flags off (a spin wait cannot be flattened)
    tail_rows: int = 0  # bf16, half tiles: an expert's last tile may carry this many rows more (BM/2 + TL, or BM
    # + TL instead of a full tile and a half tile), run as a second MMA with the rows in N ("swap AB") off the same
    # weight tiles: with 32, an expert of 70 rows costs 96 rows of MMA work instead of 128 (schedule.padded_rows)
    w_tiled: bool = False  # TMA: the expert weights in the tiled layout of tile_weights (each TMA block one
    # contiguous run of memory instead of BN rows of BK elements a row length apart); the layer tiles them once
    up_fused: bool = False  # bf16, w_tiled: the up GEMM's gate and up weight rows interleaved (tile_weights_gu), one
    # [2 up_n, up_k] block and one MMA of N = 2 up_n per K step instead of two of up_n (A read once per step)
    up_stacked: bool = False  # bf16, TMA over plain weights (w_tiled off): the up GEMM's gate and up blocks of a K
    # step as one [up_n, 2, up_k] TMA box of W13 seen as [L, I, 2, H] (a strided view: gate row i then up row i),
    # which is up_fused's interleaved block without the tiled copy; Triton 3.6 and 3.8 feed the MMA from the box in
    # shared memory (a reshape of it, no copy). No tails: their swapped MMA would take the box as its A operand,
    # which both load into registers (the training forward's up GEMM then spills 232-520 B: aot_check)
    fp8_up_fused: bool = False  # for_fp8 (w_tiled): the fp8 up GEMM as one MMA of N = 2 x 64 over interleaved gate and
    # up weight rows, each column promoted by its own weight scale (one MMA wait a K step instead of two;
    # lab/perf-notes.md v14); ignored in bf16 (up_fused is bf16's)
    fp8_down_pair: bool = False  # fp8: each loop step of the down GEMM runs two 1 x 64 hidden blocks (two MMAs, each
    # promoted by its own scales: the same result bit for bit) instead of one: half the loop steps, 16 KB of weights
    # a step instead of 8 (unpaired, the fp8 down GEMM streams at 1.9-2.3 TB/s: run mok_hopper-fp8-fwd_h200x1_20261202;
    # paired, the down GEMM 10-12% faster, the forward 4-5%: lab/perf-notes.md v15; default_tile's since v15); ignored
    # in bf16
    fp8_up_pair: bool = False  # fp8: the same for the up GEMM, two 1 x 128 x blocks a loop step (32 KB of weights a
    # step instead of 16; half the stages; no gain: lab/diagnostics/2026-12-03-s21/, so off); ignored in bf16
    fp8_flat_down: bool = False  # fp8: the down GEMM's flattened loop (flat_down; for_fp8 turns it off otherwise:
    # 0-5% slower in fp8, lab/perf-notes.md v6; with the paired blocks 5-13% slower, lab/diagnostics/2026-12-03-s21/)
    fp8_down_n: int = 128  # fp8: the down GEMM's output columns per item (for_fp8 sets down_n to it; a divisor of
    # the 128-wide weight-scale block)
    down_per_sm: int = 1  # programs of the down GEMM per SM: with 2 (at 4 warps, so two fit an SM), one program's
    # fp8 promotion and barriers run beside the other's MMAs and loads (lab/diagnostics/2026-12-03-s22/)
    down_halves: bool = False  # half tiles, no tails, not flattened: the down GEMM runs every row tile as BM/2-row
    # items, a full tile as two (its weight blocks read twice; rare where experts average well under BM/2 rows), so
    # it holds a BM/2-row accumulator only: with down_warps=4 a 128-wide fp8 item fits two programs an SM
    # (down_per_sm=2) without spilling (lab/perf-notes.md v16)
    fp8_down_halves: bool = False  # for_fp8: the fp8 down GEMM as 64-row items (down_halves) at 4 warps, two programs
    # an SM (down_per_sm=2): the forward 14% faster on qwen3_5_397b, 8% on kimi_k2_7, even on glm_5_2 (run
    # mok_hopper-fp8-fwd-bwd_h200x1_20261203); default_tile's where few experts run a full tile (DOWN_HALVES_MAX_FULL);
    # ignored in bf16
    up_per_sm: int = 1  # programs of each routed up-GEMM launch per SM it is given (main, helper, side): with 2
    # (at 4 warps over BM/2-row items, so two fit an SM) one program's fp8 promotion runs beside the other's MMAs
    up_halves: bool = False  # half tiles, no tails, not flattened: the up GEMM runs every row tile as BM/2-row items
    # (a full tile as two, its weight blocks read twice), so it holds BM/2-row accumulators only (as down_halves)
    fp8_up_halves: bool = False  # for_fp8: the fp8 up GEMM as 64-row items (up_halves) at 4 warps and 4 stages, two
    # programs an SM (up_per_sm=2): the up GEMM's counterpart of fp8_down_halves (lab/perf-notes.md v17)
    save_h_tma: bool = False  # TMA (no tails, no flattened up loop): the training forward's saved H leaves the up
    # GEMM's epilogue as two bulk TMA stores an item instead of scattered stores from the MMA layout (those
    # cost 0.125 ms, six times their bytes, on qwen3_5_397b bf16: lab/diagnostics/2026-12-04-s26/)
    fp8_pull_rows: int = 0  # for_fp8: the pull's rows a step (0: pull_rows); default_tile's 16 (lab/perf-notes.md v17:
    # an fp8 row is half a bf16 one, and with two up programs an SM the pull's 4-row steps gated the up GEMM)
    down_maxnreg: int = 0  # registers a thread the down GEMM is compiled for (0: the compiler's choice). 128 lets
    # two programs of 8 warps share an SM: the fp8 down GEMM over whole 128-row tiles 64 columns wide (an 8-warp
    # item holds a 32-register accumulator) at two programs an SM, for glm_5_2 whose full tiles the 64-row items
    # read twice (16 B of spill at 128 registers under Triton 3.6 and 3.8; the forward 10-21% slower:
    # lab/diagnostics/2026-12-04-s29/, so off)
    packed_rows: bool = False  # the schedule packs every expert's rows right after the previous expert's (no tile
    # padding: capacity = routed rows, schedule.capacity_rows): a tile is BM rows from its first row (the expert's
    # last tile the rest, a BM/2-row MMA where it fits with half_tiles); the MMA's rows past the tile's end are the
    # next expert's, computed and not stored. Needs no tails and no TMA store of the saved H (a whole-tile store)
    fp8: bool = False  # set by for_fp8 (the fp8 GEMM steps and pipeline depths)

    def __post_init__(self) -> None:
        if self.down_maxnreg and not 24 <= self.down_maxnreg <= 255:
            raise ValueError(f"down_maxnreg={self.down_maxnreg} must be 0 (the compiler's choice) or 24-255")
        if self.down_per_sm < 1 or 128 % self.fp8_down_n:
            raise ValueError(f"down_per_sm={self.down_per_sm} must be >= 1 and fp8_down_n={self.fp8_down_n} divide 128 "
                             "(one weight scale a 128 x 128 block)")
        if self.shared_sms < 0 or (self.shared_sms and self.shared_last):
            raise ValueError("shared_sms (the shared expert beside the up GEMM) must be >= 0 and cannot be combined "
                             "with shared_last (the shared expert after the routed GEMMs)")
        if self.down_halves and not (self.half_tiles and not self.tail_rows and not self.flat_down):
            raise ValueError("down_halves (every down tile as BM/2-row items) needs half_tiles=True, no tails and no "
                             "flattened down loop")
        if self.up_per_sm < 1:
            raise ValueError(f"up_per_sm={self.up_per_sm} must be >= 1")
        if self.up_halves and not (self.half_tiles and not self.tail_rows and not self.flat_up):
            raise ValueError("up_halves (every up tile as BM/2-row items) needs half_tiles=True, no tails and no "
                             "flattened up loop")
        if self.w_tiled and not self.tma:
            raise ValueError("w_tiled (weights in TMA block order) needs tma=True")
        if self.up_fused and not self.w_tiled:
            raise ValueError("up_fused (one gate/up MMA over interleaved weight rows) needs w_tiled=True")
        if self.up_stacked and (self.w_tiled or not self.tma or self.tail_rows):
            raise ValueError("up_stacked (one gate/up MMA over a [up_n, 2, up_k] box of plain weights) needs tma=True, "
                             "w_tiled=False (tiled weights have up_fused) and tail_rows=0")
        if self.flat_up and self.ready_flags:
            raise ValueError("flat_up needs ready_flags=False: the up GEMM's spin wait for the pull cannot be "
                             "flattened")
        if self.tail_rows and (not self.half_tiles or self.flat_up or self.flat_down
                               or self.tail_rows & (self.tail_rows - 1)
                               or not 16 <= self.tail_rows < self.block_m // 2):
            raise ValueError(f"tail_rows={self.tail_rows} needs half_tiles=True, no flattened loop (its items have "
                             "one row count), and a power of two from 16 to below block_m / 2")

        if self.packed_rows and (self.tail_rows or self.save_h_tma):
            raise ValueError("packed_rows (no tile padding) needs tail_rows=0 (a tail tile's rows are its expert's "
                             "only) and save_h_tma=False (its bulk store writes the whole tile, past the expert's end)")

    def for_fp8(self) -> "TileConfig":
        """fp8 tiles: one weight scale per step (BK <= 128, BN <= 128 inside one 128 x 128 block). The up GEMM
        steps over whole 1 x 128 x blocks (BK = 128) and is 64 columns wide, which keeps its two accumulators and
        their promotion temporaries in registers; the hidden activations are quantised in its 1 x 64 column
        tiles, so the down GEMM steps 64 deep. The flattened down loop is off (it ran 0-5% slower in fp8,
        lab/perf-notes.md v6); tails are bf16 only. The paired loop steps (``fp8_down_pair``, ``fp8_up_pair``) need TMA
        operands: with pointer loads the paired down GEMM spills (8-16 B at 255 registers) and was never timed."""
        from dataclasses import replace

        if self.fp8:  # idempotent: callers may apply it to a tile that already is one
            return self
        down_stages = (6 if self.down_n > 128 else self.down_stages) + 2  # (the bf16 tile's 4 stages are 256 wide)
        pair_down, pair_up = self.fp8_down_pair and self.tma, self.fp8_up_pair and self.tma
        if pair_down:  # a stage holds two 1 x 64 blocks: half the stages, the same bytes in flight
            down_stages = max(2, down_stages // 2)
        up_stages = self.up_stages + 2
        if pair_up:  # the same for the up GEMM's two 1 x 128 blocks
            up_stages = max(2, up_stages // 2)
        halves = dict(down_halves=True, down_warps=4, down_per_sm=2) if self.fp8_down_halves else {}
        if self.fp8_up_halves:  # two programs' stages must fit one SM: 4 x (8 KB of x + 16 KB of weights) each
            halves.update(up_halves=True, up_warps=4, up_per_sm=2)
            up_stages = min(up_stages, 4)
        if self.fp8_pull_rows:
            halves.update(pull_rows=self.fp8_pull_rows)
        return replace(self, up_n=64, up_k=128, up_stages=up_stages, down_n=self.fp8_down_n, down_k=64,
                       down_stages=down_stages, flat_down=self.fp8_flat_down, tail_rows=0,
                       fp8_down_pair=pair_down, fp8_up_pair=pair_up,
                       up_fused=self.fp8_up_fused and self.w_tiled, up_stacked=False, fp8=True, **halves)

    @property
    def h_block(self) -> int:
        """fp8: columns per scale of the hidden activations (the up GEMM's column tile)."""
        return self.up_n


def parse_tile_overrides(text: str) -> dict[str, int | bool]:
    """``"tma=1,ready_flags=0"`` -> ``{"tma": True, "ready_flags": False}``: :class:`TileConfig` fields as the
    command lines' ``--tile`` gives them (integers; the on/off switches as 0 / 1). ValueError names what is not a
    field or not an integer."""
    kinds = {f.name: f.type for f in fields(TileConfig)}  # (annotations are strings here)
    out: dict[str, int | bool] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in kinds:
            raise ValueError(f"--tile: {name!r} is not a TileConfig field (mok_kernels/mok_hopper/tiles.py)")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"--tile: {name}={value!r} is not an integer (0 / 1 for on / off)") from None
        if kinds[name] == "bool":
            out[name] = bool(out[name])
    return out


def h_save_by_tma(cfg: TileConfig) -> bool:
    """Whether a training forward's up GEMM stores the saved H by TMA (``save_h_tma``): only with TMA operands and
    where every row an item computes is its tile's own and the items' row counts are the descriptors' blocks (no
    flattened up loop, whose half tiles run BM rows; no tails)."""
    return cfg.save_h_tma and cfg.tma and not cfg.flat_up and not cfg.tail_rows


def ready_granule(cfg: TileConfig) -> int:
    """Rows per ready flag: every tile starts on a multiple of it (the tail, the half tile, or the tile)."""
    return cfg.tail_rows or (cfg.block_m // 2 if cfg.half_tiles else cfg.block_m)


def _row_counts(rows_per_expert: float) -> list[tuple[int, float]]:
    """(rows, weight) of one expert's row count under uniform routing: binomial-like, sd = sqrt of the mean."""
    m = float(rows_per_expert)
    sd = max(1.0, math.sqrt(m))
    lo, hi = max(1, int(m - 5 * sd)), int(m + 5 * sd) + 1
    wts = [math.exp(-0.5 * ((r - m) / sd) ** 2) for r in range(lo, hi + 1)]
    total = sum(wts)
    return [(r, w / total) for r, w in zip(range(lo, hi + 1), wts)]


def half_tile_waste(rows_per_expert: float, block_m: int = 128) -> float:
    """Extra MMA rows per routed row when every expert's last half tile runs at full height (as in the flattened
    GEMM loops), for experts getting ``rows_per_expert`` rows on average with a binomial-like spread (sd = sqrt of
    the mean; uniform routing). An expert of r rows ends in a half tile when r mod block_m is in [1, block_m/2]."""
    if rows_per_expert <= 0:
        return 0.0
    half = sum(w for r, w in _row_counts(rows_per_expert) if 1 <= r % block_m <= block_m // 2)
    return half * (block_m // 2) / float(rows_per_expert)


def paired_fraction(rows_per_expert: float, block_m: int = 128) -> float:
    """Fraction of experts that end in a full tile followed by a half tile (r > block_m, r mod block_m in
    [1, block_m/2]): the ones whose last two tiles ``tail_rows`` turns into one tile and a tail MMA."""
    if rows_per_expert <= 0:
        return 0.0
    return sum(w for r, w in _row_counts(rows_per_expert) if r > block_m and 1 <= r % block_m <= block_m // 2)


def full_tile_fraction(rows_per_expert: float, block_m: int = 128) -> float:
    """Fraction of experts with more than ``block_m / 2`` rows (at least one full tile), for experts getting
    ``rows_per_expert`` rows on average (uniform routing, as :func:`half_tile_waste`)."""
    if rows_per_expert <= 0:
        return 0.0
    return sum(w for r, w in _row_counts(rows_per_expert) if r > block_m // 2)


def default_tile(*, precision: str = "bf16", device: Optional[torch.device] = None, comm_sms: Optional[int] = None,
                 hidden: Optional[int] = None, ffn: Optional[int] = None,
                 rows_per_expert: Optional[float] = None, n_sm: Optional[int] = None) -> TileConfig:
    """The tile configuration used unless one is given (fp8 forces its own GEMM steps, see ``for_fp8``).

    On CUDA: 128-row tiles with half tiles, TMA operands over weights in TMA block order (``w_tiled``), the down
    GEMM 256 wide with 4 stages, the shared expert on ``SHARED_SMS`` SMs of its own stream beside the routed up
    GEMM (unless ``comm_sms`` leaves the up GEMM fewer than that of the GPU's ``n_sm``). ``rows_per_expert``
    (uniform routing: EP * T * K / E) picks the down GEMM's loop: flattened (``flat_down``) where that wastes at
    most ``FLAT_DOWN_MAX_WASTE`` of the MMA rows (:func:`half_tile_waste`); otherwise, where at least
    ``PAIR_MIN_FRACTION`` of the experts end in a full tile and a half tile (:func:`paired_fraction`),
    ``TAIL_ROWS``-row tails in both GEMMs and the fused gate/up MMA (``up_fused``). fp8 runs its up GEMM as one
    MMA over interleaved gate and up rows (``fp8_up_fused``, v14) and its down GEMM two 1 x 64 hidden blocks a loop
    step (``fp8_down_pair``, v15; where ``ffn`` is a multiple of 128 or not given); where at most
    ``DOWN_HALVES_MAX_FULL`` of the experts run a full tile (:func:`full_tile_fraction`), as 64-row items at two
    programs an SM (``fp8_down_halves``, v16), and there its up GEMM too (``fp8_up_halves``, v17); its pull steps
    16 rows (``fp8_pull_rows``, v17).

    On the CPU (Triton interpreter) the cost is per operation, not per FLOP: few programs, small row tiles and
    the widest column / depth steps that divide ``hidden`` / ``ffn``, and pointer loads (``tma`` off).

    The measurements behind each choice: the journal, lab/perf-notes.md, "The default tiles and why"."""
    cfg = TileConfig(shared_sms=SHARED_SMS, w_tiled=True, down_n=256, down_stages=4, fp8_up_fused=True,
                     fp8_down_pair=ffn is None or ffn % 128 == 0, fp8_pull_rows=16)
    if comm_sms is not None:
        cfg = replace(cfg, comm_sms=comm_sms)
    if n_sm is not None and n_sm - cfg.comm_sms - cfg.shared_sms < SHARED_SMS:
        cfg = replace(cfg, shared_sms=0)  # the routed up GEMM keeps at least as many SMs as the shared expert
    if rows_per_expert is not None and half_tile_waste(rows_per_expert, cfg.block_m) <= FLAT_DOWN_MAX_WASTE:
        cfg = replace(cfg, flat_down=True)  # (256 wide, 4 stages: as every bf16 down tile)
    elif rows_per_expert is not None and paired_fraction(rows_per_expert, cfg.block_m) >= PAIR_MIN_FRACTION:
        cfg = replace(cfg, tail_rows=TAIL_ROWS, up_fused=True)
    if rows_per_expert is not None and full_tile_fraction(rows_per_expert, cfg.block_m) <= DOWN_HALVES_MAX_FULL:
        cfg = replace(cfg, fp8_down_halves=True, fp8_up_halves=True)  # (fp8 only: for_fp8 applies them)
    if device is not None and torch.device(device).type != "cuda":
        def widest(n: Optional[int], cap: int) -> int:
            return next(b for b in (256, 128, 64, 32, 16) if b <= cap and (n is None or n % b == 0))

        cfg = replace(cfg, block_m=32, up_n=widest(ffn, 128), up_k=widest(hidden, 256), down_n=widest(hidden, 256),
                      down_k=widest(ffn, 256), pull_rows=16, num_chunks=2, gemm_programs=2, pull_programs=2,
                      shared_sms=0, tail_rows=0)
        cfg = replace(cfg, tma=False, w_tiled=False, up_fused=False)
    return cfg.for_fp8() if precision == "fp8" else cfg


def launch_programs(n_sm: int, cfg: TileConfig, *, ready: bool, overlap: bool,
                    has_shared: bool) -> dict[str, int]:
    """Programs per launch of one forward on ``n_sm`` SMs: ``pull``, ``shared`` (both shared-expert GEMMs), ``up``
    (the routed up GEMM on the main stream), ``up_helper`` (a second up launch after the pull, on the comm
    stream), ``side`` (``shared_sms``: the shared expert's stream), ``up_side`` (a third up launch there, after the
    shared expert), ``down``. Each up launch gets ``up_per_sm`` programs for each SM it is given.

    With ``overlap`` (CUDA) the pulls run on their own stream with ``comm_sms`` programs, beside the shared expert
    and the up GEMM (ready counters) or the previous chunk's GEMMs (chunks). A GEMM that can run while pulls still
    run leaves those SMs free: the up GEMM with ready counters must (its programs wait for the pull). The down GEMM
    runs after every pull it depends on when there is one chunk, so it takes every SM. With ready counters and one
    chunk the up launches after the pull (and after the side stream's shared expert) take work items off the same
    counter, so the up GEMM gets every SM once the pull is done.

    With ``up_per_sm`` = 2 (``up_halves``: programs of 4 warps) the spinning up programs no longer fill an SM each, and
    the block scheduler may put them beside the pull's. The pull still always finds room: at most 2 x (SMs given to the
    up launches) programs wait while it runs, so some SM holds at most one of them, and a pull program (16 warps at 58
    registers under Triton 3.6, aot_check) fits beside one up program (4 warps at up to 252). Measured cost of that
    sharing: the 4-row pull got 35% slower beside them (lab/diagnostics/2026-12-04-s27/), hence fp8's 16-row steps; and
    the side stream's shared expert, which needs a whole SM, can wait for the up GEMM's end."""
    C = cfg.num_chunks
    comm = cfg.comm_sms if overlap else 0
    helpers = ready and C == 1 and overlap
    side = cfg.shared_sms if (helpers and has_shared and not cfg.shared_last) else 0
    if ready and overlap:
        # the up programs spin until the pull has written their rows: they must never fill every SM
        if not 1 <= comm < n_sm:
            raise ValueError(f"ready_flags need 1 <= comm_sms < {n_sm} SMs (got comm_sms={comm}): the up GEMM "
                             f"waits for the pull, which needs SMs of its own; or set ready_flags=False")
        if side and not 1 <= side < n_sm - comm:
            raise ValueError(f"shared_sms={side} leaves no SM to the up GEMM beside comm_sms={comm} on {n_sm} SMs")
    busy = C > 1 or ready
    up = cfg.gemm_programs or (max(1, n_sm - comm) if busy else n_sm)
    if ready and overlap:
        up = min(up, n_sm - comm - side)
    if side:
        shared = side
    else:
        shared = cfg.gemm_programs or (n_sm if cfg.shared_last else max(1, n_sm - comm))
    per = cfg.up_per_sm  # up programs a launch's SMs hold (up_halves: two programs of 4 warps fill what one of 8 did)
    return {"pull": cfg.pull_programs or (comm if overlap else n_sm), "shared": shared, "up": up * per,
            "up_helper": comm * per if helpers else 0, "side": side, "up_side": side * per,
            "down": cfg.gemm_programs or (n_sm if C == 1 else max(1, n_sm - comm)) * cfg.down_per_sm}


def plain_weights(cfg: TileConfig, stacked: bool = False) -> TileConfig:
    """``cfg`` reading the routed weights in the caller's plain layout ([L, 2I, H] / [L, H, I], strided TMA
    descriptors where ``tma``): no copy in TMA block order (``w_tiled`` off) and so no fused gate/up MMA, whose
    interleaved gate and up rows only the tiled copy has. Everything else as ``cfg``; the MMAs see the same blocks
    in the same order, so outputs and gradients are bitwise those of ``cfg`` without ``up_fused``. ``stacked``:
    where ``cfg`` fuses the gate/up MMA (bf16, TMA), keep it by loading the gate and up blocks as one box of the
    plain weights, interleaved as the tiled copy has them (``up_stacked``), without tails (``up_stacked`` has none:
    both GEMMs then run an expert's last rows in a half or a full tile); without tails in ``cfg``, bitwise its
    outputs."""
    stack = stacked and cfg.up_fused and cfg.tma and not cfg.fp8
    return replace(cfg, w_tiled=False, up_fused=False, up_stacked=stack, tail_rows=0 if stack else cfg.tail_rows)


def packed_rows(cfg: TileConfig) -> TileConfig:
    """``cfg`` with the routed rows packed by expert, no tile padding (``packed_rows``), and without what packing
    refuses: tails (``tail_rows``, their rows sized in multiples of BM/2) and the TMA store of the saved H
    (``save_h_tma``, a whole-tile store). Outputs and gradients are bitwise those of ``cfg`` on the interpreter."""
    return replace(cfg, packed_rows=True, tail_rows=0, save_h_tma=False)
