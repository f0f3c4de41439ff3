"""Shared builders: for op tests fresh state, output buffers and running an op step; for the
connector's units a CPU registration and vLLM-shaped scheduler outputs."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from hisparse import ops
from hisparse.runtime import empty_residency

# resolve_residency's tensor arguments in schema order (the error messages name them).
RESOLVE_TENSOR_ARGS = [
    "top_k",
    "state_rows",
    "resident_rows",
    "slot_keys",
    "lru",
    "stats",
    "out_rows",
    "miss_src",
    "miss_dst",
    "miss_count",
]


# ------------------------------------------------------------ child processes
#: Multiplies every child-process time limit (a slow CI machine, a sanitizer, a debugger).
TIMEOUT_FACTOR_ENV = "HISPARSE_TEST_TIMEOUT_FACTOR"


def child_timeout(idle_s: float) -> float:
    """The time limit for a child process that takes about ``idle_s`` seconds on an idle
    machine: 10x that, times ``$HISPARSE_TEST_TIMEOUT_FACTOR`` (default 1), times the load per
    core when it is above 1. A fixed limit failed the interpreter test at load 6 on 2 cores;
    the limit only guards against a hang, so it may be generous."""
    raw = os.environ.get(TIMEOUT_FACTOR_ENV, "") or "1"
    try:
        factor = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_FACTOR_ENV} must be a number, got {raw!r}") from None
    if not factor > 0:
        raise ValueError(f"{TIMEOUT_FACTOR_ENV} must be > 0, got {raw!r}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = max(os.getloadavg()) / max(1, cores or 1)
    return 10.0 * idle_s * factor * max(1.0, load)


def new_state(S, H, device="cpu"):
    slot_keys, lru = empty_residency(S, H, device)
    stats = torch.zeros(2, dtype=torch.uint64, device=device)
    return slot_keys, lru, stats


def new_plan(B, K, device="cpu"):
    out = torch.full((B, K), -7, dtype=torch.int32, device=device)
    src = torch.full((B, K), -7, dtype=torch.int32, device=device)
    dst = torch.full((B, K), -7, dtype=torch.int32, device=device)
    count = torch.full((B,), -7, dtype=torch.int32, device=device)
    return out, src, dst, count


def run_resolve(
    top_k, state_rows, slot_keys, lru, stats, *, num_keys, hot_base=0, resident_rows=None
):
    B, K = top_k.shape
    out, src, dst, count = new_plan(B, K, top_k.device)
    ops.resolve_residency(
        top_k,
        state_rows,
        slot_keys,
        lru,
        stats,
        out,
        src,
        dst,
        count,
        num_keys=num_keys,
        hot_base=hot_base,
        resident_rows=resident_rows,
    )
    return out, src, dst, count


def stats_list(stats):
    return [int(x) for x in stats.cpu().tolist()]


# ------------------------------------------------------------ connector units
def cpu_registration(
    layers=("l0", "l1"),
    row_bytes=16,
    *,
    S=2,
    H=4,
    K=2,
    host_rows=40,
    groups=None,
    extra_rows=0,
    **cfg,
):
    """``(config, registration, caches)``: a worker's ``register`` on the CPU, alone. ``row_bytes``
    is one size or one per layer; each cache holds ``extra_rows`` resident rows below its
    ``S * H`` hot rows; ``cfg`` goes to ``HiSparseConfig`` (block_size 4 unless given)."""
    from hisparse.connector.config import HiSparseConfig
    from hisparse.connector.registration import register

    rbs = [row_bytes] * len(layers) if isinstance(row_bytes, int) else list(row_bytes)
    config = HiSparseConfig(top_k=K, hot_size=H, max_num_seqs=S, **{"block_size": 4, **cfg})
    caches = {
        n: torch.zeros(extra_rows + S * H, rb, dtype=torch.uint8) for n, rb in zip(layers, rbs)
    }
    return config, register(config, caches, host_rows=host_rows, groups=groups), caches


def fill_host_rows(reg, seed=0):
    """Random bytes in every layer's host rows (each layer its own)."""
    gen = torch.Generator().manual_seed(seed)
    for rt in reg.runtimes.values():
        rows = rt.host_view.reshape(-1, rt.row_bytes)
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen))


def vllm_step(*args, **kwargs):
    """``vllm_output(...)`` as the connector's scheduler sees it (a ``StepSchedule`` with the
    block view hisparse's vLLM connector reads from vLLM's output)."""
    from hisparse.connector import StepSchedule
    from hisparse.vllm.compat import scheduled_requests

    out = vllm_output(*args, **kwargs)
    return StepSchedule(
        num_scheduled_tokens=out.num_scheduled_tokens,
        finished_req_ids=out.finished_req_ids,
        preempted_req_ids=out.preempted_req_ids,
        blocks=scheduled_requests(out),
    )


# A vLLM SchedulerOutput's shape (no vLLM needed), for the scheduler's block-list logic.
def vllm_new_req(rid, num_computed, blocks):
    """One entry of ``scheduled_new_reqs`` (KV-cache group 0 only)."""
    return SimpleNamespace(req_id=rid, num_computed_tokens=num_computed, block_ids=(list(blocks),))


def vllm_output(sched, new=(), cached=(), finished=(), preempted=None, resumed=()):
    """``sched``: {req_id: tokens} in batch order; cached = [(rid, num_computed, new_blocks or
    None)]."""
    c = SimpleNamespace(
        req_ids=[r for r, _, _ in cached],
        num_computed_tokens=[n for _, n, _ in cached],
        new_block_ids=[None if b is None else (list(b),) for _, _, b in cached],
        resumed_req_ids=set(resumed),
    )
    return SimpleNamespace(
        num_scheduled_tokens=dict(sched),
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=c,
        finished_req_ids=set(finished),
        preempted_req_ids=preempted,
        has_sync_kv_loads=False,
    )


def connector_impl(extra=None, role="worker", **kwargs):
    """The vLLM-free connector (``HiSparseConnectorImpl``) in ``role``, its settings parsed from
    an extra-config mapping as vLLM's would be."""
    from hisparse.connector import HiSparseConnectorImpl
    from hisparse.vllm.settings import config_from_extra

    return HiSparseConnectorImpl(config_from_extra(extra), role, **kwargs)


def vllm_connector(extra=None, role="worker", **vllm_fields):
    """hisparse's vLLM connector class built from a stand-in VllmConfig holding ``extra`` as its
    kv_connector_extra_config (and ``vllm_fields`` beside it)."""
    from hisparse.vllm.connector import HiSparseConnector

    kv = SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both")
    return HiSparseConnector(SimpleNamespace(kv_transfer_config=kv, **vllm_fields), role)
