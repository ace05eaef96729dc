"""Shared fixtures for planner tests: the real K3 config and its parameter table."""

import pytest

from moeswap.planner.models import resolve_model
from moeswap.planner.params import model_params


@pytest.fixture(scope="session")
def k3():
    cfg, _ = resolve_model("kimi-k3")
    return cfg


@pytest.fixture(scope="session")
def k3p(k3):
    return model_params(k3)
