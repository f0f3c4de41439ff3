"""The ``vllm.general_plugins`` entry point: registers hisparse's model architectures (the
DeepSeek-V3.2 / GLM-5 classes and their MTP draft).

vLLM calls ``register()`` in every process it starts (engine core, workers, API server). It names
each model class by its import path and installs hisparse's few vLLM patches
(``hisparse.vllm.patches``: the connector name, the early refusal, the KV sizing).
"""

from __future__ import annotations

import logging


def register() -> None:
    from vllm import ModelRegistry

    from hisparse.vllm.patches import install

    install()
    # DeepSeek-V3.2 / GLM-5 with HiSparse-capable attention, under names of their own so vLLM's
    # native classes stay as they are; a checkpoint picks ours with --hf-overrides.
    from hisparse.vllm.dsa import DSA_ARCHITECTURES

    for name, model_class in DSA_ARCHITECTURES.values():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, model_class)
    # Block-FP8 checkpoints: their quantization_config becomes a block size the classes'
    # loader dequantizes with, before vLLM would build FP8 linear methods from it.
    from hisparse.vllm.dsa.weights import register_config_hook

    why = register_config_hook(name for name, _ in DSA_ARCHITECTURES.values())
    if why is not None:
        logging.getLogger("vllm.hisparse").warning(
            "hisparse: FP8 config hook not installed: %s", why
        )
    # The DSA classes' attention op splits vLLM's compiled graphs as vLLM's own attention does.
    why = _add_splitting_op("hisparse::dsa_attention")
    if why is not None:
        logging.getLogger("vllm.hisparse").warning("hisparse: %s", why)
    # --speculative-config method=mtp: the checkpoints' MTP layer through our draft class.
    from hisparse.vllm.dsa.mtp_config import install_draft_override

    why = install_draft_override()
    if why is not None:
        logging.getLogger("vllm.hisparse").warning("hisparse: MTP draft not installed: %s", why)


def _add_splitting_op(name: str):
    """Append ``name`` to the ops vLLM's piecewise compilation splits at (its attention ops);
    None, or why it could not."""
    try:
        from vllm.config.compilation import CompilationConfig
    except ImportError as e:  # pragma: no cover - depends on the vLLM version
        return f"attention op not added to vLLM's splitting ops: {e}"
    ops = getattr(CompilationConfig, "_attention_ops", None)
    if not isinstance(ops, list):
        return "attention op not added to vLLM's splitting ops: no _attention_ops list"
    if name not in ops:
        ops.append(name)
    return None
