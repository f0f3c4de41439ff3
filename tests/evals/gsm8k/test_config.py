"""evals/gsm8k/config.py: the shipped configs, the schema and every kind of config error."""

from __future__ import annotations

import ast
import copy
import os

import pytest
import yaml

from evals.gsm8k.config import SCHEMA, ConfigError, load_config, read_model_list, validate
from hisparse.vllm.settings import config_from_extra
from tests import REPO_ROOT
from tests.evals.gsm8k.builders import CONFIGS, DSV, GLM, good_dict

REPO = str(REPO_ROOT)


def test_glm_config_has_exactly_the_issue_values():
    cfg = load_config(GLM)
    assert cfg.model_name == "nvidia/GLM-5.2-NVFP4"
    assert (cfg.accuracy_threshold, cfg.tolerance) == (0.90, 0.0)
    assert (cfg.num_questions, cfg.num_fewshot, cfg.max_tokens) == (1319, 5, 256)
    assert cfg.max_concurrency == 32
    assert cfg.request_timeout_seconds == 1800
    assert cfg.startup_max_wait_seconds == 1200
    assert cfg.server_option("--tensor-parallel-size") == "4"
    assert cfg.server_option("--max-model-len") == "8192"
    assert cfg.server_option("--max-num-seqs") == "32"
    assert cfg.server_option("--max-num-batched-tokens") == "4096"
    assert cfg.server_option("--enforce-eager") == ""
    assert cfg.server_option("--kv-cache-dtype") == "bfloat16"
    assert cfg.kv_transfer_config() == {
        "kv_connector": "HiSparseOOTConnector",
        "kv_connector_module_path": "hisparse.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": 32},
    }
    assert cfg.gpus_needed() == 4


def test_deepseek_config_loads_and_uses_the_connector():
    cfg = load_config(DSV)
    assert cfg.model_name == "deepseek-ai/DeepSeek-V3.2"
    assert cfg.num_questions == 1319 and cfg.num_fewshot == 5
    kv = cfg.kv_transfer_config()
    assert kv["kv_connector"] == "HiSparseOOTConnector"
    assert kv["kv_connector_module_path"] == "hisparse.vllm.connector"
    assert kv["kv_role"] == "kv_both"


def test_model_list_names_both_configs():
    listed = read_model_list(os.path.join(CONFIGS, "models-hisparse.txt"))
    assert [os.path.basename(p) for p in listed] == [os.path.basename(GLM), os.path.basename(DSV)]


