"""ops.kda.kda_fla: moeswap's KDA conventions mapped onto flash-linear-attention's kernels (fla-core), checked
against `kda_recurrent` (the reference). Skipped where fla does not import.

Without a GPU (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported):
- fla's `fused_recurrent_kda` (the decode kernel) runs for real in Triton's interpreter on CPU tensors.
- fla's `chunk_kda` (the prefill kernel) does not run there (fla 0.6.0's chunk_delta_h calls `.to` on a loop
  index, a Python int in the interpreter), so its mapping is checked through `kda_fla(core=...)` with what
  ChunkKDAFunction.forward does in front of its kernels (fla's own `l2norm_fwd` kernel on q and k) followed by
  fla's torch reference (`naive_chunk_kda` where T is a multiple of its chunk of 64, else
  `naive_recurrent_kda`): the same keyword arguments, layouts, scale and state as chunk_kda gets.
The layer on CUDA with fla against the layer's torch path is marked cuda (skipped here).

Tolerances: everything is fp32. fla and the reference sum the same K = 16 products in different orders
(a few ulps per step) and the recurrence does not amplify them (|exp g| <= 1, beta <= 1, unit-norm k): 1e-5
absolute on values of order 1 (measured: under 1e-6). On CUDA chunk_kda's tl.dot takes fp32 inputs as TF32
(10-bit mantissa, 2^-11 relative per product), hence 5e-3 relative to the largest output there.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeswap.config import parse_config
from moeswap.models.layers.kda import KDA, KDAState
from moeswap.ops import kda as ops_kda
from moeswap.ops.kda import ENV_BACKEND, fla_selected, kda_fla, kda_recurrent, l2_normalize
from moeswap.tiny import tiny_config

B, H, K = 2, 2, 16
ATOL_FP32 = 1e-5


@pytest.fixture(scope="module")
def fla_kda():
    # imported here, not at collection: importing fla takes ~3 s and warns without a GPU
    return pytest.importorskip("fla.ops.kda")


@pytest.fixture
def one_config_per_kernel(monkeypatch):
    """Triton's autotuner times its configurations on a device; the interpreter has none (no active driver).
    Keep the first configuration: every one of them computes the same values."""
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs
    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])


def interpreted() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def inputs(T: int, seed: int):
    """Raw q, k (unnormalised, of varied norms), v, K3-style bounded log decays g in (-5, 0), beta in (0, 1),
    and a non-zero initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen) * 3
    k = torch.randn(B, T, H, K, generator=gen) * torch.rand(B, T, H, 1, generator=gen) * 4
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.rand(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    S0 = torch.randn(B, H, K, K, generator=gen)
    return q, k, v, g, beta, S0


def reference(q, k, v, g, beta, S0):
    return kda_recurrent(l2_normalize(q) * K**-0.5, l2_normalize(k), v, g, beta, S0.clone())


@pytest.mark.parametrize("T", [5, 37, 70])
def test_fused_recurrent_kernel_matches_recurrence(fla_kda, T):
    """fla's decode kernel, for real in the interpreter, over T tokens (crossing 64) from a non-zero state."""
    if not interpreted():
        pytest.skip("needs Triton's interpreter (CPU tensors)")
    q, k, v, g, beta, S0 = inputs(T, seed=T)
    want_o, want_S = reference(q, k, v, g, beta, S0)
    state = S0.clone()
    got_o = kda_fla(q, k, v, g, beta, state, K**-0.5, allow_cpu=True, core=fla_kda.fused_recurrent_kda)
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=ATOL_FP32)
    torch.testing.assert_close(state, want_S, rtol=0, atol=ATOL_FP32)  # updated in place


