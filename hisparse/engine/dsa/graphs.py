"""The DSA engine's decode steps as CUDA graphs: captured once per batch size (and the store's
``graph_key``: hybrid residency's split of the batch), then replayed.

A step that only decodes (one token per request) has the same shapes every time the batch has
the same number of requests (and key), and everything it reads is on the device (positions,
block table, the connector's state rows, hybrid's page table and routes), so it is captured
whole: every layer's projections, key store,
indexer and top-k, the connector's save and resolve (HiSparse) or the resident row store, the
attention and the LM head. Steps with a prefill run eagerly.

The first decode step of a size runs eagerly (it compiles the kernels the capture records and
warms cuBLAS); the second is captured and replayed; later ones copy their inputs into the
graph's buffers and replay. The capture runs the step's Python once, so host-side bookkeeping
(which layers resolved this step) is that of a real step, and it never synchronises the host
with the device (no ``torch.cuda.graph``, which does).
"""

from __future__ import annotations

from typing import Dict

import torch

from hisparse.models.dsa.core import TokenBatch


class DecodeGraphs:
    """``step(...)``: ``fwd.step(store, ...)``, replayed from a graph for decode-only batches."""

    def __init__(self, fwd, store) -> None:
        if fwd.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {fwd.device}")
        self.fwd, self.store = fwd, store
        self.seen: set = set()  # keys that ran a decode step (the first one eagerly)
        self.graphs: Dict[tuple, tuple] = {}  # (batch size, graph_key) -> (graph, inputs, logits)
        self.pool = None
        self.replays = 0

    def step(self, tokens, batch: TokenBatch, last, num_decodes: int) -> torch.Tensor:
        n = batch.seq_lens.shape[0]
        if num_decodes != n or tokens.shape[0] != n:
            return self.fwd.step(self.store, tokens, batch, last, num_decodes)
        key = (n,) + self.store.graph_key()
        if key not in self.seen:  # every captured key is in it
            self.seen.add(key)
            return self.fwd.step(self.store, tokens, batch, last, num_decodes)
        new = (tokens, batch.positions, batch.req, batch.seq_lens, batch.block_table, last)
        if key not in self.graphs:
            return self._capture(key, new)
        graph, inputs, logits = self.graphs[key]
        for dst, src in zip(inputs, new):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        self.replays += 1
        return logits

    def _capture(self, key: tuple, new: tuple) -> torch.Tensor:
        n = key[0]
        inputs = tuple(t.clone() for t in new)
        tokens, pos, req, lens, table, last = inputs
        batch = TokenBatch(pos, req, lens, table, self.fwd.max_context)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.fwd.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self.pool)
            try:
                logits = self.fwd.step(self.store, tokens, batch, last, n)
            except Exception as e:
                try:  # end the capture; its own error would only say that one came before
                    graph.capture_end()
                except Exception:
                    pass
                raise RuntimeError(
                    f"the decode step of {n} requests could not be captured as a CUDA graph "
                    f"({type(e).__name__}: {e}); generate(..., graphs=False) steps eagerly"
                ) from e
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.pool = graph.pool()
        self.graphs[key] = (graph, inputs, logits)
        graph.replay()
        self.replays += 1
        return logits
