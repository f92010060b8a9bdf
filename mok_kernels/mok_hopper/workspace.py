"""The communication workspace: buffers every rank can address on every other rank, allocated once per
(group, device, tokens, hidden, top-k, precision) and reused across calls.

Legend: P ranks, T tokens per rank, K top-k, H hidden, B = H / 128 scale blocks.

With P > 1 on CUDA the buffers are torch symmetric memory (``symm_mem.empty`` + ``symm_mem.rendezvous``); peer
addresses come from the handle's ``buffer_ptrs``. Barriers use the handle's signal pads (peer stores), never
NVLink multicast. On a gloo group (several ranks in processes of their own on one GPU, where the rendezvous refuses
them) the buffers are exchanged as CUDA IPC handles instead (:class:`~mok_kernels.mok_hopper.ipc.IpcPeers`, the same
``buffer_ptrs`` and ``barrier(channel=)``); the tables and the kernels are the same either way. With one rank, or
on the CPU (Triton interpreter tests), ordinary tensors stand in and :func:`link_local` makes a set of them address
each other, to simulate several ranks in one process.

Everything lives in one byte buffer (one rendezvous); each region starts on a 256-byte boundary:

| region | shape | dtype | written by | read by |
|---|---|---|---|---|
| ``x`` | [T, H] | bf16, or e4m3 for fp8 | this rank (stage) | expert owners (pull) |
| ``xs`` | [T, B] | fp32 (fp8 only) | this rank (stage) | expert owners (pull) |
| ``idx`` | [T, K] | int32 | this rank (stage) | every rank (schedule) |
| ``w`` | [T, K] | fp32 | this rank (stage) | expert owners (pull) / this rank (epilogue) |
| ``comb`` | [T*K, H] | bf16 | expert owners (push) | this rank (epilogue) |

The bf16 backward across ranks (``train.py``, EP >= 2) reuses the regions once the forward is done with them:
``x`` holds this rank's output gradient dO (pulled by the expert owners), ``comb`` the dX rows pushed back to
their token slots, ``w`` the router-weight gradients pushed back the same way.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mok_kernels.mok_hopper import ipc as _ipc

_ALIGN = 256
_CACHE: dict[tuple, "Workspace"] = {}


def _layout(T: int, H: int, K: int, fp8: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    regions: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        ("x", (T, H), torch.float8_e4m3fn if fp8 else torch.bfloat16)]
    if fp8:
        regions.append(("xs", (T, H // 128), torch.float32))
    regions += [("idx", (T, K), torch.int32), ("w", (T, K), torch.float32), ("comb", (T * K, H), torch.bfloat16)]
    return regions


class Workspace:
    """Views into one (symmetric) byte buffer and, per region, an int64 table locating every rank's copy."""

    def __init__(self, *, rank: int, world: int, device: torch.device, tokens: int, hidden: int, topk: int,
                 fp8: bool, group: Any = None, symmetric: Optional[bool] = None, ipc: Any = None) -> None:
        """``ipc``: the layer that shares buffers between processes (:class:`~mok_kernels.mok_hopper.ipc.IpcLayer`;
        None: the CUDA driver's where :func:`~mok_kernels.mok_hopper.ipc.wanted`, else symmetric memory)."""
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.tokens, self.hidden, self.topk, self.fp8 = tokens, hidden, topk, fp8
        if symmetric is None:
            symmetric = world > 1 and self.device.type == "cuda"
        if ipc is None and symmetric and world > 1 and _ipc.wanted(group, self.device):
            ipc = _ipc.DriverIpc()
        self.symmetric = symmetric or ipc is not None
        self.transport = "ipc" if ipc is not None else "symmetric" if symmetric else "local"
        offsets, total = {}, 0
        layout = _layout(tokens, hidden, topk, fp8)
        for name, shape, dtype in layout:
            n = 1
            for d in shape:
                n *= d
            offsets[name] = total
            total += -(-n * torch.empty((), dtype=dtype).element_size() // _ALIGN) * _ALIGN
        self.offsets, self.nbytes = offsets, total
        self.handle = None
        if ipc is not None:
            self.handle = _ipc.IpcPeers(total, device=self.device, group=group, rank=rank, world=world, layer=ipc,
                                        fault=_ipc.planted_fault())
            self.buf = self.handle.buf
            bases = list(self.handle.buffer_ptrs)
        elif symmetric:
            import torch.distributed._symmetric_memory as symm_mem

            self.buf = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
            self.handle = _rendezvous(symm_mem, self.buf, group)
            # A new buffer's signal pads are initialised on each rank's stream. A rank whose GPU is still busy
            # (earlier work queued) would initialise them *after* a faster peer's first barrier signal arrived,
            # wiping it: the two ranks then wait on each other forever. So every rank's GPU finishes the setup
            # before any rank can signal. Without this, the first forward of a workspace made while the GPUs were
            # busy hung on 2xH200; with it, no hang in two later runs.
            _settle(self.device, group)
            mine = int(self.handle.buffer_ptrs[rank])
            shift = self.buf.data_ptr() - mine  # the tensor's offset inside the allocation, same on every rank
            bases = [int(p) + shift for p in self.handle.buffer_ptrs]
        else:
            self.buf = torch.zeros(total, dtype=torch.uint8, device=self.device)
            bases = [self.buf.data_ptr()] * world if world == 1 else []
        self.views: dict[str, torch.Tensor] = {}
        for name, shape, dtype in layout:
            n = 1
            for d in shape:
                n *= d
            nb = n * torch.empty((), dtype=dtype).element_size()
            self.views[name] = self.buf[offsets[name] : offsets[name] + nb].view(dtype).view(shape)
        self.tables: dict[str, torch.Tensor] = {}
        if bases:
            self._set_bases(bases)

    def _set_bases(self, bases: list[int]) -> None:
        """Per region, an int64 [P] table of element offsets from this rank's view of the region to each rank's
        (``view.data_ptr() + table[p] * element_size`` is rank p's copy). Offsets instead of raw addresses let
        kernels add them to a real pointer argument and declare them multiples of 16 elements (every region
        starts on a 256-byte boundary), which keeps loads and stores vectorised."""
        assert len(bases) == self.world
        mine = bases[self.rank]
        for name, view in self.views.items():
            es = view.element_size()
            deltas = [b - mine for b in bases]
            assert all(d % (16 * es) == 0 for d in deltas), "peer buffers must share the 256-byte alignment"
            self.tables[name] = torch.tensor([d // es for d in deltas], dtype=torch.int64, device=self.device)

    @property
    def x(self) -> torch.Tensor:
        return self.views["x"]

    @property
    def xs(self) -> Optional[torch.Tensor]:
        return self.views.get("xs")

    @property
    def idx(self) -> torch.Tensor:
        return self.views["idx"]

    @property
    def w(self) -> torch.Tensor:
        return self.views["w"]

    @property
    def comb(self) -> torch.Tensor:
        return self.views["comb"]

    def barrier(self, channel: int = 0) -> None:
        """Every rank has reached this point on its stream (device-side, signal pads; a no-op for one rank)."""
        if self.handle is not None:
            self.handle.barrier(channel=channel)

    def close(self) -> None:
        """Give the memory back. CUDA IPC (collective: every rank of the group): the views go, the peers' buffers
        are unmapped and this rank's freed once every rank has unmapped it. Otherwise the views go with the object."""
        if self.transport == "ipc":
            self.views, self.tables, self.buf = {}, {}, None  # type: ignore[assignment]
            self.handle.close()


def _settle(device: torch.device, group: Any) -> None:
    """Every rank's queued GPU work is done, then every rank has got here (host barrier), then done again."""
    import torch.distributed as dist

    torch.cuda.synchronize(device)
    dist.barrier(group=group if group is not None else dist.group.WORLD)
    torch.cuda.synchronize(device)


def _rendezvous(symm_mem: Any, buf: torch.Tensor, group: Any) -> Any:
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    name = getattr(group, "group_name", None)
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and name is not None:  # needed on older torch, a deprecated no-op on newer
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not symm_mem.is_symm_mem_enabled_for_group(name):
                    enable(name)
        except Exception:  # noqa: BLE001 - newer torch needs no enabling
            pass
    try:
        return symm_mem.rendezvous(buf, group)
    except TypeError:
        return symm_mem.rendezvous(buf, name)


def link_local(workspaces: list[Workspace]) -> list[Workspace]:
    """Make ordinary (non-symmetric) workspaces address each other: one process simulating several ranks."""
    bases = [ws.buf.data_ptr() for ws in workspaces]
    for ws in workspaces:
        assert not ws.symmetric and ws.world == len(workspaces)
        ws._set_bases(bases)
    return workspaces


def get_workspace(*, group: Any, rank: int, world: int, device: torch.device, tokens: int, hidden: int, topk: int,
                  fp8: bool) -> Workspace:
    """The cached workspace for this (group, device, T, H, K, precision); created (collectively) on first use."""
    key = (id(group) if group is not None else None, str(torch.device(device)), tokens, hidden, topk, fp8, world)
    ws = _CACHE.get(key)
    if ws is None:
        ws = Workspace(rank=rank, world=world, device=device, tokens=tokens, hidden=hidden, topk=topk, fp8=fp8,
                       group=group)
        _CACHE[key] = ws
    return ws


def clear_workspace_cache() -> None:
    """Drop the cached workspaces; those over CUDA IPC are closed (collective: every rank calls this)."""
    for ws in list(_CACHE.values()):
        ws.close()
    _CACHE.clear()
