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
    """top-k above 16384: the default hot size is capped at 32768, not 2 x top-k."""
    from hisparse.cli.app import build_parser
    from hisparse.cli.flags import check_engine_flags

    assert config_from_extra({"top_k": 20000}).hot_size == 32768
    parser = build_parser()
    args = parser.parse_args(["demo", "--top-k", "20000", "--recent-window", "8"])
    assert check_engine_flags(parser, args).hot_size == 32768
    args = parser.parse_args(["bench", "--top-k", "20000", "--hot-sizes", "20000"])
    assert check_engine_flags(parser, args, hot_size=20000).hot_size == 20000


def test_the_row_format_flag_keeps_its_earlier_name():
    from hisparse.cli.app import build_parser

    p = build_parser()
    assert p.parse_args(["demo", "--row-layout", "bf16"]).row_format == "bf16"
    assert p.parse_args(["demo", "--row-format", "f32"]).row_format == "f32"
    assert p.parse_args(["demo"]).row_format is None  # fp8, or f32 with --model
