"""The EngineConfig that the engine flags of `hisparse demo` and `hisparse bench` describe."""

from __future__ import annotations

from hisparse.engine import EngineConfig
from hisparse.ops.limits import default_hot_size


def engine_config_from_args(args, **over) -> EngineConfig:
    """The EngineConfig the flags describe; ``over`` replaces fields before validation."""
    hot_size = getattr(args, "hot_size", None) or default_hot_size(args.top_k)
    fields = dict(
        num_layers=args.layers,
        index_share=args.index_share,
        row_format=args.row_format or "fp8",
        top_k=args.top_k,
        hot_size=hot_size,
        num_requests=args.requests,
        max_running=args.concurrency,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        drift=args.drift,
        recent_window=args.recent_window,
        seed=args.seed,
        metrics_interval=args.metrics_interval,
    )
    fields.update(over)
    return EngineConfig(**fields)
