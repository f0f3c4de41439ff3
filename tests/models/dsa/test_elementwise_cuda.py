"""The one-launch norm, rotary and row-encoding kernels against their torch references on a GPU
(marked ``cuda``): the rotary embedding and the FP8 row bytes bit for bit, the norms within one
rounding of the output dtype, and the projections with and without them."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.decoder import Rotary, rms_norm, rope_half, rope_interleaved
from hisparse.models.dsa.kernels import elementwise as ew
from hisparse.models.dsa.projections import index_inputs, mla_query, mla_row
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import encode_rows
from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]
GPU = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]


def _randn(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=GPU, generator=g) * scale).to(dtype)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the dtype's spacing at each reference value."""
    eps = torch.finfo(want.dtype).eps
    spacing = want.float().abs().clamp(min=torch.finfo(want.dtype).tiny) * eps
    return float(((got.float() - want.float()).abs() / spacing).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape,start", [((37, 16, 192), 128), ((37, 8, 128), 0), ((5, 1, 64), 0)])
def test_rope_is_bit_identical_to_torch_in_place(dtype, interleaved, shape, start):
    g = torch.Generator(device=GPU).manual_seed(1)
    T = shape[0]
    buf = _randn(g, T, shape[1], shape[2] + 8, dtype=dtype)
    x = buf[..., 8:]  # strided rows
    cos, sin = _randn(g, T, 64, dtype=dtype), _randn(g, T, 64, dtype=dtype)
    turn = rope_interleaved if interleaved else rope_half
    part = turn(x[..., start : start + 64], cos, sin)
    want = torch.cat([x[..., :start], part, x[..., start + 64 :]], dim=-1)
    before = buf[..., :8].clone()
    got = ew.rope_(x, cos, sin, start=start, interleaved=interleaved)
    assert got is x and torch.equal(x, want)
    assert torch.equal(buf[..., :8], before), "rope_ wrote outside x"


@pytest.mark.parametrize("heads", [1, 3, 24, 128])
def test_rope_covers_every_head(heads):
    """Heads that are not a multiple of the kernel's head block: every one rotated, once."""
    g = torch.Generator(device=GPU).manual_seed(6)
    x = _randn(g, 5, heads, 192, dtype=torch.bfloat16)
    cos, sin = _randn(g, 5, 64, dtype=torch.bfloat16), _randn(g, 5, 64, dtype=torch.bfloat16)
    want = torch.cat([x[..., :128], rope_interleaved(x[..., 128:], cos, sin)], dim=-1)
    assert torch.equal(ew.rope_(x, cos, sin, start=128, interleaved=True), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_row_bytes_are_the_torch_encoders(dtype):
    g = torch.Generator(device=GPU).manual_seed(2)
    n = 300
    spread = torch.logspace(-8, 8, n, device=GPU)[:, None]  # tiny to huge rows, one zero row
    kv = (torch.randn(n, 576, device=GPU, generator=g) * spread).to(dtype)
    kv[7] = 0
    kv[9, :128] = 0  # one zero tile: scale 1
    wide = torch.cat([kv, kv[:, :8]], dim=1)[:, :576]  # a strided view
    for x in (kv, wide):
        assert torch.equal(ew.encode_fp8_rows(x), encode_rows(x, "fp8"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [512, 1536, 7168])
def test_rms_norm_is_within_one_rounding(dtype, n):
    g = torch.Generator(device=GPU).manual_seed(3)
    x = _randn(g, 33, n, dtype=dtype, scale=4.0)
    w = (1 + 0.1 * torch.randn(n, device=GPU, generator=g)).to(dtype)
    got, want = ew.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype
    assert _ulps(got, want) <= (2.0 if dtype == torch.bfloat16 else 8.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_row_is_the_norm_and_rotated_key(dtype):
    g = torch.Generator(device=GPU).manual_seed(4)
    kv = _randn(g, 41, 576, dtype=dtype, scale=3.0)
    w = (1 + 0.1 * torch.randn(512, device=GPU, generator=g)).to(dtype)
    cos, sin = _randn(g, 41, 64, dtype=dtype), _randn(g, 41, 64, dtype=dtype)
    got = ew.latent_row(kv, w, 1e-6, cos, sin)
    assert torch.equal(got[:, 512:], rope_interleaved(kv[:, 512:], cos, sin))
    assert _ulps(got[:, :512], rms_norm(kv[:, :512], w, 1e-6)) <= 8.0


def test_mismatched_inputs_fall_back_or_are_refused_by_name():
    x = torch.zeros(4, 8, 192, device=GPU, dtype=torch.bfloat16)
    cos = torch.zeros(4, 64, device=GPU)
    assert not ew.supported(x, cos)  # bf16 beside float32: the torch path runs
    with pytest.raises(ValueError, match="cos and sin"):
        ew.rope_(x, cos[:3].bfloat16(), cos[:3].bfloat16(), start=128, interleaved=True)
    with pytest.raises(ValueError, match="kv must be"):
        ew.encode_fp8_rows(torch.zeros(4, 575, device=GPU))


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_projections_with_the_kernels_match_torch(arch, dtype):
    cfg = DSAConfig.from_hf(random_config(arch, index_topk=64, num_attention_heads=16))
    g = torch.Generator(device=GPU).manual_seed(5)
    hidden, T = cfg.hidden_size, 29
    shapes = {
        "q_a_proj.weight": (cfg.q_lora_rank, hidden),
        "q_a_layernorm.weight": (cfg.q_lora_rank,),
        "q_b_proj.weight": (cfg.num_heads * (cfg.qk_nope_head_dim + 64), cfg.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (576, hidden),
        "kv_a_layernorm.weight": (512,),
        "indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "indexer.wk.weight": (cfg.index_head_dim, hidden),
        "indexer.k_norm.weight": (cfg.index_head_dim,),
        "indexer.k_norm.bias": (cfg.index_head_dim,),
        "indexer.weights_proj.weight": (cfg.index_n_heads, hidden),
    }
    w = {k: _randn(g, *s, dtype=dtype, scale=s[-1] ** -0.5) for k, s in shapes.items()}
    for k in ("q_a_layernorm.weight", "kv_a_layernorm.weight", "indexer.k_norm.weight"):
        w[k] = (1 + 0.1 * w[k].float()).to(dtype)
    h = _randn(g, T, hidden, dtype=dtype)
    cos, sin = Rotary(cfg, 4096, GPU)(torch.arange(100, 100 + T, device=GPU))
    rope = (cos.to(dtype), sin.to(dtype))
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    fast = mla_row(h, w, cfg, rope, kernels=True)
    slow = mla_row(h, w, cfg, rope)
    for a, b in zip(fast, slow):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
    # the same q_resid in: the product and the rotary are exact
    fast_q = mla_query(fast[0], w, cfg, rope, kernels=True)
    slow_q = mla_query(fast[0], w, cfg, rope)
    for a, b in zip(fast_q, slow_q):
        assert a.shape == b.shape and torch.equal(a, b)
    fast_i = index_inputs(h, fast[0], w, cfg, rope, kernels=True)
    slow_i = index_inputs(h, fast[0], w, cfg, rope)
    for a, b in zip(fast_i, slow_i):
        assert torch.equal(a, b)  # the same q_resid in: layer_norm and the rotary are exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_gate_is_bit_identical_to_torch(dtype):
    g = torch.Generator(device=GPU).manual_seed(6)
    gu = _randn(g, 30, 2 * 3000, dtype=dtype, scale=6.0)
    gate, up = gu.split(3000, dim=1)  # strided halves, as the step's fused gate/up product
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(ew.silu_mul(gate, up), want)
    assert torch.equal(ew.silu_mul(gate.contiguous(), up.contiguous()), want)
