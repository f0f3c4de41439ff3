"""Triton kernels of the DSA attention core on CUDA (``hisparse.models.dsa.core``):

* ``rows``    -- the selected FP8 rows read and decoded to bf16 in one pass (``gather_decode``);
* ``mla``     -- sparse MLA decode over FP8 rows in one kernel, split-KV for small batches; the
  softmax of the batched-products path with the padding masked inside;
* ``indexer`` -- the DSA indexer's scores over a paged FP8 key cache (block table), the weights
  and ReLU fused, no [tokens, heads, context] logits; the fp8 key store;
* ``select``  -- the top-k's positions to sorted slots through the block table.

Each has a torch reference in ``hisparse.models.dsa`` (the CPU path and the tests' oracle).
"""
