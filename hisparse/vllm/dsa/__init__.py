"""DeepSeek-V3.2 and GLM-5 as vLLM architectures whose sparse attention reads latent rows from
vLLM's KV cache (all-resident) or through the HiSparse connector.

Registered by ``hisparse.vllm.plugin`` as ``HiSparseDeepseekV32ForCausalLM`` and
``HiSparseGlmMoeDsaForCausalLM``; a checkpoint selects one with
``--hf-overrides '{"architectures": ["HiSparseDeepseekV32ForCausalLM"]}'``.
"""

#: Our architecture name -> the model class import path, by checkpoint architecture.
DSA_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": (
        "HiSparseDeepseekV32ForCausalLM",
        "hisparse.vllm.dsa.model:HiSparseDeepseekV32ForCausalLM",
    ),
    "GlmMoeDsaForCausalLM": (
        "HiSparseGlmMoeDsaForCausalLM",
        "hisparse.vllm.dsa.model:HiSparseGlmMoeDsaForCausalLM",
    ),
    # Both checkpoints' MTP draft (vLLM's name for it; ours reached through the callable
    # ``hisparse.vllm.dsa.mtp.hf_overrides``).
    "DeepseekV32MTPModel": (
        "HiSparseDeepseekV32MTP",
        "hisparse.vllm.dsa.mtp:HiSparseDeepseekV32MTP",
    ),
}


def override_hint(archs: str) -> str:
    """The ``--hf-overrides`` that serves a checkpoint of ``archs`` with our class ('' if none)."""
    for checkpoint_arch, (ours, _) in DSA_ARCHITECTURES.items():
        if checkpoint_arch in archs.split(", "):
            return f"""--hf-overrides '{{"architectures": ["{ours}"]}}'"""
    return ""
