"""The engine: the model, the KV store of the run's mode, the indexer, and one forward pass per
step over the step's batch (decode rows first, then the newly admitted prompts)."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from hisparse.engine.batch import StepBatch, to_device
from hisparse.engine.config import EngineConfig
from hisparse.engine.hostkv import HiSparseKV
from hisparse.engine.hybrid import HybridKV
from hisparse.engine.indexer import Indexer
from hisparse.engine.kvstore import BINDING_FAULTS, SPILL_FAULTS, KVStore, ResidentKV
from hisparse.engine.layer import LayerPass
from hisparse.engine.requests import Request
from hisparse.models.reference import Model

MODES = ("resident", "hisparse")


def _check(cfg: EngineConfig, mode: str, binding_fault, spill_fault) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if binding_fault not in BINDING_FAULTS:
        raise ValueError(f"binding_fault must be one of {BINDING_FAULTS}, got {binding_fault!r}")
    if spill_fault not in SPILL_FAULTS:
        raise ValueError(f"spill_fault must be one of {SPILL_FAULTS}, got {spill_fault!r}")
    if spill_fault is not None and not (mode == "hisparse" and cfg.residency == "hybrid"):
        raise ValueError("spill_fault needs mode='hisparse' with residency='hybrid'")


def make_kv_store(
    cfg: EngineConfig, mode: str, device: torch.device, binding_fault, on_stats, spill_fault
) -> KVStore:
    if mode == "resident":
        return ResidentKV(cfg, device, binding_fault)
    if cfg.residency == "hybrid":
        return HybridKV(cfg, device, binding_fault, on_stats=on_stats, spill_fault=spill_fault)
    return HiSparseKV(cfg, device, binding_fault, on_stats=on_stats)


class Engine:
    """One run of the reference workload. Use ``run_workload``."""

    def __init__(
        self,
        cfg: EngineConfig,
        mode: str,
        device: torch.device,
        *,
        record_attention: bool = False,
        binding_fault: Optional[str] = None,
        on_stats: Optional[Callable] = None,
        spill_fault: Optional[str] = None,
    ) -> None:
        _check(cfg, mode, binding_fault, spill_fault)
        self.cfg, self.mode, self.device = cfg, mode, device
        self.model = Model(cfg, device)
        self.dtype = self.model.dtype
        self.kv = make_kv_store(cfg, mode, device, binding_fault, on_stats, spill_fault)
        self.indexer = Indexer(cfg, self.model, device)
        self.cur_tok = torch.zeros(cfg.num_state_rows, dtype=torch.int64, device=device)
        self.record_attention = record_attention
        self.attn: List[List[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
        self.layers = LayerPass(cfg, self.model, self.kv, self.attn if record_attention else None)

    def forward(
        self,
        dec: List[Request],
        new: List[Request],
        out_tokens: torch.Tensor,
        final_hidden: torch.Tensor,
    ) -> None:
        cfg, m = self.cfg, self.model
        batch = StepBatch.build(dec, new, cfg.max_context, self.kv.window, self.device)
        x = m.embed(self.cur_tok[batch.slots]) if dec else None
        xp = [m.embed(r.prompt.to(self.device)) for r in new]
        sel = prompt_sel = None
        for layer in range(cfg.num_layers):
            proj = self.layers.project(layer, batch, x, xp)
            self.kv.store(layer, batch.rows(proj.rows))
            if cfg.is_leader(layer):
                sel, prompt_sel = self.indexer.select(
                    cfg.group_of(layer), batch, proj.decode_h, proj.prompt_h
                )
            if dec:
                x = self.layers.attend_decode(layer, batch, x, proj, sel)
            xp = self.layers.attend_prompts(layer, xp, proj, prompt_sel)
        if dec:
            self._emit_decode(batch, x, out_tokens, final_hidden)
        self._emit_prompts(new, xp, out_tokens, final_hidden)

    def _emit_decode(
        self,
        batch: StepBatch,
        x: torch.Tensor,
        out_tokens: torch.Tensor,
        final_hidden: torch.Tensor,
    ) -> None:
        """Greedy next tokens of the decode rows; a request's last one also leaves its hidden
        state."""
        dec, dev = batch.decode, self.device
        tok = self.model.logits(x).argmax(dim=-1)
        self.cur_tok[batch.slots] = tok
        ridx = to_device([r.idx for r in dec], dev)
        gidx = to_device([r.generated for r in dec], dev)
        out_tokens[ridx, gidx] = tok
        last = [i for i, r in enumerate(dec) if r.generated + 1 == r.output_len]
        if last:
            li = to_device(last, dev)
            final_hidden[ridx[li]] = x[li]

    def _emit_prompts(
        self,
        new: List[Request],
        xp: List[torch.Tensor],
        out_tokens: torch.Tensor,
        final_hidden: torch.Tensor,
    ) -> None:
        """A prompt's first generated token comes from its last position."""
        for r, x_prompt in zip(new, xp):
            xl = x_prompt[-1:]
            tok = self.model.logits(xl).argmax(dim=-1)
            self.cur_tok[r.slot] = tok[0]
            out_tokens[r.idx, 0] = tok[0]
            if r.output_len == 1:
                final_hidden[r.idx] = xl[0]
