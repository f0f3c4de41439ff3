"""models/reference_config.py: the reference model's settings are checked once, for both the
model alone (ReferenceConfig, what a checkpoint stores) and the engine's config, with the same
one-line messages; the layer/group arithmetic is shared."""

from __future__ import annotations

import pytest

from hisparse.engine import EngineConfig
from hisparse.models.reference_config import MODEL_FIELDS, ReferenceConfig


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(top_k=0), "top_k"),
        (dict(row_format="fp4"), "row_format must be one of"),
        (dict(dtype="float16"), "dtype must be one of"),
        (dict(drift=1.5), r"drift must be a number in \[0, 1\]"),
        (dict(drift=True), r"drift must be a number in \[0, 1\]"),
        (dict(recent_window=9, top_k=8), r"recent_window \(9\) must be <= top_k \(8\)"),
    ],
)
def test_model_and_engine_refuse_the_same_settings_alike(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ReferenceConfig(**kw)
    with pytest.raises(ValueError, match=msg):
        EngineConfig(**{"hot_size": 64, **kw})


def test_shape_arithmetic_is_shared():
    ref = ReferenceConfig(num_layers=5, index_share=2, row_format="bf16")
    eng = EngineConfig(num_layers=5, index_share=2, row_format="bf16")
    for c in (ref, eng):
        assert c.num_groups == 3 and c.row_bytes == 1152
        assert [c.group_of(l) for l in range(5)] == [0, 0, 1, 1, 2]
        assert [c.is_leader(l) for l in range(5)] == [True, False, True, False, True]
        assert c.layer_names()[4] == "model.layers.4.self_attn"
    assert {k: getattr(ref, k) for k in MODEL_FIELDS} == {k: getattr(eng, k) for k in MODEL_FIELDS}
    assert ref.replace(seed=3).seed == 3 and ref.to_dict()["max_context"] == 2048
