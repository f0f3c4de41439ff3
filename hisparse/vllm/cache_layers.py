"""The layers through which a model hisparse serves holds KV in vLLM, and their backend.

vLLM allocates KV cache only for layers registered in ``static_forward_context`` that declare a
spec, binds each one's tensor as ``layer.kv_cache`` and builds per-step metadata with the
layer's backend (``HiSparseCacheBackend``: no attention of its own, only storage and
``hisparse.vllm.step_metadata``). ``CacheLayer`` is one such layer, its cache read back as rows
or blocks (the DSA indexer's key cache is one); ``SparseMLACache`` holds one decoder layer's
latent KV rows (656-B FP8, 1152-B BF16 or f32 bytes). All-resident mode stores every row there;
with the HiSparse connector it declares no spec (vLLM allocates nothing) and the rows live in
the connector's host pool and hot buffers. ``hisparse.vllm.model_check`` finds a model's
HiSparse layers by the ``row_bytes`` / ``group_leader`` a ``SparseMLACache`` carries.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from hisparse.vllm.step_metadata import StepMetadataBuilder


class _NoImpl:
    """The model computes attention itself; vLLM only needs storage and metadata."""

    supports_pcp = False
    supports_dcp = False


class HiSparseCacheBackend(AttentionBackend):
    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "HISPARSE_CACHE"

    @staticmethod
    def get_impl_cls():
        return _NoImpl

    @staticmethod
    def get_builder_cls():
        return StepMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple:
        return (num_blocks, block_size, head_size)


class CacheLayer(nn.Module, AttentionLayerBase):
    """Registers itself with vLLM under ``prefix`` and exposes its bound cache as rows."""

    def __init__(self, prefix: str, row_width: int, dtype: torch.dtype, declare: bool) -> None:
        super().__init__()
        self.prefix = prefix
        self.row_width = row_width
        self.cache_dtype = dtype
        self.declare = declare
        self.kv_cache = torch.tensor([])
        vllm_config = get_current_vllm_config()
        self.block_size = vllm_config.cache_config.block_size
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix!r}")
        ctx[prefix] = self

    def get_attn_backend(self) -> type:
        return HiSparseCacheBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> Optional[KVCacheSpec]:
        if not self.declare:
            return None
        return FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=1,
            head_size=self.row_width,
            head_size_v=0,
            dtype=self.cache_dtype,
        )

    def rows(self) -> torch.Tensor:
        """The bound cache as [num_slots, row_width] (slot = block * block_size + offset)."""
        kv = self.kv_cache
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        if kv.numel() == 0:
            raise RuntimeError(f"layer {self.prefix!r} has no KV cache bound")
        return kv.reshape(-1, self.row_width)

    def blocks(self) -> torch.Tensor:
        """The bound cache as [num_blocks, block_size * row_width] (a paged key cache)."""
        kv = self.rows()
        return kv.view(-1, self.block_size * self.row_width)


class SparseMLACache(CacheLayer):
    """A decoder layer's latent KV rows (bytes). ``group_leader``: the layer owning the top-k."""

    def __init__(self, prefix: str, row_bytes: int, group_leader: str, declare: bool) -> None:
        super().__init__(prefix, row_bytes, torch.uint8, declare)
        self.row_bytes = row_bytes
        self.group_leader = group_leader
