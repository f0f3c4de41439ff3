"""`import hisparse` (and `hisparse.connector`) never imports vLLM; hisparse.vllm.connector (and
its stats) use vLLM's bases only when vLLM imports, and fall back to their own otherwise. Each
case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import REPO_ROOT
from tests.helpers import child_timeout

ROOT = REPO_ROOT


def _run(code: str, tmp_path: Path, fake_vllm: str | None = None, env_extra=None):
    env = dict(os.environ)
    env.pop("HISPARSE_NO_VLLM", None)
    paths = [str(ROOT)]
    if fake_vllm is not None:
        pkg = tmp_path / "fake" / "vllm"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(fake_vllm)
        paths.insert(0, str(tmp_path / "fake"))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=child_timeout(12),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# A vllm that explodes on import: importing it at all is detectable.
_EXPLODING = "raise RuntimeError('vllm was imported')\n"


def test_import_hisparse_never_imports_vllm(tmp_path):
    out = _run(
        """
        import sys
        import hisparse, hisparse.runtime, hisparse.ops
        import hisparse.connector, hisparse.connector.exporter, hisparse.connector.tp_pool
        loaded = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]
        assert not loaded, sorted(sys.modules)
        print('ok')
    """,
        tmp_path,
        fake_vllm=_EXPLODING,
    )
    assert out.strip() == "ok"


def test_broken_vllm_falls_back_to_own_bases(tmp_path):
    out = _run(
        """
        from hisparse.vllm import compat as c
        from hisparse.vllm.connector import HiSparseConnector, VllmConnectorStats
        assert not c.HAVE_VLLM
        assert 'vllm was imported' in c.VLLM_UNAVAILABLE_REASON, c.VLLM_UNAVAILABLE_REASON
        assert issubclass(VllmConnectorStats, c.KVConnectorStats)
        assert HiSparseConnector.__mro__[1].__module__ == 'hisparse.vllm.compat'
        print('ok')
    """,
        tmp_path,
        fake_vllm=_EXPLODING,
    )
    assert out.strip() == "ok"


def test_no_vllm_env_skips_vllm_entirely(tmp_path):
    out = _run(
        """
        import sys
        import hisparse.connector, hisparse.connector.exporter, hisparse.connector.worker
        from hisparse.vllm import compat as c
        assert not c.HAVE_VLLM and c.VLLM_UNAVAILABLE_REASON == 'HISPARSE_NO_VLLM is set'
        assert 'vllm' not in sys.modules
        print('ok')
    """,
        tmp_path,
        fake_vllm=_EXPLODING,
        env_extra={"HISPARSE_NO_VLLM": "1"},
    )
    assert out.strip() == "ok"


# A minimal stand-in for vLLM's v1 connector modules (real vLLM is tested in the conformance stage).
_FAKE_V1 = {
    "distributed/__init__.py": "",
    "distributed/kv_transfer/__init__.py": "",
    "distributed/kv_transfer/kv_connector/__init__.py": "",
    "distributed/kv_transfer/kv_connector/v1/__init__.py": "",
    "distributed/kv_transfer/kv_connector/v1/base.py": """
import enum
from abc import ABC, abstractmethod
class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1
class KVConnectorMetadata(ABC):
    pass
class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids): ...
class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config):
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._role = role
        self._connector_metadata = None
    @property
    def role(self):
        return self._role
    def bind_connector_metadata(self, m): self._connector_metadata = m
    def clear_connector_metadata(self): self._connector_metadata = None
    def has_connector_metadata(self): return self._connector_metadata is not None
    def _get_connector_metadata(self): return self._connector_metadata
    @abstractmethod
    def start_load_kv(self, forward_context, **kw): ...
""",
    "distributed/kv_transfer/kv_connector/v1/metrics.py": """
from dataclasses import dataclass, field
from prometheus_client import Counter, Gauge, Histogram
@dataclass
class KVConnectorStats:
    data: dict = field(default_factory=dict)
    def to_dict(self): return self.data
class KVConnectorPromMetrics:
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues
""",
}


def test_subclasses_vllm_bases_when_vllm_imports(tmp_path):
    pkg = tmp_path / "fake" / "vllm"
    for rel, text in _FAKE_V1.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    out = _run(
        """
        import sys
        import hisparse
        assert 'vllm' not in sys.modules  # still nothing at package import
        from vllm.distributed.kv_transfer.kv_connector.v1 import base, metrics
        import types
        from hisparse.vllm.connector import (
            HiSparseConnector, VllmConnectorMetadata, VllmConnectorStats, VllmPromMetrics)
        from hisparse.vllm import compat as c
        assert c.HAVE_VLLM
        assert issubclass(HiSparseConnector, base.KVConnectorBase_V1)
        assert issubclass(HiSparseConnector, base.SupportsHMA)
        assert issubclass(VllmConnectorStats, metrics.KVConnectorStats)
        assert issubclass(VllmPromMetrics, metrics.KVConnectorPromMetrics)
        assert issubclass(VllmConnectorMetadata, base.KVConnectorMetadata)
        kv = types.SimpleNamespace(kv_connector_extra_config={'top_k': 4, 'hot_size': 8})
        c1 = HiSparseConnector(types.SimpleNamespace(kv_transfer_config=kv),
                               base.KVConnectorRole.WORKER)
        assert c1.role is base.KVConnectorRole.WORKER and c1.worker is not None
        print('ok')
    """,
        tmp_path,
        fake_vllm="",
    )
    assert out.strip() == "ok"
