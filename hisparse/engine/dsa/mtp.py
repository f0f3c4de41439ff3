"""The multi-token-prediction (MTP) layer of a DSA checkpoint as a draft model, over the same
row store as the target.

DeepSeek-V3.2 and GLM-5 ship ``num_nextn_predict_layers`` MTP layers after the decoder, stored
as ``model.layers.{num_hidden_layers}.*``: ``enorm`` / ``hnorm`` / ``eh_proj`` (the next token's
embedding beside the target's hidden state), one decoder layer (sparse attention with its own
indexer, MLP or MoE) and ``shared_head`` (norm + LM head). The draft layer is the store's layer
``num_hidden_layers``: its rows and index keys are saved, selected and read exactly like a target
layer's (in HiSparse mode through the connector: host pool, hot buffer, its own index group).

The math follows vLLM's ``DeepSeekMultiTokenPredictorLayer`` (the target's hidden state after the
final norm; the embedding of position 0 zeroed), so the acceptance measured here is the one a
vLLM draft of the same weights would see.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

import torch

from hisparse.engine.dsa.model import DSAForward
from hisparse.models.dsa import weights as dsa_weights
from hisparse.models.dsa.decoder import linear, mlp, moe, rms_norm
from hisparse.models.dsa.weights import Checkpoint, CheckpointError

_HEAD = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


@dataclass
class MTPHead:
    """The MTP layer's parts around its decoder layer (which ``MTPModel.ck`` holds as layer
    ``index``)."""

    index: int
    embed: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor
    head_norm: torch.Tensor
    head: torch.Tensor


def load_mtp(d: Union[str, Path], ck: Checkpoint, device: torch.device):
    """(checkpoint with the MTP decoder layer appended as layer ``num_hidden_layers``, its
    ``MTPHead``) of the checkpoint directory ``d`` whose target ``ck`` is loaded already. Only the
    first MTP layer is read (one speculative token). One-line errors, before any weights are
    read."""
    d = Path(d)
    n = int(ck.hf.get("num_nextn_predict_layers") or 0)
    if n < 1:
        raise CheckpointError(f"{d}: config.json has no MTP layer (num_nextn_predict_layers)")
    i = ck.cfg.num_layers
    p = f"model.layers.{i}."
    block = dsa_weights.fp8_block(ck.hf, d)
    entries = dsa_weights.check_headers(dsa_weights.weight_files(d), ck.hf, ck.cfg, block)
    mine = {k: e for k, e in entries.items() if k.startswith(p)}
    if p + "self_attn.indexer.wk.weight" not in mine:
        # A shared-indexer MTP layer would need the target's top-k of the same positions, which
        # the draft's own forward does not have.
        raise CheckpointError(f"{d}: the MTP layer {i} has no indexer ({p}self_attn.indexer.*)")
    dense = p + "mlp.gate.weight" not in mine
    cfg = replace(ck.cfg, num_layers=i + 1, indexer_types=ck.cfg.indexer_types + ("full",))
    spec = replace(ck.spec, dense=tuple(ck.spec.dense) + (dense,))
    for name in dsa_weights._required(cfg, spec, i) + [p + s for s in _HEAD]:
        if not dsa_weights._present(name, mine):
            raise CheckpointError(f"{d}: the weights lack {name!r} (MTP layer)")
    t = dsa_weights._read(mine, block, device)
    dsa_weights._unfuse_experts(t)
    sub = dsa_weights._layer
    ext = replace(
        ck,
        cfg=cfg,
        spec=spec,
        attn=ck.attn + [sub(t, p + "self_attn.")],
        ffn=ck.ffn + [sub(t, p + "mlp.")],
        norms=ck.norms + [sub(t, p)],
    )
    head = MTPHead(
        index=i,
        # DeepSeek-V3.2 stores the embedding and head again under the MTP layer; without them
        # they are the target's (vLLM shares them the same way).
        embed=t.get(p + "embed_tokens.weight", ck.embed),
        enorm=t[p + "enorm.weight"],
        hnorm=t[p + "hnorm.weight"],
        eh_proj=t[p + "eh_proj.weight"],
        head_norm=t[p + "shared_head.norm.weight"],
        head=t.get(p + "shared_head.head.weight", ck.lm_head),
    )
    return ext, head


class MTPModel:
    """Target and draft forwards over one store whose last layer is the MTP layer's."""

    def __init__(self, fwd: DSAForward, head: MTPHead) -> None:
        if fwd.cfg.num_layers != head.index + 1:
            raise ValueError("the forward's checkpoint must be load_mtp's (MTP layer last)")
        self.fwd, self.head = fwd, head
        self.eps = fwd.spec.rms_norm_eps

    def _layer(self, i: int, x, rope, store, batch, slots, nd, sel):
        f = self.fwd
        h = rms_norm(x, f.ck.norms[i]["input_layernorm.weight"], self.eps)
        o, sel = f._attention(i, h, rope, store, batch, slots, nd, sel)
        x = x + o
        h = rms_norm(x, f.ck.norms[i]["post_attention_layernorm.weight"], self.eps)
        w = f.ck.ffn[i]
        return x + (mlp(h, w) if f.spec.dense[i] else moe(h, w, f.spec)), sel

    @torch.no_grad()
    def target(self, store, tokens, batch, want, nd):
        """(hidden [T, H] after the final norm, logits [len(want), vocab]) of the target's layers
        over ``tokens``; ``nd``: the leading decodes (``model.Decodes``, or a count of one-token
        decodes)."""
        f = self.fwd
        slots = batch.slots(batch.positions.view(-1, 1)).view(-1)
        rope = f.rotary(batch.positions)
        x, sel = f.ck.embed[tokens], None
        for i in range(self.head.index):
            x, sel = self._layer(i, x, rope, store, batch, slots, nd, sel)
        h = rms_norm(x, f.ck.norm, self.eps)
        return h, linear(h[want], f.ck.lm_head)

    @torch.no_grad()
    def draft(self, store, tokens, hidden, batch, want, nd) -> torch.Tensor:
        """Draft logits [len(want), vocab] (each predicts the token two after its position):
        ``tokens[j]`` is the token that follows position ``batch.positions[j]``, ``hidden[j]``
        the target's hidden state at that position; ``nd`` as in ``target``."""
        m = self.head
        e = m.embed[tokens]
        e = torch.where(batch.positions.view(-1, 1) == 0, torch.zeros_like(e), e)
        x = torch.cat([rms_norm(e, m.enorm, self.eps), rms_norm(hidden, m.hnorm, self.eps)], -1)
        x = linear(x, m.eh_proj)
        slots = batch.slots(batch.positions.view(-1, 1)).view(-1)
        rope = self.fwd.rotary(batch.positions)
        x, _ = self._layer(m.index, x, rope, store, batch, slots, nd, None)
        return linear(rms_norm(x[want], m.head_norm, self.eps), m.head)


def discard(store, rid: str, keys) -> None:
    """Rows at ``keys`` of request ``rid`` hold rejected draft tokens: the next step rewrites
    them before any read, and in HiSparse mode their hot copies are dropped (the connector's
    scheduler side), so no later decode serves the rejected row."""
    own: Optional[object] = getattr(store, "discard", None)
    if own is not None:
        own(rid, keys)
    elif getattr(store, "sched", None) is not None:
        store.sched.invalidate_keys(rid, list(keys))
