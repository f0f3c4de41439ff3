"""The GPU side of a shared host pool's flags (``device_fence``): one-thread kernels that write a
flag in the pinned control block, or spin on one until it reaches this step.

Why kernels and not ``cuStreamWriteValue`` / ``cuStreamWaitValue``: those take the value as a
constant, which a captured CUDA graph would replay unchanged, while a flag must carry the step
it belongs to. Here the value comes from a device counter (``step``) that the step itself
advances, so a replayed graph signals and waits for the right step.

Ordering: a signal is ``fence.sc.sys`` then a release store at system scope; it runs after the
rows' copy in stream order, so a reader that sees the flag (acquire load at system scope) and
then reads, in a later kernel of its stream, sees the rows. A wait gives up when the control
block's ``abort`` slot is set (a watchdog saw a rank die) or after ``timeout_ns`` (a stalled
rank; it then sets ``abort`` itself so the other ranks stop waiting too), leaves a status for
the host's watchdog (``[code, step, what]``, code written last) and traps: nothing after it
runs on rows of another step, and the rank's CUDA context is lost (it is leaving anyway).
"""

from __future__ import annotations

import torch

from hisparse.runtime.host_pool import HostPointer

try:  # CUDA machines; a CPU-only install never launches these
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: Status codes a wait leaves in its rank's status slot.
OK, ABORTED, TIMED_OUT = 0, 2, 3

if triton is not None:

    @triton.jit
    def _store_release(ptr, value):
        tl.inline_asm_elementwise(
            "fence.sc.sys; st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;",
            "=r,l,l",
            [ptr, value],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit(do_not_specialize=["offset"])
    def _signal(flag, step, offset):
        _store_release(flag, tl.load(step) + tl.cast(offset, tl.int64))

    @triton.jit(do_not_specialize=["offset", "what", "abort_value", "timeout_ns"])
    def _wait(flag, step, offset, abort, status, what, abort_value, timeout_ns):
        target = tl.load(step) + tl.cast(offset, tl.int64)
        timeout_ns = tl.cast(timeout_ns, tl.int64)
        # 0: the flag reached the target; 2: abort was set; 3: timed out.
        code = tl.inline_asm_elementwise(
            """{
            .reg .b64 %v, %t0, %t;
            .reg .pred %p;
            mov.u64 %t0, %globaltimer;
            HISPARSE_WAIT:
            ld.acquire.sys.global.b64 %v, [$1];
            setp.ge.s64 %p, %v, $2;
            @%p bra HISPARSE_OK;
            ld.acquire.sys.global.b64 %v, [$3];
            setp.ne.s64 %p, %v, 0;
            @%p bra HISPARSE_ABORT;
            mov.u64 %t, %globaltimer;
            sub.s64 %t, %t, %t0;
            setp.gt.s64 %p, %t, $4;
            @%p bra HISPARSE_LATE;
            nanosleep.u32 500;
            bra HISPARSE_WAIT;
            HISPARSE_OK:
            mov.u32 $0, 0;
            bra HISPARSE_END;
            HISPARSE_ABORT:
            mov.u32 $0, 2;
            bra HISPARSE_END;
            HISPARSE_LATE:
            mov.u32 $0, 3;
            HISPARSE_END:
            }""",
            "=r,l,l,l,l",
            [flag, target, abort, timeout_ns],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
        if code != 0:
            tl.store(status + 8, target)
            tl.store(status + 16, tl.cast(what, tl.int64))
            if code == 3:
                _store_release(abort, tl.cast(abort_value, tl.int64))
            _store_release(status, code.to(tl.int64))
            # Nothing after the wait may run: it would read rows of another step. The context
            # is lost; the watchdog reports the status and the rank leaves.
            tl.inline_asm_elementwise(
                "trap; mov.u32 $0, 0;", "=r,r", [code], dtype=tl.int32, is_pure=False, pack=1
            )


def _Address(address: int) -> HostPointer:
    """A flag's pinned host address, read as int64."""
    return HostPointer(address, torch.int64)


def signal(flag_address: int, step, offset: int = 0) -> None:
    """On the current stream: ``*flag = step[0] + offset`` once the stream's earlier work is
    done, visible to every process and device."""
    _signal[(1,)](_Address(flag_address), step, offset, num_warps=1)


def wait(
    flag_address: int,
    step,
    offset: int,
    *,
    abort_address: int,
    status_address: int,
    what: int,
    abort_value: int,
    timeout_ns: int,
) -> None:
    """On the current stream: nothing after this runs until ``*flag >= step[0] + offset``, or
    until the wait gives up (see the module's docstring)."""
    _wait[(1,)](
        _Address(flag_address),
        step,
        offset,
        _Address(abort_address),
        _Address(status_address),
        what,
        abort_value,
        timeout_ns,
        num_warps=1,
    )
