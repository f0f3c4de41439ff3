"""Experiment (leaves the tree after): why eight 2.4 GB pinned pools gather at 28 GB/s where one
gathers at 43. Pools placed on each NUMA node (mbind), with transparent huge pages, the
product's HostPool form (malloc + cudaHostRegister), and eight pools whose gathers touch only a
small region of each."""

import ctypes
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from exp_gather_pools import ROW, plans, time_case  # noqa: E402

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.syscall.restype = ctypes.c_long
SYS_mbind, SYS_move_pages = 237, 279


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return repr(e)


def nodes_of(addr, size, samples=64):
    n = samples
    pages = (ctypes.c_void_p * n)(*[addr + (size // n) * i for i in range(n)])
    status = (ctypes.c_int * n)()
    libc.syscall(SYS_move_pages, 0, n, pages, None, status, 0)
    out = {}
    for s in status:
        out[s] = out.get(s, 0) + 1
    return out


keep = []


def mmap_pool(size, node=None, thp=False):
    addr = libc.mmap(None, size, 3, 0x22, -1, 0)  # RW, PRIVATE|ANON
    assert addr not in (None, ctypes.c_void_p(-1).value)
    if thp:
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), 14)
    if node is not None:
        mask = ctypes.c_ulong(1 << node)
        r = libc.syscall(SYS_mbind, ctypes.c_void_p(addr), ctypes.c_ulong(size), 2, ctypes.byref(mask), 64, 0)
        assert r == 0, ctypes.get_errno()
    ctypes.memset(addr, 1, size)
    err = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
    assert int(err) == 0, err
    buf = (ctypes.c_uint8 * size).from_address(addr)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    keep.append((addr, size))
    return t, addr


def free_all():
    torch.cuda.synchronize()
    for addr, size in keep:
        torch.cuda.cudart().cudaHostUnregister(addr)
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    keep.clear()


def main():
    for c in ["lscpu | grep -i -E 'numa|socket|model name'", "nvidia-smi topo -m",
              "cat /sys/bus/pci/devices/$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | tr A-Z a-z | sed 's/^0000//;s/^/0000/' | cut -c1-12)/numa_node",
              "ls /sys/class/iommu; cat /proc/cmdline", "cat /sys/kernel/mm/transparent_hugepage/enabled",
              "numactl -H 2>&1 | head -8", "grep -E 'MemTotal|MemFree|Huge' /proc/meminfo"]:
        print(f"$ {c}\n{sh(c)}", flush=True)
    nnodes = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")])
    print("cpu now", os.sched_getaffinity(0).__len__(), "cpus; nodes", nnodes, flush=True)
    B, L, m, region = 112, 8, 95, 32768 + 64
    g = torch.Generator().manual_seed(0)
    hot = torch.zeros(B * 4096, ROW, dtype=torch.uint8, device="cuda")
    pl = plans(B, region, 4096, m, 16, g)
    pl_small = plans(B, 2048 + 64, 4096, m, 16, g)
    nbytes = B * m * ROW
    size = B * region * ROW

    def rep(name, pools, p=pl):
        med, lo, hi = time_case(pools, hot, p, L, 20)
        print(f"{name:44s} {med:7.1f} us/layer [{lo:.1f}, {hi:.1f}] {nbytes / med / 1e3:5.1f} GB/s", flush=True)

    pools = [torch.empty(B * region, ROW, dtype=torch.uint8, pin_memory=True) for _ in range(L)]
    print("torch pinned pools' nodes", [nodes_of(p.data_ptr(), size, 16) for p in pools[:2]])
    rep("torch pin_memory: eight pools", pools)
    rep("torch pin_memory: one pool", pools[:1])
    rep("torch pin_memory: eight pools, small regions", pools, pl_small)
    del pools
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    # the product's form: malloc'd memory, cudaHostRegister
    raw = [torch.empty(size, dtype=torch.uint8) for _ in range(L)]
    for r in raw:
        r.fill_(1)
        assert int(torch.cuda.cudart().cudaHostRegister(r.data_ptr(), size, 0)) == 0
    views = [r.view(-1, ROW) for r in raw]
    print("HostPool-form nodes", [nodes_of(r.data_ptr(), size, 16) for r in raw[:2]])
    rep("HostPool form: eight pools", views)
    rep("HostPool form: one pool", views[:1])
    for r in raw:
        torch.cuda.cudart().cudaHostUnregister(r.data_ptr())
    del raw, views
    for node in range(nnodes):
        ts = [mmap_pool(size, node=node)[0].view(-1, ROW) for _ in range(L)]
        print(f"node {node} pools' nodes", nodes_of(ts[0].data_ptr(), size, 16))
        rep(f"mbind node {node}: eight pools", ts)
        rep(f"mbind node {node}: one pool", ts[:1])
        del ts
        free_all()
    ts = [mmap_pool(size, thp=True)[0].view(-1, ROW) for _ in range(L)]
    print("THP AnonHugePages:", sh("grep AnonHuge /proc/meminfo"))
    rep("THP: eight pools", ts)
    rep("THP: one pool", ts[:1])
    del ts
    free_all()


if __name__ == "__main__":
    main()
