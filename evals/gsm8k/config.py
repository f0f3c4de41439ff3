"""GSM8K eval configs: the schema, the loader and the model-list reader.

A config is a YAML mapping. Every key is checked before anything is started, and each error
names the file and the key, so a typo in a nightly config fails in a second instead of after a
20-minute server start.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import yaml


class ConfigError(ValueError):
    """A config file is missing, unreadable, or does not match the schema."""


# key -> (accepted python types, required, description). bool is rejected where a number is
# expected (YAML `true` is not a count), and int is accepted where a float is expected.
_NUM = (int, float)
SCHEMA: Dict[str, Tuple[tuple, bool, str]] = {
    "model_name": ((str,), True, "Hugging Face model id passed to `vllm serve`"),
    "accuracy_threshold": (_NUM, True, "minimum accuracy, in (0, 1]"),
    "tolerance": (_NUM, True, "allowed shortfall below the threshold, in [0, 1)"),
    "num_questions": ((int,), True, "number of GSM8K test questions (1..1319)"),
    "num_fewshot": ((int,), True, "number of worked train examples in the prompt (0..20)"),
    "max_tokens": ((int,), True, "completion token limit per question (>= 1)"),
    "max_concurrency": ((int,), True, "requests in flight at once (>= 1)"),
    "request_timeout_seconds": (_NUM, True, "per-request HTTP timeout (> 0)"),
    "startup_max_wait_seconds": (_NUM, True, "how long to wait for the server to be ready (> 0)"),
    "server_args": ((str,), True, "arguments appended to `vllm serve MODEL`"),
    "env": ((dict,), False, "extra environment variables for the server (str -> str)"),
    "temperature": (_NUM, False, "sampling temperature (default 0.0: greedy)"),
}

GSM8K_TEST_SIZE = 1319


def _type_name(types: tuple) -> str:
    names = {int: "int", float: "float", str: "str", dict: "mapping"}
    return " or ".join(names.get(t, t.__name__) for t in types)


@dataclass(frozen=True)
class EvalConfig:
    model_name: str
    accuracy_threshold: float
    tolerance: float
    num_questions: int
    num_fewshot: int
    max_tokens: int
    max_concurrency: int
    request_timeout_seconds: float
    startup_max_wait_seconds: float
    server_args: str
    env: Dict[str, str] = field(default_factory=dict)
    temperature: float = 0.0
    source: str = "<dict>"

    @property
    def pass_floor(self) -> float:
        """The accuracy a run must reach: threshold - tolerance."""
        return self.accuracy_threshold - self.tolerance

    def server_argv(self) -> List[str]:
        """`server_args` split as a POSIX shell would (quotes around JSON are honoured)."""
        return shlex.split(self.server_args)

    def server_option(self, name: str) -> Optional[str]:
        """Value of `--name VALUE` or `--name=VALUE` in server_args; '' for a bare flag; None if
        absent."""
        argv = self.server_argv()
        for i, tok in enumerate(argv):
            if tok == name:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    return argv[i + 1]
                return ""
            if tok.startswith(name + "="):
                return tok[len(name) + 1 :]
        return None

    def kv_transfer_config(self) -> Optional[Dict[str, Any]]:
        raw = self.server_option("--kv-transfer-config")
        return None if raw is None else json.loads(raw)

    def gpus_needed(self) -> int:
        """tensor-parallel-size x pipeline-parallel-size x data-parallel-size (each default 1)."""
        n = 1
        for opt in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"):
            v = self.server_option(opt)
            if v:
                n *= int(v)
        return n


def _check_type(where: str, key: str, value: Any, types: tuple) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        raise ConfigError(
            f"{where}: key '{key}' must be {_type_name(types)}, got {type(value).__name__} "
            f"({value!r})"
        )


def validate(data: Any, where: str = "<dict>") -> EvalConfig:
    """Check a parsed config against SCHEMA and the value ranges; return an EvalConfig."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the config must be a YAML mapping, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in SCHEMA)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)}; "
            f"allowed keys: {', '.join(SCHEMA)}"
        )
    missing = [k for k, (_, req, _) in SCHEMA.items() if req and k not in data]
    if missing:
        raise ConfigError(
            f"{where}: missing required key(s) "
            + ", ".join(f"'{k}' ({SCHEMA[k][2]})" for k in missing)
        )
    for key, value in data.items():
        _check_type(where, key, value, SCHEMA[key][0])

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: key '{key}' {why}, got {data[key]!r}")

    if not data["model_name"].strip():
        raise bad("model_name", "must not be empty")
    if not 0.0 < data["accuracy_threshold"] <= 1.0:
        raise bad("accuracy_threshold", "must be in (0, 1]")
    if not 0.0 <= data["tolerance"] < 1.0:
        raise bad("tolerance", "must be in [0, 1)")
    if not 1 <= data["num_questions"] <= GSM8K_TEST_SIZE:
        raise bad("num_questions", f"must be in 1..{GSM8K_TEST_SIZE}")
    if not 0 <= data["num_fewshot"] <= 20:
        raise bad("num_fewshot", "must be in 0..20")
    for key in ("max_tokens", "max_concurrency"):
        if data[key] < 1:
            raise bad(key, "must be >= 1")
    for key in ("request_timeout_seconds", "startup_max_wait_seconds"):
        if data[key] <= 0:
            raise bad(key, "must be > 0")
    if "temperature" in data and data["temperature"] < 0:
        raise bad("temperature", "must be >= 0")
    env = data.get("env", {})
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ConfigError(
                f"{where}: key 'env' must map strings to strings; entry {k!r}: {v!r} is "
                f"{type(k).__name__} -> {type(v).__name__} (quote numbers in YAML)"
            )

    try:
        argv = shlex.split(data["server_args"])
    except ValueError as e:
        raise ConfigError(f"{where}: key 'server_args' is not valid shell syntax: {e}") from None
    if argv and not argv[0].startswith("-"):
        raise ConfigError(
            f"{where}: key 'server_args' must start with an option; the model comes from "
            f"'model_name', got {argv[0]!r} first"
        )
    cfg = EvalConfig(
        model_name=data["model_name"],
        accuracy_threshold=float(data["accuracy_threshold"]),
        tolerance=float(data["tolerance"]),
        num_questions=data["num_questions"],
        num_fewshot=data["num_fewshot"],
        max_tokens=data["max_tokens"],
        max_concurrency=data["max_concurrency"],
        request_timeout_seconds=float(data["request_timeout_seconds"]),
        startup_max_wait_seconds=float(data["startup_max_wait_seconds"]),
        server_args=data["server_args"],
        env=dict(env),
        temperature=float(data.get("temperature", 0.0)),
        source=where,
    )
    for opt in (
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--data-parallel-size",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
    ):
        v = cfg.server_option(opt)
        if v is not None and not (v.isdigit() and int(v) >= 1):
            raise ConfigError(
                f"{where}: key 'server_args': {opt} needs a positive integer, got {v!r}"
            )
    if cfg.server_option("--model") is not None:
        raise ConfigError(f"{where}: key 'server_args' must not set --model; use 'model_name'")
    kv = cfg.server_option("--kv-transfer-config")
    if kv is not None:
        try:
            parsed = json.loads(kv)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{where}: key 'server_args': --kv-transfer-config is not valid JSON ({e}); "
                f"quote it with single quotes in the YAML"
            ) from None
        if not isinstance(parsed, dict) or "kv_connector" not in parsed:
            raise ConfigError(
                f"{where}: key 'server_args': --kv-transfer-config must be a JSON object with "
                f"a 'kv_connector' entry, got {kv!r}"
            )
        if (
            parsed.get("kv_connector_module_path") == "hisparse.vllm.connector"
            and parsed["kv_connector"] == "HiSparseConnector"
        ):
            # vLLM >= 0.32 keys its own CUDA-only HiSparse path on this name, whatever module
            # path is given: the run would not exercise this package.
            raise ConfigError(
                f"{where}: key 'server_args': kv_connector 'HiSparseConnector' selects vLLM's "
                "in-tree HiSparse; use 'HiSparseOOTConnector' to load hisparse.vllm.connector"
            )
    return cfg


def load_config(path: str) -> EvalConfig:
    """Read and validate one YAML config file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return validate(data, where=path)


def read_model_list(path: str) -> List[str]:
    """Config paths listed in a models-*.txt file (one per line, relative to the list's folder;
    blank lines and '#' comments ignored). Every listed file must exist."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read model list: {e.strerror or e}") from None
    base = os.path.dirname(os.path.abspath(path))
    out: List[str] = []
    for n, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        full = entry if os.path.isabs(entry) else os.path.join(base, entry)
        if not os.path.isfile(full):
            raise ConfigError(f"{path}:{n}: listed config {entry!r} does not exist")
        out.append(full)
    if not out:
        raise ConfigError(f"{path}: lists no configs")
    return out
