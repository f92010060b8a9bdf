"""DeepEP + PyTorch baseline (the published ``bench_deepep_torch.py`` role), on DeepEP's V1 ``Buffer`` API.

The published run used DeepEP V2 (``ElasticBuffer``), which needs NCCL >= 2.30.4; torch 2.11 ships 2.28.9, so this
adapter uses the V1 intranode ``Buffer`` from DeepEP's ``hybrid-ep`` branch (the one Megatron builds). Layout:

* ``get_dispatch_layout`` + ``dispatch`` (one row per token per destination rank, router weights travel with it;
  DeepEP syncs the host for the receive count), experts in PyTorch on the received rows (expanded to one row per
  local (token, k), sorted by expert, grouped GEMMs, router weight applied, summed back per received token in fp32),
  ``combine`` (an unweighted sum over ranks), plus the shared expert.
* Backward: dispatch's backward is a combine of the gradient (router-weight gradients ride along as combine's
  top-k weights); combine's backward is a cached-mode dispatch. The experts' backward is autograd.
* More than 128 local experts (DeepEP V1's layout kernel asserts ``num_experts / num_ranks <= 128``; three
  published shapes have 192-256 at EP=2): DeepEP gets a coarser expert id, at most 128 groups per rank, each expert
  mapped to a group on its own rank, so destinations and bytes are unchanged. Each received row's true experts are
  then looked up in an all-gather of the [T, K] top-k table through the dispatch handle (source rank from the rank
  prefix matrix, source token from ``recv_src_idx``). Rows record it in ``notes``.
* fp8: tokens are quantized in 1x128 blocks before the dispatch (DeepEP's own FP8 dispatch format, so the wire
  carries e4m3 + scales); the expert GEMMs are real fp8 (rowwise or DeepGEMM blockwise) or emulated by the
  ``fp8_gemm`` option, as in the nccl baseline (``scaling`` says which).
* Comm SMs: published DeepEP+PyTorch used 32 (bf16) / 24 (fp8); ``comm_sms`` overrides. DeepEP V1 has no
  deterministic mode (V2's ``deterministic=True`` has no V1 counterpart): ``notes`` says so.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from contract import Case, LayerInputs
from baselines import fp8_gemm
from baselines.common import ExpertParams, dequantize_blocks, precision_unsupported, quantize_blocks
from baselines.options import ExpertGemmOptions

INSTALL_HINT = ("build DeepEP's hybrid-ep branch from source (docs/backends.md, 'DeepEP and HybridEP'): "
                "TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation .")
MAX_LOCAL_EXPERTS = 128  # DeepEP V1 notify_dispatch limit


PRELOAD_ENV = "MOKBENCH_DEEPEP_PRELOAD"  # stdcxx | none (see import_deep_ep)


def import_deep_ep() -> Any:
    """``import deep_ep``, after loading the system libstdc++ into the process's global symbol scope
    (``MOKBENCH_DEEPEP_PRELOAD=stdcxx``, the default; ``none`` skips it).

    The hybrid-ep build's ``hybrid_ep_cpp`` links a static copy of libstdc++ and exports its symbols. Without a
    global libstdc++, HybridEPBuffer's constructor died with SIGSEGV in ``std::ostream`` (formatting the rank list
    in ``get_comm_id``) in plain processes and harness ranks; with it (or after ``import transformer_engine``,
    which loads its libraries globally, as the HybridEP + Megatron pytest did) it runs. Measured on 2xH200
    (lab/diagnostics/2026-11-30-hybridep-preload/); ``RTLD_DEEPBIND`` on the extension did not help. Every
    backend imports deep_ep through here, so the order is the same in every process."""
    if os.environ.get(PRELOAD_ENV, "stdcxx") == "stdcxx":
        try:
            ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
    import deep_ep

    return deep_ep


def deepep_unsupported(case: Case, *, min_ranks: int = 2, mxfp8: bool = False) -> Optional[str]:
    """Reasons shared by the DeepEP-based backends (None: can run). ``mxfp8``: the backend has an mxfp8 path."""
    if case.device != "cuda":
        return f"DeepEP needs CUDA GPUs connected by NVLink (this run is on {case.device}); run on a GPU node"
    why = precision_unsupported(case.precision, torch.device("cuda"))
    if why:
        return why
    if case.precision == "mxfp8" and not mxfp8:
        return "mxfp8 is not wired for the DeepEP baselines on this stack; use precision=bf16 or fp8"
    try:
        import_deep_ep()
    except ImportError as e:
        return f"DeepEP is not installed ({e}); {INSTALL_HINT}"
    if case.ep_size < min_ranks:
        return (f"DeepEP needs at least {min_ranks} ranks (it has no single-rank communication path); "
                f"use ep_size >= {min_ranks}")
    if case.ep_size > 8:
        return "DeepEP V1 intranode supports at most 8 NVLink peers; multi-node needs its internode (NVSHMEM) build"
    return None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, topk_w_TK, be, layout, coarse_idx_TK):  # type: ignore[override]
        ctx.be = be
        n_rank, n_expert, in_rank = layout
        payload = x_TH
        if be.fp8_dispatch:
            payload = quantize_blocks(x_TH, 1, be.case.act_block)  # (e4m3 [T,H], fp32 scales [T,H/128])
        recv, recv_idx, recv_w, _, handle, _ = be.buffer.dispatch(
            payload, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
            topk_idx=coarse_idx_TK, topk_weights=topk_w_TK, config=be.dispatch_config())
        if isinstance(recv, tuple):
            be.last_payload = payload
            recv = dequantize_blocks(recv[0], recv[1], 1, be.case.act_block).to(torch.bfloat16)
        else:
            be.last_payload = x_TH.detach()
        be.handle = handle
        be.recv_idx = recv_idx
        ctx.mark_non_differentiable(recv_idx)
        return recv, recv_w, recv_idx

    @staticmethod
    def backward(ctx, g_recv, g_recv_w, _g_idx):  # type: ignore[override]
        be = ctx.be
        gx, gw, _ = be.buffer.combine(g_recv.contiguous(), be.handle, topk_weights=g_recv_w.contiguous(),
                                      config=be.combine_config())
        return gx, gw, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RH, be):  # type: ignore[override]
        ctx.be = be
        out, _, _ = be.buffer.combine(y_RH, be.handle, config=be.combine_config())
        be.last_combine_in = y_RH.detach()
        return out

    @staticmethod
    def backward(ctx, g_out):  # type: ignore[override]
        be = ctx.be
        g, _, _, _, _, _ = be.buffer.dispatch(g_out.contiguous(), handle=be.handle, config=be.dispatch_config())
        return g, None


class DeepEPBackend:
    """DeepEP V1 dispatch / combine around PyTorch experts. ``dispatch`` and ``combine`` are the DeepEP half, shared
    with the DeepEP + Transformer Engine backend (``baselines/deepep_te.py``), which swaps the experts."""

    name = "deepep"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case, options: Optional[ExpertGemmOptions] = None) -> Optional[str]:
        return deepep_unsupported(case) or fp8_gemm.resolve(case, (options or ExpertGemmOptions()).fp8_gemm)[1]

    def __init__(self, case: Case, group: Any, options: Optional[ExpertGemmOptions] = None) -> None:
        self.case, self.group = case, group
        self.options = options or ExpertGemmOptions()
        self.rank, self.ep = dist.get_rank(group), dist.get_world_size(group)
        L = case.local_experts
        self.groups = min(L, MAX_LOCAL_EXPERTS)
        self.coarse = L > MAX_LOCAL_EXPERTS
        self.num_sms = case.comm_sms or (24 if case.precision == "fp8" else 32)
        self.fp8_dispatch = case.precision == "fp8"  # tokens travel as e4m3 1x128 blocks (DeepEP's FP8 dispatch)
        self.handle = None

    def setup(self, inputs: LayerInputs) -> None:
        self.setup_buffer()
        self.params = ExpertParams(self.case, inputs, group=self.group, fp8_option=self.options.fp8_gemm)

    def setup_buffer(self) -> None:
        Buffer = import_deep_ep().Buffer

        self._Buffer = Buffer
        Buffer.set_num_sms(self.num_sms)
        hidden_bytes = self.case.hidden * 2
        nvl = max(Buffer.get_dispatch_config(self.ep).get_nvl_buffer_size_hint(hidden_bytes, self.ep),
                  Buffer.get_combine_config(self.ep).get_nvl_buffer_size_hint(hidden_bytes, self.ep))
        self.buffer = Buffer(self.group, nvl, 0, explicitly_destroy=True)

    def dispatch_config(self):
        self._Buffer.set_num_sms(self.num_sms)
        return self._Buffer.get_dispatch_config(self.ep)

    def combine_config(self):
        self._Buffer.set_num_sms(self.num_sms)
        return self._Buffer.get_combine_config(self.ep)

    def _true_local_experts(self, topk_idx_TK: torch.Tensor, recv_idx: torch.Tensor) -> torch.Tensor:
        """[R, K] local expert of each received (token, k), -1 where the slot is another rank's."""
        L = self.case.local_experts
        if not self.coarse:
            return recv_idx
        T, K = topk_idx_TK.shape
        all_idx = torch.empty(self.ep * T, K, dtype=topk_idx_TK.dtype, device=topk_idx_TK.device)
        dist.all_gather_into_tensor(all_idx, topk_idx_TK.contiguous(), group=self.group)
        rank_prefix, src_idx = self.handle[0], self.handle[3]
        # rows arrive grouped by source rank; column `rank` of the prefix matrix holds the cumulative counts
        ends = rank_prefix[:, self.rank].to(torch.int64)
        rows = torch.arange(src_idx.numel(), device=ends.device)
        src_rank = torch.searchsorted(ends, rows, right=True)
        true = all_idx.view(self.ep, T, K)[src_rank, src_idx.to(torch.int64)] - self.rank * L
        return torch.where((true >= 0) & (true < L), true, torch.full_like(true, -1))

    def dispatch(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor,
                 topk_w_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepEP layout + dispatch. Returns the received rows ``recv_x_RH`` (bf16, one per (token, this rank)),
        their router weights ``recv_w_RK`` (fp32) and ``local_RK``: the local expert of each received (token, k),
        -1 where the slot is another rank's."""
        L, G = self.case.local_experts, self.groups
        coarse_idx = (topk_idx_TK // L) * G + (topk_idx_TK % L) % G if self.coarse else topk_idx_TK
        n_rank, _, n_expert, in_rank, _ = self.buffer.get_dispatch_layout(coarse_idx, self.ep * G)
        self.last_rows_to = n_rank
        recv_x, recv_w, recv_idx = _Dispatch.apply(x_TH, topk_w_TK, self, (n_rank, n_expert, in_rank), coarse_idx)
        return recv_x, recv_w, self._true_local_experts(topk_idx_TK, recv_idx)

    def combine(self, y_RH: torch.Tensor) -> torch.Tensor:
        """DeepEP combine of the per-received-row expert sums (bf16) back to this rank's tokens [T, H]."""
        return _Combine.apply(y_RH, self)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        L = self.case.local_experts
        recv_x, recv_w, local = self.dispatch(x_TH, topk_idx_TK, topk_w_TK)
        j, k = torch.nonzero(local >= 0, as_tuple=True)  # host sync (the receive count is known on the host anyway)
        e = local[j, k]
        order = torch.argsort(e, stable=True)
        j, k = j[order], k[order]
        y = self.params.experts(recv_x.index_select(0, j), torch.bincount(e, minlength=L))
        y = y.float() * recv_w[j, k].unsqueeze(-1)
        y_R = torch.zeros(recv_x.shape, dtype=torch.float32, device=y.device).index_add(0, j, y)
        out = self.combine(y_R.to(torch.bfloat16))
        return self.params.add_shared(out.float(), x_TH)

    def zero_grad(self) -> None:
        self.params.zero_grad()

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        return self.params.grads()

    def _row_bytes(self) -> int:
        h = self.case.hidden
        return h + 4 * (h // self.case.act_block) if self.fp8_dispatch else 2 * h

    def traffic(self) -> dict[str, Any]:
        """One row per (token, destination rank) each way; combine returns bf16 rows to their sources."""
        received = self.handle[0][:, self.rank].to(torch.int64)
        from_src = torch.diff(received, prepend=received.new_zeros(1)).tolist()
        return {"dispatch_rows_to": self.last_rows_to.tolist(), "combine_rows_to": from_src,
                "dispatch_row_bytes": self._row_bytes(), "combine_row_bytes": 2 * self.case.hidden}

    def phases(self) -> dict[str, Callable[[], Any]]:
        """DeepEP's dispatch (cached layout, as DeepEP's own test times it) and combine on the last rows."""
        payload, y = self.last_payload, self.last_combine_in
        return {
            "dispatch": lambda: self.buffer.dispatch(payload, handle=self.handle, config=self.dispatch_config()),
            "combine": lambda: self.buffer.combine(y, self.handle, config=self.combine_config()),
        }

    def info(self) -> dict[str, Any]:
        notes = [f"DeepEP V1 Buffer (hybrid-ep branch), {self.num_sms} comm SMs, no deterministic mode in V1",
                 f"grouped GEMM: {self.params.gemm_name()}"]
        if self.coarse:
            notes.append(f"expert ids coarsened to {self.groups} groups/rank for DeepEP's layout; true experts "
                         "recovered from an all-gathered top-k table")
        return {**self.params.columns("e4m3 1x128 (DeepEP fp8 dispatch)"), "comm_sms": self.num_sms,
                "notes": "; ".join(notes)}

    def teardown(self) -> None:
        buf = getattr(self, "buffer", None)
        if buf is not None:
            torch.cuda.synchronize()
            dist.barrier(group=self.group)
            buf.destroy()
            self.buffer = None
