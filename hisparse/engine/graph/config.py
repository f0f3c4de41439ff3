"""Shapes of the graph step (layers of the DSA attention core with random weights) and the
device-memory arithmetic behind its capacity figures.

`GraphConfig.deepseek_v32()` is DeepSeek-V3.2's attention (MLA, 128 heads, a 512-wide latent plus
64 rope values stored as the 656-byte FP8 row; the DSA indexer, 64 heads x 128; top-k 2048). The
MoE is replaced by a dense SwiGLU MLP whose width is the MoE's active width per token (8 routed +
1 shared expert x 2048 = 18432), so each layer does the same matrix work per token as the real
one. `GraphConfig.tiny()` keeps the row layout (it is fixed by the bytes) and shrinks everything
else so the step runs on the CPU in a unit test. `dsa_config()` is the same shapes as the
`DSAConfig` the core takes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.rows import KV_DIM, LATENT_DIM, ROPE_DIM, ROW_FORMATS

ROW_BYTES = ROW_FORMATS["fp8"].row_bytes  # 656
# DSA indexer cache per token: 128 fp8 values + one fp32 scale (what DeepSeek-V3.2 stores).
INDEXER_BYTES_FP8 = 128 + 4
GIB = 1 << 30


@dataclass(frozen=True)
class GraphConfig:
    hidden: int = 7168
    heads: int = 128
    q_lora: int = 1536
    nope: int = 128  # per-head query/key width absorbed into the latent
    v_head: int = 128
    idx_heads: int = 64
    idx_dim: int = 128
    top_k: int = 2048
    hot_size: int = 4096  # hot-buffer rows per request (the setting)
    ctx_len: int = 32768  # context tokens per request (fixed for the run)
    layers: int = 4
    mlp_inter: int = 18432
    vocab: int = 129280
    seed: int = 0

    @classmethod
    def deepseek_v32(cls, **kw) -> "GraphConfig":
        return replace(cls(), **kw)

    @classmethod
    def tiny(cls, **kw) -> "GraphConfig":
        base = cls(
            hidden=64,
            heads=4,
            q_lora=32,
            nope=16,
            v_head=16,
            idx_heads=4,
            idx_dim=64,  # at least the 64 rope values
            top_k=32,
            hot_size=48,
            ctx_len=256,
            layers=2,
            mlp_inter=96,
            vocab=101,
        )
        return replace(base, **kw)

    @property
    def latent(self) -> int:
        return LATENT_DIM

    @property
    def rope(self) -> int:
        return ROPE_DIM

    @property
    def kv_dim(self) -> int:
        return KV_DIM

    def dsa_config(self) -> DSAConfig:
        """The attention's shapes as a DeepSeek-V3.2 config.json reads them."""
        return DSAConfig.from_hf(
            dict(
                model_type="deepseek_v32",
                num_hidden_layers=self.layers,
                hidden_size=self.hidden,
                num_attention_heads=self.heads,
                q_lora_rank=self.q_lora,
                kv_lora_rank=self.latent,
                qk_rope_head_dim=self.rope,
                qk_nope_head_dim=self.nope,
                v_head_dim=self.v_head,
                index_topk=self.top_k,
                index_n_heads=self.idx_heads,
                index_head_dim=self.idx_dim,
                max_position_embeddings=max(163840, self.ctx_len + 1),
                rope_theta=10000.0,
            )
        )

    def check(self) -> None:
        if not self.top_k <= self.hot_size:
            raise ValueError(f"need top_k <= hot_size, got {self.top_k} > {self.hot_size}")
        if not self.top_k <= self.ctx_len:
            raise ValueError(f"need top_k <= ctx_len, got {self.top_k} > {self.ctx_len}")


@dataclass(frozen=True)
class MemoryBudget:
    """Device bytes left for KV state on one GPU of a full deployment, over the full model's
    layers. Default: DeepSeek-V3.2 (61 layers) on 8 x H200 (~84 GB of FP8 weights per GPU out
    of ~141 GB, ~12 GB kept for activations and graphs): 45 GiB of KV state per GPU."""

    kv_gib: float = 45.0
    model_layers: int = 61

    def per_request_bytes(self, cfg: GraphConfig, resident: bool) -> int:
        """A request's device bytes over all model layers: the indexer cache always stays on the
        device; the MLA rows are the full context (resident) or the hot buffer (HiSparse)."""
        rows = cfg.ctx_len if resident else cfg.hot_size
        per_layer = rows * ROW_BYTES + cfg.ctx_len * INDEXER_BYTES_FP8
        return per_layer * self.model_layers

    def max_batch(self, cfg: GraphConfig, resident: bool) -> int:
        return int(self.kv_gib * GIB // self.per_request_bytes(cfg, resident))
