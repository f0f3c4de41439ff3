"""``registration.register`` alone: the host pool's size, each layer's host view at its own offset
in the packed pool (token-major within an index group), hot views that alias each layer's own
registered cache (never the allocation's base), index groups from leaders and followers, and the
refusal of caches it cannot bind."""

from __future__ import annotations

import pytest
import torch

from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.connector.registration import register
from hisparse.runtime.views import BindingError
from tests.helpers import cpu_registration

S, H = 2, 4


def _cfg(**over):
    return HiSparseConfig(top_k=2, hot_size=H, max_num_seqs=S, **{"block_size": 4, **over})


def _u8(rows, rb=16):
    return torch.zeros(rows, rb, dtype=torch.uint8)


def _offset(view, pool):
    return view.data_ptr() - pool.raw.data_ptr()


def test_default_pool_holds_whole_blocks_of_every_layers_rows():
    # 1 KiB for rows of 16 + 32 bytes in blocks of 4: 1024 // 192 = 5 blocks = 20 rows
    _, reg, _ = cpu_registration(row_bytes=(16, 32), host_rows=None, host_pool_gib=2**-20)
    assert reg.host_rows == 20 and reg.host_pool.num_bytes == 20 * 48
    assert reg.host_pool.raw.numel() == 960 and not reg.host_pool.pinned
    for g in reg.groups:
        assert g.num_keys == 20


def test_given_host_rows_are_rounded_up_to_a_block():
    _, reg, _ = cpu_registration(row_bytes=(16, 32), host_rows=10)
    assert reg.host_rows == 12 and reg.host_pool.num_bytes == 12 * 48


def test_each_layer_binds_its_own_bytes_of_the_pool_token_major_within_a_group():
    _, reg, _ = cpu_registration(("l0", "l1", "l2"), (16, 32, 48), host_rows=8, index_share=2)
    pool, rts = reg.host_pool, reg.runtimes
    # group [l0, l1]: a token's rows side by side (stride 48); group [l2] after all 8 of them
    got = {n: (_offset(rt.host_view, pool), tuple(rt.host_view.stride())) for n, rt in rts.items()}
    assert got == {"l0": (0, (48, 16, 1)), "l1": (16, (48, 32, 1)), "l2": (384, (48, 48, 1))}
    for i, rt in enumerate(rts.values()):
        rt.host_view.fill_(i + 1)
    raw = pool.raw
    assert pool.num_bytes == 8 * 96 and raw.numel() == 768
    pair = raw[:384].view(8, 48)
    assert bool((pair[:, :16] == 1).all()) and bool((pair[:, 16:] == 2).all())
    assert bool((raw[384:] == 3).all())  # every byte belongs to exactly one layer


def test_explicit_groups_lead_with_their_first_layer_and_lay_out_the_pool_in_that_order():
    _, reg, _ = cpu_registration(("l0", "l1", "l2"), (16, 32, 16), groups=[["l1", "l0"], ["l2"]])
    assert [g.name for g in reg.groups] == ["group0:l1", "group1:l2"]
    assert [[m.layer_name for m in g.members] for g in reg.groups] == [["l1", "l0"], ["l2"]]
    pool = reg.host_pool
    offsets = {n: _offset(rt.host_view, pool) for n, rt in reg.runtimes.items()}
    assert offsets == {"l1": 0, "l0": 32, "l2": 40 * 48}


