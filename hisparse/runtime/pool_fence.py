"""Orders the writes and reads of a host pool that the TP ranks share (``shared_pool``).

Every rank runs the same steps and, within a step, the same layers at about the same time. Rank
0 writes each layer's new rows; the other ranks read them (prefill attention, gathers into their
own hot buffers) right after. Two flags per step keep that safe, in int64 slots of the segment's
control block:

* ``written[layer] = step`` once rank 0 has written the layer's rows of the step; a reader waits
  for it before it touches the layer's rows (``wait_layer``, where it would have written them);
* ``done[rank] = step`` once a reader finished the step; rank 0 waits for every reader to have
  finished the previous step before it writes anything (``begin_step``): a row it overwrites
  (a reused block) is never one a reader still reads.

Steps are counted by each rank itself (``begin_step``); the ranks see the same sequence of steps,
so the counts agree. Ordering relies on x86-64's store order (TSO): rank 0's row stores are plain
stores issued before the flag's, and a reader loads the flag before the rows; Python cannot place
the fences other CPUs would need, so the pool is shared on x86-64 only (``SHARED_POOL_ARCH``).
A peer that exits while another waits for it fails the waiter with one line; so does a wait past
``timeout`` seconds.

Rank 0 records in the block's header what every rank must agree on: the world size, the layer
count, the pool's size and each layer's row bytes. A reader that disagrees, a rank outside
``[0, world)`` or a rank another live process already claimed is refused when it attaches
(``PoolMismatchError``, one line naming both values): otherwise it would read rows at the wrong
places, or write its pid into another rank's flag and leave rank 0 waiting out ``timeout``.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Optional, Sequence

#: CPU architectures whose store order makes the flags safe without explicit fences.
SHARED_POOL_ARCH = ("x86_64", "AMD64")
_SLOT = 8  # int64 slots per flag: one 64-byte cache line each, so flags never share a line
# Header flags: [magic, world, layers, pool bytes]; then pids[world], written[layers],
# done[world], row_bytes[layers]; then what the GPU path adds (``device_fence``): abort, and
# status[world] of 3 flags each (code, step, what).
_HEADER = 4
_MAGIC = 0x48695370  # "HiSp"
# Spin this long before yielding the core: a rank that waits for another at the same layer
# usually waits for a few row copies (microseconds).
_SPIN_S = 50e-6
_YIELD_S = 2e-3
_SLEEP_S = 200e-6


def arch_shares_pool() -> bool:
    return platform.machine() in SHARED_POOL_ARCH


def control_bytes(world: int, num_layers: int) -> int:
    """Bytes of the control block for ``world`` ranks and ``num_layers`` layers."""
    return (_HEADER + 5 * world + 2 * num_layers + 1) * _SLOT * 8


class FenceError(RuntimeError):
    """A rank waited for another that is gone or stalled past the timeout."""


class PoolMismatchError(ValueError):
    """A rank may not use the shared pool: its settings differ from TP rank 0's, or its rank is
    out of range or taken. Not a reason to fall back to a pool per rank: the ranks disagree."""


class PoolFence:
    """One rank's side of the flags in ``control`` (an int64 memoryview of the control block).
    ``row_bytes`` (each layer's row size) and ``pool_bytes`` (the pool's size), as this rank
    binds them, are compared with rank 0's where both ranks give them."""

    def __init__(
        self,
        control: memoryview,
        rank: int,
        world: int,
        num_layers: int,
        timeout: float = 1800.0,
        *,
        row_bytes: Optional[Sequence[int]] = None,
        pool_bytes: Optional[int] = None,
    ) -> None:
        if not 0 <= rank < world:
            raise PoolMismatchError(
                f"HiSparse shared host pool: TP rank {rank} is outside [0, {world}) "
                f"(world size {world})"
            )
        row_bytes = tuple(row_bytes) if row_bytes is not None else (0,) * num_layers
        if len(row_bytes) != num_layers:
            raise ValueError(f"row_bytes has {len(row_bytes)} entries for {num_layers} layers")
        self._c = control
        self.rank, self.world, self.num_layers = rank, world, num_layers
        self.timeout = timeout
        self.step = 0
        self._pids = _HEADER
        self._written = _HEADER + world
        self._done = _HEADER + world + num_layers
        self._rows = _HEADER + 2 * world + num_layers
        self.abort_flag = _HEADER + 2 * world + 2 * num_layers
        if len(control) < _HEADER * _SLOT:
            raise ValueError(f"control block of {len(control)} slots is too small")
        mine = (world, num_layers, pool_bytes or 0)  # 0: not given
        if rank == 0:
            self._check_size()
            for i, v in enumerate(row_bytes):
                self._set(self._rows + i, v)
            for flag, v in enumerate(mine, start=1):
                self._set(flag, v)
            self._set(0, _MAGIC)  # last: a reader finds the block whole or not set up
        else:
            self._check_against_writer(mine, row_bytes)
        self._set(self._pids + rank, os.getpid())

    def _check_size(self) -> None:
        if len(self._c) < control_bytes(self.world, self.num_layers) // 8:
            raise ValueError(f"control block of {len(self._c)} slots is too small")

    def _check_against_writer(self, mine: tuple, row_bytes: Sequence[int]) -> None:
        """A reader: the header rank 0 wrote must say what this rank would have written."""
        if self._get(0) != _MAGIC:
            raise ValueError("the shared pool's control block was not set up by TP rank 0")
        where = f"HiSparse shared host pool: TP rank {self.rank} has"
        for what, here, flag in zip(("world size", "layers"), mine, (1, 2)):
            if here != self._get(flag):
                raise PoolMismatchError(
                    f"{where} {what} {here}, TP rank 0 (the writer) {self._get(flag)}"
                )
        self._check_size()  # the counts agree: the block is rank 0's size for them
        # Row sizes before the pool's: they explain a pool size that differs with them.
        for i, here in enumerate(row_bytes):
            theirs = self._get(self._rows + i)
            if here != theirs and here and theirs:
                raise PoolMismatchError(
                    f"{where} {here}-byte rows in layer {i}, TP rank 0 (the writer) {theirs}"
                )
        if mine[2] != self._get(3) and mine[2] and self._get(3):
            raise PoolMismatchError(
                f"{where} pool bytes {mine[2]}, TP rank 0 (the writer) {self._get(3)}"
            )
        holder = self._get(self._pids + self.rank)
        if holder not in (0, os.getpid()) and _alive(holder):
            raise PoolMismatchError(
                f"{where} rank {self.rank}, which pid {holder} (alive) already holds"
            )

    @property
    def writer(self) -> bool:
        return self.rank == 0

    # Where the GPU path (``device_fence``) finds the flags: byte offsets into the block.
    def written_flag(self, layer: int) -> int:
        return self._written + self._layer(layer)

    def done_flag(self, rank: int) -> int:
        return self._done + rank

    def status_flag(self, rank: int) -> int:
        return self.abort_flag + 1 + 3 * rank

    @staticmethod
    def byte_offset(flag: int) -> int:
        return flag * _SLOT * 8

    def pid(self, rank: int) -> int:
        return self._get(self._pids + rank)

    def _get(self, flag: int) -> int:
        return self._c[flag * _SLOT]

    def _set(self, flag: int, value: int) -> None:
        self._c[flag * _SLOT] = value  # one aligned 8-byte store

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """Count the step; rank 0 first waits until every reader has finished the last one."""
        self.step += 1
        if self.writer:
            for r in range(1, self.world):
                self._wait(lambda r=r: self._get(self._done + r) >= self.step - 1, r, "a step")

    def layer_written(self, layer: int) -> None:
        """Rank 0: the layer's rows of this step are in the pool."""
        self._set(self._written + self._layer(layer), self.step)

    def wait_layer(self, layer: int) -> None:
        """A reader: return once rank 0 has written the layer's rows of this step."""
        flag = self._written + self._layer(layer)
        self._wait(lambda: self._get(flag) >= self.step, 0, f"layer {layer}")

    def end_step(self) -> None:
        """A reader: done with every row of this step."""
        if not self.writer:
            self._set(self._done + self.rank, self.step)

    # ---------------------------------------------------------------- helpers
    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        return layer

    def _wait(self, ready, peer: int, what: str) -> None:
        if ready():
            return
        start = last = time.perf_counter()
        while not ready():
            now = time.perf_counter()
            if now - start < _SPIN_S:
                continue
            if now - start < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(_SLEEP_S)
            if now - last > 0.5:
                last = now
                self._check_peer(peer, what, now - start)

    def _check_peer(self, peer: int, what: str, waited: float) -> None:
        pid = self._get(self._pids + peer)
        where = f"HiSparse shared host pool: TP rank {self.rank} waited for rank {peer}"
        if not _alive(pid):
            raise FenceError(f"{where} (pid {pid}), which is gone, at step {self.step} ({what})")
        if waited > self.timeout:
            raise FenceError(
                f"{where} for {waited:.0f} s at step {self.step} ({what}); is that rank stalled?"
            )


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead rank its parent has not reaped yet)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
