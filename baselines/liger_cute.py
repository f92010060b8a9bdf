"""LigerCute (``liger-cute-kernels``) as an anchor: a fused expert-parallel MoE layer (dispatch, experts and combine
in one persistent CUTLASS + NVSHMEM kernel each way, forward and backward), bf16, on Hopper (SM90) and Blackwell.

Its Python API, as read from the liger-kernel 0.8.5 and liger-cute-kernels 0.8.5 wheels (public names only):

* ``liger_kernel.ops.configure.configure(bootstrap_group=, device=, moe=MoEConfig(max_tokens, hidden_size,
  num_experts, top_k, num_hosts, gpus_per_host, max_inflight))``: collective over the group; initialises NVSHMEM
  and reserves the symmetric workspace for that capacity, once per process (a reservation cannot grow); returns
  False, with a warning, where LigerCute is absent or the GPU unsupported;
* ``liger_kernel.ops.cute.ops.moe_fused(X, expert_indices, expert_weights, all_B, all_C, all_A, num_experts, top_k,
  pg)``: X [T, H] bf16; expert_indices [T, K] int32, global expert ids; expert_weights [T, K] bf16; all_B (gate)
  and all_C (up) [L, I, H], contiguous when gradients are on; all_A (down) [L, H, I]. It returns the combined
  [T, H] bf16; its backward gives the gradients of X, of the router weights (bf16) and of the three weights in those
  layouts;
* ``liger_cute_kernels.nvshmem.resolve_team(pg, create=False)``, ``.finalize()`` and
  ``liger_cute_kernels.tvm_ffi.moe_pop_fwd(team)``: the group's NVSHMEM team, the runtime's end, and the release of
  a forward's buffers (below). ``tvm_ffi.uniqueid_nbytes()`` loads the native core (its README's check), so a library
  that cannot be loaded fails there, with the loader's own message.

On the harness's inputs: gate and up are copied once in ``setup`` (untimed) out of ``w13`` [L, 2I, H] into
contiguous [L, I, H] leaves, the layout its backward needs; down is ``w2`` [L, H, I] as it is. Its gradients come
back in the harness's layout (gate / up [L, I, H], down [L, H, I]): no re-packing. In the timed forward the top-k ids
are cast to int32 and the fp32 router weights to bf16 (its router-weight format; their gradient is computed in bf16
and goes back through the cast to the fp32 leaf). The shared expert is the PyTorch baselines' dense SwiGLU
(``baselines.common``), added to its output.

Forward-only timing: a training forward keeps its intermediates in LigerCute's symmetric stack until its backward
runs, and ``MoEConfig.max_inflight=1`` (its default, kept here) allows one such pending forward, so a timing loop of
forwards would fail at the second. Each forward therefore first releases the previous forward when its backward
has not run (``moe_pop_fwd``, a host call inside the timed forward; LigerCute's own inference path pops right after
its forward the same way); a backward on a released forward raises instead of reading reused buffers. The forward
rows are training forwards (intermediates kept), as the other backends' are, and ``notes`` says so.

Libraries: its ``libliger_cute_kernels_sm90a.so`` needs ``libnvshmem_host.so.3`` (the ``nvidia-nvshmem-cu12`` wheel,
which LigerCute preloads), ``libcudart.so.12`` (the release wheel is built with CUDA 12.9; beside a CUDA 13 torch
install ``nvidia-cuda-runtime-cu12``, which ``load`` preloads) and ``libtvm_ffi.so`` (``apache-tvm-ffi``), even at
EP=1. It refuses an NVSHMEM runtime that another library initialised. ``teardown`` finalises NVSHMEM
(collectively), so the backends after it get that memory back.

Not supported, as ``unsupported`` rows: precisions other than bf16; the clamped SwiGLU (it has no clamp); GPUs other
than SM90 / SM100; a package that is missing or does not load (the error and the install line). EP >= 2 runs only
with ``MOKBENCH_LIGER_CUTE_EP=1`` (its NVSHMEM expert parallelism is not validated here yet), which ``notes``
records. A failure of ``configure`` in ``setup`` (collective, after those checks) raises its message with the fix.

Legend: T tokens per rank, K top-k, E experts, L local experts, H hidden, I expert ffn.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from contract import Case, LayerInputs
from baselines.common import (ExpertParams, device_capability, ep_note, ep_unsupported, package_version,
                              warm_forward_backward)

EP_ENV = "MOKBENCH_LIGER_CUTE_EP"  # 1: run at EP >= 2 (not validated by this harness)
MAX_INFLIGHT = 1  # MoEConfig.max_inflight: forwards awaiting their backward (LigerCute's default)
INSTALL_HINT = ("python3 -m pip install liger-kernel==0.8.5 'liger-cute-kernels[cu12]==0.8.5' nvidia-cuda-runtime-cu12 "
                "(its release wheel is built with CUDA 12.9: NVSHMEM for CUDA 12, and libcudart.so.12 beside a "
                "CUDA 13 torch; docs/backends.md, 'Anchors: LigerCute and DeepGEMM MegaMoE')")


def versions() -> str:
    return ", ".join(f"{d} {package_version(d)}" for d in ("liger-cute-kernels", "liger-kernel"))


def preload_cudart12() -> Optional[str]:
    """Load ``libcudart.so.12`` of the ``nvidia-cuda-runtime-cu12`` wheel into the global symbol scope, where that wheel
    is installed: LigerCute's release core links it by name only (its run path is its build machine's). Returns the
    file loaded, or None."""
    import ctypes
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except ModuleNotFoundError:
        return None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        lib = Path(loc) / "lib" / "libcudart.so.12"
        if lib.is_file():
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            return str(lib)
    return None


def load() -> SimpleNamespace:
    """LigerCute's public API with its native core loaded; raises with the loader's message where it cannot be."""
    cudart = preload_cudart12()
    from liger_cute_kernels import nvshmem, tvm_ffi

    tvm_ffi.uniqueid_nbytes()  # loads libliger_cute_kernels_sm*.so and NVSHMEM's host library
    from liger_kernel.ops.configure import MoEConfig, configure
    from liger_kernel.ops.cute.ops import moe_fused

    return SimpleNamespace(moe_fused=moe_fused, configure=configure, MoEConfig=MoEConfig, nvshmem=nvshmem,
                           pop=tvm_ffi.moe_pop_fwd, cudart=cudart)


def count_hosts(group: Any) -> int:
    """How many hosts the ranks of ``group`` are on (collective)."""
    import socket

    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return len(set(names))


class PendingForward:
    """A training forward whose buffers LigerCute holds until its backward: hooks on its autograd node mark the
    backward done, and refuse a backward after ``release``."""

    def __init__(self, node: Any) -> None:
        self.done = self.released = False
        node.register_prehook(self._before_backward)
        node.register_hook(self._after_backward)

    def _before_backward(self, grad_outputs: Any) -> None:
        if self.released:
            raise RuntimeError("this LigerCute forward's buffers were released by a later forward (its backward had "
                               "not run): run the backward before the next forward")

    def _after_backward(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.done = True


class LigerCuteBackend:
    name = "liger_cute"
    directions = ("fwd", "bwd", "fwd_bwd")

    @classmethod
    def unsupported_reason(cls, case: Case) -> Optional[str]:
        if case.precision != "bf16":
            return "LigerCute's MoE is bf16 only (moe_fused_fwd_bf16 / moe_fused_bwd_bf16); use precision=bf16"
        if case.swiglu_limit is not None:
            return "LigerCute's MoE has no clamped SwiGLU (shape.swiglu_limit); use a shape without swiglu_limit"
        why = ep_unsupported("LigerCute", case, EP_ENV)
        if why:
            return why
        cap = device_capability(torch.device(case.device))
        if cap != (9, 0) and cap[0] != 10:
            where = "the CPU" if case.device != "cuda" else f"SM{cap[0]}{cap[1]}"
            return f"LigerCute's kernels are built for Hopper (SM90) and Blackwell (SM100) GPUs; this is {where}"
        for module, dist_name in (("liger_kernel", "liger-kernel"), ("liger_cute_kernels", "liger-cute-kernels")):
            if importlib.util.find_spec(module) is None:
                return f"{dist_name} is not installed; {INSTALL_HINT}"
        try:
            load()
        except Exception as e:  # noqa: BLE001 (a missing shared library is an OSError / RuntimeError / ImportError)
            first = str(e).splitlines()[0] if str(e) else ""
            return f"LigerCute does not load ({type(e).__name__}: {first}); {INSTALL_HINT}"
        return None

    def __init__(self, case: Case, group: Any) -> None:
        self.case, self.group = case, group
        self.lck: Optional[SimpleNamespace] = None
        self.params: Optional[ExpertParams] = None
        self._pending: Optional[PendingForward] = None
        self._team: Any = None
        self.released = 0  # forwards released before their backward (forward-only timing)
        self.hosts = 1
        self.warm_s = 0.0
        self.configured = False  # NVSHMEM initialised by configure (teardown finalises it)

    def setup(self, inputs: LayerInputs) -> None:
        c = self.case
        self.lck = load()
        self.params = ExpertParams(c, inputs)  # w2 and the shared expert as leaves aliasing the inputs
        # gate and up out of w13 into contiguous [L, I, H] leaves (moe_fused's backward takes no expert stride)
        self.gate = inputs.w_gate_LIH.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
        self.up = inputs.w_up_LIH.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
        w2 = self.params.w2
        self.down = w2 if w2.is_contiguous() else w2.detach().contiguous().requires_grad_()
        self.hosts = count_hosts(self.group) if c.ep_size > 1 else 1
        if c.ep_size % self.hosts:
            raise RuntimeError(f"LigerCute needs the same number of ranks on every host; {c.ep_size} ranks are on "
                               f"{self.hosts} hosts")
        moe = self.lck.MoEConfig(max_tokens=c.tokens_per_gpu, hidden_size=c.hidden, num_experts=c.num_experts,
                                 top_k=c.topk, num_hosts=self.hosts, gpus_per_host=c.ep_size // self.hosts,
                                 max_inflight=MAX_INFLIGHT)
        try:
            ok = self.lck.configure(bootstrap_group=self.group, device=inputs.x_TH.device, moe=moe)
        except Exception as e:  # noqa: BLE001 (capacity, topology or an NVSHMEM runtime another library initialised)
            raise RuntimeError(f"LigerCute's configure failed ({type(e).__name__}: {e}); it initialises NVSHMEM once "
                               "per process for the largest point: run each point in its own process (the harness's "
                               "default) and no other NVSHMEM user before it") from e
        if ok is False:
            raise RuntimeError("liger_kernel.ops.configure.configure skipped LigerCute (its warning says why: not "
                               f"installed, or this GPU unsupported); {INSTALL_HINT}")
        self.configured = True
        self._team = self.lck.nvshmem.resolve_team(self.group, create=False)
        # One untimed forward + backward: LigerCute's first-use work (kernel selection, module loads) lands in setup
        self.warm_s = warm_forward_backward(self.forward, inputs, self.params)
        self.zero_grad()

    def release_pending(self) -> None:
        """Release the last forward's buffers if its backward has not run (at most one is pending)."""
        p, self._pending = self._pending, None
        if p is not None and not p.done:
            p.released = True
            self.lck.pop(self._team)
            self.released += 1

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> torch.Tensor:
        self.release_pending()
        c = self.case
        y = self.lck.moe_fused(x_TH, topk_idx_TK.to(torch.int32), topk_w_TK.to(torch.bfloat16), self.gate, self.up,
                               self.down, c.num_experts, c.topk, self.group)
        if y.grad_fn is not None:  # a training forward: its buffers stay until its backward
            self._pending = PendingForward(y.grad_fn)
        return self.params.add_shared(y, x_TH)

    def zero_grad(self) -> None:
        self.params.zero_grad()
        for p in (self.gate, self.up, self.down):
            p.grad = None

    def weight_grads(self) -> dict[str, Optional[torch.Tensor]]:
        shared = self.params.grads()
        return {"w_gate": self.gate.grad, "w_up": self.up.grad, "w_down": self.down.grad,
                **{k: shared[k] for k in ("ws_gate", "ws_up", "ws_down")}}

    def traffic(self) -> dict[str, Any]:
        return {}  # LigerCute's kernels move the rows themselves and do not report them

    def phases(self) -> dict[str, Callable[[], Any]]:
        return {}

    def info(self) -> dict[str, Any]:
        c = self.case
        cudart = f"; libcudart.so.12 preloaded from {self.lck.cudart}" if self.lck and self.lck.cudart else ""
        notes = [f"LigerCute moe_fused ({versions()}): dispatch, experts and combine fused over NVSHMEM; the harness's "
                 "top-k ids as int32 and its router weights cast to bf16 in the forward (LigerCute's router-weight "
                 "format; their gradient is computed in bf16)",
                 "gate and up copied once in setup into contiguous [L, I, H] (its backward's layout); gradients "
                 "returned in the harness layout, no re-packing",
                 f"forward rows are training forwards; a forward whose backward did not run is released by the next "
                 f"(moe_pop_fwd inside the timed forward, max_inflight={MAX_INFLIGHT})",
                 f"setup forward+backward {self.warm_s:.1f} s{cudart}",
                 "shared expert: the PyTorch baselines' dense SwiGLU, added to LigerCute's output",
                 ep_note(c, EP_ENV) + (f" on {self.hosts} hosts" if self.hosts > 1 else "")]
        return {**(self.params.columns() if self.params is not None else {}), "notes": "; ".join(notes)}

    def teardown(self) -> None:
        if self.configured:
            self.release_pending()
            if self.case.device == "cuda":
                torch.cuda.synchronize()
            self.lck.nvshmem.finalize()  # collective: every rank tears down together
            self.configured = False
        self.params = self.lck = None
