"""The architecture contract (contract.py) on the init-tiny checkpoint of every architecture in
moeswap.archs.REGISTRY: registering one is all it takes to be checked."""

from __future__ import annotations

import pytest
from archs.contract import CHECKS, check_id

from moeswap.archs import REGISTRY
from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="module", params=list(REGISTRY))
def checkpoint(request, tmp_path_factory):
    name = request.param
    return name, write_tiny_model(tmp_path_factory.mktemp(name) / "model", name, "tiny", seed=0)


@pytest.mark.parametrize("check", CHECKS, ids=check_id)
def test_contract(checkpoint, check):
    check(*checkpoint)
