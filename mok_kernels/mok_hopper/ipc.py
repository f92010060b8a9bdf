"""Peer buffers exchanged as CUDA IPC handles over a process group: the workspace's route where torch symmetric
memory cannot rendezvous, i.e. several ranks in processes of their own on one GPU (the harness's ``ranks_per_gpu``
> 1, whose group is gloo; torch's rendezvous refuses "allocations from overlapping devices from different ranks").

:class:`IpcPeers` stands where symmetric memory's handle stands in :class:`~mok_kernels.mok_hopper.workspace.Workspace`
(``buffer_ptrs``, ``barrier(channel=)``): the kernels and their peer offset tables are the ones every EP size runs;
only how the peers' base addresses are obtained differs. Each rank allocates one buffer (the workspace's bytes, then
the barrier's signal pads), exports it, gathers every rank's handle over the group and opens the peers'.

Allocation: the CUDA driver's own ``cuMemAlloc`` (through ctypes on ``libcuda.so.1``), outside torch's caching
allocator. The harness runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, under which torch shares
CUDA memory by file descriptors with known problems (torch issues #198305 and #186213); a plain ``cuMemAlloc``
allocation is what ``cuIpcGetMemHandle`` was made for, whatever the allocator's settings, and the driver API is
the same on every torch (no ``cuda-python``, no pluggable-allocator library to build). Torch sees the memory as
tensors through ``__cuda_array_interface__``.

The layer that allocates, exports and opens is an argument (:class:`DriverIpc` on CUDA): the CPU tests give a
double that hands out shared host memory, so the exchange, the offset tables, the barrier (its Triton kernel under
the interpreter, spinning across processes) and the teardown run on gloo ranks without a GPU.

Planted faults for the GPU test (:data:`FAULTS`, switched on by the environment variable :data:`FAULT_ENV` in every
rank; rank 0 is the faulty one): they must turn harness rows into ``mismatch`` or ``timeout``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional, Protocol

import torch

FAULT_ENV = "MOKBENCH_IPC_FAULT"
FAULTS = {
    "wrong-peer-pointer": "rank 0 takes its own buffer for rank 1's: its pulls read, and its pushes land in, the "
                          "wrong rank's workspace (expected: mismatch)",
    "skip-barrier": "rank 0 skips every cross-process barrier on channel 1 (the forward's barrier before the "
                    "epilogue): it neither signals nor waits (expected: timeout, the peers wait for its signal; or "
                    "mismatch)",
}
CHANNELS = 4  # signal-pad channels (the layer uses 0 and 1)
_ALIGN = 256


class IpcLayer(Protocol):
    """Allocate, export, open, close and free buffers shared between processes."""

    def alloc(self, nbytes: int, device: torch.device) -> tuple[int, torch.Tensor]: ...  # (pointer, uint8 view)

    def export(self, ptr: int) -> bytes: ...

    def open(self, handle: bytes, nbytes: int, device: torch.device) -> int: ...

    def close(self, ptr: int) -> None: ...

    def free(self, ptr: int) -> None: ...


def wanted(group: Any, device: torch.device) -> bool:
    """Whether a workspace of ``group`` on ``device`` goes over CUDA IPC: a CUDA device and a gloo group (the
    harness's several-ranks-on-one-GPU route; NCCL groups, one rank per GPU, keep symmetric memory)."""
    import torch.distributed as dist

    if torch.device(device).type != "cuda" or not dist.is_initialized():
        return False
    return dist.get_backend(group if group is not None else dist.group.WORLD) == "gloo"


def planted_fault() -> Optional[str]:
    """The fault :data:`FAULT_ENV` names (None: none); a name not in :data:`FAULTS` is an error."""
    name = os.environ.get(FAULT_ENV, "").strip()
    if not name:
        return None
    if name not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={name!r}: not a planted fault; one of {', '.join(FAULTS)}")
    return name


# ---- the CUDA driver through ctypes ------------------------------------------------------------------------------


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # CUipcMemHandle


_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_DRIVER: Optional[ctypes.CDLL] = None


def _driver() -> ctypes.CDLL:
    global _DRIVER
    if _DRIVER is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuInit", "cuCtxGetCurrent", "cuMemAlloc_v2", "cuMemFree_v2", "cuIpcGetMemHandle",
                     "cuIpcCloseMemHandle", "cuGetErrorString"):
            getattr(lib, name)  # AttributeError: a driver without it
        getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        _DRIVER = lib
    return _DRIVER


def unavailable() -> Optional[str]:
    """Why :class:`DriverIpc` cannot run here (None: it can)."""
    try:
        _driver()
    except (OSError, AttributeError) as e:
        return f"CUDA IPC needs the CUDA driver library (libcuda.so.1) with its IPC calls: {e}"
    return None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA driver error {rc} ({(msg.value or b'?').decode()})")