def test_index_share_forms_groups_of_consecutive_layers_with_the_configured_shape():
    names = tuple(f"l{i}" for i in range(5))
    cfg, reg, _ = cpu_registration(names, (16, 32, 16, 16, 48), index_share=2, extra_rows=3)
    assert reg.layer_names == names
    members = [[m.layer_name for m in g.members] for g in reg.groups]
    assert members == [["l0", "l1"], ["l2", "l3"], ["l4"]]
    assert [g.stats_row_bytes for g in reg.groups] == [48, 32, 48]
    assert [reg.runtimes[n].is_leader for n in names] == [True, False, True, False, True]
    assert all(reg.runtimes[n].index_group is reg.groups[i // 2] for i, n in enumerate(names))
    for g in reg.groups:
        assert (g.num_state_rows, g.hot_size, g.top_k, g.max_batch) == (S, H, cfg.top_k, S)
        assert (g.hot_base, g.num_keys, g.device) == (3, 40, torch.device("cpu"))
    assert reg.hot_base == 3 and reg.device == torch.device("cpu")


def test_hot_views_alias_each_layers_own_cache_in_a_packed_allocation():
    rows = 3 + S * H
    packed = torch.zeros(3, rows, 16, dtype=torch.uint8)  # three layers in one allocation
    caches = {f"l{i}": packed[i] for i in range(3)}
    reg = register(_cfg(), caches, host_rows=8)
    for i, rt in enumerate(reg.runtimes.values()):
        assert rt.hot_view.data_ptr() == packed.data_ptr() + i * rows * 16  # not the base
        assert tuple(rt.hot_view.shape) == (rows, 16)
        rt.hot_view[rows - 1] = i + 1
    assert packed[:, rows - 1, 0].tolist() == [1, 2, 3]  # each write landed in its own layer
    assert reg.hot_base == 3


def test_a_typed_cache_is_bound_as_rows_of_its_last_dimensions_bytes():
    cache = torch.zeros(3, 4, 24, dtype=torch.bfloat16)  # [blocks, block_size, head]: 48 B rows
    reg = register(_cfg(), {"l0": cache}, host_rows=8)
    rt = reg.runtimes["l0"]
    assert rt.row_bytes == 48 and tuple(rt.hot_view.shape) == (12, 48)
    assert rt.hot_view.dtype == torch.uint8 and rt.hot_view.data_ptr() == cache.data_ptr()
    assert reg.hot_base == 12 - S * H


_MISALIGNED = torch.zeros(8 * 16 + 8, dtype=torch.uint8)[8:].view(8, 16)
_SHARED = _u8(8)


@pytest.mark.parametrize(
    "caches, error, says",
    [
        ({}, ValueError, "kv_caches must be a non-empty dict"),
        ([("l0", _u8(8))], ValueError, "kv_caches must be a non-empty dict"),
        ({"l0": [0] * 16}, BindingError, "layer 'l0' must be a tensor, got list"),
        ({"l0": _u8(0)}, BindingError, "layer 'l0' is empty or 0-d"),
        ({"l0": torch.tensor(3)}, BindingError, "layer 'l0' is empty or 0-d"),
        ({"l0": _u8(8, 32)[:, ::2]}, BindingError, "layer 'l0' must be contiguous"),
        ({"l0": _u8(8, 8)}, BindingError, "rows must be 16-byte aligned, got row_bytes=8"),
        ({"l0": _MISALIGNED}, BindingError, "row_bytes=16 and data pointer"),
        ({"l0": _u8(7)}, BindingError, "has 7 rows but .* = 2 \\* 4 = 8"),
        ({"l0": _u8(8), "l1": _u8(9)}, BindingError, r"same number of rows, got \[8, 9\]"),
        ({"l0": _SHARED, "l1": _SHARED}, BindingError, "layers 'l0' and 'l1' overlap in memory"),
        (
            {"l0": _u8(8), "l1": torch.zeros(8, 16, dtype=torch.uint8, device="meta")},
            BindingError,
            r"all be on one device, got \['cpu', 'meta'\]",
        ),
    ],
)
def test_caches_that_cannot_be_bound_are_refused_by_layer(caches, error, says):
    with pytest.raises(error, match=says):
        register(_cfg(), caches, host_rows=8)


@pytest.mark.parametrize(
    "cfg, kwargs, error, says",
    [
        (_cfg(pin_host_pool=True), {"host_rows": 8}, HiSparseConfigError, r"\['pin_host_pool'\]"),
        (_cfg(host_pool_gib=1e-9), {}, HiSparseConfigError, r"\['host_pool_gib'\] = 1e-09 is"),
        (_cfg(), {"host_rows": 0}, ValueError, "host_rows must be a positive int, got 0"),
        (_cfg(), {"host_rows": True}, ValueError, "host_rows must be a positive int, got True"),
        (_cfg(), {"host_rows": 2**31}, ValueError, "does not fit int32 keys"),
        (_cfg(), {"groups": [["l0"]]}, ValueError, "every registered layer exactly once"),
        (_cfg(), {"groups": [["l0", "l1"], ["l1"]]}, ValueError, "exactly once"),
    ],
)
def test_settings_that_do_not_fit_the_caches_are_refused(cfg, kwargs, error, says):
    with pytest.raises(error, match=says):
        register(cfg, {"l0": _u8(8), "l1": _u8(8)}, **kwargs)


def test_a_pool_the_ram_cannot_hold_names_the_setting_that_sized_it():
    """host_pool_gib unset and the pool sized by the engine's slots (vLLM's KV blocks): the
    error names those, not a host_pool_gib nobody set; set, it names host_pool_gib."""
    from hisparse.runtime.host_pool import HostPoolError

    caches = {"l0": _u8(8, rb=1 << 16)}
    with pytest.raises(HostPoolError) as e:
        register(_cfg(), caches, host_rows=1 << 30)  # 64 TiB of rows
    assert "--gpu-memory-utilization" in str(e.value) and "host_pool_gib" not in str(e.value)
    cfg = _cfg(host_pool_gib=60000.0)
    with pytest.raises(HostPoolError, match=r"lower kv_connector_extra_config\['host_pool_gib'\]"):
        register(cfg, caches)
    assert not _cfg().host_pool_set and cfg.host_pool_set
