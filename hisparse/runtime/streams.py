"""Stream switches and cross-stream waits on the decode path, with less host time than
``torch.cuda.stream`` / ``Stream.wait_stream``.

Why: each connector call per layer switches to its group's copy stream and orders it after the
compute stream. ``torch.cuda.stream(s)`` looks the current device up through the CUDA runtime
on every entry, and ``wait_stream`` creates a new event each call; on the H200 host these were
a large share of the ~100 µs a per-layer call took. Here the device index is known, the stream
is set directly, and the caller keeps one event per ordering and records it again each time
(a wait is enqueued when it is called, so reusing the event is safe).
"""

from __future__ import annotations

import torch


class on_stream:
    """``with on_stream(s):`` work goes to ``s``; the device's previous stream comes back after."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def __enter__(self) -> torch.cuda.Stream:
        self.prev = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.prev)


def wait_for(waiter: torch.cuda.Stream, producer: torch.cuda.Stream, event) -> None:
    """``waiter`` runs nothing more until the work queued on ``producer`` so far is done."""
    event.record(producer)
    waiter.wait_event(event)


def current(device: torch.device) -> torch.cuda.Stream:
    """The current stream of ``device`` (which must carry its index)."""
    return torch.cuda.current_stream(device.index)