class _Mem:
    """Device memory at a raw address, as torch sees it (``__cuda_array_interface__``, no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


class DriverIpc:
    """CUDA IPC through the driver API: ``cuMemAlloc`` / ``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle`` on the
    device's primary context (the one torch's runtime uses)."""

    def _context(self, device: torch.device) -> None:
        torch.cuda.set_device(device)
        torch.cuda.synchronize(device)  # the runtime has made the device's primary context current on this thread
        lib = _driver()
        _check(lib.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise RuntimeError(f"no current CUDA context on {device} for the IPC allocation")

    def alloc(self, nbytes: int, device: torch.device) -> tuple[int, torch.Tensor]:
        self._context(device)
        ptr = ctypes.c_uint64()
        _check(_driver().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), f"cuMemAlloc({nbytes})")
        return ptr.value, self.view(ptr.value, nbytes, device)

    @staticmethod
    def view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
        with torch.cuda.device(device):
            return torch.as_tensor(_Mem(ptr, nbytes), device=device)

    def export(self, ptr: int) -> bytes:
        h = _Handle()
        _check(_driver().cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle")
        return bytes(h.reserved)

    def open(self, handle: bytes, nbytes: int, device: torch.device) -> int:
        self._context(device)
        lib = _driver()
        fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        h = _Handle()
        h.reserved = handle
        ptr = ctypes.c_uint64()
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        _check(fn(ctypes.byref(ptr), h, _LAZY_PEER_ACCESS), "cuIpcOpenMemHandle")
        return ptr.value

    def close(self, ptr: int) -> None:
        _check(_driver().cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")

    def free(self, ptr: int) -> None:
        _check(_driver().cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")


# ---- the exchange --------------------------------------------------------------------------------------------------


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class IpcPeers:
    """One buffer per rank (``nbytes`` for the caller, then the signal pads), every rank's opened in every rank.

    ``buf``: this rank's ``nbytes`` (uint8, zeroed); ``buffer_ptrs[q]``: where rank q's buffer is mapped in this
    process; ``barrier(channel=)``: the signal-pad barrier (:mod:`mok_kernels.mok_hopper.ops.barrier`); :meth:`close`
    (collective): unmap the peers', then free this rank's once every rank has unmapped it."""

    def __init__(self, nbytes: int, *, device: torch.device, group: Any, rank: int, world: int,
                 layer: Optional[IpcLayer] = None, fault: Optional[str] = None) -> None:
        import torch.distributed as dist

        self.device, self.group, self.rank, self.world = torch.device(device), group, rank, world
        self.layer: IpcLayer = layer if layer is not None else DriverIpc()
        self.fault = fault
        pad_at = _round(nbytes)
        self.nbytes_total = pad_at + _round(CHANNELS * world * 4)
        self.ptr, self.mem = self.layer.alloc(self.nbytes_total, self.device)
        self.mem.zero_()  # the workspace and the signal pads: no signal before every rank is set up
        self.buf = self.mem[:nbytes]
        self.pads = self.mem[pad_at : pad_at + CHANNELS * world * 4].view(torch.int32).view(CHANNELS, world)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        handles: list[Any] = [None] * world
        dist.all_gather_object(handles, self.layer.export(self.ptr), group=group)
        self.opened: dict[int, int] = {}
        bases = []
        for q, h in enumerate(handles):
            if q == rank:
                bases.append(self.ptr)
            else:
                self.opened[q] = self.layer.open(h, self.nbytes_total, self.device)
                bases.append(self.opened[q])
        dist.barrier(group=group)  # every rank has mapped every buffer (and zeroed its own) before any barrier
        self.pad_ptrs = [b + pad_at for b in bases]
        mine = self.pads.data_ptr()
        assert all((p - mine) % 4 == 0 for p in self.pad_ptrs)
        self.peer_pads = torch.tensor([(p - mine) // 4 for p in self.pad_ptrs], dtype=torch.int64,
                                      device=self.device)
        self.buffer_ptrs = list(bases)
        if fault == "wrong-peer-pointer" and rank == 0 and world > 1:
            self.buffer_ptrs[1] = self.ptr
        self.skip_channels = (1,) if fault == "skip-barrier" and rank == 0 else ()
        self.closed = False

    def barrier(self, channel: int = 0) -> None:
        if channel in self.skip_channels:
            return
        from mok_kernels.mok_hopper.ops.barrier import signal_pad_barrier

        signal_pad_barrier(self.pads, self.peer_pads, rank=self.rank, channel=channel)

    def close(self) -> None:
        """Collective: every rank unmaps its peers' buffers; once all have, each frees its own. Views of ``buf``
        must be gone (the caller drops them first)."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for q in sorted(self.opened):
            self.layer.close(self.opened[q])
        self.opened = {}
        dist.barrier(group=self.group)
        self.buf = self.mem = self.pads = None  # type: ignore[assignment]
        self.layer.free(self.ptr)
