"""Binding and allocation for one worker: what ``register_kv_caches`` does, once, before any step.

The layers' registered buffers are checked (one device, disjoint, equal row counts, room for the
hot buffers at their end), a host pool with the same number of rows for every layer is
allocated, each layer gets a host view in it (an index group's layers token-major: a token's rows
of every member side by side), and layers are grouped behind index-group leaders.
The result is a ``Registration``; the per-step side (``step_driver``) only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.connector.tp_pool import make_pool
from hisparse.ops.limits import INT32_MAX, ROW_ALIGN
from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime
from hisparse.runtime.host_pool import HostPool
from hisparse.runtime.pool_fence import PoolFence
from hisparse.runtime.shared_pool import SharedHostPool
from hisparse.runtime.views import BindingError, PackedLayout, bind_layers, check_disjoint


@dataclass(frozen=True)
class Registration:
    """Everything ``register_kv_caches`` built: fixed for the worker's life."""

    device: torch.device
    layer_names: tuple
    host_pool: Union[HostPool, SharedHostPool]
    host_rows: int  # keys: rows of every layer's host view
    hot_base: int  # first hot-buffer row of every registered buffer
    groups: list  # HiSparseIndexGroup, in layer order of their leaders
    runtimes: dict  # layer name -> HiSparseRuntime
    fence: Optional[PoolFence] = None  # set when the TP ranks share the pool (layer_names order)


def register(
    cfg: HiSparseConfig,
    kv_caches: Mapping[str, torch.Tensor],
    *,
    host_rows: Optional[int] = None,
    groups: Optional[Sequence[Sequence[str]]] = None,
    peers: Any = None,
) -> Registration:
    """Bind every layer of ``kv_caches`` (see ``HiSparseConnectorWorker.register_kv_caches``).
    ``peers``: the worker's TP group (``hisparse.connector.tp_pool``), None for one rank."""
    if not isinstance(kv_caches, Mapping) or not kv_caches:
        raise ValueError("kv_caches must be a non-empty dict {layer_name: tensor}")
    names = tuple(kv_caches)
    groups = _layer_groups(names, groups, cfg.index_share)
    views = {n: _as_row_bytes(n, kv_caches[n]) for n in names}
    device = _one_device(views)
    # Every layer attends through its own rows: two layers sharing bytes would overwrite
    # each other's hot rows (the base-offset binding bug).
    check_disjoint(views)
    pin = _pin_host_pool(cfg, device)
    sized_by_engine = host_rows is not None
    hot_base = _hot_base(views, cfg.max_num_seqs, cfg.hot_size)
    row_bytes = {n: int(views[n].shape[1]) for n in names}
    host_rows = _host_pool_rows(cfg, sum(row_bytes.values()), host_rows)
    pool, fence = make_pool(
        cfg,
        device,
        host_rows * sum(row_bytes.values()),
        len(names),
        peers,
        row_bytes=[row_bytes[n] for n in names],
        pin=pin,
        **_pool_names(cfg, sized_by_engine),
    )
    host_views = _bind_host_pool(pool, row_bytes, groups, host_rows)
    group_objs, runtimes = [], {}
    for gi, members in enumerate(groups):
        g = HiSparseIndexGroup(
            f"group{gi}:{members[0]}",
            num_state_rows=cfg.max_num_seqs,
            hot_size=cfg.hot_size,
            # A decode's row holds the top-k of each of its query tokens (speculative decoding).
            top_k=cfg.resolve_width,
            max_batch=cfg.max_num_seqs,
            num_keys=host_rows,
            device=device,
            hot_base=hot_base,
        )
        for n in members:
            runtimes[n] = HiSparseRuntime(n, g, host_views[n], views[n])
        group_objs.append(g)
    return Registration(device, names, pool, host_rows, hot_base, group_objs, runtimes, fence)


def _layer_groups(names: tuple, groups, share: int) -> list:
    """Runs of ``share`` layers by default; explicit groups must cover every layer once."""
    if groups is None:
        return [names[i : i + share] for i in range(0, len(names), share)]
    flat = [n for members in groups for n in members]
    if sorted(flat) != sorted(names) or len(set(flat)) != len(flat):
        raise ValueError(
            "groups must list every registered layer exactly once, got "
            f"{[list(m) for m in groups]} for layers {list(names)}"
        )
    return list(groups)


