"""A stand-in for CUDA IPC on the CPU (the ``IpcLayer`` of mok_kernels/mok_hopper/ipc.py): each buffer is a file in a
shared folder, mapped into the process that allocates it; a handle is the file's name, and opening it maps the
same file again (another address in this process, the same memory as the exporter's). Gloo ranks in processes of
their own then address each other's buffers as the GPU ranks do, and the Triton kernels under the interpreter read
and write them. Every call is logged with the time (CLOCK_MONOTONIC, comparable across the processes) so a test can
check the order of the teardown."""

from __future__ import annotations

import gc
import mmap
import os
import time
from pathlib import Path

import torch


class FileIpc:
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.maps: dict[int, tuple[mmap.mmap, torch.Tensor, str]] = {}  # pointer -> (map, its tensor, file)
        self.log: list[tuple[str, float, str]] = []  # (call, time, file)
        self.n = 0

    def _map(self, path: str) -> tuple[int, torch.Tensor]:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        self.maps[t.data_ptr()] = (mm, t, path)
        return t.data_ptr(), t

    def alloc(self, nbytes: int, device: torch.device) -> tuple[int, torch.Tensor]:
        assert torch.device(device).type == "cpu"
        self.n += 1
        path = str(self.folder / f"ipc-{os.getpid()}-{self.n}")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        ptr, t = self._map(path)
        self.log.append(("alloc", time.monotonic(), path))
        return ptr, t

    def export(self, ptr: int) -> bytes:
        self.log.append(("export", time.monotonic(), self.maps[ptr][2]))
        return self.maps[ptr][2].encode()

    def open(self, handle: bytes, nbytes: int, device: torch.device) -> int:
        ptr, t = self._map(handle.decode())
        assert t.numel() == nbytes, (t.numel(), nbytes)
        self.log.append(("open", time.monotonic(), handle.decode()))
        return ptr

    def _unmap(self, ptr: int) -> str:
        mm, t, path = self.maps.pop(ptr)
        del t
        gc.collect()
        mm.close()  # BufferError while any tensor still views this memory: the caller dropped too little
        return path

    def close(self, ptr: int) -> None:
        self.log.append(("close", time.monotonic(), self._unmap(ptr)))

    def free(self, ptr: int) -> None:
        path = self._unmap(ptr)
        os.unlink(path)
        self.log.append(("free", time.monotonic(), path))
