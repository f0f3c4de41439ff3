"""The model math, shared by the vLLM classes and the DSA engine: the KV row formats, the files
every exported checkpoint shares, and the real sparse-attention architectures (DeepSeek-V3.2,
GLM-5).

May import: torch and ``hisparse.ops.limits``. Never the engine, the connector or vLLM.
"""
