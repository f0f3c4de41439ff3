"""The reference model's KV-holding layers as vLLM sees them, and their attention backend.

vLLM allocates KV cache only for layers registered in ``static_forward_context`` that declare a
spec, binds each one's tensor as ``layer.kv_cache`` and builds per-step metadata with the
layer's backend. Two kinds of layer:

* ``SparseMLACache`` (one per decoder layer): the layer's latent KV rows (656-B FP8 or 1152-B
  BF16). All-resident mode stores every row here; with the HiSparse connector it declares no
  spec (vLLM allocates nothing) and the rows live in the connector's host pool + hot buffers.
* ``IndexerCache`` (one per index group): the indexer's key and query vector of every token,
  always on the device. Its block table is the one every layer uses; ``slot_mapping`` values
  are the tokens' keys (host row ids) in HiSparse mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from hisparse.vllm.settings import decode_query_len


@dataclass
class StepMetadata:
    """One step's batch as the model reads it (the same object for every layer).

    Requests are batch rows in vLLM's order, requests with at most ``decode_len`` query tokens
    (decodes: one token, or 1 + num_speculative_tokens under speculative decoding) first
    (``reorder_batch_threshold``). ``query_start`` is a host list taken from vLLM's own host copy
    (no device sync); everything else is on the device. Tokens of row r are
    ``query_start[r]:query_start[r+1]`` at positions ``seq_lens[r] - q_len .. seq_lens[r] - 1``."""

    num_reqs: int
    query_start: List[int]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    seq_lens_dev: torch.Tensor  # int32 [num_reqs], device
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_size: int
    num_decodes: int  # leading rows with at most decode_len query tokens
    decode_len: int = 1
    # The speculative draft's pass: 0 for the target and the draft's first pass (the step's
    # scheduled tokens), k for its k-th later pass (one token per row, past them).
    draft_index: int = 0

    @property
    def num_tokens(self) -> int:
        return self.query_start[self.num_reqs]

    @property
    def seq_lens(self) -> List[int]:
        """Host copy of the sequence lengths: a device sync on CUDA. Only the exported reference
        model reads it; the DSA classes stay on the device."""
        return self.seq_lens_dev.cpu().tolist()


class StepMetadataBuilder(AttentionMetadataBuilder[StepMetadata]):
    # Decodes first: the model then finds them as the leading rows without a device read.
    # Under speculative decoding a decode verifies its draft tokens too (``__init__``).
    reorder_batch_threshold = 1

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list,
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device
        self.reorder_batch_threshold = decode_query_len(vllm_config)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> StepMetadata:
        c = common_attn_metadata
        n = c.num_reqs
        qsl = c.query_start_loc_cpu[: n + 1].tolist()
        q = self.reorder_batch_threshold
        decodes = 0
        while decodes < n and 1 <= qsl[decodes + 1] - qsl[decodes] <= q:
            decodes += 1
        return StepMetadata(
            num_reqs=n,
            query_start=qsl,
            query_start_loc=c.query_start_loc[: n + 1],
            seq_lens_dev=c.seq_lens[:n],
            block_table=c.block_table_tensor[:n],
            slot_mapping=c.slot_mapping[: qsl[n]].long(),
            block_size=self.kv_cache_spec.block_size,
            num_decodes=decodes,
            decode_len=q,
        )

    def build_for_drafting(self, common_attn_metadata, draft_index: int) -> StepMetadata:
        meta = self.build(0, common_attn_metadata, fast_build=True)
        meta.draft_index = draft_index
        return meta


class _NoImpl:
    """The model computes attention itself; vLLM only needs storage and metadata."""

    supports_pcp = False
    supports_dcp = False


class HiSparseReferenceBackend(AttentionBackend):
    supported_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "HISPARSE_REFERENCE"

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


class _CacheLayer(nn.Module, AttentionLayerBase):
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
        return HiSparseReferenceBackend

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


class SparseMLACache(_CacheLayer):
    """A decoder layer's latent KV rows (bytes). ``group_leader``: the layer owning the top-k."""

    def __init__(self, prefix: str, row_bytes: int, group_leader: str, declare: bool) -> None:
        super().__init__(prefix, row_bytes, torch.uint8, declare)
        self.row_bytes = row_bytes
        self.group_leader = group_leader


class IndexerCache(_CacheLayer):
    """An index group's indexer key and query per token (float32, [key | query])."""

    def __init__(self, prefix: str, indexer_dim: int) -> None:
        super().__init__(prefix, 2 * indexer_dim, torch.float32, True)
