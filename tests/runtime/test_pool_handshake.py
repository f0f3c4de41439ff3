"""The shared pool's handshake (``pool_fence``): rank 0 records the world size, the layer count,
the pool's size and each layer's row bytes; a reader that disagrees, a rank outside
``[0, world)`` or a rank another live process holds is refused at attach, in one line naming
both values, before it writes anything into the control block."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hisparse.runtime.pool_fence import PoolFence, PoolMismatchError, control_bytes
from hisparse.runtime.shared_pool import SharedHostPool

MIB = 1 << 20
WHAT = "test pool"
ROWS = (656, 656, 1152)  # three layers, one of another layout


@pytest.fixture
def writer():
    """Rank 0's pool (3 layers, world 2) and a second mapping of it for the reader."""
    p0 = SharedHostPool.create(MIB, control_bytes(2, len(ROWS)), what=WHAT)
    f0 = PoolFence(p0.control, 0, 2, len(ROWS), row_bytes=ROWS, pool_bytes=MIB)
    p1 = SharedHostPool.attach(p0.info, what=WHAT)
    p0.close_fd()
    yield p0, f0, p1
    p1.release()
    p0.release()


def _refused(p1, match: str, rank=1, world=2, layers=3, rows=ROWS, pool_bytes=MIB) -> str:
    before = bytes(p1.control)
    with pytest.raises(PoolMismatchError, match=match) as e:
        PoolFence(p1.control, rank, world, layers, row_bytes=rows, pool_bytes=pool_bytes)
    assert bytes(p1.control) == before  # no pid written, no flag touched
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("HiSparse shared host pool: TP rank")
    return msg


def test_a_reader_that_agrees_attaches(writer):
    _, f0, p1 = writer
    f1 = PoolFence(p1.control, 1, 2, 3, row_bytes=list(ROWS), pool_bytes=MIB)
    f0.begin_step(), f1.begin_step()
    f0.layer_written(2)
    f1.wait_layer(2)


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(layers=4, rows=ROWS + (656,)), r"rank 1 has layers 4, TP rank 0 \(the writer\) 3$"),
        (dict(layers=2, rows=ROWS[:2]), r"has layers 2, TP rank 0 \(the writer\) 3$"),
        (dict(world=3), r"has world size 3, TP rank 0 \(the writer\) 2$"),
        (dict(pool_bytes=2 * MIB), rf"has pool bytes {2 * MIB}, TP rank 0 \(the writer\) {MIB}$"),
        (
            dict(rows=(656, 1152, 1152)),
            r"has 1152-byte rows in layer 1, TP rank 0 \(the writer\) 656$",
        ),
    ],
    ids=["more-layers", "fewer-layers", "world", "pool-bytes", "row-bytes"],
)
def test_a_reader_that_disagrees_is_refused_naming_both_values(writer, over, match):
    _refused(writer[2], match, **over)


@pytest.mark.parametrize("rank, world", [(5, 2), (2, 2), (-1, 2)])
def test_a_rank_outside_the_world_is_refused(writer, rank, world):
    msg = _refused(writer[2], r"is outside \[0, 2\) \(world size 2\)$", rank=rank, world=world)
    assert f"TP rank {rank} " in msg


def test_a_rank_another_live_process_holds_is_refused(writer):
    _, _, p1 = writer
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        flags = PoolFence(p1.control, 1, 2, 3, row_bytes=ROWS, pool_bytes=MIB)
        flags._set(flags._pids + 1, other.pid)  # as if another process had attached as rank 1
        msg = _refused(p1, rf"has rank 1, which pid {other.pid} \(alive\) already holds$")
        assert "TP rank 1" in msg
    finally:
        other.kill()
        other.wait()
    PoolFence(p1.control, 1, 2, 3, row_bytes=ROWS, pool_bytes=MIB)  # its holder is gone


def test_the_writer_refuses_a_rank_outside_the_world_too():
    p = SharedHostPool.create(MIB, control_bytes(2, 1), what=WHAT)
    try:
        with pytest.raises(PoolMismatchError, match=r"TP rank 0 is outside \[0, 0\)"):
            PoolFence(p.control, 0, 0, 1)
        with pytest.raises(ValueError, match="row_bytes has 2 entries for 1 layers"):
            PoolFence(p.control, 0, 2, 1, row_bytes=(656, 656))
    finally:
        p.release()


def test_sizes_left_out_are_not_compared(writer):
    """A caller that gives no row or pool sizes is checked on the counts alone."""
    _refused(writer[2], r"has layers 4", layers=4, rows=None, pool_bytes=None)
    PoolFence(writer[2].control, 1, 2, 3)
