"""kda_chunked (intra-chunk decays factored through sub-chunk starts) equals kda_chunked_pairwise (every
pairwise decay formed) for every gate kind, sub-chunk size and ragged tail; both match the recurrence."""

import importlib.util
from pathlib import Path

import pytest
import torch

from moeswap.ops.kda import kda_chunked, kda_chunked_pairwise, kda_recurrent

_spec = importlib.util.spec_from_file_location("kda_ops_inputs", Path(__file__).with_name("test_kda_ops.py"))
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
make_inputs = _mod.make_inputs


@pytest.mark.parametrize("decay", ["bounded", "strong", "unbounded", "steep"])
@pytest.mark.parametrize("T,chunk,sub", [(150, 64, 16), (77, 32, 8), (64, 64, 64), (19, 64, 5)])
def test_factored_equals_pairwise(decay, T, chunk, sub):
    q, k, v, g, beta, S0 = make_inputs(2, T, 3, 16, 8, decay, seed=T + sub)
    o, S = kda_chunked(q, k, v, g, beta, S0, chunk=chunk, sub=sub)
    o_ref, S_ref = kda_chunked_pairwise(q, k, v, g, beta, S0, chunk=chunk)
    o_rec, S_rec = kda_recurrent(q, k, v, g, beta, S0)
    scale = o_rec.abs().max()
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert (o - o_ref).abs().max() <= 1e-5 * scale
    assert (o - o_rec).abs().max() <= 1e-5 * scale
    assert (S - S_rec).abs().max() <= 1e-5 * S_rec.abs().max()
