"""Block-FP8 weights as the released DeepSeek-V3.2 checkpoints store them, and a seeded generator
of tiny checkpoints in that format.

A quantized linear's ``weight`` is float8_e4m3fn; ``weight_scale_inv`` (float32) holds one scale
per ``weight_block_size`` block, shape ``[ceil(out / bo), ceil(in / bi)]`` (edge blocks are
partial: 576 rows in 128-row blocks is 5 block rows). The weight is ``fp8 value x its block's
scale_inv``. config.json says so with::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                             "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

Which tensors are quantized follows DeepSeek's release (its inference code builds these linears
in FP8 and names the rest bf16/fp32): the attention projections (q_a, q_b, kv_a_proj_with_mqa,
kv_b, o), the indexer's ``wq_b`` and ``wk``, and every MLP / shared-expert / expert projection.
Norms, embeddings, the LM head, the router (``mlp.gate``), biases and the indexer's
``weights_proj`` stay unquantized. GLM-5's FP8 release is assumed to follow the same rule.

    quantize_checkpoint(src_dir, fp8_dir, block=(128, 128), dequantized=ref_dir)
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from hisparse.models.checkpoint_files import write_safetensors
from hisparse.models.dsa.tensor_files import CheckpointError, read_header, read_tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_SUFFIX = ".weight_scale_inv"
DEFAULT_BLOCK = (128, 128)
_QUANTIZED = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|"
    r"indexer\.wk)|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$"
)


def is_quantized(name: str) -> bool:
    """Whether the released convention stores tensor ``name`` as block-FP8."""
    return _QUANTIZED.search(name) is not None


def scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + SCALE_SUFFIX


def weight_name(scale: str) -> str:
    return scale[: -len(SCALE_SUFFIX)] + ".weight"


def quantization_config(block: Sequence[int] = DEFAULT_BLOCK) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [int(block[0]), int(block[1])],
    }


def block_size(quant) -> Optional[Tuple[int, int]]:
    """``weight_block_size`` of a ``quantization_config`` (dict or object; None: unquantized).
    Anything but DeepSeek's block-FP8 is refused in one line."""
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    what = f"config.json: quantization_config {json.dumps(quant, sort_keys=True, default=str)}"
    if str(quant.get("quant_method", "")).lower() != "fp8":
        raise CheckpointError(f"{what} is not read: only block-FP8 (quant_method fp8) is")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{what} is not read: only fmt e4m3 (float8_e4m3fn) is")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{what} is not read: static activation scales are not")
    block = quant.get("weight_block_size")
    ok = isinstance(block, (list, tuple)) and len(block) == 2
    if not ok or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise CheckpointError(
            f"{what} is not read: weight_block_size must be two positive sizes (per-tensor FP8 "
            "is not read)"
        )
    return int(block[0]), int(block[1])


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> Tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize(w: torch.Tensor, block: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block): each block's largest magnitude maps to
    FP8_MAX, as DeepSeek's conversion does."""
    out, inn = w.shape
    bo, bi = block
    ro, ri = scale_shape(w.shape, block)
    padded = w.new_zeros(ro * bo, ri * bi, dtype=torch.float32)
    padded[:out, :inn] = w
    blocks = padded.view(ro, bo, ri, bi)
    # An all-zero block keeps a tiny positive scale: its values quantize to 0 either way.
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-30) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(ro * bo, ri * bi)[:out, :inn].contiguous(), scale.float()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """float32 ``q x scale_inv`` of its block; ValueError when the scale grid does not fit."""
    if q.dim() != 2 or tuple(scale_inv.shape) != scale_shape(q.shape, block):
        raise ValueError(
            f"weight {list(q.shape)} in {list(block)} blocks needs weight_scale_inv "
            f"{list(scale_shape(q.shape, block)) if q.dim() == 2 else '[rows, cols]'}, "
            f"got {list(scale_inv.shape)}"
        )
    out, inn = q.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out]
    return q.float() * s.repeat_interleave(block[1], 1)[:, :inn]


def _read_all(d: Path) -> Dict[str, torch.Tensor]:
    out = {}
    for path in sorted(d.glob("*.safetensors")):
        with open(path, "rb") as f:
            out.update({n: read_tensor(f, e) for n, e in read_header(path).items()})
    return out


def _write(d: Path, tensors: Dict[str, torch.Tensor], shards: int) -> None:
    """One model.safetensors, or ``shards`` files with an index; tensors are dealt round-robin,
    so a weight and its scale land in different files (loaders must pair across files)."""
    d.mkdir(parents=True, exist_ok=True)
    for old in list(d.glob("*.safetensors")) + list(d.glob("model.safetensors.index.json")):
        old.unlink()
    if shards <= 1:
        write_safetensors(d / "model.safetensors", tensors)
        return
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts = [dict() for _ in names]
    for i, (n, t) in enumerate(tensors.items()):
        parts[i % shards][n] = t
    total = sum(write_safetensors(d / f, p) for f, p in zip(names, parts))
    index = {
        "metadata": {"total_size": total},
        "weight_map": {n: f for f, p in zip(names, parts) for n in p},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def _copy_config(src: Path, dst: Path, quant: Optional[dict]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, dst / f.name)
    hf = json.loads((src / "config.json").read_text())
    hf.pop("quantization_config", None)
    if quant is not None:
        hf["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(hf, indent=1) + "\n")


def quantize_checkpoint(
    src: Union[str, Path],
    dst: Union[str, Path],
    block: Sequence[int] = DEFAULT_BLOCK,
    dequantized: Union[str, Path, None] = None,
    shards: int = 1,
) -> Path:
    """Write ``src`` (an unquantized checkpoint directory: transformers-made or
    ``random_checkpoint``) to ``dst`` in block-FP8, with its config, tokenizer and generation
    files. ``dequantized``: also write there the same checkpoint with every quantized weight
    replaced by its float32 dequantization (no quantization_config) - the weights the FP8
    checkpoint stands for, which transformers runs as the reference. Unquantized tensors are
    copied as they are into both. Deterministic: no randomness beyond ``src``'s."""
    src, dst = Path(src), Path(dst)
    block = (int(block[0]), int(block[1]))
    fp8, ref = {}, {}
    for name, t in _read_all(src).items():
        if is_quantized(name) and t.dim() == 2:
            q, s = quantize(t.float(), block)
            fp8[name], fp8[scale_name(name)] = q, s
            ref[name] = dequantize(q, s, block)
        else:
            fp8[name] = ref[name] = t
    _copy_config(src, dst, quantization_config(block))
    _write(dst, fp8, shards)
    if dequantized is not None:
        _copy_config(src, Path(dequantized), None)
        _write(Path(dequantized), ref, shards)
    return dst
