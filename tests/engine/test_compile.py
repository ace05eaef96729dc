"""EngineConfig(compile=True): the compiled decode gives the eager tokens, and its attention compiles
into whole graphs (a graph break at every C kernel call made it 2x slower than eager); the C kernels'
torch ops agree with the kernels and pass torch.library's checks."""

import pytest
import torch

from moeswap.engine.generate import GenerationConfig, generate_batch
from moeswap.engine.scheduler import EngineConfig
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels


@pytest.fixture
def kernel():
    k = cpu_kernels.kernel()
    if k is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    return k


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens_without_graph_breaks(tiny_k3_dir, kernel, greedy_oracle):
    from torch._dynamo.utils import counters

    model, _ = load_model(tiny_k3_dir, LoadOptions())
    prompts = [list(range(3, 15)), list(range(40, 47))]
    cfg = GenerationConfig(max_tokens=6, stop_ids=())
    # eager: the model's modules, not the native step (the default, which compile=True replaces)
    eager = EngineConfig(max_batch=2, native=False)
    want = [r.tokens for r in generate_batch(model, prompts, cfg, engine=eager)]
    assert want == [greedy_oracle(model, p, 6) for p in prompts]
    torch._dynamo.reset()
    counters.clear()
    got = [r.tokens for r in generate_batch(model, prompts, cfg, engine=EngineConfig(max_batch=2, compile=True))]
    assert got == want
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_kernel_ops_match_the_kernels(kernel):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(48, 64, generator=g).bfloat16()
    assert torch.equal(torch.ops.moeswap.bf16_linear(x, w), kernel.bf16_linear(x, w))
    torch.library.opcheck(torch.ops.moeswap.bf16_linear.default, (x, w))

    N, K = 4, 16
    q, k, v, gate = (torch.randn(N, K, generator=g) for _ in range(4))
    beta, state = torch.rand(N, generator=g), torch.randn(N, K, K, generator=g)
    want_state = state.clone()
    want = kernel.kda_decode(q, k, v, -gate.abs(), beta, want_state, 0.25, 1e-6)
    got = torch.ops.moeswap.kda_decode(q, k, v, -gate.abs(), beta, state, 0.25, 1e-6)
    assert torch.equal(got, want) and torch.equal(state, want_state)  # the state is updated in place
    torch.library.opcheck(torch.ops.moeswap.kda_decode.default, (q, k, v, -gate.abs(), beta, state.clone(), 0.25, 1e-6))
