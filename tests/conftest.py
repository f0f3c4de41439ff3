"""Fixtures shared by the whole suite."""

from __future__ import annotations

import pytest

from tests.devices import DEVICES


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The op backend a test runs on: "cpu", and "cuda" (marked `cuda`; skipped without a GPU
    or without the CUDA build of hisparse._C). Write a behaviour once against `device`."""
    return request.param
