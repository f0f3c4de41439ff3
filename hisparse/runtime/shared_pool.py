"""A host pool the tensor-parallel ranks of one host share: one memory segment, mapped by each.

MLA's latent rows are one per token and layer, not split by head, so every TP rank computes the
same rows: one copy of the pool serves them all (host RAM 1x, not once per rank). Rank 0
``create``s the segment and writes the rows; the other ranks ``attach`` and only read
(``hisparse.runtime.pool_fence`` orders the two, in a control block at the segment's end).

The segment is an anonymous memfd: it never has a name in /dev/shm, is not bounded by /dev/shm's
size, and its memory is freed when the last rank unmaps it (at shutdown, or when the processes
die), so nothing can leak. The other ranks open it as ``/proc/<rank 0's pid>/fd/<fd>`` while
rank 0 still holds the descriptor (until ``close_fd``, once every rank has mapped it).

On CUDA every rank page-locks the same mapping (``pin``: cudaHostRegister, once per process;
the pages exist once), so each GPU copies rows to and from the one copy directly; the flags are
then written and waited for by the GPUs (``device_fence``).
"""

from __future__ import annotations

import mmap
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch

from hisparse.runtime.host_pool import HostPoolError, available_host_bytes

# Leave this much of the available RAM to the rest of the process and the OS (as HostPool).
_RESERVE_BYTES = 1 << 30
#: The name the segment shows in /proc/<pid>/maps (as ``/memfd:hisparse-host-pool (deleted)``).
SEGMENT_NAME = "hisparse-host-pool"


def host_key() -> str:
    """Names this host and boot: ranks whose keys differ cannot map one segment."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class SegmentInfo:
    """What rank 0 hands the other ranks (picklable): where to open the segment, its sizes."""

    pid: int
    fd: int
    pool_bytes: int
    control_bytes: int
    host: str

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


def _page_round(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


class SharedHostPool:
    """The pool's bytes (``raw``, uint8) and the control block (``control``, int64 slots) of one
    shared segment. Same face as ``HostPool`` (``raw``, ``num_bytes``, ``pinned``, ``release``);
    views bound into ``raw`` must not be used after ``release()``."""

    def __init__(self, mm: mmap.mmap, info: SegmentInfo, fd: Optional[int]) -> None:
        self.pinned = False
        self._mm: Optional[mmap.mmap] = mm
        self.info = info
        self._fd = fd  # rank 0's descriptor, open until every rank has mapped the segment
        self.num_bytes = info.pool_bytes
        self._whole = torch.frombuffer(mm, dtype=torch.uint8)
        self.raw: Optional[torch.Tensor] = self._whole[: info.pool_bytes]
        start = _page_round(info.pool_bytes)
        self.control: Optional[memoryview] = memoryview(mm)[start:].cast("q")
        self.control_address = self._whole.data_ptr() + start

    def pin(self, *, what: str) -> None:
        """Page-lock this process's mapping (pool and control block) for the GPU. Every rank
        pins the same pages: RAM is not counted again, and each GPU's copies and flag accesses
        reach the one copy."""
        if self.pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(self._whole.data_ptr(), self._whole.numel(), 0)
        if int(err) != 0:
            raise HostPoolError(
                f"{what}: cudaHostRegister of the shared segment ({self._whole.numel()} bytes) "
                f"failed (cudaError {int(err)}); is the memlock limit too low?"
            )
        self.pinned = True

    @classmethod
    def create(
        cls, pool_bytes: int, control_bytes: int, *, what: str, remedy: str = "host_pool_gib"
    ) -> "SharedHostPool":
        """Rank 0: a zero-filled segment of ``pool_bytes`` + a control block (touched lazily);
        ``remedy``: what to lower when the RAM cannot hold it."""
        for name, n in (("size", pool_bytes), ("control size", control_bytes)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise HostPoolError(f"{what}: {name} must be a positive number of bytes, got {n!r}")
        available = available_host_bytes()
        if pool_bytes > available - _RESERVE_BYTES:
            raise HostPoolError(
                f"{what}: {pool_bytes / 2**30:.2f} GiB requested but only "
                f"{available / 2**30:.2f} GiB of host RAM is available "
                f"({_RESERVE_BYTES / 2**30:.0f} GiB is kept free); lower {remedy}"
            )
        total = _page_round(pool_bytes) + _page_round(control_bytes)
        fd = os.memfd_create(SEGMENT_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total)
        except OSError:
            os.close(fd)
            raise
        info = SegmentInfo(os.getpid(), fd, pool_bytes, control_bytes, host_key())
        return cls(mm, info, fd)

    @classmethod
    def attach(cls, info: SegmentInfo, *, what: str) -> "SharedHostPool":
        """Another rank: map rank 0's segment. Fails with one line if it cannot be opened (another
        host, rank 0 gone, or /proc/<pid>/fd not readable)."""
        if info.host != host_key():
            raise HostPoolError(f"{what}: TP rank 0 runs on another host ({info.host})")
        total = _page_round(info.pool_bytes) + _page_round(info.control_bytes)
        try:
            fd = os.open(info.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise HostPoolError(f"{what}: cannot open TP rank 0's segment {info.path}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise HostPoolError(f"{what}: {info.path} holds {size} bytes, expected {total}")
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        return cls(mm, info, None)

    def close_fd(self) -> None:
        """Rank 0, once every rank has mapped the segment: from now on only the mappings hold
        it, so it is freed with the last of them."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Drop this process's mapping (safe to call twice). The memory is freed once every
        rank has released it or exited."""
        self.close_fd()
        if self._mm is None:
            return
        if self.pinned:  # the GPUs must be done with it first (never on the decode path)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._whole.data_ptr())
            self.pinned = False
        self.raw = self._whole = None
        self.control.release()
        self.control = None
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass  # views bound into ``raw`` still exist: unmapped when the last one goes

    @property
    def released(self) -> bool:
        return self._mm is None
