"""``hisparse.vllm.model_connector`` without vLLM: a model class runs through the connector
exactly when vLLM's ``kv_transfer_config`` names hisparse's connector module (the name alone,
another module path, or no transfer config: all-resident). ``active_connector`` needs vLLM's
KV-transfer group; the vLLM stages serve through it (tests/vllm_conformance)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hisparse.vllm.model_connector import uses_hisparse_connector
from hisparse.vllm.settings import CONNECTOR_MODULE


def _config(kv):
    return SimpleNamespace(kv_transfer_config=kv)


@pytest.mark.parametrize(
    "kv, expected",
    [
        (SimpleNamespace(kv_connector_module_path=CONNECTOR_MODULE), True),
        (SimpleNamespace(kv_connector_module_path=None), False),  # vLLM's own HiSparse
        (SimpleNamespace(kv_connector_module_path="hisparse.connector"), False),
        (SimpleNamespace(), False),
        (None, False),
    ],
)
def test_the_connector_module_path_decides(kv, expected):
    assert uses_hisparse_connector(_config(kv)) is expected


def test_a_config_without_transfer_settings_is_all_resident():
    assert uses_hisparse_connector(object()) is False
