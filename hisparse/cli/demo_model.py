"""`hisparse demo --model DIR`: a DeepSeek-V3.2 / GLM-5 checkpoint run twice on the DSA engine
(hisparse.engine.dsa) -- every latent row on the device, then HiSparse (rows in the connector's
host pool, per-group resolve into small hot buffers) -- with a token-parity check and a summary.
Exits 1 when the two runs' tokens differ. The flags are declared here too; torch and the engine
are imported only when the command runs (``hisparse --help`` stays fast)."""

from __future__ import annotations

import argparse
import json
import sys

from hisparse.cli.errors import CommandError
from hisparse.cli.flags import int_range


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """`demo --model DIR`: a DeepSeek-V3.2 / GLM-5 checkpoint instead of the reference model."""
    g = p.add_argument_group("checkpoint (DeepSeek-V3.2 / GLM-5, replaces the reference model)")
    g.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM checkpoint directory "
        "(config.json + safetensors); --device, --hot-size, --threads and --json apply",
    )
    g.add_argument(
        "--prompts",
        type=int_range(1, 64),
        default=3,
        help="prompts of at least 4 x index_topk byte tokens (default: 3)",
    )
    g.add_argument(
        "--new-tokens",
        type=int_range(1, 4096),
        default=24,
        help="greedy tokens per prompt (default: 24)",
    )
    g.add_argument(
        "--device-blocks",
        type=int_range(1, 1 << 24),
        default=None,
        metavar="N",
        help="also run hybrid residency under a device budget of N blocks of 16 rows (requests "
        "beyond it spilled to the host pool) and require its tokens equal too (default: off)",
    )


def _hits(c: dict) -> str:
    hits, misses = c.get("hits", 0), c.get("misses", 0)
    rate = hits / (hits + misses) if hits + misses else 0.0
    moved = c.get("host_to_device_bytes", 0)
    return f"{hits} hits, {misses} misses ({rate:.1%} hit rate), {moved} B gathered from host"


def _summary(s: dict) -> list:
    return [
        ("model", f"{s['model']} ({s['arch']}, indexer {'/'.join(s['indexer_types'])})"),
        ("device", s["device"]),
        ("row format", s["row_format"]),
        ("prompts", f"{s['prompts']} x {s['prompt_tokens']} tokens, {s['new_tokens']} new each"),
        ("top-k / hot", f"{s['index_topk']} / {s['hot_size']} rows per layer"),
        ("seconds", ", ".join(f"{m} {t}" for m, t in s["seconds"].items())),
        ("hot buffers", _hits(s["hisparse_counters"])),
        ("sample", repr(s["sample"])),
        ("tokens equal", f"{s['tokens_equal']}/{s['prompts']} prompts"),
    ] + ([("hybrid", _hybrid(s))] if "hybrid_counters" in s else [])


def _hybrid(s: dict) -> str:
    c = s["hybrid_counters"]
    return (
        f"{s['device_blocks']} device blocks: {c['spilled_requests']} requests spilled "
        f"({c['spills']} while decoding), {c['returns']} returned"
    )


def main(args) -> int:
    import torch

    from hisparse.engine.dsa.generate import parity
    from hisparse.models.dsa.weights import CheckpointError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        s = parity(
            args.model,
            torch.device(args.device),
            args.row_format or "f32",
            num_prompts=args.prompts,
            max_new=args.new_tokens,
            hot_size=args.hot_size,
            device_blocks=args.device_blocks,
        )
    except CheckpointError as e:
        raise CommandError(str(e), 2) from None
    for k, v in _summary(s):
        print(f"{k:<16} {v}")
    modes = "resident, HiSparse and hybrid" if "hybrid_counters" in s else "resident and HiSparse"
    verdict = f"PASS: {modes} tokens identical" if s["parity"] else "FAIL"
    print(f"{'parity':<16} {verdict}", file=sys.stdout if s["parity"] else sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0 if s["parity"] else 1
