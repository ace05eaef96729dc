"""The same code on CUDA: parity with the CPU reference on tiny models. Skipped without a GPU."""

import pytest
import torch

from moeswap.engine.generate import GenerationConfig, generate, generate_batch
from moeswap.engine.scheduler import EngineConfig
from moeswap.experts.tiers import tensors_of
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops.kda import ENV_BACKEND, kda_chunked, kda_recurrent
from moeswap.tiny import write_tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cuda") / "k3", "kimi_k3", "tiny", seed=1)


@pytest.fixture
def torch_kda(monkeypatch):
    """KDA on its torch path, not flash-linear-attention's kernels: the tests comparing with the CPU at fp32
    rounding hold for it (fla's chunk_kda multiplies fp32 as TF32; tests/ops/test_kda_fla.py checks it)."""
    monkeypatch.setenv(ENV_BACKEND, "torch")


def _ids(n, seed=0):
    return torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def test_fp32_matches_cpu_sublayer_by_sublayer(k3_dir, torch_kda):
    cpu, _ = load_model(k3_dir, LoadOptions(dtype="float32"))
    gpu, _ = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda"))
    x = torch.randn(1, 100, cpu.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i, (a, b) in enumerate(zip(cpu.model.layers, gpu.model.layers)):
            assert (b.self_attn(x.cuda()).cpu() - a.self_attn(x)).abs().max().item() < 1e-5, f"layer {i} attention"
            assert (b.feed_forward(x.cuda()).cpu() - a.feed_forward(x)).abs().max().item() < 1e-5, f"layer {i} MLP/MoE"
        err_T = (gpu(_ids(100).cuda()).cpu() - cpu(_ids(100))).abs().amax(-1)[0]
    # Sublayers agree to ~1e-6 (measured on an H200); through six layers a random model's near-tied
    # routing amplifies that at some positions (max seen 3.7e-3), as CPU chunked-vs-recurrent does.
    assert err_T.median().item() < 1e-4


def test_bf16_sublayers_close_to_cpu_fp32(k3_dir):
    """bf16 on the GPU, layer by layer (whole random models are chaotic under any rounding change)."""
    cpu, _ = load_model(k3_dir, LoadOptions(dtype="float32"))
    gpu, _ = load_model(k3_dir, LoadOptions(dtype="auto", device="cuda"))
    assert next(gpu.parameters()).dtype == torch.bfloat16
    x = torch.randn(1, 40, cpu.config.hidden_size, generator=torch.Generator().manual_seed(4))
    kinds = {}
    for i, layer_cpu in enumerate(cpu.model.layers):
        kinds.setdefault(layer_cpu.attn_kind, i)
    with torch.no_grad():
        for kind, i in kinds.items():
            want = cpu.model.layers[i].self_attn(x)
            got = gpu.model.layers[i].self_attn(x.cuda().bfloat16()).float().cpu()
            assert ((got - want).norm() / want.norm()).item() < 0.03, kind
        want = cpu.model.layers[0].mlp(x)
        got = gpu.model.layers[0].mlp(x.cuda().bfloat16()).float().cpu()
        assert ((got - want).norm() / want.norm()).item() < 0.03
    assert set(kinds) == {"kda", "mla"}


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


def test_generation_on_cuda_matches_cpu_and_batches(k3_dir, torch_kda):
    cpu, _ = load_model(k3_dir, LoadOptions(dtype="float32"))
    gpu, store = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda"))
    prompts = [_ids(7, 2)[0].tolist(), _ids(30, 3)[0].tolist()]
    cfg = GenerationConfig(max_tokens=12, stop_ids=())
    want = [generate(cpu, p, cfg).tokens for p in prompts]
    assert [generate(gpu, p, cfg).tokens for p in prompts] == want
    assert [r.tokens for r in generate_batch(gpu, prompts, cfg)] == want


def test_swapping_experts_on_cuda_gives_the_cpu_tokens(k3_dir, torch_kda):
    """A fast tier in device memory at 10 % of the experts, a pinned host tier, next-layer prefetch (reads
    into pinned buffers, copies on the side stream, events waited at first use): the all-resident tokens."""
    cpu, _ = load_model(k3_dir, LoadOptions(dtype="float32"))
    prompt = _ids(20, 4)[0].tolist()
    cfg = GenerationConfig(max_tokens=12, stop_ids=())
    want = generate(cpu, prompt, cfg).tokens
    _, store = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda"))
    total = sum(store.fast.cost(k) for k in store.index.entries)
    for host in (0, total // 2):
        gpu, store = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda", expert_memory=total // 10,
                                                    host_memory=host, prefetch="next-layer"))
        try:
            assert generate(gpu, prompt, cfg).tokens == want, host
        finally:
            store.close()
        s = store.stats
        assert s.misses > 0 and s.prefetch.loaded > 0 and store.fast.used <= store.fast.capacity
        assert all(t.is_cuda for key in store.fast.keys() for t in tensors_of(store.fast.get(key)))


