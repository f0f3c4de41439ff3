"""The engine for the real sparse-attention architectures (DeepSeek-V3.2
``DeepseekV32ForCausalLM``, GLM-5 ``GlmMoeDsaForCausalLM``) from their checkpoint directories,
on the CPU or a GPU, over the batched attention core ``hisparse.models.dsa.core`` (the code the
vLLM classes run).

* ``model``    -- one forward step of a batch of requests over a row store;
* ``stores``   -- ``ResidentRows`` (every row on the device) and ``HiSparseRows`` (the connector:
  host pool, per-group resolve, hot buffers);
* ``hybrid`` / ``residency`` -- ``HybridRows``: device pages under a block budget, whole requests
  spilled to the connector's host pool beyond it (and back), decoding in one batch with the
  resident ones;
* ``generate`` -- batched greedy generation in any of the three modes (requests join and
  leave) and the resident-vs-HiSparse parity run (``hisparse demo --model DIR``);
* ``clock`` / ``budget`` -- what a benchmark reads off a run: its decode-only time, and the KV
  bytes it holds on the device by mode (``benchmarks/bench_engine.py``'s budget);
* ``mtp`` / ``mtp_generate`` -- the checkpoint's MTP layer as the draft of greedy speculative
  decoding.
"""
