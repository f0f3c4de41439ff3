"""The sparse-attention indexer: per index group, a key of every past token and an EMA query per
request; each step's selection is the top-k of query . keys (docs/engine.md, "Model").
The leader layer of a group selects, its followers reuse the selection."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from hisparse.engine import prefill
from hisparse.engine.batch import StepBatch
from hisparse.engine.config import EngineConfig
from hisparse.models.reference import Model, ema_matrix, select_top_k


class Indexer:
    def __init__(self, cfg: EngineConfig, model: Model, device: torch.device) -> None:
        self.cfg, self.model, self.device = cfg, model, device
        dtype = model.dtype
        S, C = cfg.num_state_rows, cfg.max_context
        self.keys = [
            torch.zeros(S, C, cfg.indexer_dim, dtype=dtype, device=device)
            for _ in range(cfg.num_groups)
        ]
        self.query = [
            torch.zeros(S, cfg.indexer_dim, dtype=dtype, device=device)
            for _ in range(cfg.num_groups)
        ]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.keys)
        # previous step's selection of each state row as a bitmap (column C absorbs padding)
        self.prev_sel = torch.zeros(S, C + 1, dtype=torch.bool, device=device)
        # summed on the device so that measuring the overlap never synchronises a step
        self.overlap_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.overlap_cnt = torch.zeros((), dtype=torch.float64, device=device)
        self._ema_cache: dict = {}

    def select(
        self,
        group: int,
        batch: StepBatch,
        decode_h: Optional[torch.Tensor],
        prompt_h: List[torch.Tensor],
    ) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
        """The group's selection of every decode row [B, top_k] (None without decode rows) and
        of every prompt position ([P, top_k] per prompt); positions, -1 = padding."""
        sel = self._select_decode(group, batch, decode_h) if batch.num_decode else None
        prompt_sel = [
            self._select_prompt(group, r, h, pos)
            for r, h, pos in zip(batch.prefill, prompt_h, batch.prompt_positions)
        ]
        return sel, prompt_sel

    def topk_overlap(self) -> float:
        cnt = float(self.overlap_cnt)
        return float(self.overlap_sum) / cnt if cnt else 0.0

    def _select_decode(self, g: int, batch: StepBatch, h: torch.Tensor) -> torch.Tensor:
        cfg, m = self.cfg, self.model
        slots, pos = batch.slots, batch.positions
        self.keys[g][slots, pos] = m.index_key(h, g, pos)
        a = cfg.drift
        qs = (1.0 - a) * self.query[g][slots] + a * m.index_query(h, g)
        self.query[g][slots] = qs
        scores = torch.einsum("bd,btd->bt", qs, self.keys[g][slots, : batch.context_len])
        sel = select_top_k(scores, pos + 1, cfg.top_k, cfg.recent_window)
        if g == 0:
            self._overlap(slots, sel)
        return sel

    def _select_prompt(self, g: int, r, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg, m = self.cfg, self.model
        ik = m.index_key(h, g, pos)
        self.keys[g][r.slot, : r.prompt_len] = ik
        u = m.index_query(h, g)
        sel, q_last = prefill.select_over_prompt(
            u, ik, pos, self._ema_weights, cfg.top_k, cfg.recent_window
        )
        self.query[g][r.slot] = q_last
        if g == 0:
            self._remember(r.slot, sel[-1])
        return sel

    def _remember(self, slot: int, last: torch.Tensor) -> None:
        """A prompt's last selection is what its first decode step's overlap is measured
        against."""
        C = self.cfg.max_context
        row = torch.zeros(C + 1, dtype=torch.bool, device=self.device)
        row.scatter_(0, torch.where(last >= 0, last, torch.full_like(last, C)), True)
        row[C] = False
        self.prev_sel[slot] = row

    def _ema_weights(self, n: int):
        """[n, n] weights a(1-a)^(i-j) (j <= i) and the decay (1-a)^(i+1) of the carried state."""
        got = self._ema_cache.get(n)
        if got is None:
            a, dev = self.cfg.drift, self.device
            ema = ema_matrix(n, a, torch.float64, "cpu")
            ema[:, 0] = a * (1.0 - a) ** torch.arange(n, dtype=torch.float64)
            decay = (1.0 - a) ** torch.arange(1, n + 1, dtype=torch.float64)
            got = (ema.to(self.model.dtype).to(dev), decay.to(self.model.dtype).to(dev))
            self._ema_cache[n] = got
        return got

    def _overlap(self, slots: torch.Tensor, sel: torch.Tensor) -> None:
        C = self.cfg.max_context
        valid = sel >= 0
        idx = torch.where(valid, sel, torch.full_like(sel, C))
        prev = self.prev_sel[slots].gather(1, idx)  # column C is always False
        self.overlap_sum += prev.sum(dtype=torch.float64)
        self.overlap_cnt += valid.sum(dtype=torch.float64)
        fresh = torch.zeros_like(self.prev_sel[slots])
        fresh.scatter_(1, idx, True)  # only True is written: duplicates at C cannot race
        fresh[:, C] = False
        self.prev_sel[slots] = fresh
