"""One step's batch as the sparse-attention models read it, built by vLLM once per step.

vLLM builds attention metadata per KV-cache group with the builder of the layers' backend
(``hisparse.vllm.cache_layers``); every model hisparse serves (the DeepSeek-V3.2 / GLM-5
classes and their MTP draft) reads the same ``StepMetadata``: batch rows in vLLM's
order with the decodes first, their query ranges, sequence lengths, block table and the new
tokens' slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheSpec

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
