"""The engine-side door to a worker's host pool: the one interface through which an engine that
hosts the connector (the reference engine's hybrid residency) moves its own rows in and out of
the pool, instead of calling the ops on the pool's views itself.

A server never needs this: vLLM writes rows through ``save_kv_layer`` and reads them through the
attention's resolve. An engine that keeps rows in its own device pages and spills whole requests
to the pool (hybrid residency) needs three moves, each over every layer at once.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hisparse import ops


class HostRows:
    """The host rows of ``layer_names`` (model order) in ``worker``'s pool; key = host row."""

    def __init__(self, worker, layer_names: Sequence[str]) -> None:
        self._views = [worker.host_view(n) for n in layer_names]
        self.pool_bytes = sum(v.numel() for v in self._views)

    def save(self, layers: Sequence[torch.Tensor], src: torch.Tensor, keys: torch.Tensor) -> None:
        """Row ``src[i]`` of every ``layers[l]`` → host row ``keys[i]`` of layer l (one launch)."""
        ops.save_rows(list(layers), self._views, src, keys)

    def save_layer(self, layer: int, rows: torch.Tensor, src: torch.Tensor, keys) -> None:
        """Row ``src[i]`` of ``rows`` → host row ``keys[i]`` of layer ``layer``."""
        ops.save_rows([rows], [self._views[layer]], src, keys)

    def scatter(self, keys: torch.Tensor, rows: Sequence[torch.Tensor]) -> None:
        """``rows[l][i]`` → host row ``keys[i]`` of layer l (rows already on the host)."""
        for view, r in zip(self._views, rows):
            view.index_copy_(0, keys, r)

    def load(self, layers: Sequence[torch.Tensor], keys: torch.Tensor, dst: torch.Tensor) -> None:
        """Host rows ``keys`` of every layer → rows ``dst`` of ``layers[l]`` (one launch)."""
        n = int(keys.numel())
        count = torch.full((1,), n, dtype=torch.int32, device=dst.device)
        ops.gather(self._views, list(layers), keys.reshape(1, n), dst.reshape(1, n), count)
