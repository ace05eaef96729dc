"""glu: the in-place inference path gives exactly glu_reference's values; with autograd on fp32 CPU tensors
it is GLUFunction (the C kernel forward and backward), whose gradients match float64 autograd."""

import pytest
import torch

from moeswap.ops import cpu_kernels
from moeswap.ops.activation import glu, glu_reference


def no_kernel(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "kernel", lambda flags=None: None)


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("shape", [(1, 7), (33, 64), (2, 5, 96)])
def test_torch_in_place_path_equals_the_reference_bitwise(act, shape, monkeypatch):
    no_kernel(monkeypatch)
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


def test_situ_kernel_is_within_a_few_ulp_and_the_same_for_any_split():
    kernel = cpu_kernels.kernel()
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(300, 257, generator=g) * 5, torch.randn(300, 257, generator=g) * 30
    gate[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-30])
    up[1, 0] = float("nan")
    exact = glu_reference("situ", gate.double(), up.double(), (4.0, 25.0)).float()
    with torch.no_grad():
        got = glu("situ", gate, up, (4.0, 25.0))
    assert torch.equal(got.isnan(), exact.isnan()) and got.isnan().sum() == 2
    finite = ~exact.isnan()
    err = (got - exact).abs()[finite] / (exact.abs()[finite] * 2**-23).clamp_min(2**-126)
    assert err.max() <= 4  # ulp; torch's own tanh and sigmoid are ~2.4 from the float64 value here
    for rows, cols in ((slice(5, 6), slice(3, 20)), (slice(0, 300), slice(0, 100)), (slice(7, 9), slice(0, 257))):
        part = kernel.glu(gate[rows, cols].contiguous(), up[rows, cols].contiguous(), "situ", (4.0, 25.0))
        whole = got[rows, cols]  # vector body and scalar tail agree bit for bit (NaN where NaN)
        assert torch.equal(part.nan_to_num(), whole.nan_to_num()) and torch.equal(part.isnan(), whole.isnan())
    with pytest.raises(ValueError, match="expected fp32 CPU tensors of one shape"):
        kernel.glu(gate, up[:, :5], "situ", (4.0, 25.0))


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_glu_gradients_under_autograd_match_float64(act):
    """GLUFunction (the C forward and backward) against autograd through glu_reference in float64, over
    the range where SiTU's soft caps bend (gate to +-12, up to +-80)."""
    if cpu_kernels.kernel() is None:
        pytest.skip("no C compiler for the CPU kernels")
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(300, 37, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    up = (torch.randn(300, 37, generator=g, dtype=torch.float64) * 30).requires_grad_(True)
    probe = torch.randn(300, 37, generator=g, dtype=torch.float64)
    (glu_reference(act, gate, up) * probe).sum().backward()
    gate32, up32 = (t.detach().float().requires_grad_(True) for t in (gate, up))
    out = glu(act, gate32, up32)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "GLUFunctionBackward"
    (out * probe.float()).sum().backward()
    torch.testing.assert_close(out.double(), glu_reference(act, gate, up).detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gate32.grad.double(), gate.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(up32.grad.double(), up.grad, rtol=1e-4, atol=1e-4)
