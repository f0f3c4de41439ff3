"""The reference engine for the real sparse-attention architectures (DeepSeek-V3.2
``DeepseekV32ForCausalLM``, GLM-5 ``GlmMoeDsaForCausalLM``) from their checkpoint directories,
on the CPU or a GPU, with the model math of ``hisparse.models.dsa``.

* ``model``    -- one forward step of one request over a row store;
* ``stores``   -- ``ResidentRows`` (every row on the device) and ``HiSparseRows`` (the connector:
  host pool, per-group resolve, hot buffers);
* ``generate`` -- greedy generation in either mode and the resident-vs-HiSparse parity run
  (``hisparse demo --model DIR``).
"""
