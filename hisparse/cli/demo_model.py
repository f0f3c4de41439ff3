"""The checkpoint `hisparse demo` and `hisparse bench` run on the DSA engine: ``--model DIR`` (a
DeepSeek-V3.2 / GLM-5 checkpoint directory), or by default a tiny seeded one written to a
temporary directory: ``hisparse.models.dsa.random_checkpoint``'s config and weights (real latent
sizes, a few layers and experts), shaped by ``--arch``, ``--layers``, ``--index-share``,
``--top-k``, ``--seed`` and ``--drift``.

One change to the random weights: each token embedding is ``sqrt(1 - drift) * shared +
sqrt(drift) * own``, one shared random vector mixed into all. With independent embeddings
(drift 1) the indexer's query jumps at every decode step and selects nearly at random, so a hot
buffer of h rows over c context rows hits about h / c of the time; a trained model's queries
move slowly from step to step, which is what the hot buffers exploit.

Flags are declared here too; torch is imported only when a checkpoint is read or written.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hisparse.cli.errors import CommandError
from hisparse.cli.flags import float_range, int_range
from hisparse.ops.limits import MAX_HOT_SIZE

ARCHS = {"glm_moe_dsa": "GLM-5", "deepseek_v32": "DeepSeek-V3.2"}
#: The generated checkpoint's shape where its flags are left out (their defaults read None).
GENERATED = dict(arch="glm_moe_dsa", layers=4, index_share=2, top_k=16, seed=0, drift=0.1)
#: The generated checkpoint's positions at least (longer workloads get theirs).
MIN_POSITIONS = 512


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """The model group of `demo` and `bench`: a checkpoint directory, or the generated one."""
    g = p.add_argument_group(
        "model (a DeepSeek-V3.2 / GLM-5 checkpoint; by default a tiny seeded one, generated)"
    )
    g.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM checkpoint directory "
        "(config.json + safetensors) instead of the generated one; the flags below are then "
        "the checkpoint's own",
    )
    g.add_argument(
        "--arch", choices=tuple(ARCHS), default=None, help="architecture (default: glm_moe_dsa)"
    )
    g.add_argument(
        "--layers", type=int_range(1, 64), default=None, help="decoder layers (default: 4)"
    )
    g.add_argument(
        "--index-share",
        type=int_range(1, 64),
        default=None,
        help="layers per index group, a full indexer layer and the shared ones reusing its "
        "top-k; GLM-5 only (default: 2; DeepSeek-V3.2: 1)",
    )
    g.add_argument(
        "--top-k",
        type=int_range(1, MAX_HOT_SIZE),
        default=None,
        help="tokens the indexer selects per request per step (default: 16)",
    )
    g.add_argument(
        "--seed", type=int_range(0, 2**31 - 1), default=None, help="weights seed (default: 0)"
    )
    g.add_argument(
        "--drift",
        type=float_range(0.0, 1.0),
        default=None,
        help="how far the token embeddings differ: 0 = all alike (the indexer's query barely "
        "moves between steps), 1 = independent random (it selects nearly at random) "
        "(default: 0.1)",
    )


@dataclass
class ModelChoice:
    """The checkpoint to run, its configs read or made (no weights yet)."""

    directory: Optional[str]  # None: generated
    hf: dict
    cfg: object  # hisparse.models.dsa.config.DSAConfig
    max_positions: int
    seed: Optional[int] = None
    drift: Optional[float] = None

    @property
    def index_groups(self) -> int:
        return sum(self.cfg.is_full(i) for i in range(self.cfg.num_layers))

    def describe(self) -> str:
        c = self.cfg
        what = (
            f"{self.directory} ({c.arch})"
            if self.directory
            else f"a tiny {ARCHS[c.arch]} checkpoint ({c.arch}, seed {self.seed}, "
            f"drift {self.drift:g}), generated"
        )
        n = self.index_groups
        groups = f"{n} index group{'s' if n > 1 else ''}"
        return f"{what}: {c.num_layers} layers in {groups}, top-k {c.index_topk}"

    def to_dict(self) -> dict:
        return dict(
            directory=self.directory,
            arch=self.cfg.arch,
            layers=self.cfg.num_layers,
            index_groups=self.index_groups,
            index_topk=self.cfg.index_topk,
            seed=self.seed,
            drift=self.drift,
        )


def choose(args: argparse.Namespace, context: int) -> ModelChoice:
    """The checkpoint the flags name, for contexts of up to ``context`` tokens: one line naming
    the flag to change otherwise, before any weights are read or written."""
    if args.model is not None:
        for dest in GENERATED:
            if getattr(args, dest) is not None:
                flag = "--" + dest.replace("_", "-")
                raise CommandError(
                    f"argument {flag}: shapes the generated checkpoint; --model {args.model} "
                    "has its own (leave it out)",
                    2,
                )
        return _read(args.model)
    v = {k: d if getattr(args, k) is None else getattr(args, k) for k, d in GENERATED.items()}
    if args.index_share is None and v["arch"] == "deepseek_v32":
        v["index_share"] = 1
    if v["arch"] == "deepseek_v32" and v["index_share"] != 1:
        raise CommandError(
            "argument --index-share: DeepSeek-V3.2 runs every layer's indexer (1), "
            f"got {v['index_share']}; --arch glm_moe_dsa shares them",
            2,
        )
    if v["index_share"] > v["layers"]:
        raise CommandError(
            f"argument --index-share: must be <= --layers ({v['layers']}), got {v['index_share']}",
            2,
        )
    # config.json's rule: the indexer never selects more tokens than the model has positions
    return _generated(v, max(MIN_POSITIONS, context, v["top_k"]))


def _read(directory: str) -> ModelChoice:
    from hisparse.models.dsa.weights import CheckpointError, checkpoint_config

    try:
        cfg, spec, hf = checkpoint_config(directory)
    except CheckpointError as e:
        raise CommandError(str(e), 2) from None
    limit = min(spec.max_positions, cfg.rope_positions() or spec.max_positions)
    return ModelChoice(directory, hf, cfg, limit)


def _generated(v: dict, positions: int) -> ModelChoice:
    from hisparse.models.dsa.config import DSAConfig
    from hisparse.models.dsa.random_checkpoint import random_config

    over = dict(
        num_hidden_layers=v["layers"], index_topk=v["top_k"], max_position_embeddings=positions
    )
    if v["arch"] == "glm_moe_dsa":
        share = v["index_share"]
        over["indexer_types"] = ["shared" if i % share else "full" for i in range(v["layers"])]
    hf = random_config(v["arch"], **over)
    return ModelChoice(None, hf, DSAConfig.from_hf(hf), positions, v["seed"], v["drift"])


def write_checkpoint(out: Path, choice: ModelChoice) -> Path:
    """The generated checkpoint's config.json and model.safetensors in ``out``."""
    import torch

    from hisparse.models.checkpoint_files import write_safetensors
    from hisparse.models.dsa.random_checkpoint import random_weights

    w = random_weights(choice.hf, choice.seed)
    own = w["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(choice.seed + 1)
    shared = own.std() * torch.randn(own.shape[1], generator=gen)
    w["model.embed_tokens.weight"] = (1 - choice.drift) ** 0.5 * shared + choice.drift**0.5 * own
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", w)
    (out / "config.json").write_text(json.dumps(choice.hf, indent=1) + "\n")
    return out


def load(choice: ModelChoice, device):
    """The checkpoint's weights on ``device`` (a generated one is written to a temporary
    directory, read back as any checkpoint is, and the directory removed)."""
    from hisparse.models.dsa.weights import CheckpointError, load_checkpoint

    try:
        if choice.directory is not None:
            return load_checkpoint(choice.directory, device)
        with tempfile.TemporaryDirectory(prefix="hisparse-demo-") as tmp:
            return load_checkpoint(write_checkpoint(Path(tmp), choice), device)
    except CheckpointError as e:
        raise CommandError(str(e), 2) from None
