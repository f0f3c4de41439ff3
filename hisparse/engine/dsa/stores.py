"""Where the DSA engine's latent rows live, for a batch of requests.

* ``ResidentRows``: every layer's rows [keys, row_bytes] in device memory; attention reads the
  selected rows by key.
* ``HiSparseRows``: rows in the connector's host pool (saved with a device slot mapping, as a
  CUDA vLLM saves them); each step the index-group leader resolves the decodes' top-k and every
  member layer gathers into its own hot buffer, attention reads the hot rows. Prefill reads rows
  back from the host pool (``load_host_rows``: one device gather on CUDA).

Both hand attention (source rows, row ids) for the selected keys in the caller's order, so two
runs agree bit for bit exactly when the rows are right. Keys are ``block * max_context +
position``; a request's block is its slot in the resident store, its state row with HiSparse.

``inject_faults`` is a test seam for the parity eval's negative controls (``evals/parity``): the
faults exist to show that the eval would see them, and are off unless its block is active.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, List, Optional

import torch

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.union import token_ids, union_rows

BLOCK = 16
BINDING_FAULTS = ("base_offset",)
SPILL_FAULTS = ("off_by_one",)
_FAULTS: ContextVar = ContextVar("hisparse_dsa_faults", default=None)


@contextlib.contextmanager
def inject_faults(binding: Optional[str] = None, spill: Optional[str] = None):
    """Stores built inside the block carry the faults. ``binding="base_offset"``: every layer's
    row buffer is the first rows of one allocation (the upstream per-layer binding bug: layers
    overwrite each other; the connector refuses such buffers at bind time, ``ResidentRows`` has
    no such check). ``spill="off_by_one"``: a hybrid spill copies one row too few to the host
    pool (``hybrid.HybridRows``)."""
    if binding not in (None, *BINDING_FAULTS) or spill not in (None, *SPILL_FAULTS):
        raise ValueError(
            f"binding must be None or one of {BINDING_FAULTS}, spill None or one of "
            f"{SPILL_FAULTS}; got {binding!r}, {spill!r}"
        )
    token = _FAULTS.set({"binding": binding, "spill": spill})
    try:
        yield
    finally:
        _FAULTS.reset(token)


def injected_fault(kind: str) -> Optional[str]:
    """The fault of ``kind`` ("binding", "spill") an active ``inject_faults`` sets, else None."""
    faults = _FAULTS.get()
    return faults[kind] if faults else None


def upload(values, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """Host values as a tensor on ``device``: pinned and non-blocking on CUDA, so a step's
    inputs never make the host wait for the device."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def layer_buffers(layers: int, rows: int, row_bytes: int, device: torch.device) -> list:
    """Each layer's zeroed row buffer [rows, row_bytes] in an allocation of its own (under the
    base-offset fault: all of them the same first rows of one allocation for every layer)."""
    if injected_fault("binding") is None:
        return [
            torch.zeros(rows, row_bytes, dtype=torch.uint8, device=device) for _ in range(layers)
        ]
    raw = torch.zeros(layers * rows * row_bytes, dtype=torch.uint8, device=device)
    return [raw[: rows * row_bytes].view(rows, row_bytes)] * layers


def layer_names(n: int) -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def nothing() -> None:
    """``decode_rows``' default ``beside``: no work."""


