"""Experiment (leaves the tree after): does the host page size of the pinned pools set the rate
of one step's misses' gather over a 19 GB host range? Torch-pinned pools against the CUDA VMM
host allocation (cuMemCreate, location HOST) and hugetlbfs 2 MiB / 1 GiB pages registered with
cudaHostRegister. One Triton gather for all, and the op's gather on the torch-pinned pools."""

import ctypes
import json
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

import hisparse.ops as ops
from hisparse.runtime.host_pool import HostPointer

ROW, W = 656, 164
B, M, L, REGION = 112, 95, 8, 32768 + 64
POOL = B * REGION * ROW


@triton.jit
def _gather(host, hot, src, dst, cnt, K, W: tl.constexpr, BR: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1) * BR + tl.arange(0, BR)
    ok = j < tl.load(cnt + b)
    s = tl.load(src + b * K + j, mask=ok, other=0).to(tl.int64)
    d = tl.load(dst + b * K + j, mask=ok, other=0).to(tl.int64)
    w = tl.arange(0, 256)
    m = ok[:, None] & (w < W)[None, :]
    v = tl.load(host + s[:, None] * W + w[None, :], mask=m)
    tl.store(hot + d[:, None] * W + w[None, :], v, mask=m)


def plans(n, g):
    out = []
    for _ in range(n):
        src = torch.zeros(B, 2048, dtype=torch.int32)
        dst = torch.zeros(B, 2048, dtype=torch.int32)
        for b in range(B):
            src[b, :M] = (b * REGION + torch.randperm(REGION - 64, generator=g)[:M]).int()
            if os.environ.get("SORTED"):
                src[b, :M] = src[b, :M].sort().values
            dst[b, :M] = (b * 4096 + torch.randperm(4096, generator=g)[:M]).int()
        out.append((src.cuda(), dst.cuda(), torch.full((B,), M, dtype=torch.int32).cuda()))
    return out


def timed(launch, reps=15):
    for i in range(3):
        launch(i)
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launch(i)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / L)
    ts.sort()
    return ts[len(ts) // 2], ts[0], ts[-1]


res = {}


def report(name, addrs, hot, pl):
    hot32 = hot.view(torch.int32)

    def launch(i):
        for l in range(L):
            src, dst, cnt = pl[(i * L + l) % len(pl)]
            _gather[(B, 3)](HostPointer(addrs[l % len(addrs)], torch.int32), hot32, src, dst, cnt, 2048, W, 32, num_warps=4)

    med, lo, hi = timed(launch)
    nb = B * M * ROW
    res[name] = dict(us=med, lo=lo, hi=hi, gbs=nb / med / 1e3)
    print(f"{name:44s} {med:7.1f} us/layer [{lo:.1f}, {hi:.1f}] {nb / med / 1e3:5.1f} GB/s", flush=True)


libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
cu = ctypes.CDLL("libcuda.so.1")


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("loc", Loc), ("win32", ctypes.c_void_p),
                ("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("res", ctypes.c_ubyte * 4)]


class Access(ctypes.Structure):
    _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def vmm_pools(n, loc_type):
    prop = Prop(type=1, handles=0, loc=Loc(loc_type, 0))
    gran = ctypes.c_size_t()
    ck(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1), "granularity(recommended)")
    g0 = ctypes.c_size_t()
    ck(cu.cuMemGetAllocationGranularity(ctypes.byref(g0), ctypes.byref(prop), 0), "granularity(min)")
    print(f"  VMM host loc_type {loc_type}: granularity min {g0.value} recommended {gran.value}", flush=True)
    size = (POOL + gran.value - 1) // gran.value * gran.value
    out, undo = [], []
    for _ in range(n):
        va = ctypes.c_uint64()
        ck(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(gran.value), ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "reserve")
        h = ctypes.c_uint64()
        ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)), "create")
        ck(cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "map")
        acc = (Access * 2)(Access(Loc(1, torch.cuda.current_device()), 3), Access(Loc(3, 0), 3))
        ck(cu.cuMemSetAccess(va, ctypes.c_size_t(size), acc, ctypes.c_size_t(2)), "setaccess(dev+host)")
        ctypes.memset(va.value, 1, size)  # the CPU writes it: host access works
        out.append(va.value)
        undo.append((va, h, size))
    return out, undo


def vmm_free(undo):
    torch.cuda.synchronize()
    for va, h, size in undo:
        cu.cuMemUnmap(va, ctypes.c_size_t(size))
        cu.cuMemRelease(h)
        cu.cuMemAddressFree(va, ctypes.c_size_t(size))


