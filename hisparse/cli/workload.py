"""The workload `hisparse demo` and `hisparse bench` run on the DSA engine (hisparse.engine.dsa),
from their flags: the checkpoint (``demo_model``), the byte-token prompts, the batch, the
hot-buffer size(s) and hybrid residency's device budget.

``plan`` checks every flag against the checkpoint's config and the memory free, before any
weights are read or written: each problem is one line naming the flag to change.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from hisparse.cli import demo_model
from hisparse.cli.demo_report import fmt_bytes
from hisparse.cli.errors import CommandError
from hisparse.cli.flags import check_retired
from hisparse.engine.dsa.stores import BLOCK
from hisparse.models.rows import FP8_TILE, fits
from hisparse.ops.limits import MAX_HOT_SIZE, default_hot_size

#: Request i's prompt is JITTER x (i mod 4) tokens longer than --prompt-len: requests of
#: different lengths, as a server gets them.
JITTER = 7


@dataclass
class Plan:
    model: demo_model.ModelChoice
    device: str
    row_format: str
    requests: int
    batch: int  # requests decoding at once: min(--concurrency, --requests)
    prompt_len: int
    new_tokens: int
    hot_sizes: List[int]  # demo: one; bench: the sweep
    device_blocks: Optional[int]  # hybrid's budget in blocks of BLOCK rows; None: no hybrid run
    resident: bool = True  # a resident run too (bench runs HiSparse only)

    @property
    def modes(self) -> tuple:
        return (
            ("resident",) * self.resident + ("hisparse",) + ("hybrid",) * bool(self.device_blocks)
        )

    @property
    def longest(self) -> int:
        """Tokens of the longest request, prompt and generated."""
        return self.prompt_len + JITTER * min(3, self.requests - 1) + self.new_tokens

    @property
    def context_blocks(self) -> int:
        return -(-self.longest // BLOCK)

    def describe(self) -> str:
        jit = JITTER * min(3, self.requests - 1)
        prompts = f"{self.prompt_len}" + (f"-{self.prompt_len + jit}" if jit else "")
        hybrid = (
            f", hybrid under {self.device_blocks} device blocks of {BLOCK} rows"
            if self.device_blocks
            else ""
        )
        return (
            f"workload: {self.requests} requests (<= {self.batch} running), prompts of {prompts} "
            f"byte tokens, {self.new_tokens} generated each; {self.row_format} rows; hot buffer "
            f"{'/'.join(map(str, self.hot_sizes))} rows{hybrid}; device {self.device}"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        return d


def plan(
    args: argparse.Namespace,
    *,
    hot_flag: str,
    hot_sizes: Optional[Sequence[int]],
    device_blocks: Optional[int] = 0,
    resident: bool = True,
) -> Plan:
    """The workload the flags describe. ``hot_sizes``: the flag ``hot_flag``'s value (None: its
    default, from the top-k). ``device_blocks``: None picks half the batch's pages, 0 no hybrid.
    ``resident``: whether a resident run is part of it."""
    check_retired(args)
    jit = JITTER * min(3, args.requests - 1)
    choice = demo_model.choose(args, args.prompt_len + jit + args.output_len)
    p = Plan(
        model=choice,
        device=args.device,
        row_format=args.row_format or _row_format(choice.cfg.kv_lora_rank),
        requests=args.requests,
        batch=min(args.concurrency, args.requests),
        prompt_len=args.prompt_len,
        new_tokens=args.output_len,
        hot_sizes=[],
        device_blocks=None,
        resident=resident,
    )
    if p.longest > choice.max_positions:
        raise CommandError(
            f"argument --prompt-len: requests of up to {p.longest} tokens (--prompt-len "
            f"{p.prompt_len} + {jit} + --output-len {p.new_tokens}) exceed the "
            f"{choice.max_positions} positions of --model {choice.directory}",
            2,
        )
    latent = choice.cfg.kv_lora_rank
    if not fits(p.row_format, latent):
        raise CommandError(
            f"argument --row-format: {p.row_format} needs kv_lora_rank to be a multiple of "
            f"{FP8_TILE}; --model {choice.directory}'s is {latent}: use bf16 or f32",
            2,
        )
    p.hot_sizes = _hot_sizes(choice, hot_flag, hot_sizes)
    if device_blocks is None:
        device_blocks = max(1, p.batch * p.context_blocks // 2)
    p.device_blocks = device_blocks or None
    check_memory(p)
    return p


def _row_format(latent: int) -> str:
    """--row-format's default: fp8, as DeepSeek-V3.2 serves, where the latent is whole tiles."""
    return "fp8" if fits("fp8", latent) else "bf16"


