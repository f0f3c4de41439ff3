"""The flags of a shared host pool (``pool_fence``) written and waited for by the GPUs: the TP
ranks of one host share one pinned pool on CUDA with no host sync in the decode step.

The protocol is the CPU path's: rank 0 writes each layer's rows and then ``written[layer] =
step``; a reader waits for that flag where it would have written the rows, and sets ``done[rank]
= step`` once it has read everything of the step; rank 0 waits for every reader's ``done`` of
the last step before it writes. Here each of these is a one-thread kernel on the stream that
writes or reads the rows (``fence_kernels``), and the step count lives on the device: each rank
advances its own counter at the start of a step, so the ranks' counts agree and a captured step
replays with the right values.

A wait cannot raise on the host, so faults reach the host through the control block: a rank
whose wait timed out sets ``abort`` (every rank's waits then give up) and its status; a
watchdog thread in every rank polls its status and checks that its peers' processes still live
(a dead rank: it sets ``abort`` so no wait spins forever). A failed wait is reported by
``on_fault(message)``, one line; the connector's ``on_fault`` logs it and leaves the TP group,
as the CPU path does.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch

from hisparse.runtime import fence_kernels
from hisparse.runtime.pool_fence import PoolFence, _alive

# How often the watchdog looks at its status (s), and at its peers' processes.
_POLL_S = 0.05
_PEERS_S = 0.5
# abort = (reason << 16) | (1 + the rank at fault)
_GONE, _STALLED = 1, 2


class DeviceFence:
    """One rank's side of the flags on CUDA. ``fence``: the rank's ``PoolFence`` over the same
    control block (it did the handshake and holds the pids); ``control_address``: the block's
    address, page-locked with the pool. Methods enqueue on the current stream of ``device``."""

    def __init__(
        self,
        fence: PoolFence,
        control_address: int,
        device: torch.device,
        *,
        on_fault: Callable[[str], None],
        timeout: Optional[float] = None,
    ) -> None:
        if fence_kernels.triton is None:
            raise RuntimeError("a host pool shared on CUDA needs Triton (pip install triton)")
        self.fence = fence
        self.rank, self.world = fence.rank, fence.world
        self.timeout = fence.timeout if timeout is None else timeout
        self._base = control_address
        self._step = torch.zeros(1, dtype=torch.int64, device=device)
        self._on_fault = on_fault
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watchdog, name="hisparse-fence", daemon=True)

    def start(self) -> None:
        """Start the watchdog, once every rank has joined (a peer's pid is known)."""
        self._watch.start()

    @property
    def writer(self) -> bool:
        return self.rank == 0

    @property
    def step_counter(self) -> torch.Tensor:
        """The device's step count (int64 [1]), advanced by ``begin_step``."""
        return self._step

    def _addr(self, flag: int) -> int:
        return self._base + PoolFence.byte_offset(flag)

    def _wait(self, flag: int, offset: int, peer: int, what: int) -> None:
        fence_kernels.wait(
            self._addr(flag),
            self._step,
            offset,
            abort_address=self._addr(self.fence.abort_flag),
            status_address=self._addr(self.fence.status_flag(self.rank)),
            what=what,
            abort_value=(_STALLED << 16) | (1 + peer),
            timeout_ns=int(self.timeout * 1e9),
        )

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """Count the step; rank 0's stream then waits until every reader finished the last."""
        self._step.add_(1)
        if self.writer:
            for r in range(1, self.world):
                self._wait(self.fence.done_flag(r), -1, r, -1 - r)

    def layer_written(self, layer: int) -> None:
        """Rank 0, after the layer's row writes on this stream: flag them."""
        fence_kernels.signal(self._addr(self.fence.written_flag(layer)), self._step)

    def wait_layer(self, layer: int) -> None:
        """A reader: this stream waits until rank 0 has flagged the layer's rows of this step."""
        self._wait(self.fence.written_flag(layer), 0, 0, layer)

    def end_step(self) -> None:
        """A reader, after its last read of the step on this stream: say so."""
        if not self.writer:
            fence_kernels.signal(self._addr(self.fence.done_flag(self.rank)), self._step)

    # --------------------------------------------------------------- watchdog
    def close(self) -> None:
        """Stop the watchdog (before the pool is released; safe to call twice)."""
        self._stop.set()
        if self._watch.is_alive() and self._watch is not threading.current_thread():
            self._watch.join(2 * _POLL_S + 1)

    def _watchdog(self) -> None:
        get = self.fence._get
        status = self.fence.status_flag(self.rank)
        last = time.monotonic()
        while not self._stop.wait(_POLL_S):
            code = get(status)
            if code:
                self._stop.set()
                self._on_fault(self._message(code, get(status + 1), get(status + 2)))
                return
            if time.monotonic() - last >= _PEERS_S:
                last = time.monotonic()
                self._check_peers()

    def _check_peers(self) -> None:
        for peer in range(self.world):
            pid = self.fence.pid(peer)
            if peer != self.rank and pid and not _alive(pid):
                if not self.fence._get(self.fence.abort_flag):
                    self.fence._set(self.fence.abort_flag, (_GONE << 16) | (1 + peer))
                return

    def _message(self, code: int, step: int, what: int) -> str:
        if what >= 0:
            peer, at = 0, f"layer {what}"
        else:
            peer, at = -1 - what, "a step"
        where = f"HiSparse shared host pool: TP rank {self.rank} waited for rank {peer}"
        pid = self.fence.pid(peer)
        if code == fence_kernels.TIMED_OUT:
            return f"{where} for {self.timeout:.0f} s at step {step} ({at}); is that rank stalled?"
        abort = self.fence._get(self.fence.abort_flag)
        reason, culprit = abort >> 16, (abort & 0xFFFF) - 1
        if reason == _GONE:
            why = f"rank {culprit} (pid {self.fence.pid(culprit)}) is gone"
        else:
            why = f"rank {culprit} stopped responding (another rank's wait timed out)"
        return f"{where} (pid {pid}) at step {step} ({at}) and gave up: {why}"