def test_decode_steps_carry_the_state(fla_kda):
    """One token at a time through kda_fla's own choice for T == 1 (fused_recurrent_kda): three steps with the
    state carried between them give the reference's three tokens."""
    if not interpreted():
        pytest.skip("needs Triton's interpreter (CPU tensors)")
    q, k, v, g, beta, S0 = inputs(3, seed=11)
    want_o, want_S = reference(q, k, v, g, beta, S0)
    state = S0.clone()
    outs = [kda_fla(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], state, K**-0.5,
                    allow_cpu=True) for t in range(3)]
    torch.testing.assert_close(torch.cat(outs, dim=1), want_o, rtol=0, atol=ATOL_FP32)
    torch.testing.assert_close(state, want_S, rtol=0, atol=ATOL_FP32)


@pytest.mark.parametrize("T", [5, 64, 70, 128])
def test_chunk_mapping_through_fla_reference(fla_kda, one_config_per_kernel, T):
    """The arguments kda_fla gives chunk_kda, taken the way chunk_kda takes them: fla's l2norm kernel on q
    and k (use_qk_l2norm_in_kernel), then fla's torch reference of the chunked (or token) recurrence."""
    if not interpreted():
        pytest.skip("needs Triton's interpreter (CPU tensors)")
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    naive = naive_chunk_kda if T % 64 == 0 else naive_recurrent_kda
    calls = []

    def as_chunk_kda(*, q, k, use_qk_l2norm_in_kernel, **kwargs):
        calls.append(sorted(kwargs))
        if use_qk_l2norm_in_kernel:
            q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
        return naive(q=q, k=k, **kwargs)

    q, k, v, g, beta, S0 = inputs(T, seed=100 + T)
    want_o, want_S = reference(q, k, v, g, beta, S0)
    state = S0.clone()
    got_o = kda_fla(q, k, v, g, beta, state, K**-0.5, allow_cpu=True, core=as_chunk_kda)
    assert calls == [["beta", "g", "initial_state", "output_final_state", "scale", "v"]]
    torch.testing.assert_close(got_o, want_o, rtol=0, atol=ATOL_FP32)
    torch.testing.assert_close(state, want_S, rtol=0, atol=ATOL_FP32)


def test_selection_never_takes_cpu_tensors_and_honours_the_switch(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    assert not fla_selected(x)
    monkeypatch.setenv(ENV_BACKEND, "torch")
    assert not fla_selected(x)
    monkeypatch.setenv(ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match=ENV_BACKEND):
        fla_selected(x)
    with pytest.raises(ValueError, match="CUDA"):
        kda_fla(*inputs(2, seed=0)[:5], torch.zeros(B, H, K, K), K**-0.5)


# -- on CUDA ---------------------------------------------------------------------------------------------


def random_kda(seed: int) -> KDA:
    """A tiny K3 KDA layer (bounded gates) with seeded weights of informative size."""
    layer = KDA(parse_config(tiny_config("kimi_k3", "tiny")))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log())
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return layer.eval()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layer_on_cuda_with_fla_matches_torch_path(fla_kda, monkeypatch):
    """Prefill 100 tokens (chunk_kda) then decode 3 (fused_recurrent_kda), the state carried, against the same
    layer on the torch path ($MOESWAP_KDA_BACKEND=torch: kda_chunked, kda_decode_step)."""
    layer = random_kda(seed=3).cuda()
    x = torch.randn(2, 103, layer.q_proj.in_features, generator=torch.Generator().manual_seed(4)).cuda()

    def run(backend: str):
        monkeypatch.setenv(ENV_BACKEND, backend)
        state = KDAState.zeros(2, layer.H, layer.K, layer.W, torch.float32, "cuda")
        assert fla_selected(state.recurrent_BHKK) == (backend == "auto")
        with torch.no_grad():
            ys = [layer(x[:, :100], state)] + [layer(x[:, t:t + 1], state) for t in range(100, 103)]
        return torch.cat(ys, dim=1), state

    want_y, want_state = run("torch")
    got_y, got_state = run("auto")
    assert ops_kda._fla_kda() is fla_kda
    for got, want in ((got_y, want_y), (got_state.recurrent_BHKK, want_state.recurrent_BHKK),
                      (got_state.conv_BWC, want_state.conv_BWC)):
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 5e-3 * want.abs().max().item()