def _defined_names(mod_file: str) -> set:
    """Classes and names a module defines; a package's names re-exported from its own modules
    count when that module defines them."""
    with open(mod_file, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    names |= {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("hisparse."):
            src = os.path.join(REPO, *n.module.split(".")) + ".py"
            if os.path.isfile(src):
                names |= {a.name for a in n.names} & _defined_names(src)
    return names


@pytest.mark.parametrize("path", [GLM, DSV])
def test_config_connector_resolves_to_a_class_in_this_repo(path):
    """vLLM imports kv_connector_module_path and looks up kv_connector in it. Check, without
    importing vLLM, that the module file exists and defines that class: a rename breaks this."""
    kv = load_config(path).kv_transfer_config()
    base = os.path.join(REPO, *kv["kv_connector_module_path"].split("."))
    mod_file = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")
    assert os.path.isfile(mod_file), f"{kv['kv_connector_module_path']} -> {mod_file} missing"
    names = _defined_names(mod_file)
    assert kv["kv_connector"] in names


@pytest.mark.parametrize("path", [GLM, DSV])
def test_config_extra_config_is_accepted_by_the_connector(path):
    """kv_connector_extra_config goes to HiSparseConfig.from_extra_config on the server; a typo
    there must fail in CI, not 20 minutes into a nightly."""

    extra = load_config(path).kv_transfer_config()["kv_connector_extra_config"]
    cfg = config_from_extra(extra)
    assert cfg.host_pool_gib == 32.0
    with pytest.raises(ValueError, match="host_pool_gb"):
        config_from_extra({"host_pool_gb": 32})


def test_good_dict_validates():
    cfg = validate(good_dict(env={"A": "1"}, temperature=0.0))
    assert cfg.env == {"A": "1"} and cfg.pass_floor == 0.5


@pytest.mark.parametrize("key", [k for k, (_, req, _) in SCHEMA.items() if req])
def test_missing_key_is_named(key):
    d = good_dict()
    del d[key]
    with pytest.raises(ConfigError, match=f"missing required key.*'{key}'"):
        validate(d, "cfg.yaml")


@pytest.mark.parametrize(
    "key,value",
    [
        ("model_name", 7),
        ("accuracy_threshold", "0.9"),
        ("accuracy_threshold", True),
        ("tolerance", None),
        ("num_questions", 10.5),
        ("num_questions", "1319"),
        ("num_fewshot", True),
        ("max_tokens", [256]),
        ("max_concurrency", 3.0),
        ("request_timeout_seconds", "1800"),
        ("startup_max_wait_seconds", None),
        ("server_args", ["--enforce-eager"]),
        ("env", ["A=1"]),
        ("temperature", "0"),
    ],
)
def test_mistyped_key_is_named(key, value):
    with pytest.raises(ConfigError, match=f"key '{key}' must be"):
        validate(good_dict(**{key: value}), "cfg.yaml")


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'acuracy_threshold'"):
        validate(good_dict(acuracy_threshold=0.9), "cfg.yaml")


@pytest.mark.parametrize(
    "key,value",
    [
        ("accuracy_threshold", 0.0),
        ("accuracy_threshold", 1.5),
        ("tolerance", -0.1),
        ("tolerance", 1.0),
        ("num_questions", 0),
        ("num_questions", 1320),
        ("num_fewshot", -1),
        ("max_tokens", 0),
        ("max_concurrency", 0),
        ("request_timeout_seconds", 0),
        ("startup_max_wait_seconds", -5),
        ("model_name", "  "),
        ("temperature", -1.0),
    ],
)
def test_out_of_range_value_is_named(key, value):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        validate(good_dict(**{key: value}), "cfg.yaml")


@pytest.mark.parametrize(
    "args,match",
    [
        ('--kv-transfer-config \'{"kv_connector":"x"}', "not valid shell syntax"),
        ("--kv-transfer-config '{kv_connector: x}'", "not valid JSON"),
        ("--kv-transfer-config '[1, 2]'", "JSON object with a 'kv_connector'"),
        ("nvidia/GLM-5.2-NVFP4 --enforce-eager", "must start with an option"),
        ("--model foo", "must not set --model"),
        ("--tensor-parallel-size four", "--tensor-parallel-size needs a positive integer"),
        ("--max-num-seqs 0", "--max-num-seqs needs a positive integer"),
    ],
)
def test_bad_server_args_are_explained(args, match):
    with pytest.raises(ConfigError, match=match) as ei:
        validate(good_dict(server_args=args), "cfg.yaml")
    assert "server_args" in str(ei.value)


def test_env_values_must_be_strings():
    with pytest.raises(ConfigError, match="key 'env' must map strings to strings.*'A'"):
        validate(good_dict(env={"A": 1}), "cfg.yaml")


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(str(lst))
    models = tmp_path / "models.txt"
    models.write_text("# comment\n\nmissing.yaml\n")
    with pytest.raises(ConfigError, match=r"models.txt:3: listed config 'missing.yaml'"):
        read_model_list(str(models))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="lists no configs"):
        read_model_list(str(empty))


def test_shipped_configs_round_trip_through_yaml():
    # every shipped key is in the schema, so adding a key without a schema entry fails here
    for path in (GLM, DSV):
        with open(path) as f:
            data = yaml.safe_load(f)
        assert set(data) <= set(SCHEMA)
        assert validate(copy.deepcopy(data), path).model_name == data["model_name"]


def test_config_naming_vllms_in_tree_connector_for_this_package_is_refused(tmp_path):
    """vLLM 0.32 routes the name HiSparseConnector to its own CUDA path even with our module
    path: a nightly config saying so would never load this package."""
    p = tmp_path / "bad.yaml"
    text = (
        open(DSV)
        .read()
        .replace('"kv_connector":"HiSparseOOTConnector"', '"kv_connector":"HiSparseConnector"')
    )
    assert '"HiSparseConnector"' in text
    p.write_text(text)
    with pytest.raises(ConfigError, match="use 'HiSparseOOTConnector'"):
        load_config(str(p))
