"""The `moeswap-cuda` engine profile's kernel counts (catalog/engines.toml) are those of the graphed decode step
as the code is: a fresh count on the tiny K3 (planner/graph_kernels.py) equals the catalog's."""

import pytest

from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import triton_mxfp4
from moeswap.planner import graph_kernels
from moeswap.planner.hardware import builtin_catalog


@pytest.mark.skipif(not triton_mxfp4.interpreted(), reason="needs triton under its interpreter")
def test_catalog_counts_are_the_graphed_steps(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir, LoadOptions())
    try:
        counted = graph_kernels.count(model)
    finally:
        store.close()
    profile = builtin_catalog().get("engine", "moeswap-cuda").fields
    assert counted == {k: profile[k] for k in counted}, "recount: planner/graph_kernels.py count(tiny K3)"
