"""Public API: :class:`MoKHopperLayer` (the fused forward as a torch module; its backward is
:mod:`mok_kernels.mok_hopper.train`, the trainable module :mod:`mok_kernels.mok_hopper.module`) and
:func:`mok_hopper_forward`.

Legend: P ranks (EP), T tokens per rank, K top-k, H hidden, I expert ffn, L local experts (rank r owns global
experts [r*L, (r+1)*L)), R capacity rows, M = R / BM tiles, C pipeline chunks.

One forward, all on the device, no host synchronisation::

    stage      x -> symmetric x (fp8: quantised 1x128 on the way), top-k ids -> int32, router weights
    barrier 0  (signal pads)
    schedule   pull every rank's top-k ids from its buffer; build this rank's row and tile tables (five Triton
               kernels; schedule.py has the same in torch ops, and a Python twin)
    pull       per chunk c: routed rows from the source ranks' x buffers into local rows; each granule of
               rows done bumps a ready counter                                                  [comm stream]
    shared     shared expert (same GEMM kernels, one "expert" with T rows)                     [main stream]
    experts    per chunk c: gate/up GEMM + SwiGLU (each tile first waits on its rows' ready counters), then
               down GEMM x router weight, each row stored into its source rank's combine buffer at slot
               t*K + k                                                                          [main stream]
    barrier 1  (after the comm stream joins)
    epilogue   out[t] = sum_k combine[t*K + k] + shared[t], fp32, k ascending -> bf16

The pull overlaps the shared expert and, tile by tile, the up GEMM (MoK's fine-grained overlap: the GEMM programs
spin on the counters, so they leave ``comm_sms`` SMs to the pull). With ``ready_flags`` off, chunk c's GEMMs wait
for chunk c's whole pull (a stream event) instead.
Results are bitwise reproducible: fixed schedule order, no split-K, no atomics on data, fixed-order epilogue.

Example (every rank of ``group``, weights of this rank's experts)::

    layer = MoKHopperLayer(w13_LIH, w2_LHI, topk=8, tokens=2048, shared=(g_IH, u_IH, d_HI), group=group)
    out_TH = layer(x_TH, topk_idx_TK, topk_w_TK)          # bf16 [T, H]
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from mok_kernels.mok_hopper.ops import down_gemm, pull, up_gemm
from mok_kernels.mok_hopper.ops.gemm_common import adjacent_rows, adopted_dims, tile_weights, tile_weights_gu
from mok_kernels.mok_hopper.ops.schedule_kernels import DeviceScheduler, gather_peer_i32
from mok_kernels.mok_hopper.tiles import TileConfig, default_tile, launch_programs, num_sms, ready_granule
from mok_kernels.mok_hopper.fp8 import quantize_expert_weights
from mok_kernels.mok_hopper.schedule import Schedule, build_schedule, capacity_rows, empty_schedule
from mok_kernels.mok_hopper.workspace import Workspace, get_workspace

PRECISIONS = ("bf16", "fp8")
# timeline stamps (``timeline=True``): where each phase of a forward ends, on the stream that runs it
STAMPS = ("start", "stage", "barrier0", "schedule", "shared", "up", "down", "join", "barrier1", "epilogue",
          "pull [comm]", "up helper [comm]", "up [side]")
MAX_GRAPHS = 4  # captured forwards kept per layer (one per set of input tensors)
ROUTER_WEIGHT_IN = ("expert", "epilogue")
SCHEDULES = ("triton", "torch")


class MoKHopperLayer(torch.nn.Module):
    """The forward of the expert-parallel MoE layer over torch symmetric memory (MoK's pull dispatch / push combine);
    autograd-free itself (``save_h`` keeps what :mod:`mok_kernels.mok_hopper.train`'s backward reads).

    Args:
        w13_LIH: bf16 [L, 2I, H], this rank's experts, gate rows then up rows.
        w2_LHI: bf16 [L, H, I]. On CUDA the layer keeps its own copy of both in TMA block order (fp8: quantised
            too), made here: build a new layer after changing the weights.
        topk, tokens: K and T (identical on every rank; the workspace is sized for them).
        shared: optional shared expert (gate [I, H], up [I, H], down [H, I]), bf16 in every precision.
        swiglu_limit: clamp gate <= limit and |up| <= limit before SwiGLU (DeepSeek-V4), or None.
        precision: "bf16" or "fp8" (e4m3, 128x128 weight blocks quantised here, 1x128 activation blocks
            quantised in the dispatch path, fp32 accumulation).
        group: the EP process group (None: the default group if initialised, else one rank).
        tile: launch parameters (:class:`~mok_kernels.mok_hopper.tiles.TileConfig`); its ``packed_rows`` packs the
            routed rows with no tile padding (the capacity below is then the routed rows).
        capacity_multiplier: routed-row capacity rule (see :func:`~mok_kernels.mok_hopper.schedule.capacity_rows`);
            None = worst case. Overflow is counted on the device: check :meth:`overflow_rows` outside timing.
        capacity: explicit capacity in rows (overrides the rule; rounded up to the tile).
        router_weight_in: "expert" (the down GEMM scales each row before the push) or "epilogue" (the source
            rank scales the k rows while summing them, MoK's choice).
        cuda_graph: on CUDA, replay the whole forward (barriers, schedule, pulls, GEMMs, epilogue: about 30
            launches on two streams) as one CUDA graph, captured on the first call with a given set of input
            tensors (keyed by their addresses; up to ``MAX_GRAPHS`` sets, then the oldest is dropped). The
            output is a fresh tensor either way. False: launch every kernel from Python each call.
        schedule: "triton" (five small kernels, the default) or "torch" (``schedule.build_schedule``, ~20 torch
            launches; the same tables).
        adopt_weights: use ``w13_LIH``, ``w2_LHI`` and the shared weights as they are, no copy (a training module
            whose parameters they are: :class:`~mok_kernels.mok_hopper.module.MoKHopperMoE`). bf16 only, contiguous,
            already in the layout of ``tile`` (required): ``tile_weights`` / ``tile_weights_gu`` blocks when
            ``w_tiled``, else plain; the shared gate and up must be the two halves of one [2I, H] tensor.
        adopt_routed: the same for the routed weights only (the shared expert's are copied as without it): the
            harness adapter's weights re-laid in place (:mod:`mok_kernels.mok_hopper.owned`).
        timeline: diagnostics (CUDA): every forward writes the GPU timer at each phase boundary (``STAMPS``) into
            ``stamps``; :meth:`timeline_ms` reads them. Adds about a dozen one-thread launches per forward.
        rank, world, workspace: for tests that simulate several ranks in one process (see ``workspace.link_local``).
        save_h: the training forward (bf16 and fp8): the routed up GEMM's epilogue also stores
            the pre-SwiGLU H of every row it computes into ``h_save`` (bf16 [R, 2I], row r = routed row r as in
            ``x_rows``, gate columns then up columns, the fp32 accumulators rounded once: 4I bytes a row) and, with
            ``swiglu_limit``, where the clamp clipped them, decided on the fp32 accumulators, into ``clip_save``
            (uint8 [R, 2I], 1 = clipped: gate > limit, |up| > limit; 2I bytes a row): what the backward's dgate
            stage reads (``bwd_gemm.bwd_rows``, ``twin_bwd.saved``). Both are allocated here and overwritten by
            every forward (CUDA graph replays too); rows outside the last forward's tiles keep older values. The
            shared expert saves nothing. False (the default): None, and the inference kernels are unchanged.
        train: a layer a backward will follow (:mod:`mok_kernels.mok_hopper.train`). fp8: it also keeps its e4m3
            weights transposed (``w13_bwd`` [L, H, 2I], ``w2_bwd`` [L, I, H]; the forward's values, with its scales
            ``w13_scale`` / ``w2_scale``), what the fp8 backward's dgrad GEMMs read K-major (1 byte a parameter).
            bf16: nothing more (its backward reads the caller's weights).
    """

    def __init__(self, w13_LIH: torch.Tensor, w2_LHI: torch.Tensor, *, topk: int, tokens: int,
                 shared: Optional[Sequence[torch.Tensor]] = None, swiglu_limit: Optional[float] = None,
                 precision: str = "bf16", group: Any = None, tile: Optional[TileConfig] = None,
                 capacity_multiplier: Optional[float] = 0.5, capacity: Optional[int] = None,
                 router_weight_in: str = "expert", cuda_graph: bool = True, rank: Optional[int] = None,
                 world: Optional[int] = None, workspace: Optional[Workspace] = None, timeline: bool = False,
                 schedule: str = "triton", adopt_weights: bool = False, save_h: bool = False,
                 train: bool = False, adopt_routed: bool = False) -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} (got {precision!r}); mxfp8 is the `mok` "
                             f"backend's format on Blackwell")
        if router_weight_in not in ROUTER_WEIGHT_IN:
            raise ValueError(f"router_weight_in must be one of {ROUTER_WEIGHT_IN} (got {router_weight_in!r})")
        self.rank, self.world = _rank_world(group, rank, world)
        dev = w13_LIH.device
        self.device = dev
        self.cuda = dev.type == "cuda"
        adopt_r = adopt_weights or adopt_routed  # the routed weights as given, no copy
        L, I, H = adopted_dims(w13_LIH, w2_LHI, tile, precision) if adopt_r else (
            w13_LIH.shape[0], w13_LIH.shape[1] // 2, w13_LIH.shape[2])
        self.L, self.H, self.I, self.K, self.T = L, H, I, topk, tokens
        # rows a local expert gets under uniform routing (EP T K over the EP L experts): the tile rules' input,
        # forward and backward (not the row capacity, which adds tile padding)
        self.rows_per_expert = tokens * topk / L
        self.num_experts = L * self.world
        self.precision, self.fp8 = precision, precision == "fp8"
        self.limit = swiglu_limit
        self.weights_in_expert = router_weight_in == "expert"
        self.cfg = tile if tile is not None else default_tile(precision=precision, device=dev, hidden=H, ffn=I,
                                                              rows_per_expert=self.rows_per_expert)
        if self.fp8:
            self.cfg = self.cfg.for_fp8()
        self.cfg_bf16 = tile if tile is not None and not self.fp8 else default_tile(device=dev, hidden=H, ffn=I)
        # the shared expert: one "expert" of T rows in full tiles, nothing to wait for
        self.cfg_bf16 = replace(self.cfg_bf16, block_m=self.cfg.block_m, tma=self.cfg.tma, half_tiles=False,
                                ready_flags=False, tail_rows=0, w_tiled=False, up_fused=False, up_stacked=False,
                                down_halves=False, up_halves=False, up_per_sm=1, packed_rows=False)
        _check_divisible(H, I, self.cfg, self.cfg_bf16, shared is not None)
        BM = self.cfg.block_m

        # weights (fp8: prequantised once, here)
        if adopt_r:  # the caller's tensors themselves (checked by adopted_dims)
            self.register_buffer("w13", w13_LIH.detach(), persistent=False)
            self.register_buffer("w2", w2_LHI.detach(), persistent=False)
            self.w13_scale = self.w2_scale = None
            self.w13_bwd = self.w2_bwd = None
        elif self.fp8:
            q13, s13 = quantize_expert_weights(w13_LIH)
            q2, s2 = quantize_expert_weights(w2_LHI)
            self.register_buffer("w13", q13, persistent=False)
            self.register_buffer("w13_scale", s13, persistent=False)
            self.register_buffer("w2", q2, persistent=False)
            self.register_buffer("w2_scale", s2, persistent=False)
            # the backward's dgrad GEMMs reduce over W's rows: Hopper's e4m3 MMA wants them contiguous (K-major), so
            # a training layer keeps W^T (the same e4m3 values; W's 128 x 128 scales serve it transposed)
            self.w13_bwd, self.w2_bwd = ((q13.transpose(1, 2).contiguous(), q2.transpose(1, 2).contiguous())
                                         if train else (None, None))
        else:
            self.register_buffer("w13", w13_LIH.detach().contiguous(), persistent=False)
            self.register_buffer("w2", w2_LHI.detach().contiguous(), persistent=False)
            self.w13_scale = self.w2_scale = None
            self.w13_bwd = self.w2_bwd = None
        if self.cfg.w_tiled and not adopt_r:  # each TMA block of the weights one contiguous run (a copy, once)
            tile13 = tile_weights_gu if self.cfg.up_fused else tile_weights
            self.w13 = tile13(self.w13, self.cfg.up_n, self.cfg.up_k)
            self.w2 = tile_weights(self.w2, self.cfg.down_n, self.cfg.down_k)

        # workspace and per-layer scratch (allocated here, reused by every forward)
        self.ws = workspace if workspace is not None else get_workspace(
            group=group, rank=self.rank, world=self.world, device=dev, tokens=tokens, hidden=H, topk=topk,
            fp8=self.fp8)
        self.R = capacity_rows(ep=self.world, tokens=tokens, topk=topk, local_experts=L, block_m=BM,
                               capacity_multiplier=capacity_multiplier, half_tiles=self.cfg.half_tiles,
                               packed=self.cfg.packed_rows)
        if capacity is not None:  # explicit rows (tests of the overflow check), rounded up to the tile
            self.R = -(-capacity // BM) * BM
        R, C = self.R, self.cfg.num_chunks
        xdt = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        self.x_rows = torch.zeros(R, H, dtype=xdt, device=dev)
        self.xs_rows = torch.zeros(R, H // 128, dtype=torch.float32, device=dev) if self.fp8 else None
        self.rw_rows = torch.zeros(R, dtype=torch.float32, device=dev) if self.weights_in_expert else None
        self.h_rows = torch.zeros(R, I, dtype=xdt, device=dev)
        self.hs_rows = torch.zeros(R, I // self.cfg.h_block, dtype=torch.float32, device=dev) if self.fp8 else None
        # save_h: the pre-SwiGLU H and the clamp's decisions of every routed row, for the backward
        self.save_h = save_h
        self.h_save = torch.zeros(R, 2 * I, dtype=torch.bfloat16, device=dev) if save_h else None
        self.clip_save = torch.zeros(R, 2 * I, dtype=torch.uint8, device=dev) if save_h and self.limit is not None \
            else None
        self.idx_all = torch.zeros(self.world, tokens * topk, dtype=torch.int32, device=dev)
        self.sched: Schedule = empty_schedule(capacity=R, block_m=BM, local_experts=L, num_chunks=C, device=dev,
                                              half_tiles=self.cfg.half_tiles,  # (tails never add tiles)
                                              packed=self.cfg.packed_rows)
        # pull -> up GEMM ready counters, one per granule of rows, and the up GEMM's work-item counter per chunk.
        # The schedule zeroes them, every forward.
        n_gran = R // ready_granule(self.cfg)
        self.ready = torch.zeros(n_gran, dtype=torch.int32, device=dev) if self.cfg.ready_flags else None
        self.work = torch.zeros(C, dtype=torch.int32, device=dev) if self.cfg.ready_flags else None
        self.overflow_total = torch.zeros(1, dtype=torch.int32, device=dev)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES} (got {schedule!r})")
        self.scheduler = DeviceScheduler(
            world=self.world, tokens=tokens, topk=topk, local_experts=L, block_m=BM, capacity=R,
            half_tiles=self.cfg.half_tiles, num_chunks=C, device=dev,
            tail_rows=self.cfg.tail_rows, packed=self.cfg.packed_rows) if schedule == "triton" else None

        self.has_shared = shared is not None
        if self.has_shared:
            g, u, d = shared
            sh13 = adjacent_rows(g, u) if adopt_weights else torch.cat([g, u]).unsqueeze(0).contiguous()
            if adopt_weights and (tuple(d.shape) != (H, I) or not d.is_contiguous()):
                raise ValueError(f"adopt_weights: the shared down weight must be contiguous [{H}, {I}], got "
                                 f"{tuple(d.shape)}")
            self.register_buffer("sh_w13", sh13, persistent=False)
            self.register_buffer("sh_w2", d.detach().unsqueeze(0).contiguous(), persistent=False)
            n_tiles = -(-tokens // BM)
            self.sh_h = torch.zeros(tokens, I, dtype=torch.bfloat16, device=dev)
            self.sh_y = torch.zeros(tokens, H, dtype=torch.bfloat16, device=dev)
            self.sh_code = torch.arange(tokens, dtype=torch.int32, device=dev)
            self.sh_tiles = torch.zeros(n_tiles, dtype=torch.int32, device=dev)
            self.sh_rows = torch.arange(n_tiles + 1, dtype=torch.int32, device=dev) * BM
            self.sh_chunk = torch.tensor([0, n_tiles], dtype=torch.int32, device=dev)
            self.sh_delta = torch.zeros(1, dtype=torch.int64, device=dev)  # the "combine buffer" is sh_y itself

        self.overlap = self.cuda  # on CUDA the pulls (and with shared_sms the shared expert) get streams of their own
        progs = launch_programs(num_sms(dev), self.cfg, ready=self.cfg.ready_flags, overlap=self.overlap,
                                has_shared=self.has_shared)
        self.shared_programs, self.up_programs = progs["shared"], progs["up"]
        self.up_helper_programs, self.side_programs = progs["up_helper"], progs["side"]
        self.up_side_programs = progs["up_side"]
        self.gemm_programs, self.pull_programs = progs["down"], progs["pull"]
        if self.cuda:
            self.comm_stream = torch.cuda.Stream(device=dev, priority=-1)
            self.side_stream = torch.cuda.Stream(device=dev) if self.side_programs else None
            self.ev_sched = torch.cuda.Event()
            self.ev_pull = [torch.cuda.Event() for _ in range(C)]
            self.ev_helper = torch.cuda.Event()
            self.ev_side = torch.cuda.Event()
        self.use_graph = self.cuda and cuda_graph
        self.stamps = torch.zeros(len(STAMPS), dtype=torch.int64, device=dev) if timeline and self.cuda else None
        self.graph_error: Optional[str] = None  # why capture failed (then every call runs eagerly)
        self._graphs: "OrderedDict[tuple, Any]" = OrderedDict()
        self._out = torch.empty(tokens, H, dtype=torch.bfloat16, device=dev) if self.use_graph else None

    # ---- the forward, in phases (a test can run the phases of several simulated ranks in lockstep) ----

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        """bf16 [T, H] output for this rank's tokens. Autograd-free (inputs may require grad; nothing is
        recorded)."""
        with torch.no_grad():
            if self.use_graph:
                return self._graph_forward(x_TH, topk_idx_TK, topk_w_TK)
            return self._forward(x_TH, topk_idx_TK, topk_w_TK)

    def _forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._mark("start")
        self.stage(x_TH, topk_idx_TK, topk_w_TK)
        self._mark("stage")
        self.ws.barrier(0)
        self._mark("barrier0")
        self.compute(x_TH)
        self.ws.barrier(1)
        self._mark("barrier1")
        out = self.finish(out)
        self._mark("epilogue")
        return out

    def _mark(self, name: str) -> None:
        if self.stamps is not None:
            pull.stamp(self.stamps, STAMPS.index(name))

    def timeline_ms(self) -> dict[str, float]:
        """Of the last forward (host sync): ms from its start to the end of each phase (``timeline=True``)."""
        t = self.stamps.tolist()
        return {name: (v - t[0]) / 1e6 if v else float("nan") for name, v in zip(STAMPS, t)}  # 0: never written

    def _graph_forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        """Replay the captured forward for these input tensors; on the first call with them, run eagerly (every
        rank executes exactly one forward per call either way, so the cross-rank barriers keep pairing up) and
        capture. Capture executes nothing and involves no peer."""
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (x_TH, topk_idx_TK, topk_w_TK))
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.replay()
            return self._out.clone()
        out = self._forward(x_TH, topk_idx_TK, topk_w_TK)  # this call's result; also compiles every kernel
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._forward(x_TH, topk_idx_TK, topk_w_TK, out=self._out)
        except Exception as e:  # noqa: BLE001 - fall back to launching from Python, and say why
            self.use_graph = False
            self.graph_error = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize(self.device)
            return out
        if len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)
        self._graphs[key] = graph
        return out

    def stage(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> None:
        """This rank's inputs into its workspace (what the peers read)."""
        T, H = x_TH.shape
        assert (T, H) == (self.T, self.H) and topk_idx_TK.shape == (T, self.K), \
            f"the layer was built for T={self.T}, H={self.H}, K={self.K}; got x {tuple(x_TH.shape)}, " \
            f"topk {tuple(topk_idx_TK.shape)}"
        ws = self.ws
        if self.fp8:
            pull.quantize_rows(x_TH.detach().contiguous(), ws.x, ws.xs)
        else:
            ws.x.copy_(x_TH.detach())
        ws.idx.copy_(topk_idx_TK)
        ws.w.copy_(topk_w_TK.detach())

    def compute(self, x_TH: torch.Tensor) -> None:
        """Schedule, pull, experts and push (every rank's stage must be visible: after barrier 0)."""
        self.schedule()
        self._mark("schedule")
        C = self.cfg.num_chunks
        if not self.overlap:
            if self.has_shared:
                self.shared_expert(x_TH)
            for c in range(C):
                self.pull(c)
                self.experts(c)
            return
        main = torch.cuda.current_stream(self.device)
        self.ev_sched.record(main)
        self.comm_stream.wait_event(self.ev_sched)
        with torch.cuda.stream(self.comm_stream):
            for c in range(C):
                self.pull(c)
                if c == C - 1:
                    self._mark("pull [comm]")
                self.ev_pull[c].record(self.comm_stream)
            if self.up_helper_programs:
                self.up(0, programs=self.up_helper_programs)
                self._mark("up helper [comm]")
                self.ev_helper.record(self.comm_stream)
        if self.side_programs:  # the shared expert on SMs of its own beside the up GEMM, then more up programs
            self.side_stream.wait_event(self.ev_sched)
            with torch.cuda.stream(self.side_stream):
                self.shared_expert(x_TH)
                self._mark("shared")
                self.up(0, programs=self.up_side_programs)
                self._mark("up [side]")
                self.ev_side.record(self.side_stream)
        elif self.has_shared and not self.cfg.shared_last:
            self.shared_expert(x_TH)
            self._mark("shared")
        for c in range(C):
            if self.ready is None:
                main.wait_event(self.ev_pull[c])
            self.up(c)
            if c == C - 1:
                self._mark("up")
            self._join_up_streams(main)
            self.down(c)
        self._mark("down")
        main.wait_event(self.ev_pull[C - 1])  # join the comm stream (pulls done) before barrier 1
        self._mark("join")
        if self.has_shared and self.cfg.shared_last:
            self.shared_expert(x_TH)
            self._mark("shared")

    def _join_up_streams(self, main: Any) -> None:
        """The main stream waits for the up programs of the comm and side streams."""
        if self.up_helper_programs:
            main.wait_event(self.ev_helper)
        if self.side_programs:
            main.wait_event(self.ev_side)

    def finish(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The fixed-order epilogue (every push into this rank must be visible: after barrier 1)."""
        if out is None:
            out = torch.empty(self.T, self.H, dtype=torch.bfloat16, device=self.device)
        ws = self.ws
        pull.combine_epilogue(ws.comb, ws.idx, None if self.weights_in_expert else ws.w,
                            self.sh_y if self.has_shared else None, out)
        return out

    # ---- stages (also timed one by one by gpu_check) ----

    def schedule(self) -> Schedule:
        if self.scheduler is not None:  # five Triton launches
            self.scheduler(self.ws.idx, self.ws.tables["idx"], self.idx_all, rank=self.rank, out=self.sched,
                           overflow_total=self.overflow_total, ready=self.ready, work=self.work)
            return self.sched
        gather_peer_i32(self.ws.idx, self.ws.tables["idx"], self.idx_all)  # the torch twin: ~20 launches
        build_schedule(self.idx_all, rank=self.rank, local_experts=self.L, block_m=self.cfg.block_m,
                       capacity=self.R, num_chunks=self.cfg.num_chunks, half_tiles=self.cfg.half_tiles,
                       tail_rows=self.cfg.tail_rows, packed=self.cfg.packed_rows, out=self.sched)
        if self.ready is not None:
            self.ready.zero_()
            self.work.zero_()
        self.overflow_total += self.sched.overflow_rows
        return self.sched

    def pull(self, c: int) -> None:
        ws, s = self.ws, self.sched
        pw = self.weights_in_expert
        pull.pull_rows(s.row_code_R, s.chunk_tiles_C1[c : c + 2], s.tile_row_M1, ws.x, ws.tables["x"], ws.xs,
                     ws.tables.get("xs"), ws.w if pw else None, ws.tables["w"] if pw else None, self.x_rows,
                     self.xs_rows, self.rw_rows, tokens=self.T, topk=self.K, cfg=self.cfg,
                     programs=self.pull_programs, ready=self.ready)

    def experts(self, c: int) -> None:
        self.up(c)
        self.down(c)

    def up(self, c: int, programs: Optional[int] = None) -> None:
        s = self.sched
        up_gemm.up_swiglu(self.x_rows, self.xs_rows, self.w13, self.w13_scale, self.h_rows, self.hs_rows,
                     s.tile_expert_M, s.tile_row_M1, s.chunk_tiles_C1[c : c + 2], limit=self.limit, cfg=self.cfg,
                     programs=programs or self.up_programs, ready=self.ready,
                     work=self.work[c : c + 1] if self.work is not None else None, h_save=self.h_save,
                     clip_save=self.clip_save)

    def down(self, c: int) -> None:
        s = self.sched
        down_gemm.down_push(self.h_rows, self.hs_rows, self.w2, self.w2_scale, s.tile_expert_M, s.tile_row_M1,
                     s.chunk_tiles_C1[c : c + 2], s.row_code_R, self.rw_rows, self.ws.comb, self.ws.tables["comb"],
                     slots_per_rank=self.T * self.K, cfg=self.cfg, programs=self.gemm_programs)

    def shared_expert(self, x_TH: torch.Tensor) -> None:
        x = x_TH.detach().contiguous()
        up_gemm.up_swiglu(x, None, self.sh_w13, None, self.sh_h, None, self.sh_tiles, self.sh_rows, self.sh_chunk,
                     limit=self.limit, cfg=self.cfg_bf16, programs=self.shared_programs, n_rows=self.T)
        down_gemm.down_push(self.sh_h, None, self.sh_w2, None, self.sh_tiles, self.sh_rows, self.sh_chunk, self.sh_code,
                     None, self.sh_y, self.sh_delta, slots_per_rank=1 << 30, cfg=self.cfg_bf16,
                     programs=self.shared_programs, n_rows=self.T)

    # ---- outside the timed path ----

    def overflow_rows(self) -> int:
        """Routed rows dropped for lack of capacity over every forward so far (host sync). Must be 0."""
        return int(self.overflow_total.item())

    def check_no_overflow(self) -> None:
        n = self.overflow_rows()
        if n:
            raise RuntimeError(f"mok_hopper: {n} routed rows did not fit in the capacity of {self.R} rows on rank "
                               f"{self.rank}; raise capacity_multiplier (None = worst case)")

    def rows_per_peer(self) -> tuple[list[int], list[int]]:
        """Of the last forward (host sync): rows of this rank's tokens pulled by each rank (dispatch), and rows
        this rank pushed to each rank (combine). Masked ids (< 0) count nowhere."""
        idx = self.idx_all.long()
        owner = torch.where(idx >= 0, idx // self.L, torch.full_like(idx, self.world))
        mine = torch.bincount(owner[self.rank], minlength=self.world + 1)[: self.world]
        pushed = (owner == self.rank).sum(dim=1)
        return mine.tolist(), pushed.tolist()


def _rank_world(group: Any, rank: Optional[int], world: Optional[int]) -> tuple[int, int]:
    if rank is not None and world is not None:
        return rank, world
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _check_divisible(H: int, I: int, cfg: TileConfig, cfg_bf16: TileConfig, shared: bool) -> None:
    need = [(I, cfg.up_n, "ffn", "up_n"), (H, cfg.up_k, "hidden", "up_k"), (H, cfg.down_n, "hidden", "down_n"),
            (I, cfg.down_k, "ffn", "down_k")]
    if shared:
        need += [(I, cfg_bf16.up_n, "ffn", "up_n"), (H, cfg_bf16.up_k, "hidden", "up_k"),
                 (H, cfg_bf16.down_n, "hidden", "down_n"), (I, cfg_bf16.down_k, "ffn", "down_k")]
    for v, b, what, knob in need:
        if v % b:
            raise ValueError(f"{what}={v} is not a multiple of the tile's {knob}={b}")


_LAYERS: dict[tuple, MoKHopperLayer] = {}


def mok_hopper_forward(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                       w13_LIH: torch.Tensor, w2_LHI: torch.Tensor, *,
                       shared: Optional[Sequence[torch.Tensor]] = None, swiglu_limit: Optional[float] = None,
                       precision: str = "bf16", group: Any = None, **layer_kwargs: Any) -> torch.Tensor:
    """Functional form: builds (once, cached by weight storage, shapes and options) a :class:`MoKHopperLayer`
    and runs its forward. The first call per configuration does the setup work (workspace rendezvous, fp8
    weight quantisation, Triton compilation), so call it once before timing."""
    T, K = topk_idx_TK.shape
    key = (w13_LIH.data_ptr(), w2_LHI.data_ptr(), tuple(w13_LIH.shape), tuple(w2_LHI.shape), T, K, precision,
           swiglu_limit, id(group), tuple(t.data_ptr() for t in shared) if shared else None,
           tuple(sorted(layer_kwargs.items())))
    layer = _LAYERS.get(key)
    if layer is None:
        layer = MoKHopperLayer(w13_LIH, w2_LHI, topk=K, tokens=T, shared=shared, swiglu_limit=swiglu_limit,
                               precision=precision, group=group, **layer_kwargs)
        _LAYERS[key] = layer
    return layer(x_TH, topk_idx_TK, topk_w_TK)


def clear_layer_cache() -> None:
    _LAYERS.clear()
