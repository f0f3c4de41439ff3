"""kv_connector_extra_config bounds: every value is checked against a finite range and the
error names the key the user actually set."""

from __future__ import annotations

import pytest

from hisparse.connector.config import (
    MAX_HOST_POOL_GIB,
    MAX_INT_SETTING,
    HiSparseConfig,
    HiSparseConfigError,
)
from hisparse.ops.limits import MAX_HOT_SIZE
from hisparse.vllm.settings import config_from_extra


@pytest.mark.parametrize("key", ["max_num_seqs", "block_size", "index_share", "metrics_interval"])
def test_integer_settings_have_upper_bounds(key):
    limit = MAX_INT_SETTING[key]
    config_from_extra({key: limit, "top_k": 4})
    with pytest.raises(
        HiSparseConfigError,
        match=rf"^kv_connector_extra_config\['{key}'\] must be <= {limit}, got {limit + 1}$",
    ):
        config_from_extra({key: limit + 1, "top_k": 4})


def test_top_k_above_the_hot_buffer_limit_is_blamed_on_top_k():
    # hot_size is not set: the message must not name it.
    with pytest.raises(
        HiSparseConfigError,
        match=rf"^kv_connector_extra_config\['top_k'\] must be <= {MAX_HOT_SIZE},",
    ):
        config_from_extra({"top_k": MAX_HOT_SIZE + 1})
    with pytest.raises(HiSparseConfigError, match=r"\['top_k'\]"):
        config_from_extra({"top_k": MAX_HOT_SIZE + 1, "hot_size": MAX_HOT_SIZE})


def test_hot_rows_must_fit_int32():
    with pytest.raises(HiSparseConfigError, match=r"\['max_num_seqs'\] \* hot_size"):
        config_from_extra({"max_num_seqs": 65536, "top_k": MAX_HOT_SIZE})


@pytest.mark.parametrize("extra", ["top_k=4", [("top_k", 4)], 7, b"{}"])
def test_non_mapping_extra_config_is_one_named_error(extra):
    with pytest.raises(HiSparseConfigError, match=r"^kv_connector_extra_config must be a mapping"):
        config_from_extra(extra)


@pytest.mark.parametrize("gib", [1e30, MAX_HOST_POOL_GIB + 1, 2**70])
def test_absurd_host_pool_is_refused_not_clamped(gib):
    with pytest.raises(
        HiSparseConfigError, match=rf"\['host_pool_gib'\] must be <= {MAX_HOST_POOL_GIB} \(GiB\)"
    ):
        config_from_extra({"host_pool_gib": gib})
    assert (
        HiSparseConfig(host_pool_gib=MAX_HOST_POOL_GIB).host_pool_bytes == MAX_HOST_POOL_GIB << 30
    )


def test_the_old_name_of_hot_size_is_read_with_one_line(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="vllm.hisparse"):
        cfg = config_from_extra({"top_k": 4, "device_buffer_size": 12})
    assert cfg.hot_size == 12
    lines = [r.getMessage() for r in caplog.records if "device_buffer_size" in r.getMessage()]
    assert len(lines) == 1 and "'hot_size'" in lines[0]
    with pytest.raises(HiSparseConfigError, match="both 'device_buffer_size' and 'hot_size'"):
        config_from_extra({"device_buffer_size": 8, "hot_size": 8})


def test_a_retired_setting_is_accepted_with_one_line_and_not_read(caplog):
    import logging

    from hisparse.vllm import settings

    settings._said.clear()
    with caplog.at_level(logging.INFO, logger="vllm.hisparse"):
        cfg = config_from_extra({"top_k": 4, "resolve_parts": 3})
        config_from_extra({"resolve_parts": 2})  # parsed again in the same process: no line
    assert cfg == config_from_extra({"top_k": 4})
    lines = [r.getMessage() for r in caplog.records if "resolve_parts" in r.getMessage()]
    assert len(lines) == 1 and "no longer read" in lines[0]
    with pytest.raises(HiSparseConfigError, match=r"\['resolve_part'\] is not a HiSparse"):
        config_from_extra({"resolve_part": 3})


def test_every_setting_has_a_row_in_the_connector_docs():
    """Users set these keys by name from docs/connector.md's table: none may go unlisted."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "connector.md").read_text()
    listed = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    assert set(HiSparseConfig.keys()) <= listed, set(HiSparseConfig.keys()) - listed
