"""The ``vllm.general_plugins`` entry point: registers the reference model's architecture.

vLLM calls ``register()`` in every process it starts (engine core, workers, API server). It only
names the model class by its import path, so nothing heavy is imported here.
"""

from __future__ import annotations

from hisparse.models.checkpoint import ARCHITECTURE

MODEL_CLASS = "hisparse.vllm.model:HiSparseMLAForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