def default_sweep(top_k: int) -> List[int]:
    """bench's hot sizes when --hot-sizes is left out: 1, 1.25, 1.5, 2, 3 and 4 x top-k."""
    sizes = {top_k, int(1.25 * top_k), int(1.5 * top_k), 2 * top_k, 3 * top_k, 4 * top_k}
    return sorted(h for h in sizes if 0 < h <= MAX_HOT_SIZE)


def _hot_sizes(choice, flag: str, given: Optional[Sequence[int]]) -> List[int]:
    k = choice.cfg.index_topk
    if given is None:
        return [default_hot_size(k)] if flag == "--hot-size" else default_sweep(k)
    small = [h for h in given if h < k]
    if small:
        whose = "--top-k" if choice.directory is None else "the checkpoint's index_topk"
        got = small[0] if flag == "--hot-size" else small
        raise CommandError(f"argument {flag}: must be >= {whose} ({k}), got {got}", 2)
    return list(given)


def memory_needs(p: Plan) -> dict:
    """Bytes of the big allocations of each run (the engine's own accounting,
    hisparse.engine.dsa.budget): device KV by mode (rows and index keys), and the host pool
    that holds every row of the HiSparse and hybrid runs."""
    from hisparse.engine.dsa.budget import DeviceKV

    kv = DeviceKV.of(p.model.cfg, p.row_format, p.context_blocks * BLOCK, max(p.hot_sizes))
    need = {m: kv.total(m, p.batch, p.device_blocks or 0) for m in p.modes}
    need["host_pool"] = (p.batch * p.context_blocks + 1) * BLOCK * kv.layers * kv.row_bytes
    return need


def check_memory(p: Plan, *, host_free: Optional[int] = None, device_free=None) -> dict:
    """Refuse, before anything is allocated, a workload whose KV cannot fit: the allocator would
    otherwise fail deep inside the run (a long traceback, or the OOM killer)."""
    from hisparse.runtime.host_pool import _RESERVE_BYTES, available_host_bytes

    need = memory_needs(p)
    if host_free is None:
        host_free = max(0, available_host_bytes() - _RESERVE_BYTES)
    pool = need["host_pool"]
    if p.device == "cuda":
        if device_free is None:
            import torch

            device_free = torch.cuda.mem_get_info()[0]
        budgets = [(m, "device", need[m], device_free) for m in p.modes]
        budgets.append(("hisparse", "host", pool, host_free))
    else:  # every run keeps everything in RAM; they run one after the other
        budgets = [(m, "host", need[m] + pool * (m != "resident"), host_free) for m in p.modes]
    for run, where, n, free in budgets:
        if n > free:
            raise CommandError(
                f"the {run} run needs {fmt_bytes(n)} of {where} memory for its KV but "
                f"{fmt_bytes(free)} is free: lower --prompt-len + --output-len ({p.prompt_len} + "
                f"{p.new_tokens}) or --concurrency ({p.batch} running)",
                2,
            )
    return need


def prompts(ck, p: Plan) -> List[List[int]]:
    """The requests' prompts: the engine's byte-token texts, cut or repeated to length."""
    from hisparse.engine.dsa.generate import byte_prompts

    out = []
    for i, base in enumerate(byte_prompts(ck, p.requests)):
        n = p.prompt_len + JITTER * (i % 4)
        out.append((base * (n // len(base) + 1))[:n])
    return out
