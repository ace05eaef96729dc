"""The same code on CUDA: parity with the CPU reference on tiny models. Skipped without a GPU."""

import pytest
import torch

from moeswap.engine.generate import GenerationConfig, generate, generate_batch
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops.kda import kda_chunked, kda_recurrent
from moeswap.tiny import write_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cuda") / "k3", "kimi_k3", "tiny", seed=1)


def _ids(n, seed=0):
    return torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def test_fp32_logits_match_cpu(k3_dir):
    cpu, _ = load_model(k3_dir, LoadOptions(dtype="float32"))
    gpu, _ = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda"))
    ids = _ids(100)
    with torch.no_grad():
        want = cpu(ids)
        got = gpu(ids.cuda()).cpu()
    assert (got - want).abs().max().item() < 1e-3


def test_bf16_logits_close_to_cpu_fp32(k3_dir):
    cpu, _ = load_model(k3_dir, LoadOptions(dtype="float32"))
    gpu, _ = load_model(k3_dir, LoadOptions(dtype="auto", device="cuda"))
    assert next(gpu.parameters()).dtype == torch.bfloat16
    ids = _ids(64, 1)
    with torch.no_grad():
        want = cpu(ids)
        got = gpu(ids.cuda()).float().cpu()
    assert ((got - want).norm() / want.norm()).item() < 0.05


def test_kda_chunked_equals_recurrent_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K = 2, 130, 3, 32
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(B, T, H, K, device="cuda", generator=g)
    decay = -5 * torch.sigmoid(torch.randn(B, T, H, K, device="cuda", generator=g))
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=g))
    S0 = torch.randn(B, H, K, K, device="cuda", generator=g)
    o1, s1 = kda_recurrent(q, k, v, decay, beta, S0)
    o2, s2 = kda_chunked(q, k, v, decay, beta, S0)
    assert (o1 - o2).abs().max().item() < 1e-4 and (s1 - s2).abs().max().item() < 1e-4


def test_generation_on_cuda_matches_cpu_and_batches(k3_dir):
    cpu, _ = load_model(k3_dir, LoadOptions(dtype="float32"))
    gpu, store = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda"))
    prompts = [_ids(7, 2)[0].tolist(), _ids(30, 3)[0].tolist()]
    cfg = GenerationConfig(max_tokens=12, stop_ids=())
    want = [generate(cpu, p, cfg).tokens for p in prompts]
    assert [generate(gpu, p, cfg).tokens for p in prompts] == want
    assert [r.tokens for r in generate_batch(gpu, prompts, cfg)] == want
