"""MTP speculative greedy decoding in the DSA engine (hisparse.engine.dsa.mtp_generate) on the
CPU: the tokens (and logit gaps) of plain greedy in both modes, acceptance above one half on a
checkpoint whose MTP layer agrees with the target, and rows of rejected draft tokens never read
before they are written again. Verify steps are decodes: only the prompts are read as prefill
rows, and in HiSparse mode the hot buffers' lookups equal an independent count of the union of
each request's decode tokens' keys per index group (a key two tokens chose counted once); the
same on a block-FP8 checkpoint with an MTP layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hisparse.engine.dsa import mtp as mtp_module
from hisparse.engine.dsa.generate import MODES, byte_prompts, generate
from hisparse.engine.dsa.mtp import load_mtp
from hisparse.engine.dsa.mtp_generate import generate_mtp
from hisparse.engine.dsa.stores import nothing
from hisparse.models.dsa.mtp_checkpoint import write_mtp_checkpoint
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.weights import CheckpointError, load_checkpoint
from tests.engine.dsa.helpers import ARCHS, one_thread, tie_aware_mismatch

CPU = torch.device("cpu")
PROMPTS, NEW = 3, 16
_LABEL = {True: "agreeing", False: "random", "fp8": "block-FP8 agreeing"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa_mtp")
    out = {
        (a, agree): write_mtp_checkpoint(root / f"{a}-{agree}", a, agree)
        for a in ARCHS
        for agree in (True, False)
    }
    for a in ARCHS:  # DeepSeek's block-FP8 format, blocks of 128 x 128 (partial at the edges)
        out[a, "fp8"] = write_mtp_checkpoint(root / f"{a}-fp8", a, True, fp8_block=(128, 128))
    return out


class StaleReadCheck:
    """Wraps a store: a key the generator discards (a rejected draft token's position) must be
    saved again in a layer before that layer reads it."""

    def __init__(self, store, cfg) -> None:
        layers = cfg.num_layers
        self.inner, self.cfg, self.stale = store, cfg, [set() for _ in range(layers)]
        self.discarded = self.stale_reads = 0
        self.prefill_tokens = [0] * layers  # tokens read as prefill rows, per layer
        self.decode_tokens = [0] * layers
        self.lookups = 0  # distinct valid keys per decode row, over the index-group leaders

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def discard(self, rid, keys) -> None:
        self.discarded += len(keys)
        for s in self.stale:
            s.update(int(k) for k in keys)
        mtp_module.discard(self.inner, rid, keys)

    def save(self, layer, rows, keys) -> None:
        self.stale[layer].difference_update(keys.tolist())
        self.inner.save(layer, rows, keys)

    def _check(self, layer, keys) -> None:
        hit = self.stale[layer].intersection(keys[keys >= 0].tolist())
        self.stale_reads += len(hit)
        assert not hit, f"layer {layer} read rejected rows {sorted(hit)} before rewriting them"

    def decode_rows(self, layer, keys, defer_misses=False, decodes=None, *, beside=nothing):
        self._check(layer, keys)
        self.decode_tokens[layer] += keys.shape[0]
        if self.cfg.is_full(layer):
            # Each request's row: its tokens' keys (decodes.at: token t sits in row at[t] // q).
            row = decodes.at // decodes.q if decodes is not None else torch.arange(len(keys))
            for r in row.unique().tolist():
                k = keys[row == r]
                self.lookups += len(set(k[k >= 0].tolist()))
        if decodes is None:
            return self.inner.decode_rows(layer, keys, defer_misses, beside=beside)
        return self.inner.decode_rows(layer, keys, defer_misses, decodes, beside=beside)

    def prefill_rows(self, layer, keys):
        self._check(layer, keys)
        self.prefill_tokens[layer] += keys.shape[0]
        return self.inner.prefill_rows(layer, keys)


def _run(d: Path, mode: str, wrap=None):
    ck = load_checkpoint(d, CPU)
    ext, head = load_mtp(d, ck, CPU)
    prompts = byte_prompts(ck, PROMPTS)
    checks = []

    def wrapper(store):
        checks.append((wrap or StaleReadCheck)(store, ext.cfg))
        return checks[-1]

    with one_thread():
        plain = generate(ck, mode, "f32", CPU, prompts, NEW, max_batch=2)
        spec = generate_mtp(
            ext, head, mode, "f32", CPU, prompts, NEW, max_batch=2, store_wrapper=wrapper
        )
    return plain, spec, checks[0], prompts


@pytest.mark.parametrize("agree", [True, False, "fp8"], ids=["agreeing", "random-mtp", "fp8"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_tokens_are_plain_greedy(checkpoints, arch, mode, agree):
    plain, spec, check, prompts = _run(checkpoints[arch, agree], mode)
    equal = sum(a == b for a, b in zip(plain.tokens, spec.tokens))
    line = (
        f"{arch} {mode} {_LABEL[agree]} MTP: tokens equal {equal}/{PROMPTS}, "
        f"acceptance {spec.accepted}/{spec.proposed} = {spec.acceptance:.2f}, "
        f"{spec.target_steps} target steps for {PROMPTS * NEW} tokens, "
        f"{check.discarded} rejected rows discarded, 0 read stale, "
        f"{check.decode_tokens[0]} decode tokens per layer"
    )
    if mode == "hisparse":
        c = spec.counters
        line += f", hot hits {c['hits']} misses {c['misses']} (union keys {check.lookups})"
    print(line)
    for i in range(PROMPTS):
        bad = tie_aware_mismatch(plain.tokens[i], spec.tokens[i], plain.gaps[i], spec.gaps[i])
        assert bad is None, f"prompt {i}: {bad}; {line}"
    if equal == PROMPTS:  # same tokens: the same logits up to summation order
        for a, b in zip(plain.gaps, spec.gaps):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4), line
    assert spec.proposed > 0 and check.stale_reads == 0
    if agree:
        assert spec.acceptance > 0.5, line
        assert spec.target_steps < PROMPTS * NEW * 0.8, line
    assert check.discarded == spec.proposed - spec.accepted, line  # every rejection discarded
    # Verify tokens (and the draft's confirmed pairs) are decodes: only prompts are prefilled,
    # once by the target's layers and once by the MTP layer.
    assert check.prefill_tokens == [sum(map(len, prompts))] * len(check.prefill_tokens), line
    assert check.decode_tokens[0] > spec.proposed, line
    if mode == "hisparse":
        c = spec.counters
        # Every decode row resolved its tokens' union through the hot buffers, each key once.
        assert c["hits"] > 0 and c["misses"] > 0, line
        assert c["hits"] + c["misses"] == check.lookups, line


def test_a_rejected_row_left_unwritten_is_caught(checkpoints):
    """Negative control: a store that skips saving a discarded position again makes the layers
    read the rejected row, which the check reports."""

    class SkipRewrite(StaleReadCheck):
        def save(self, layer, rows, keys):
            keep = torch.tensor([k not in self.stale[layer] for k in keys.tolist()])
            if not keep.all():
                self.inner.save(layer, rows[keep], keys[keep])
                return
            super().save(layer, rows, keys)

    with pytest.raises(AssertionError, match="read rejected rows"):
        _run(checkpoints["deepseek_v32", False], "resident", SkipRewrite)


def test_a_checkpoint_without_mtp_layer_is_refused_in_one_line(tmp_path):
    d = write_random_checkpoint(tmp_path / "plain", "deepseek_v32", seed=3)
    ck = load_checkpoint(d, CPU)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        load_mtp(d, ck, CPU)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match="MTP layer 4 has no indexer"):
        load_mtp(d, load_checkpoint(d, CPU), CPU)
