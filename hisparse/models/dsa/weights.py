"""A DeepSeek-V3.2 / GLM-5 checkpoint directory read without transformers or numpy: config.json,
safetensors by the tensor names transformers writes (one file or an index of shards), every
tensor to float32 on one device. Unquantized checkpoints (F32 / F16 / BF16 / F64) and DeepSeek's
block-FP8 ones (``hisparse.models.dsa.fp8_weights``: dequantized here, at load) are read. The
inverse for tests and demos, a seeded tiny checkpoint with the same config fields and tensor
names written without transformers, is ``hisparse.models.dsa.random_checkpoint``
(``make_checkpoint`` makes them with transformers).

``load_checkpoint(dir, device)`` -> ``Checkpoint`` (configs, the embedding / norm / head, and per
layer the ``self_attn.*`` and ``mlp.*`` tensors keyed by suffix). Every error is one line naming
the directory, file or tensor that is wrong; every header (offsets, dtypes, byte spans, shapes
against config.json) is checked before a byte of tensor data is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch

from hisparse.models.dsa import fp8_weights as fp8
from hisparse.models.dsa.config import DSAConfig, DSAConfigError
from hisparse.models.dsa.decoder import DecoderSpec
from hisparse.models.dsa.tensor_files import CheckpointError, Entry, read_header, read_tensor
from hisparse.models.dsa.weight_shapes import expected_shapes, shape_error


def read_safetensors(path: Union[str, Path], device: torch.device) -> Dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, as float32 on ``device`` (FP8 values as stored)."""
    path = Path(path)
    entries = read_header(path)
    with open(path, "rb") as f:
        return {
            n: read_tensor(f, e).to(device=device, dtype=torch.float32) for n, e in entries.items()
        }


def _check_dtype(e: Entry, entries: Mapping[str, Entry], block) -> None:
    """The FP8 rules: F8_E4M3 only for the quantized linears of a block-FP8 config, each with
    its weight_scale_inv; a weight_scale_inv only beside an F8_E4M3 weight."""
    if e.dtype == "F8_E4M3":
        if block is None:
            raise CheckpointError(
                f"{e.where()} is F8_E4M3; only unquantized checkpoints are read when config.json "
                "has no block-FP8 quantization_config"
            )
        if not fp8.is_quantized(e.name):
            raise CheckpointError(
                f"{e.where()} is F8_E4M3, but block-FP8 checkpoints keep it unquantized"
            )
        if fp8.scale_name(e.name) not in entries:
            raise CheckpointError(
                f"{e.where()} is F8_E4M3 but no file holds {fp8.scale_name(e.name)!r}"
            )
    elif e.name.endswith(fp8.SCALE_SUFFIX):
        w = entries.get(fp8.weight_name(e.name))
        if w is None or w.dtype != "F8_E4M3":
            raise CheckpointError(
                f"{e.where()} scales {fp8.weight_name(e.name)!r}, which the checkpoint holds "
                f"{'as ' + w.dtype if w is not None else 'nowhere'} (not F8_E4M3)"
            )


def check_headers(
    files: Iterable[Path], hf, cfg: DSAConfig, block: Optional[Sequence[int]]
) -> Dict[str, Entry]:
    """Every tensor entry of ``files`` by name, each checked against its file, the FP8 rules and
    the shape config.json gives it; no tensor data is read. One line naming file and tensor."""
    entries: Dict[str, Entry] = {}
    for path in files:
        for name, e in read_header(path).items():
            if name in entries:
                raise CheckpointError(
                    f"{e.where()} is also in {entries[name].path} (which one is meant?)"
                )
            entries[name] = e
    expected = expected_shapes(hf, cfg, block)
    for name, e in entries.items():
        _check_dtype(e, entries, block)
        want = expected.get(name)
        if want is not None and e.shape != want:
            raise CheckpointError(shape_error(str(e.path), name, e.shape, want))
    return entries


def weight_files(d: Path) -> List[Path]:
    """The safetensors files of ``d``: the shards its index names, else every *.safetensors."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e!r})") from None
        missing = [s for s in shards if not (d / str(s)).is_file()]
        if missing:
            raise CheckpointError(f"{index} names {missing[0]!r}, which {d} does not hold")
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


def fp8_block(hf: Mapping, d: Union[str, Path]) -> Optional[Sequence[int]]:
    """The checkpoint's FP8 block size (None: unquantized), refused in one line if unreadable."""
    try:
        return fp8.block_size(hf.get("quantization_config"))
    except CheckpointError as e:
        raise CheckpointError(f"--model {d}: {e}") from None


def _present(name: str, entries: Mapping[str, Entry]) -> bool:
    if name in entries:
        return True
    p = name.split(".mlp.experts.")[0] + ".mlp.experts."
    return ".mlp.experts." in name and p + "gate_up_proj" in entries


def _read(entries: Mapping[str, Entry], block, device: torch.device) -> Dict[str, torch.Tensor]:
    """Every tensor as float32 on ``device``, FP8 weights dequantized by their scales."""
    by_file: Dict[Path, List[Entry]] = {}
    for e in entries.values():
        by_file.setdefault(e.path, []).append(e)
    raw: Dict[str, torch.Tensor] = {}
    for path, es in by_file.items():
        with open(path, "rb") as f:
            raw.update({e.name: read_tensor(f, e) for e in es})
    out = {}
    for name, t in raw.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue
        if t.dtype == fp8.FP8:
            t = fp8.dequantize(t, raw[fp8.scale_name(name)], block)
        out[name] = t.to(device=device, dtype=torch.float32)
    return out


def load_checkpoint(d: Union[str, Path], device: torch.device) -> Checkpoint:
    """Configs first, then every header (against its file and config.json), then the weights
    onto ``device``: nothing is read or computed before a one-line error could be raised."""
    d = Path(d)
    cfg, spec, hf = checkpoint_config(d)
    block = fp8_block(hf, d)
    entries = check_headers(weight_files(d), hf, cfg, block)
    for i in range(cfg.num_layers):
        for name in _required(cfg, spec, i):
            if not _present(name, entries):
                raise CheckpointError(f"{d}: the weights lack {name!r}")
    tensors = _read(entries, block, device)
    _unfuse_experts(tensors)
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
