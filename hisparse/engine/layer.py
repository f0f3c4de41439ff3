"""One layer of the forward pass over a step's batch: project the new tokens, attend over the
selected rows (decode rows read them from the KV store, prompts from their own fresh rows),
then the output projection and MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from hisparse.engine import prefill
from hisparse.engine.batch import StepBatch
from hisparse.engine.config import EngineConfig
from hisparse.engine.kvstore import KVStore
from hisparse.models.reference import Model
from hisparse.models.rows import decode_rows, encode_rows


@dataclass
class Projection:
    """One layer's projections of the step's tokens."""

    rows: torch.Tensor  # every new row, encoded, batch order
    decode_h: Optional[torch.Tensor]  # decode rows' normalised input (None without any)
    decode_q: Optional[torch.Tensor]
    prompt_h: List[torch.Tensor]
    prompt_q: List[torch.Tensor]
    prompt_rows: List[torch.Tensor]  # each prompt's encoded rows (a slice of ``rows``' bytes)


class LayerPass:
    def __init__(
        self,
        cfg: EngineConfig,
        model: Model,
        kv: KVStore,
        attention_log: Optional[List[List[torch.Tensor]]],
    ) -> None:
        self.cfg, self.model, self.kv = cfg, model, kv
        self.attention_log = attention_log  # layer -> decode attention outputs, when recorded

    def project(
        self, layer: int, batch: StepBatch, x: Optional[torch.Tensor], xp: List[torch.Tensor]
    ) -> Projection:
        m, layout = self.model, self.cfg.row_format
        parts, prompt_h, prompt_q, prompt_rows = [], [], [], []
        h = q = None
        if batch.num_decode:
            h, kv, q = m.project(x, layer, batch.positions)
            parts.append(encode_rows(kv, layout))
        for x_prompt, pos in zip(xp, batch.prompt_positions):
            hp, kvp, qp = m.project(x_prompt, layer, pos)
            rows = encode_rows(kvp, layout)
            parts.append(rows)
            prompt_rows.append(rows)
            prompt_h.append(hp)
            prompt_q.append(qp)
        return Projection(torch.cat(parts), h, q, prompt_h, prompt_q, prompt_rows)

    def attend_decode(
        self, layer: int, batch: StepBatch, x: torch.Tensor, proj: Projection, sel: torch.Tensor
    ) -> torch.Tensor:
        """Attention of the decode rows over their selection, read from the KV store as bytes
        (the only place where the modes differ: the bytes must be the same)."""
        cfg, m = self.cfg, self.model
        slots = batch.slots
        sel_keys = torch.where(sel >= 0, slots.unsqueeze(1) * cfg.max_context + sel, sel)
        rows = self.kv.read(layer, sel_keys, sel, batch.positions, slots, batch.num_prefill)
        kvs = decode_rows(rows, cfg.row_format, m.dtype)
        o = m.attend(proj.decode_q, kvs, sel >= 0)
        if self.attention_log is not None:
            self.attention_log[layer].append(o)
        return m.finish_layer(x, o, layer)

    def attend_prompts(
        self, layer: int, xp: List[torch.Tensor], proj: Projection, prompt_sel: List[torch.Tensor]
    ) -> List[torch.Tensor]:
        m, layout = self.model, self.cfg.row_format
        out = []
        for x_prompt, q, rows, sel in zip(xp, proj.prompt_q, proj.prompt_rows, prompt_sel):
            vals = decode_rows(rows, layout, m.dtype)
            out.append(
                m.finish_layer(x_prompt, prefill.attend_over_prompt(q, vals, sel, m.scale), layer)
            )
        return out
