"""The ``vllm.general_plugins`` entry point: declared in pyproject.toml, and ``register()``
registers the DeepSeek-V3.2 / GLM-5 classes (and their MTP draft) by import paths that exist,
nothing else; run here against a stand-in ``ModelRegistry`` (the real one: the vLLM stage)."""

from __future__ import annotations

import sys
import types

import tomllib

from hisparse.vllm import plugin
from hisparse.vllm.dsa import DSA_ARCHITECTURES
from tests import REPO_ROOT


def test_the_entry_point_is_declared():
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    plugins = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"hisparse": "hisparse.vllm.plugin:register"}


class _Registry:
    registered: dict = {}

    @classmethod
    def get_supported_archs(cls):
        return list(cls.registered)

    @classmethod
    def register_model(cls, name, path):
        cls.registered[name] = path


def test_register_names_the_dsa_classes_and_nothing_else(monkeypatch):
    import hisparse.vllm.dsa.mtp_config as mtp_config
    import hisparse.vllm.dsa.weights as weights
    import hisparse.vllm.patches as patches

    _Registry.registered = {}
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(ModelRegistry=_Registry))
    # vLLM's own code is what these reach into: the vLLM stage checks them.
    monkeypatch.setattr(patches, "install", lambda: None)
    monkeypatch.setattr(weights, "register_config_hook", lambda names: None)
    monkeypatch.setattr(mtp_config, "install_draft_override", lambda: None)
    monkeypatch.setattr(plugin, "_add_splitting_op", lambda name: None)
    plugin.register()
    assert _Registry.registered == dict(DSA_ARCHITECTURES.values())
    for path in _Registry.registered.values():
        module = path.split(":")[0]
        assert (REPO_ROOT / (module.replace(".", "/") + ".py")).is_file(), path