class Request:
    """What the connector's scheduler side needs of a request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class ResidentRows:
    """Every layer's rows [max_requests * max_context, row_bytes] on the device."""

    mode = "resident"

    def __init__(
        self,
        cfg: DSAConfig,
        row_bytes: int,
        max_context: int,
        device: torch.device,
        max_requests: int = 1,
    ) -> None:
        self.max_context = max_context
        self.rows = layer_buffers(cfg.num_layers, max_requests * max_context, row_bytes, device)
        self.free = list(range(max_requests))
        self.blocks: dict = {}

    def begin(self, scheduled: dict) -> List[int]:
        """A step of ``scheduled`` {request id: new tokens} (batch order): each one's block."""
        for rid in scheduled:
            if rid not in self.blocks:
                self.blocks[rid] = self.free.pop(0)
        return [self.blocks[rid] for rid in scheduled]

    def admits(self, tokens: int) -> bool:
        """A new request of ``tokens`` prompt tokens may join now (a free block: the caller's)."""
        return True

    def graph_key(self) -> tuple:
        """What besides the batch size fixes this step's shapes (a CUDA graph per key)."""
        return ()

    def save(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        self.rows[layer].index_copy_(0, keys, rows)

    def decode_rows(
        self, layer: int, keys: torch.Tensor, defer_misses: bool = False, decodes=None, *,
        beside: Callable[[], None] = nothing,
    ):  # fmt: skip
        beside()
        return self.rows[layer], keys, None

    def prefill_rows(self, layer: int, keys: torch.Tensor):
        return self.rows[layer], keys

    def end(self) -> None:
        pass

    def finish(self, rid: str) -> None:
        self.free.append(self.blocks.pop(rid))

    def close(self) -> dict:
        return {}


class HiSparseRows:
    """The connector in both roles, one index group per full indexer layer; the hot buffers
    ([max_requests * hot_size, row_bytes] per layer) are the only device rows."""

    mode = "hisparse"

    def __init__(
        self,
        cfg: DSAConfig,
        row_bytes: int,
        max_context: int,
        device: torch.device,
        hot_size: int,
        max_requests: int = 1,
        decode_tokens: int = 1,
        state_rows: Optional[int] = None,
    ) -> None:
        """``decode_tokens``: query tokens one decode may have (2 for an MTP verify step).
        ``state_rows``: requests the connector holds at once, each with a hot buffer (default
        ``max_requests``; hybrid residency's spilled ones); keys cover ``max_requests`` blocks."""
        from hisparse.connector import HiSparseConfig, HiSparseConnectorImpl

        self.cfg, self.device, self.max_context = cfg, device, max_context
        self.names = layer_names(cfg.num_layers)
        config = HiSparseConfig(
            # every state row's keys plus a block of slack, for every layer
            host_pool_gib=(max_requests * max_context + BLOCK) * row_bytes * cfg.num_layers / 2**30,
            top_k=cfg.index_topk,
            hot_size=hot_size,
            max_num_seqs=state_rows or max_requests,
            block_size=BLOCK,
            decode_tokens=decode_tokens,
        )
        self.worker = HiSparseConnectorImpl(config, "worker")
        hot = self._kv_buffers(state_rows or max_requests, hot_size, row_bytes)
        # An index group is a full indexer layer and the shared layers after it (GLM-5).
        groups = [
            [n for i, n in enumerate(self.names) if cfg.leader(i) == lead]
            for lead in range(cfg.num_layers)
            if cfg.is_full(lead)
        ]
        w = self.worker.worker
        w.register_kv_caches(hot, groups=groups, host_rows=max_requests * max_context + BLOCK)
        self.sched = HiSparseConnectorImpl(config, "scheduler", host_rows=w.host_rows)
        self.finished: set = set()
        self.stats: List = []
        self.closed = False

    def _kv_buffers(self, state_rows: int, hot_size: int, row_bytes: int) -> dict:
        """Each layer's registered row buffer: here its hot buffers only."""
        rows = state_rows * hot_size
        return dict(zip(self.names, layer_buffers(len(self.names), rows, row_bytes, self.device)))

    def begin(self, scheduled: dict) -> List[int]:
        """A step of ``scheduled`` {request id: new tokens} (decodes first): each one's state
        row, which is its block of keys."""
        from hisparse.connector import StepSchedule

        step = StepSchedule(num_scheduled_tokens=dict(scheduled), finished_req_ids=self.finished)
        meta = self.sched.build_connector_meta(step)
        self.finished = set()
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        return list(meta.state_rows)

    def admits(self, tokens: int) -> bool:
        return True

    def graph_key(self) -> tuple:
        return ()

    def save(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        # keys stay on the rows' device: the save path a CUDA vLLM takes (no host sync)
        self.worker.save_kv_layer(self.names[layer], rows, None, slot_mapping=keys)

    def decode_rows(
        self, layer: int, keys: torch.Tensor, defer_misses: bool = False, decodes=None, *,
        beside: Callable[[], None] = nothing,
    ):  # fmt: skip
        """The decodes' rows, resolved into the hot buffers (the batch's leading state rows):
        (hot rows, ids, the misses left to attention's row read where ``defer_misses``).
        ``decodes`` (``model.Decodes``, decodes of several tokens): one union row of its tokens'
        top-k per request, each token reading its own slice (``hisparse.models.dsa.union``).
        ``beside``: work that needs no row, run on the current stream after the resolve, while
        the misses copy in (before the wait for them)."""
        name = self.names[layer]
        q, at = (decodes.q, decodes.at) if decodes is not None else (1, None)
        rows = decodes.rows if decodes is not None else keys.shape[0]
        top_k = union_rows(keys, at, rows, q) if self.cfg.is_full(layer) else None
        got = self.worker.resolve(name, top_k, defer_misses=defer_misses)
        beside()
        self.worker.wait_for_layer_load(name)
        return self.worker.hot_rows(name), token_ids(got, at, q), self.worker.miss_plan(name)

    def prefill_rows(self, layer: int, keys: torch.Tensor):
        """Prefill tokens' rows, gathered from the host pool (ordered after this step's saves)."""
        src = self.worker.load_host_rows(self.names[layer], keys)
        ids = torch.arange(keys.numel(), device=keys.device).view(keys.shape)
        return src, torch.where(keys >= 0, ids, keys)

    def end(self) -> None:
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            self.stats.append(stats)

    def finish(self, rid: str) -> None:
        self.sched.request_finished(Request(rid), [])  # frees its state row
        self.finished.add(rid)

    def close(self) -> dict:
        """Drain the counters not yet reported, shut the worker down; the run's totals
        (hits, misses, host_to_device_bytes)."""
        if self.closed:
            return {}
        self.closed = True
        last = self.worker.worker.drain_stats()
        self.worker.shutdown()
        totals: dict = {}
        for st in self.stats + ([last] if last is not None else []):
            for k, v in st.totals().items():
                totals[k] = totals.get(k, 0) + v
        return totals
