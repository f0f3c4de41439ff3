"""A DeepSeek-V3.2 / GLM-5 checkpoint directory read without transformers or numpy: config.json,
safetensors by the tensor names transformers writes (one file or an index of shards), every
tensor to float32 on one device. The inverse for tests and demos, a seeded tiny checkpoint with
the same config fields and tensor names written without transformers, is
``hisparse.models.dsa.random_checkpoint`` (``make_checkpoint`` makes them with transformers).

``load_checkpoint(dir, device)`` -> ``Checkpoint`` (configs, the embedding / norm / head, and per
layer the ``self_attn.*`` and ``mlp.*`` tensors keyed by suffix). Every error is one line naming
the directory, file or tensor that is wrong.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Union

import torch

from hisparse.models.dsa.config import DSAConfig, DSAConfigError
from hisparse.models.dsa.decoder import DecoderSpec

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


class CheckpointError(ValueError):
    """The directory is not a readable DSA checkpoint (the message names what is wrong)."""


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        try:
            return json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path} has no valid safetensors header ({e})") from None


def read_safetensors(path: Path, device: torch.device) -> Dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, as float32 on ``device``."""
    header = _header(path)
    base = 8 + struct.unpack("<Q", path.open("rb").read(8))[0]
    out = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(
                    f"{path.name}: tensor {name!r} is {info['dtype']}; only unquantized "
                    f"checkpoints ({', '.join(_DTYPES)}) are read"
                )
            lo, hi = info["data_offsets"]
            f.seek(base + lo)
            raw = bytearray(f.read(hi - lo))
            t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            out[name] = t.reshape(info["shape"]).to(device=device, dtype=torch.float32)
    return out


def _weight_files(d: Path) -> List[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d} holds no *.safetensors weights")
    return files


def read_config(d: Union[str, Path]) -> dict:
    """config.json of ``d`` as a dict; one-line errors for a missing dir or file."""
    d = Path(d)
    if not d.is_dir():
        raise CheckpointError(f"--model {d}: no such directory")
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"--model {d}: no config.json (not a checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None


@dataclass
class Checkpoint:
    cfg: DSAConfig
    spec: DecoderSpec
    hf: dict
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    attn: List[Dict[str, torch.Tensor]]  # per layer: self_attn.* by suffix
    ffn: List[Dict[str, torch.Tensor]]  # per layer: mlp.* by suffix
    norms: List[Dict[str, torch.Tensor]]  # per layer: input / post_attention layernorm


def _unfuse_experts(tensors: Dict[str, torch.Tensor]) -> None:
    """Expert weights stored fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj`` [E, H, I], transformers' in-memory layout) -> the per-expert names
    ``mlp.experts.{e}.gate_proj.weight`` ... that checkpoints on disk use."""
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        p = name[: -len("gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(p + "down_proj", None)
        if down is None:
            raise CheckpointError(f"the weights hold {name!r} but not {p + 'down_proj'!r}")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            tensors[f"{p}{e}.gate_proj.weight"] = gate_up[e, :inter]
            tensors[f"{p}{e}.up_proj.weight"] = gate_up[e, inter:]
            tensors[f"{p}{e}.down_proj.weight"] = down[e]


def _need(tensors: Mapping[str, torch.Tensor], name: str, d: Path) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"{d}: the weights lack {name!r}")
    return t


def _layer(tensors: Mapping[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _required(cfg: DSAConfig, spec: DecoderSpec, i: int) -> List[str]:
    p = f"model.layers.{i}."
    names = [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")]
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm"]
    attn += ["kv_b_proj", "o_proj"]
    if cfg.is_full(i):
        attn += ["indexer.wq_b", "indexer.wk", "indexer.k_norm", "indexer.weights_proj"]
    names += [f"{p}self_attn.{a}.weight" for a in attn]
    mlp = ["gate_proj", "up_proj", "down_proj"]
    if spec.dense[i]:
        return names + [f"{p}mlp.{m}.weight" for m in mlp]
    names += [f"{p}mlp.gate.weight", f"{p}mlp.gate.e_score_correction_bias"]
    names += [f"{p}mlp.shared_experts.{m}.weight" for m in mlp]
    return names + [f"{p}mlp.experts.{e}.{m}.weight" for e in range(spec.n_experts) for m in mlp]


def checkpoint_config(d: Union[str, Path]):
    """(DSAConfig, DecoderSpec, config dict) of ``d``: cheap, checked before any weights."""
    hf = read_config(d)
    try:
        cfg = DSAConfig.from_hf(hf)
        return cfg, DecoderSpec.from_hf(hf, cfg), hf
    except DSAConfigError as e:
        raise CheckpointError(f"--model {d} is not a DSA checkpoint we run: {e}") from None


def load_checkpoint(d: Union[str, Path], device: torch.device) -> Checkpoint:
    """Configs first (cheap, one-line errors), then the weights onto ``device``."""
    d = Path(d)
    cfg, spec, hf = checkpoint_config(d)
    tensors: Dict[str, torch.Tensor] = {}
    for f in _weight_files(d):
        tensors.update(read_safetensors(f, device))
    _unfuse_experts(tensors)
    for i in range(cfg.num_layers):
        for name in _required(cfg, spec, i):
            _need(tensors, name, d)
    embed = _need(tensors, "model.embed_tokens.weight", d)
    head = tensors.get("lm_head.weight", embed if spec.tie_embeddings else None)
    layers = range(cfg.num_layers)
    return Checkpoint(
        cfg=cfg,
        spec=spec,
        hf=hf,
        embed=embed,
        norm=_need(tensors, "model.norm.weight", d),
        lm_head=head if head is not None else _need(tensors, "lm_head.weight", d),
        attn=[_layer(tensors, f"model.layers.{i}.self_attn.") for i in layers],
        ffn=[_layer(tensors, f"model.layers.{i}.mlp.") for i in layers],
        norms=[_layer(tensors, f"model.layers.{i}.") for i in layers],
    )