def _as_row_bytes(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a uint8 [rows, row_bytes] view (row_bytes = last-dim bytes)."""
    if not isinstance(t, torch.Tensor):
        raise BindingError(f"kv cache of layer {name!r} must be a tensor, got {type(t).__name__}")
    if t.dim() < 1 or t.numel() == 0:
        raise BindingError(f"kv cache of layer {name!r} is empty or 0-d")
    if not t.is_contiguous():
        raise BindingError(f"kv cache of layer {name!r} must be contiguous")
    row_bytes = t.shape[-1] * t.element_size()
    if row_bytes % ROW_ALIGN or t.data_ptr() % ROW_ALIGN:
        raise BindingError(
            f"kv cache of layer {name!r}: rows must be {ROW_ALIGN}-byte aligned, got row_bytes="
            f"{row_bytes} and data pointer {t.data_ptr():#x}"
        )
    b = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return b.reshape(-1, row_bytes)


def _one_device(views: dict) -> torch.device:
    devices = {v.device for v in views.values()}
    if len(devices) != 1:
        raise BindingError(f"kv caches must all be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


def _pin_host_pool(cfg: HiSparseConfig, device: torch.device) -> bool:
    pin = cfg.pin_host_pool if cfg.pin_host_pool is not None else device.type == "cuda"
    if pin != (device.type == "cuda"):
        raise HiSparseConfigError(
            f"kv_connector_extra_config['pin_host_pool'] = {cfg.pin_host_pool} does not fit "
            f"kv caches on {device}: the CUDA gather reads the host pool directly, so it is "
            "pinned exactly when the caches are on a CUDA device (leave it unset)"
        )
    return pin


def _hot_base(views: dict, S: int, H: int) -> int:
    """The hot buffers (S state rows x H rows) sit at the end of every layer's rows."""
    for n, v in views.items():
        if v.shape[0] < S * H:
            raise BindingError(
                f"kv cache of layer {n!r} has {v.shape[0]} rows but the hot buffers need "
                f"max_num_seqs * hot_size = {S} * {H} = {S * H}"
            )
    rows = {v.shape[0] for v in views.values()}
    if len(rows) != 1:
        raise BindingError(f"kv caches must all have the same number of rows, got {sorted(rows)}")
    return rows.pop() - S * H


def _pool_names(cfg: HiSparseConfig, sized_by_engine: bool) -> dict:
    """How a pool error names the pool and the setting to lower: the one that sized it."""
    if cfg.host_pool_set or not sized_by_engine:
        key = "kv_connector_extra_config['host_pool_gib']"
        return {"what": f"HiSparse host pool ({key})", "remedy": key}
    return {
        "what": "HiSparse host pool (backing every KV slot of the engine)",
        "remedy": "the engine's KV blocks (--gpu-memory-utilization, --num-gpu-blocks-override)",
    }


def _host_pool_rows(cfg: HiSparseConfig, per_row: int, host_rows: Optional[int]) -> int:
    """Rows of every layer's host view: a whole number of blocks, int32 keys. ``host_rows`` given
    (the key space, e.g. vLLM's slots) is rounded up to a block; by default as many blocks as
    ``host_pool_gib`` holds."""
    if host_rows is None:
        num_blocks = cfg.host_pool_bytes // (per_row * cfg.block_size)
        if num_blocks < 1:
            gib = (
                cfg.host_pool_gib
                if cfg.host_pool_set
                else f"{cfg.host_pool_bytes / 2**30:g} (default)"
            )
            raise HiSparseConfigError(
                f"kv_connector_extra_config['host_pool_gib'] = {gib} is smaller "
                f"than one block of every layer ({per_row * cfg.block_size} bytes)"
            )
        if num_blocks * cfg.block_size > INT32_MAX:
            num_blocks = INT32_MAX // cfg.block_size
        return num_blocks * cfg.block_size
    if isinstance(host_rows, bool) or not isinstance(host_rows, int) or host_rows < 1:
        raise ValueError(f"host_rows must be a positive int, got {host_rows!r}")
    if host_rows > INT32_MAX:
        raise ValueError(f"host_rows = {host_rows} does not fit int32 keys")
    return -(-host_rows // cfg.block_size) * cfg.block_size


def _bind_host_pool(
    pool: Union[HostPool, SharedHostPool],
    row_bytes: dict,
    groups: Sequence[Sequence[str]],
    host_rows: int,
) -> dict:
    """``{layer: host view}`` in ``pool``. Each index group gets one region of the pool in which a
    token's rows of every member layer sit next to each other (token-major; each member's view
    strides over the group's row); the groups follow one another. The members of a group gather
    the same plan, so one host page, and one GPU address translation, serves all of them: on an
    H200 a 4-layer group gathers 2.6x faster from a 32 GiB pool this way than from layer-major
    rows (benchmarks/results/bench_ops_h200.md). A group of one layer is plain layer-major."""
    host_views: dict = {}
    offset = 0
    for members in groups:
        stride = sum(row_bytes[n] for n in members)
        col = 0
        for n in members:
            layout = PackedLayout(
                (n,), host_rows, 1, row_bytes[n], block_stride=stride, offset=offset + col
            )
            host_views.update(bind_layers(pool.raw, layout))
            col += row_bytes[n]
        offset += host_rows * stride
    check_disjoint(host_views)
    return host_views
