"""`hisparse demo --model DIR`: a DeepSeek-V3.2 / GLM-5 checkpoint run twice on the DSA engine
(hisparse.engine.dsa) -- every latent row on the device, then HiSparse (rows in the connector's
host pool, per-group resolve into small hot buffers) -- with a token-parity check and a summary.
Exits 1 when the two runs' tokens differ."""

from __future__ import annotations

import json
import sys

import torch

from hisparse.cli.errors import CommandError
from hisparse.engine.dsa.generate import parity
from hisparse.models.dsa.weights import CheckpointError


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        s = parity(
            args.model,
            torch.device(args.device),
            args.row_format,
            num_prompts=args.prompts,
            max_new=args.new_tokens,
            hot_size=args.hot_size,
        )
    except CheckpointError as e:
        raise CommandError(str(e), 2) from None
    width = 16
    rows = [
        ("model", f"{s['model']} ({s['arch']}, indexer {'/'.join(s['indexer_types'])})"),
        ("device", s["device"]),
        ("row format", s["row_format"]),
        ("prompts", f"{s['prompts']} x {s['prompt_tokens']} tokens, {s['new_tokens']} new each"),
        ("top-k / hot", f"{s['index_topk']} / {s['hot_size']} rows per layer"),
        ("seconds", ", ".join(f"{m} {t}" for m, t in s["seconds"].items())),
        ("sample", repr(s["sample"])),
        ("tokens equal", f"{s['tokens_equal']}/{s['prompts']} prompts"),
    ]
    for k, v in rows:
        print(f"{k:<{width}} {v}")
    verdict = "PASS: resident and HiSparse tokens identical" if s["parity"] else "FAIL"
    print(f"{'parity':<{width}} {verdict}", file=sys.stdout if s["parity"] else sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0 if s["parity"] else 1
