"""run_workload: continuous batching of the reference workload in resident or HiSparse mode.

The pieces: ``requests`` (the workload), ``loop`` (admission and retirement), ``forward`` (the
engine: one forward per step), ``layer``, ``indexer``, ``prefill``, ``batch`` (a step's rows
and keys), ``kvstore`` / ``hybrid`` (where rows live), ``results`` (what a run returns).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from hisparse.engine.config import EngineConfig
from hisparse.engine.forward import Engine
from hisparse.engine.loop import LoopTotals, run_steps
from hisparse.engine.requests import make_requests
from hisparse.engine.results import RunResult, RunStats
from hisparse.models.rows import LATENT_DIM

__all__ = ["run_workload"]


def _resolve_device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch sees no CUDA GPU")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    return dev


class _StatsRelay:
    """The path vLLM takes: the worker's stats object crosses a process boundary as its plain
    ``data``, the frontend rebuilds it with the connector's class method, aggregates it, and
    hands the data to the Prometheus side (``metrics``)."""

    def __init__(self, metrics) -> None:
        self.metrics, self.agg, self.n = metrics, None, 0

    def __call__(self, stats) -> None:
        from hisparse.connector import HiSparseConnectorImpl

        rebuilt = HiSparseConnectorImpl.build_kv_connector_stats(dict(stats.data))
        if self.agg is None:
            self.agg = HiSparseConnectorImpl.build_kv_connector_stats(None)
        self.agg.aggregate(rebuilt)
        self.n += 1
        if self.metrics is not None:
            self.metrics.observe(rebuilt.data)


def run_workload(
    config: EngineConfig,
    mode: str = "hisparse",
    device: Union[str, torch.device] = "cpu",
    *,
    record_attention: bool = False,
    binding_fault: Optional[str] = None,
    progress: Optional[Callable[[int], None]] = None,
    metrics=None,
    spill_fault: Optional[str] = None,
) -> RunResult:
    """Run the whole workload (all requests to completion) and return tokens, hidden states and
    stats. ``metrics``: an object with ``observe(stats)`` (e.g. the CLI's Prometheus side)."""
    cfg = config
    dev = _resolve_device(device)
    from hisparse.connector.stats import HiSparseKVConnectorStats  # noqa: F401  (connector's container)

    relay = _StatsRelay(metrics)
    eng = Engine(
        cfg,
        mode,
        dev,
        record_attention=record_attention,
        binding_fault=binding_fault,
        on_stats=relay,
        spill_fault=spill_fault,
    )
    reqs = make_requests(cfg)  # looked up at call time: tests substitute their own workload
    N = len(reqs)
    max_out = max(r.output_len for r in reqs)
    out_tokens = torch.full((N, max_out), -1, dtype=torch.int64, device=dev)
    final_hidden = torch.zeros(N, cfg.hidden, dtype=eng.dtype, device=dev)
    totals = run_steps(eng, reqs, out_tokens, final_hidden, progress)
    st = _run_stats(eng, reqs, totals, relay)
    tokens = [out_tokens[r.idx, : r.output_len].tolist() for r in reqs]
    attention = None
    if record_attention:
        names = cfg.layer_names()
        attention = {
            names[i]: (torch.cat(a).cpu() if a else torch.zeros(0, LATENT_DIM, dtype=eng.dtype))
            for i, a in enumerate(eng.attn)
        }
    return RunResult(
        mode=mode,
        device=str(dev),
        config=cfg,
        tokens=tokens,
        final_hidden=final_hidden.cpu(),
        stats=st,
        attention=attention,
    )


def _run_stats(eng: Engine, reqs, tot: LoopTotals, relay: _StatsRelay) -> RunStats:
    cfg, mode, kv = eng.cfg, eng.mode, eng.kv
    st = RunStats(mode=mode, device=str(eng.device))
    st.requests = len(reqs)
    st.prompt_tokens = sum(r.prompt_len for r in reqs)
    st.generated_tokens = tot.tokens_done
    st.steps = tot.steps
    st.wall_s = tot.wall_s
    st.tokens_per_s = tot.tokens_done / tot.wall_s if tot.wall_s > 0 else 0.0
    st.host_pool_bytes = kv.host_pool_bytes
    st.device_kv_bytes = kv.device_kv_bytes
    st.indexer_bytes = eng.indexer.nbytes
    st.topk_overlap = eng.indexer.topk_overlap()
    st.peak_running = tot.peak_running
    if mode == "hisparse":
        st.host_pool_used_bytes = tot.peak_host_rows * cfg.row_bytes * cfg.num_layers
        st.residency = cfg.residency
        st.peak_spilled = kv.peak_spilled
        st.mid_request_spills = kv.mid_request_spills
    st.decode_tokens, st.decode_wall_s = tot.decode_tokens, tot.decode_wall_s
    st.decode_tokens_per_s = tot.decode_tokens / tot.decode_wall_s if tot.decode_wall_s > 0 else 0.0
    if relay.agg is not None:
        agg = relay.agg
        tot_c = agg.totals()
        st.hits, st.misses = int(tot_c["hits"]), int(tot_c["misses"])
        st.host_to_device_bytes = int(tot_c["host_to_device_bytes"])
        st.connector = {k: v for k, v in agg.reduce().items()}
        for k, v in agg.spill_totals().items():
            setattr(st, k, int(v))
        st.snapshots = relay.n
    lookups = st.hits + st.misses
    st.hit_rate = st.hits / lookups if lookups else 0.0
    return st
