"""glu: the in-place inference path gives exactly glu_reference's values; with autograd it is the
reference itself, so gradients flow (LoRA training through the experts)."""

import pytest
import torch

from moeswap.ops.activation import glu, glu_reference


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("shape", [(1, 7), (33, 64), (2, 5, 96)])
def test_in_place_path_equals_the_reference_bitwise(act, shape):
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(*shape, generator=g) * 6, torch.randn(*shape, generator=g) * 40
    gate[..., 0], up[..., 0] = float("nan"), float("inf")  # non-finite values propagate the same way
    with torch.no_grad():
        got = glu(act, gate.clone(), up.clone(), (4.0, 25.0))
    want = glu_reference(act, gate, up, (4.0, 25.0))
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
    if act == "situ":  # the betas matter
        assert not torch.equal(glu(act, gate, up, (3.0, 20.0)).nan_to_num(), want.nan_to_num())


def test_inputs_are_not_modified_and_gradients_flow():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    before = gate.clone(), up.clone()
    glu("situ", gate, up)
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1])
    gate.requires_grad_(True)
    glu("situ", gate, up).sum().backward()
    assert gate.grad is not None and torch.isfinite(gate.grad).all()
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        glu("gelu", gate, up)
