"""Test-only, for test_vllm_tp_faults.py: every Python process of one server imports this as
``sitecustomize`` (its folder comes first on that server's PYTHONPATH).

Once the file named by ``HISPARSE_TEST_STALL_FILE`` exists, TP rank 0 deletes it and stops
itself (SIGSTOP) just before it flags a layer's rows written. A signal sent from outside lands
anywhere, often while rank 1 is inside one of vLLM's collectives, where no HiSparse timeout
applies; stopped here, rank 0 has passed every collective before the flag, so rank 1 is certain
to reach the layer and wait for its rows.
"""

import importlib.abc
import importlib.machinery
import os
import signal
import sys

TRIGGER = os.environ.get("HISPARSE_TEST_STALL_FILE")
MODULE = "hisparse.runtime.pool_fence"


def _patch(module) -> None:
    flag = module.PoolFence.layer_written

    def layer_written(self, layer):
        if self.writer and os.path.exists(TRIGGER):
            os.unlink(TRIGGER)
            os.kill(os.getpid(), signal.SIGSTOP)
        flag(self, layer)

    module.PoolFence.layer_written = layer_written


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if TRIGGER:
    sys.meta_path.insert(0, _PatchOnImport())
