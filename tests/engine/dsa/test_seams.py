"""The DSA engine's two test seams (the parity eval's): ``stores.inject_faults`` and
``model.observe``. Both are off unless their block is active, the faults do what the negative
controls need (the connector refuses a base-offset binding, a resident store aliases its layers,
a hybrid spill leaves its last row behind), and the observer sees every layer of every step.
Also the order a decode keeps around the connector: resolve, the query heads, the wait."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.generate import generate
from hisparse.engine.dsa.hybrid import HybridRows
from hisparse.engine.dsa.model import observe
from hisparse.engine.dsa.stores import (
    HiSparseRows,
    ResidentRows,
    inject_faults,
    injected_fault,
    layer_buffers,
)
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.weights import load_checkpoint
from hisparse.runtime.views import BindingError
from tests.engine.dsa.helpers import one_thread

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    d = tmp_path_factory.mktemp("seams") / "glm"
    return load_checkpoint(write_random_checkpoint(d, "glm_moe_dsa", seed=2), CPU)


def test_faults_are_off_outside_their_block_and_checked():
    assert injected_fault("binding") is None and injected_fault("spill") is None
    with inject_faults(binding="base_offset", spill="off_by_one"):
        assert injected_fault("binding") == "base_offset"
        assert injected_fault("spill") == "off_by_one"
    assert injected_fault("binding") is None and injected_fault("spill") is None
    a, b = layer_buffers(2, 4, 64, CPU)
    assert a.data_ptr() != b.data_ptr()
    with pytest.raises(ValueError, match="binding must be None or one of"):
        with inject_faults(binding="shifted"):
            pass
    with pytest.raises(ValueError, match="spill None or one of"):
        with inject_faults(spill="all"):
            pass


def test_base_offset_binding_is_refused_by_the_connector_and_aliases_resident_layers(ck):
    with inject_faults(binding="base_offset"):
        res = ResidentRows(ck.cfg, 656, 64, CPU, 2)
        with pytest.raises(BindingError, match="overlap in memory"):
            HiSparseRows(ck.cfg, 656, 64, CPU, 16, 2)
        with pytest.raises(BindingError, match="overlap in memory"):
            HybridRows(ck.cfg, 656, 64, CPU, 16, 2, 4)
    assert len({r.data_ptr() for r in res.rows}) == 1 and len(res.rows) == ck.cfg.num_layers
    assert len({r.data_ptr() for r in ResidentRows(ck.cfg, 656, 64, CPU, 2).rows}) > 1


def test_a_spill_fault_leaves_one_row_behind(ck, monkeypatch):
    written = []
    real = HybridRows._write_spill

    def spy(self, layer, rows, keys):
        written.append(int(keys.numel()))
        real(self, layer, rows, keys)

    monkeypatch.setattr(HybridRows, "_write_spill", spy)
    prompts = [list(range(70 + 5 * i)) for i in range(3)]

    def spilled(**faults):
        written.clear()
        with one_thread(), inject_faults(**faults):
            g = generate(ck, "hybrid", "f32", CPU, prompts, 24, max_batch=3, device_blocks=12)
        assert g.counters["spills"] >= 1, g.counters
        return g.counters["spills"], list(written)

    spills, good = spilled()
    assert len(good) == spills * ck.cfg.num_layers  # every layer's rows, per spill
    assert spilled(spill="off_by_one") == (spills, [n - 1 for n in good])


def test_observe_sees_every_layer_of_every_step_and_stops_after(ck):
    class Seen:
        def __init__(self):
            self.layers, self.rows = [], []

        def layer(self, i, out):
            self.layers.append((i, out.shape[0]))

        def final(self, hidden):
            self.rows.append(hidden.shape[0])

    prompts = [list(range(70)), list(range(75))]
    seen = Seen()
    with one_thread(), observe(seen):
        g = generate(ck, "hisparse", "fp8", CPU, prompts, 4, max_batch=1)
    L = ck.cfg.num_layers
    steps = len(seen.rows)
    assert steps == 2 * 4 and sum(seen.rows) == 8
    assert [i for i, _ in seen.layers] == list(range(L)) * steps
    assert sum(n for _, n in seen.layers) == L * (70 + 75 + 2 * 3)
    with one_thread():
        generate(ck, "resident", "fp8", CPU, prompts, 4, max_batch=1)
    assert len(seen.rows) == steps  # nothing recorded outside the block
    assert g.tokens


@pytest.mark.parametrize("mode", ["hisparse", "hybrid"])
def test_a_decode_makes_its_query_heads_between_the_resolve_and_the_wait(ck, monkeypatch, mode):
    """The query heads need no row: each layer makes them after the resolve launched the
    misses' copy and before the wait for it (on CUDA the copy runs beside them). Either order
    the other way round would leave nothing to run beside the copy."""
    from hisparse.connector.facade import HiSparseConnectorImpl
    from hisparse.engine.dsa import model

    calls = []
    real = {n: getattr(HiSparseConnectorImpl, n) for n in ("resolve", "wait_for_layer_load")}
    real_query = model.mla_query

    def record(name):
        def call(self, *a, **kw):
            calls.append(name)
            return real[name](self, *a, **kw)

        return call

    def query(*a, **kw):
        calls.append("query")
        return real_query(*a, **kw)

    for name in real:
        monkeypatch.setattr(HiSparseConnectorImpl, name, record(name))
    monkeypatch.setattr(model, "mla_query", query)
    extra = {"device_blocks": 1} if mode == "hybrid" else {}
    with one_thread():
        generate(ck, mode, "fp8", CPU, [list(range(70))], 3, max_batch=1, **extra)
    waits = [i for i, c in enumerate(calls) if c == "wait_for_layer_load"]
    assert waits, calls  # the decodes resolved through the connector
    for i in waits:
        assert calls[i - 2 : i + 1] == ["resolve", "query", "wait_for_layer_load"], calls
