"""The engine tests' model: the tiny model (seed 4) of every registered architecture, loaded in fp32 once
per module."""

from __future__ import annotations

import pytest

from moeswap.archs import REGISTRY
from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="module", params=list(REGISTRY))
def model(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, "tiny", seed=4)
    return load_model(path, LoadOptions(dtype="float32"))[0]
