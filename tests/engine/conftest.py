"""The engine tests' model: a tiny K3, a tiny Kimi Linear and a tiny DeepSeek-V3 (seed 4), loaded in fp32 once
per module."""

from __future__ import annotations

import pytest

from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear", "deepseek_v3"])
def model(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, "tiny", seed=4)
    return load_model(path, LoadOptions(dtype="float32"))[0]