@pytest.mark.parametrize("mode", ["gpu", "cpu", "auto"])
def test_hybrid_experts_at_a_quarter_give_the_all_resident_tokens(k3_dir, mode):
    """Issue 21's acceptance for --expert-compute: the fast tier in device memory at 25 % of the expert bytes.
    gpu copies missing experts up and computes them there (evicting); cpu computes them on the CPU's C kernels
    from host memory (the step's rows copied down, outputs back) and never evicts; auto does that for decode
    and swaps for the 40-token prefill. Greedy tokens equal the all-resident run's in every mode."""
    prompts = [_ids(20, 4)[0].tolist(), _ids(40, 5)[0].tolist()]
    cfg = GenerationConfig(max_tokens=12, stop_ids=())
    resident, probe = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda"))
    total = sum(probe.fast.cost(k) for k in probe.index.entries)
    want = [generate(resident, p, cfg).tokens for p in prompts]
    gpu, store = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda", expert_memory=total // 4,
                                                expert_compute=mode))
    try:
        assert [generate(gpu, p, cfg).tokens for p in prompts] == want
    finally:
        store.close()
    s = store.stats
    assert store.fast.used <= store.fast.capacity
    assert all(t.is_cuda for key in store.fast.keys() for t in tensors_of(store.fast.get(key)))
    if mode == "gpu":
        assert s.fast.evictions > 0 and s.hybrid.cpu_steps == 0
    elif mode == "cpu":
        assert s.hybrid.cpu_experts > 0 and s.hybrid.fetch_steps == 0 and s.fast.evictions == 0
    else:
        assert s.hybrid.cpu_experts > 0 and s.hybrid.fetch_steps > 0 and s.fast.evictions > 0


@pytest.mark.parametrize("fraction", [1.0, 0.25])
@pytest.mark.parametrize("arch", ["kimi_k3", "kimi_linear"])
def test_graphed_decode_gives_the_eager_tokens(tmp_path, arch, fraction, torch_kda):
    """Issue 21's graph-captured decode (engine/cuda_graph.py): every decode step replayed from CUDA graphs (all
    resident: one graph per step; a quarter: a segment per MoE layer, the store loading between them) gives
    the eager forward's greedy tokens, alone and in a batch whose size changes as sequences finish."""
    path = write_tiny_model(tmp_path / arch, arch, "tiny", seed=1)
    _, probe = load_model(path, LoadOptions(dtype="float32", device="cuda"))
    total = sum(probe.fast.cost(k) for k in probe.index.entries)
    options = {} if fraction == 1 else {"expert_memory": int(total * fraction)}
    prompts = [_ids(7, 2)[0].tolist(), _ids(30, 3)[0].tolist(), _ids(12, 6)[0].tolist()]
    cfg = GenerationConfig(max_tokens=12, stop_ids=())
    model, store = load_model(path, LoadOptions(dtype="float32", device="cuda", **options))
    try:
        eager = [generate(model, p, cfg, engine=EngineConfig(max_batch=1, max_len=64, native=False)).tokens
                 for p in prompts]
        alone = [generate(model, p, cfg) for p in prompts]
        assert [r.tokens for r in alone] == eager
        assert all(r.native_off is None and r.native_steps == len(r.tokens) - 1 for r in alone), alone[0].native_off
        batch = generate_batch(model, prompts, GenerationConfig(max_tokens=12, stop_ids=()))
        assert [r.tokens for r in batch] == eager
    finally:
        store.close()
    assert store.fast.used <= store.fast.capacity
    assert (store.stats.fast.evictions > 0) == (fraction < 1)


def test_graphed_decode_of_compiled_attention_gives_the_eager_tokens(k3_dir, torch_kda):
    """EngineConfig.compile on CUDA: the graphs capture the attention sublayers torch.compile fused (engine/
    compile.py inside engine/cuda_graph.py); the eager forward's greedy tokens."""
    model, store = load_model(k3_dir, LoadOptions(dtype="float32", device="cuda"))
    prompt = _ids(9, 7)[0].tolist()
    cfg = GenerationConfig(max_tokens=10, stop_ids=())
    try:
        want = generate(model, prompt, cfg, engine=EngineConfig(max_batch=1, max_len=64, native=False)).tokens
        got = generate(model, prompt, cfg, engine=EngineConfig(max_batch=1, max_len=64, compile=True))
    finally:
        store.close()
    assert got.tokens == want and got.native_off is None and got.native_steps == len(want) - 1
