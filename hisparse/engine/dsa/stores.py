"""Where the DSA engine's latent rows live, one request at a time.

* ``ResidentRows``: every layer's rows [keys, row_bytes] in device memory; attention reads the
  selected rows by key.
* ``HiSparseRows``: rows in the connector's host pool (saved with a device slot mapping, as a
  CUDA vLLM saves them); each decode step the index-group leader resolves the top-k and every
  member layer gathers into its own hot buffer, attention reads the hot rows. Prefill reads the
  prompt's rows back from the host pool through ``connector/host_rows.py``.

Both hand attention the bytes of the selected keys in the caller's order, so two runs agree bit
for bit exactly when the rows are right. Keys are ``state_row * max_context + position``.
"""

from __future__ import annotations

from typing import List

import torch

from hisparse.connector.host_rows import HostRows
from hisparse.models.dsa.config import DSAConfig

BLOCK = 16


def layer_names(n: int) -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


class _Request:
    """What the connector's scheduler side needs of a request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class ResidentRows:
    """Every layer's rows [max_context, row_bytes] on the device (one state row: requests run
    one at a time)."""

    mode = "resident"

    def __init__(
        self, cfg: DSAConfig, row_bytes: int, max_context: int, device: torch.device
    ) -> None:
        self.max_context = max_context
        self.rows = [
            torch.zeros(max_context, row_bytes, dtype=torch.uint8, device=device)
            for _ in range(cfg.num_layers)
        ]
        self.state_row = 0

    def begin(self, rid: str, new_tokens: int) -> None:
        pass

    def save(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        self.rows[layer].index_copy_(0, keys, rows)

    def read(self, layer: int, keys: torch.Tensor, prefill: bool) -> torch.Tensor:
        return self.rows[layer][keys.clamp(min=0)]

    def end(self) -> None:
        pass

    def finish(self, rid: str) -> None:
        pass

    def close(self) -> dict:
        return {}


class HiSparseRows:
    """The connector in both roles, one state row, one index group per full indexer layer; the
    hot buffers ([hot_size, row_bytes] per layer) are the only device rows."""

    mode = "hisparse"

    def __init__(
        self,
        cfg: DSAConfig,
        row_bytes: int,
        max_context: int,
        device: torch.device,
        hot_size: int,
    ) -> None:
        from hisparse.connector import HiSparseConnector

        self.cfg, self.device, self.max_context = cfg, device, max_context
        self.row_bytes = row_bytes
        self.names = layer_names(cfg.num_layers)
        extra = {
            # one state row's keys plus a block of slack, for every layer
            "host_pool_gib": (max_context + BLOCK) * row_bytes * cfg.num_layers / 2**30,
            "top_k": cfg.index_topk,
            "device_buffer_size": hot_size,
            "max_num_seqs": 1,
            "block_size": BLOCK,
        }
        self.worker = HiSparseConnector.from_extra_config(extra, role="worker")
        hot = {
            n: torch.zeros(hot_size, row_bytes, dtype=torch.uint8, device=device)
            for n in self.names
        }
        # An index group is a full indexer layer and the shared layers after it (GLM-5).
        groups = [
            [n for i, n in enumerate(self.names) if cfg.leader(i) == lead]
            for lead in range(cfg.num_layers)
            if cfg.is_full(lead)
        ]
        w = self.worker.worker
        w.register_kv_caches(hot, groups=groups)
        self.sched = HiSparseConnector.from_extra_config(
            extra, role="scheduler", host_rows=w.host_rows
        )
        self.host = [HostRows(w, [n]) for n in self.names]
        self.finished: set = set()
        self.stats: List = []
        self.state_row = 0
        self._scratch: dict = {}
        self.closed = False

    def begin(self, rid: str, new_tokens: int) -> None:
        from hisparse.connector import StepSchedule

        step = StepSchedule(num_scheduled_tokens={rid: new_tokens}, finished_req_ids=self.finished)
        meta = self.sched.build_connector_meta(step)
        self.finished = set()
        self._scratch = {}  # layer -> the prompt rows read back this step
        self.state_row = meta.state_rows[0]
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)

    def save(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        # keys stay on the rows' device: the save path a CUDA vLLM takes (no host sync)
        self.worker.save_kv_layer(self.names[layer], rows, None, slot_mapping=keys)

    def read(self, layer: int, keys: torch.Tensor, prefill: bool) -> torch.Tensor:
        if prefill:
            return self._read_prefill(layer, keys)
        name = self.names[layer]
        lead = self.cfg.is_full(layer)
        out = self.worker.resolve(name, keys.to(torch.int32) if lead else None)
        self.worker.wait_for_layer_load(name)
        return self.worker.hot_rows(name)[out.long().clamp(min=0)]

    def _read_prefill(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """The prompt's rows gathered back from the host pool into a device scratch (once per
        layer and step, grown when a later chunk of queries sees further), then the selected
        ones. On CUDA the saves run on the group's copy stream: wait for them first."""
        base = self.state_row * self.max_context
        n = int(keys.max()) - base + 1 if bool((keys >= 0).any()) else 1
        scratch = self._scratch.get(layer)
        if scratch is None or scratch.shape[0] < n:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            scratch = torch.zeros(n, self.row_bytes, dtype=torch.uint8, device=self.device)
            src = torch.arange(base, base + n, dtype=torch.int32, device=self.device)
            dst = torch.arange(n, dtype=torch.int32, device=self.device)
            self.host[layer].load([scratch], src, dst)
            self._scratch[layer] = scratch
        return scratch[(keys - base).clamp(min=0)]

    def end(self) -> None:
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            self.stats.append(stats)

    def finish(self, rid: str) -> None:
        self.sched.request_finished(_Request(rid), [])  # frees its state row
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
