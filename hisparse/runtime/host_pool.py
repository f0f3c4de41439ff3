"""The host pool: one packed raw allocation in (pinned) host memory holding every layer's KV."""

from __future__ import annotations

import os
import weakref

import torch

# Leave this much of the available RAM to the rest of the process and the OS.
_RESERVE_BYTES = 1 << 30


class HostPointer:
    """Pinned host memory as Triton takes a device pointer (page-locked host memory is mapped at
    the same address on the device), under the dtype Triton should read it as."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._ptr = address

    def data_ptr(self) -> int:
        return self._ptr


class HostPoolError(ValueError):
    """The host pool cannot be allocated as configured."""


def available_host_bytes() -> int:
    """Bytes of RAM the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _unpin(raw: torch.Tensor) -> None:
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())


class HostPool:
    """A raw uint8 allocation (`raw`), page-locked when `pin`; layers are bound into it by
    offset. Views bound into `raw` must not be used after `release()`."""

    def __init__(
        self, num_bytes: int, *, pin: bool, what: str = "host pool", remedy: str = "host_pool_gib"
    ) -> None:
        """``remedy``: what to lower when the RAM cannot hold the pool (the setting that sized
        it)."""
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
            raise HostPoolError(
                f"{what}: size must be a positive number of bytes, got {num_bytes!r}"
            )
        available = available_host_bytes()
        if num_bytes > available - _RESERVE_BYTES:
            raise HostPoolError(
                f"{what}: {num_bytes / 2**30:.2f} GiB requested but only "
                f"{available / 2**30:.2f} GiB of host RAM is available "
                f"({_RESERVE_BYTES / 2**30:.0f} GiB is kept free); lower {remedy}"
            )
        if pin and not torch.cuda.is_available():
            raise HostPoolError(f"{what}: pinned memory needs a CUDA device; use pin=False on CPU")
        self.num_bytes = num_bytes
        self.pinned = False
        self.raw: torch.Tensor | None = torch.empty(num_bytes, dtype=torch.uint8)
        if pin:
            # Page-lock exactly these bytes: torch's pinned allocator rounds a request up to a
            # power of two, which for a 40 GiB pool would lock 64 GiB.
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.raw.data_ptr(), num_bytes, 0)
            if int(err) != 0:
                self.raw = None
                raise HostPoolError(
                    f"{what}: cudaHostRegister of {num_bytes} bytes failed "
                    f"(cudaError {int(err)}); is the memlock limit too low?"
                )
            self.pinned = True
            # A pool dropped without release() must not free memory the driver still has
            # registered: a later allocation at the same addresses would then fail its copies
            # ("invalid argument"). The finalizer holds the allocation until it is unpinned.
            self._unpin = weakref.finalize(self, _unpin, self.raw)
            self._unpin.atexit = False  # the process is going; the driver drops it anyway

    def release(self) -> None:
        """Unpin and drop the allocation (safe to call twice). The GPU must be done with it:
        pending work is synchronised first, since this is never on the decode path."""
        if self.raw is None:
            return
        if self.pinned:
            self._unpin()
            self.pinned = False
        self.raw = None

    @property
    def released(self) -> bool:
        return self.raw is None
