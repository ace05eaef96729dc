"""The architecture contract (contract.py) on every init-tiny layout (plain and each --quant variant) of
every architecture in moeswap.archs.REGISTRY: registering one is all it takes to be checked."""

from __future__ import annotations

import pytest

from archs.contract import CHECKS, Tiny, check_id, variants
from moeswap.archs import REGISTRY
from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="module", params=[v for name in REGISTRY for v in variants(name)],
                ids=lambda v: "-".join(filter(None, v)))
def tiny(request, tmp_path_factory) -> Tiny:
    name, quant = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(name) / "model", name, "tiny", seed=0, quant=quant)
    return Tiny(name, quant, path)


@pytest.mark.parametrize("check", CHECKS, ids=check_id)
def test_contract(tiny, check):
    check(tiny)
