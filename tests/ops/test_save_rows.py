"""hisparse_save_rows: the C++ CPU op against the oracle, its argument checks, its schema and
fake kernel, and (CUDA build on a GPU) the CUDA op against the CPU op bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse import ops
from tests import oracle
from tests.devices import host_side, needs_cuda

I32 = torch.int32


def _i32(x):
    return torch.tensor(x, dtype=I32).reshape(len(x))


@st.composite
def save_cases(draw):
    L = draw(st.integers(1, 4))
    row_bytes = draw(st.sampled_from([16, 32, 48]))
    block_size = draw(st.sampled_from([1, 2, 4]))
    src_blocks = draw(st.integers(1, 5))
    host_blocks = draw(st.integers(1, 6))
    N = draw(st.integers(0, 8))
    n_src, n_host = src_blocks * block_size, host_blocks * block_size
    src_rows = draw(st.lists(st.integers(-2, n_src + 1), min_size=N, max_size=N))
    # host rows distinct among entries that are copied (the op's contract)
    host_rows = draw(st.lists(st.integers(-2, n_host + 1), min_size=N, max_size=N))
    seen = set()
    for i, (s, d) in enumerate(zip(src_rows, host_rows)):
        if 0 <= s < n_src and 0 <= d < n_host:
            if d in seen:
                host_rows[i] = -1
            seen.add(d)
    return L, row_bytes, block_size, src_blocks, host_blocks, src_rows, host_rows


@settings(max_examples=200, deadline=None)
@given(save_cases(), st.integers(0, 2**31))
def test_save_rows_matches_oracle(case, seed):
    L, row_bytes, block_size, src_blocks, host_blocks, src_rows, host_rows = case
    g = torch.Generator().manual_seed(seed)
    srcs = [
        torch.randint(0, 256, (src_blocks, block_size, row_bytes), dtype=torch.uint8, generator=g)
        for _ in range(L)
    ]
    hosts = [
        torch.randint(0, 256, (host_blocks * block_size, row_bytes), dtype=torch.uint8, generator=g)
        for _ in range(L)
    ]
    expected, expected_moved = [], 0
    for src, host in zip(srcs, hosts):
        s_rows = [bytes(r) for r in src.reshape(-1, row_bytes).tolist()]
        h_rows = [bytes(r) for r in host.tolist()]
        expected_moved += oracle.save_rows(s_rows, h_rows, src_rows, host_rows)
        expected.append(h_rows)
    moved = torch.full((1,), 5, dtype=torch.uint64)
    ops.save_rows(srcs, hosts, _i32(src_rows), _i32(host_rows), moved)
    for host, h_rows in zip(hosts, expected):
        assert [bytes(r) for r in host.tolist()] == h_rows
    assert int(moved[0]) == 5 + expected_moved


def test_save_rows_many_layers_strided_views(device):
    """Layer-interleaved packing on both sides, more layers than one CUDA launch takes."""
    g = torch.Generator().manual_seed(1)
    L, rows, row_bytes = 70, 40, 32
    src_raw = torch.randint(0, 256, (rows, L, row_bytes), dtype=torch.uint8, generator=g)
    host_raw = host_side(torch.zeros(rows * 2, L, row_bytes, dtype=torch.uint8), device)
    src_dev = src_raw.to(device)
    src = [src_dev[:, l] for l in range(L)]
    hosts = [host_raw[:, l] for l in range(L)]
    src_rows = _i32([0, 5, 39, -1, 40, 7]).to(device)
    host_rows = _i32([79, 0, 3, 4, 5, -3]).to(device)
    moved = torch.zeros(1, dtype=torch.uint64, device=device)
    ops.save_rows(src, hosts, src_rows, host_rows, moved)
    if device != "cpu":
        torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(host_raw[79, l], src_raw[0, l])
        assert torch.equal(host_raw[0, l], src_raw[5, l])
        assert torch.equal(host_raw[3, l], src_raw[39, l])
    assert int(host_raw.sum()) == int(src_raw[[0, 5, 39]].sum())
    assert moved.cpu().tolist() == [3 * L * row_bytes]


def _save_args(device="cpu"):
    src = [torch.zeros(8, 32, dtype=torch.uint8, device=device)]
    hosts = [host_side(torch.zeros(4, 2, 32, dtype=torch.uint8), device)]
    return dict(
        src=src,
        host=hosts,
        src_rows=_i32([1, 2]).to(device),
        host_rows=_i32([3, 4]).to(device),
        moved_bytes=torch.zeros(1, dtype=torch.uint64, device=device),
    )


def _call(a):
    ops.save_rows(a["src"], a["host"], a["src_rows"], a["host_rows"], a["moved_bytes"])


def _u8(d, *shape, dtype=torch.uint8):
    return torch.zeros(*shape, dtype=dtype, device=d)


# (argument, how to break the arguments on a device, expected message fragment)
BAD = [
    ("src", lambda a, d: a.update(src=[]), "argument 'src' must list at least one view"),
    ("host", lambda a, d: a.update(host=a["host"] * 2), "arguments 'src' and 'host' must have"),
    (
        "src_rows",
        lambda a, d: a.update(src_rows=a["src_rows"].long()),
        "argument 'src_rows' must be",
    ),
    (
        "src_rows",
        lambda a, d: a.update(src_rows=a["src_rows"].view(1, 2)),
        "argument 'src_rows' must be 1-D",
    ),
    (
        "host_rows",
        lambda a, d: a.update(host_rows=_i32([1, 2, 3]).to(d)),
        "argument 'host_rows' must have shape",
    ),
    (
        "host_rows",
        lambda a, d: a.update(host_rows=a["host_rows"].to(torch.int16)),
        "argument 'host_rows' must be torch.int32",
    ),
    (
        "moved_bytes",
        lambda a, d: a.update(moved_bytes=_u8(d, 2, dtype=torch.uint64)),
        "argument 'moved_bytes' must have shape",
    ),
    (
        "moved_bytes",
        lambda a, d: a.update(moved_bytes=_u8(d, 1, dtype=torch.int64)),
        "argument 'moved_bytes' must be torch.uint64",
    ),
    (
        "src[0]",
        lambda a, d: a.update(src=[_u8(d, 8, 33)]),
        "argument 'src[0]' row size must be a positive multiple of 16",
    ),
    (
        "src[0]",
        lambda a, d: a.update(src=[_u8(d, 8, 32, dtype=torch.float32)]),
        "argument 'src[0]' must be torch.uint8",
    ),
    (
        "host[0]",
        lambda a, d: a.update(host=[host_side(_u8("cpu", 8, 16), d)]),
        "arguments 'src[0]' and 'host[0]' must have the same row size",
    ),
    (
        "host[0]",
        lambda a, d: a.update(host=[host_side(_u8("cpu", 8, 2, 64), d)[:, :, ::2]]),
        "argument 'host[0]' must have last stride 1",
    ),
]


@pytest.mark.parametrize("i", range(len(BAD)), ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_save_rows_rejects_bad_argument(device, i):
    name, breaker, fragment = BAD[i]
    a = _save_args(device)
    hosts = a["host"]
    before = [h.clone() for h in hosts]
    breaker(a, device)
    with pytest.raises(RuntimeError) as e:
        _call(a)
    msg = str(e.value)
    assert msg.startswith("hisparse_save_rows") and fragment in msg, msg
    for h, b in zip(hosts, before):  # nothing was written before the check
        assert torch.equal(h, b)


def test_save_rows_schema():
    schema = torch.ops.hisparse.hisparse_save_rows.default._schema
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == [
        "host",
        "moved_bytes",
    ]


@pytest.mark.parametrize("test_utils", ["test_schema", "test_faketensor"])
def test_save_rows_opcheck(device, test_utils):
    """The mutation marks and the fake kernel on both backends. opcheck runs the op on deep
    copies, and a copy of a pinned tensor is pageable: on CUDA the host views live on the device
    (which the CUDA backend also takes)."""
    a = _save_args(device)
    hosts = [h.to(device) for h in a["host"]]
    torch.library.opcheck(
        torch.ops.hisparse.hisparse_save_rows.default,
        (a["src"], hosts, a["src_rows"], a["host_rows"], a["moved_bytes"]),
        test_utils=test_utils,
    )


# --------------------------------------------------------------------------------------------
# CUDA against the CPU op
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "L,row_bytes,block_size,N",
    [(1, 656, 16, 256), (4, 1152, 64, 300), (61, 656, 1, 256), (3, 48, 2, 5)],
)
@pytest.mark.parametrize("host_on_device", [False, True])
def test_save_rows_cuda_matches_cpu(L, row_bytes, block_size, N, host_on_device):
    g = torch.Generator().manual_seed(L * 7 + N)
    src_blocks, host_rows_n = 64, 4096
    src_cpu = torch.randint(
        0, 256, (src_blocks, L, block_size, row_bytes), dtype=torch.uint8, generator=g
    )
    host_cpu = torch.randint(0, 256, (host_rows_n, L, row_bytes), dtype=torch.uint8, generator=g)
    src_gpu = src_cpu.cuda()
    host_other = host_cpu.cuda() if host_on_device else host_cpu.clone().pin_memory()
    src_rows = torch.randint(
        -2, src_blocks * block_size + 2, (N,), generator=g, dtype=torch.int64
    ).to(I32)
    host_rows = (torch.randperm(host_rows_n + 4, generator=g)[:N] - 2).to(I32)
    moved_cpu = torch.zeros(1, dtype=torch.uint64)
    moved_gpu = torch.zeros(1, dtype=torch.uint64, device="cuda")
    ops.save_rows(
        [src_cpu[:, l] for l in range(L)],
        [host_cpu[:, l] for l in range(L)],
        src_rows,
        host_rows,
        moved_cpu,
    )
    ops.save_rows(
        [src_gpu[:, l] for l in range(L)],
        [host_other[:, l] for l in range(L)],
        src_rows.cuda(),
        host_rows.cuda(),
        moved_gpu,
    )
    torch.cuda.synchronize()
    assert torch.equal(host_other.cpu(), host_cpu)
    assert moved_gpu.cpu().tolist() == moved_cpu.tolist()
    assert moved_cpu.tolist()[0] > 0


@pytest.mark.cuda
@needs_cuda
def test_save_rows_cuda_rejects_unpinned_host_and_graph_captures():
    src = [torch.randint(0, 256, (64, 656), dtype=torch.uint8, device="cuda")]
    host = [torch.zeros(128, 656, dtype=torch.uint8)]
    rows = torch.arange(8, dtype=I32, device="cuda")
    with pytest.raises(RuntimeError, match=r"hisparse_save_rows: argument 'host\[0\]'.*pinned"):
        ops.save_rows(src, host, rows, rows)
    host = [host[0].pin_memory()]
    moved = torch.zeros(1, dtype=torch.uint64, device="cuda")
    dst = torch.zeros(8, dtype=I32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.save_rows(src, host, rows, dst, moved)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.save_rows(src, host, rows, dst, moved)
    dst.copy_(torch.arange(100, 108, dtype=I32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(host[0][100:108], src[0][:8].cpu())
    assert moved.cpu().tolist() == [(8 + 8) * 656]


def test_save_rows_fake_kernel_refuses_a_meta_tensor_among_real_ones():
    """Like the other three ops, save_rows has a fake kernel: a meta tensor among CPU ones lands
    there (the dispatcher picks Meta) and is refused by name instead of passing silently."""
    a = _save_args("cpu")
    with pytest.raises(RuntimeError, match="argument 'host_rows' must be on cpu"):
        torch.ops.hisparse.hisparse_save_rows(
            a["src"], a["host"], a["src_rows"], a["host_rows"].to("meta"), a["moved_bytes"]
        )