def huge_pools(n, flags, align):
    size = (POOL + align - 1) // align * align
    out, undo = [], []
    for _ in range(n):
        a = libc.mmap(None, size, 3, 0x22 | 0x40000 | flags, -1, 0)
        if a in (None, ctypes.c_void_p(-1).value, 2**64 - 1):
            raise RuntimeError(f"mmap MAP_HUGETLB failed errno {ctypes.get_errno()}")
        ctypes.memset(a, 1, size)
        err = torch.cuda.cudart().cudaHostRegister(a, size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister {err}")
        out.append(a)
        undo.append((a, size))
    return out, undo


def huge_free(undo):
    torch.cuda.synchronize()
    for a, size in undo:
        torch.cuda.cudart().cudaHostUnregister(a)
        libc.munmap(a, size)


def sh(c):
    return subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()


def try_case(name, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        print(f"{name}: {e!r}", flush=True)
        res[name] = dict(error=repr(e))


def main():
    torch.cuda.init()
    print(torch.cuda.get_device_name(), sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader"), flush=True)
    print(sh("grep -i huge /proc/meminfo; id -u"), flush=True)
    g = torch.Generator().manual_seed(0)
    hot = torch.zeros(B * 4096, ROW, dtype=torch.uint8, device="cuda")
    pl = plans(16, g)
    print(f"{L} pools of {POOL / 1e9:.2f} GB, {B * M * ROW / 1e6:.2f} MB per layer", flush=True)

    def torch_pinned():
        pools = [torch.empty(B * REGION, ROW, dtype=torch.uint8, pin_memory=True) for _ in range(L)]
        if not os.environ.get("OP_ONLY"):
            report("torch pinned, 8 pools (triton)", [p.data_ptr() for p in pools], hot, pl)
            report("torch pinned, 1 pool reused (triton)", [pools[0].data_ptr()], hot, pl)
        moved = torch.zeros(1, dtype=torch.uint64, device="cuda")
        n = L

        def launch(i):
            for l in range(L):
                ops.gather([pools[l % n]], [hot], *pl[(i * L + l) % len(pl)], moved)

        ctas = os.environ.get("HISPARSE_PCIE_COPY_CTAS", "default")
        for n in (L, 1):
            med, lo, hi = timed(launch)
            name = f"torch pinned, {n} pools (op, ctas {ctas})"
            res[name] = dict(us=med, lo=lo, hi=hi, gbs=B * M * ROW / med / 1e3)
            print(f"{name:44s} {med:7.1f} us/layer [{lo:.1f}, {hi:.1f}] {B * M * ROW / med / 1e3:5.1f} GB/s", flush=True)
        del pools
        torch._C._host_emptyCache()

    def vmm(loc_type):
        def f():
            addrs, undo = vmm_pools(L, loc_type)
            try:
                report(f"VMM host (type {loc_type}), 8 pools", addrs, hot, pl)
                report(f"VMM host (type {loc_type}), 1 pool reused", addrs[:1], hot, pl)
            finally:
                vmm_free(undo)
        return f

    def huge(label, nr_path, count, flags, align):
        def f():
            try:
                with open(nr_path, "w") as fh:
                    fh.write(str(count))
            except OSError as e:
                raise RuntimeError(f"cannot set {nr_path}: {e}") from e
            print(f"  {nr_path} = {open(nr_path).read().strip()}", flush=True)
            addrs, undo = huge_pools(L, flags, align)
            try:
                report(f"{label}, 8 pools", addrs, hot, pl)
                report(f"{label}, 1 pool reused", addrs[:1], hot, pl)
            finally:
                huge_free(undo)
                open(nr_path, "w").write("0")
        return f

    try_case("torch", torch_pinned)
    if os.environ.get("OP_ONLY"):
        return
    try_case("vmm2", vmm(2))
    try_case("vmm3", vmm(3))
    n2 = L * ((POOL >> 21) + 1)
    try_case("huge2m", huge("hugetlb 2 MiB", "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", n2, 0, 1 << 21))
    n1 = L * ((POOL >> 30) + 1)
    try_case("huge1g", huge("hugetlb 1 GiB", "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages", n1, 30 << 26, 1 << 30))
    if len(sys.argv) > 1:
        json.dump(dict(device=torch.cuda.get_device_name(), results=res), open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
