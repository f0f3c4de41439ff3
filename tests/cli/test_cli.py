"""CLI error paths: every bad value exits 2 with one line that names the flag."""

from __future__ import annotations

import pytest

from hisparse.cli import app as cli
from hisparse.vllm.settings import config_from_extra


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["demo", "--top-k", "0"], "--top-k"),
        (["demo", "--top-k", "abc"], "--top-k"),
        (["demo", "--top-k", "16", "--hot-size", "8"], "--hot-size"),
        (["demo", "--hot-size", "40000"], "--hot-size"),
        (["demo", "--drift", "1.5"], "--drift"),
        (["demo", "--drift", "nan"], "--drift"),
        (["demo", "--requests", "-1"], "--requests"),
        (["demo", "--concurrency", "0"], "--concurrency"),
        (["demo", "--device", "tpu"], "--device"),
        (["demo", "--row-format", "fp4"], "--row-format"),
        (["demo", "--metrics-port", "70000"], "--metrics-port"),
        (["demo", "--metrics-port", "http"], "--metrics-port"),
        (["demo", "--json", "summary.txt"], "--json"),
        (["demo", "--json", "/"], "--json"),
        (["demo", "--top-k", "8", "--recent-window", "9"], "--recent-window"),
        (["demo", "--binding-fault", "zero"], "--binding-fault"),
        (["demo", "--metrics-interval", "4"], "--metrics-interval"),
        (["demo", "--device-blocks", "-1"], "--device-blocks"),
        (["demo", "--arch", "llama"], "--arch"),
        (["demo", "--model", "m", "--seed", "3"], "--seed"),
        (["bench", "--recent-window", "4"], "--recent-window"),
        (["bench", "--model", "m", "--layers", "3"], "--layers"),
        (["demo", "--bogus"], "--bogus"),
        (["bench", "--top-k", "16", "--hot-sizes", "8,32"], "--hot-sizes"),
        (["bench", "--hot-sizes", "a,b"], "--hot-sizes"),
        (["bench", "--plot", "curve.jpg"], "--plot"),
        (["bench", "--op-reps", "0"], "--op-reps"),
        (["plan", "--preset", "llama"], "--preset"),
        (["plan", "--layers", "4"], "--preset"),
        (["plan", "--preset", "glm-5.x", "--row-bytes", "100"], "--row-bytes"),
        (["plan", "--preset", "glm-5.x", "--hot-size", "1000"], "--hot-size"),
        (["plan", "--preset", "glm-5.x", "--miss-rate", "-0.1"], "--miss-rate"),
        (["plan", "--preset", "glm-5.x", "--gpu-mem-gib", "0"], "--gpu-mem-gib"),
        (["plan", "--preset", "glm-5.x", "--pcie-gbps", "inf"], "--pcie-gbps"),
        (["plan", "--preset", "glm-5.x", "--context", "1.5"], "--context"),
        (["plan", "--preset", "glm-5.x", "--index-share", "100"], "--index-share"),
    ],
)
def test_bad_value_exits_2_with_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hisparse {argv[0]}: error:") and flag in lines[0], lines[0]


def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--device", "cuda", "--requests", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "hisparse demo: error: argument --device: torch sees no CUDA GPU (use --device cpu)"
    )


def test_no_command_prints_help_and_returns_2(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("info", "demo", "bench", "plan"):
        assert cmd in out


def test_large_top_k_defaults_keep_hot_size_in_range():
    """top-k above 16384: the default hot size is capped at 32768, not 2 x top-k; bench's
    default sweep keeps the sizes within it."""
    from hisparse.cli import demo, workload

    assert config_from_extra({"top_k": 20000}).hot_size == 32768
    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--top-k", "20000", "--concurrency", "1", "--requests", "1"])
    assert demo.plan(args).hot_sizes == [32768]
    args = parser.parse_args(["bench", "--top-k", "20000", "--hot-sizes", "20000,24000"])
    p = workload.plan(args, hot_flag="--hot-sizes", hot_sizes=args.hot_sizes)
    assert p.hot_sizes == [20000, 24000] and p.device_blocks is None
    assert workload.default_sweep(20000) == [20000, 25000, 30000]
    assert workload.default_sweep(16) == [16, 20, 24, 32, 48, 64]


def test_the_row_format_flag_keeps_its_earlier_name():
    p = cli.build_parser()
    assert p.parse_args(["demo", "--row-layout", "bf16"]).row_format == "bf16"
    assert p.parse_args(["demo", "--row-format", "f32"]).row_format == "f32"
    assert p.parse_args(["demo"]).row_format is None  # the model picks it (below)


def test_the_row_format_default_fits_the_model(tmp_path, capsys):
    from hisparse.cli import demo
    from hisparse.models.dsa.random_checkpoint import write_random_checkpoint

    small = write_random_checkpoint(tmp_path / "m", "glm_moe_dsa", kv_lora_rank=42)
    p = cli.build_parser()
    assert demo.plan(p.parse_args(["demo"])).row_format == "fp8"
    assert demo.plan(p.parse_args(["demo", "--model", str(small)])).row_format == "bf16"
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--model", str(small), "--row-format", "fp8"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--row-format: fp8 needs kv_lora_rank" in err[0], err


def test_the_dsa_demo_flags_keep_the_earlier_model_demo_names():
    """`demo --model` took --prompts and --new-tokens; they name --requests and --output-len."""
    args = cli.build_parser().parse_args(["demo", "--prompts", "3", "--new-tokens", "7"])
    assert (args.requests, args.output_len) == (3, 7)
