"""Hybrid experts (experts/hybrid.py, `--expert-compute`): with the fast tier at 25 % of the experts, those it
lacks computed on the CPU from host memory give the all-resident tokens, and on a CPU-only machine (the same
kernels on the same bytes) the same logits bit for bit; the fast tier fills its free room and then loads
nothing more; `auto` takes the CPU for few tokens and the fetch for a long prefill; `gpu` is the store as
it was. The accelerator's side (rows copied down, outputs added back) runs here on CPU tensors."""

import pytest
import torch

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.engine.native_step import NativeDecode
from moeswap.engine.scheduler import fuse_projections
from moeswap.experts import executors
from moeswap.experts.hybrid import HybridExperts
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels
from moeswap.ops.expert import MXFP4ExpertWeights
from moeswap.weights.registry import format_of
from numerics import gamma, glu_expert_bound, glu_expert_exact

CFG = GenerationConfig(max_tokens=10, stop_ids=())


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def quarter(tiny_k3_dir) -> int:
    """A quarter of the tiny K3's expert bytes."""
    _, probe = load_model(tiny_k3_dir, LoadOptions())
    probe.close()
    return sum(probe.fast.cost(k) for k in probe.index.entries) // 4


def _load(path, **options):
    model, store = load_model(path, LoadOptions(**options))
    fuse_projections(model)
    return model, store


def _logits(model, step, prompt: list[int], steps: int) -> torch.Tensor:
    """Prefill through the model, then greedy decode steps through `step`: logits [steps + 1, V]."""
    state = model.make_state(1)
    with torch.inference_mode():
        outs = [model(torch.tensor([prompt]), state)[0, -1]]
        for _ in range(steps):
            outs.append(step(outs[-1].argmax().view(1, 1), state)[0, -1])
    return torch.stack(outs)


def _full(store) -> bool:
    """No expert fits in the fast tier's free room."""
    return store.fast.capacity - store.fast.used < min(store.fast.cost(k) for k in store.index.entries)


def test_default_is_gpu_the_store_without_hybrid(tiny_k3_dir, quarter):
    assert LoadOptions().expert_compute == "gpu"
    _, store = _load(tiny_k3_dir, expert_memory=quarter)
    assert store.hybrid is None
    _, cpu_store = _load(tiny_k3_dir, expert_memory=quarter, expert_compute="cpu")
    assert isinstance(cpu_store.hybrid, HybridExperts) and cpu_store.hybrid.mode == "cpu"


@pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")
@pytest.mark.parametrize("native", [True, False], ids=["native-step", "modules"])
@pytest.mark.parametrize("arch", ["k3", "linear"])
def test_cpu_mode_at_a_quarter_gives_the_all_resident_logits_bit_for_bit(tiny_k3_dir, tiny_linear_dir, quarter,
                                                                         arch, native):
    """The same C kernels on the same bytes (K3: MXFP4; Kimi Linear: bf16), in the same groups and order,
    whether an expert comes from the fast tier or host memory: logits equal the all-resident run's exactly,
    through the native decode step (rows of host experts in its table copy) and through the modules."""
    path = tiny_k3_dir if arch == "k3" else tiny_linear_dir
    if arch == "linear":
        _, probe = load_model(path, LoadOptions())
        probe.close()
        quarter = sum(probe.fast.cost(k) for k in probe.index.entries) // 4
    prompt = _prompt(20, 3)
    want_model, _ = _load(path, expert_memory=1 << 30)
    want = _logits(want_model, NativeDecode(want_model) if native else want_model, prompt, 8)
    model, store = _load(path, expert_memory=quarter, expert_compute="cpu")
    step = NativeDecode(model) if native else model
    got = _logits(model, step, prompt, 8)
    assert torch.equal(got, want)
    if native:
        assert step.reason is None
    h = store.stats.hybrid
    assert h.cpu_steps > 0 and h.cpu_experts > 0 and h.fetch_steps == 0
    assert store.stats.fast.evictions == 0 and store.fast.used <= store.fast.capacity
    assert store.stats.disk_reads > 0  # the missing experts were read to the host, each step again (no host tier)


@pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")
def test_cpu_mode_greedy_tokens_and_no_loads_once_the_tier_is_full(tiny_k3_dir, quarter):
    """generate (scheduler, native decode) at 25 %: the all-resident tokens in every mode. Once the fast tier
    is full, cpu mode loads nothing into it (no bytes in, no evictions, no misses) while gpu mode, on the
    same requests, swaps."""
    prompts = [_prompt(20, 3), _prompt(12, 5)]
    all_resident, _ = _load(tiny_k3_dir, expert_memory=1 << 30)
    want = [generate(all_resident, p, CFG).tokens for p in prompts]
    books = {}
    for mode in ("gpu", "cpu"):
        model, store = _load(tiny_k3_dir, expert_memory=quarter, expert_compute=mode)
        assert generate(model, prompts[0], CFG).tokens == want[0], mode
        assert _full(store), mode
        store.reset_stats()
        assert generate(model, prompts[1], CFG).tokens == want[1], mode
        s = store.stats
        books[mode] = (s.fast.bytes_in, s.fast.evictions, s.fast.misses)
        if mode == "cpu":
            assert s.hybrid.cpu_steps > 0 and s.hybrid.cpu_experts > 0 and s.hybrid.filled == 0
            assert s.hits > 0  # the experts the tier holds still run from it
    assert books["cpu"] == (0, 0, 0)
    assert all(n > 0 for n in books["gpu"])


@pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")
def test_auto_fetches_for_a_long_prefill_and_computes_on_the_cpu_for_decode(tiny_k3_dir, quarter):
    """auto at the default threshold (32 tokens): a 40-token prefill fetches the missing experts into the
    fast tier (it swaps, as gpu mode does), then 1-token decode steps compute the missing ones on the CPU and
    load nothing; the tokens are the all-resident ones."""
    prompt = _prompt(40, 7)
    all_resident, _ = _load(tiny_k3_dir, expert_memory=1 << 30)
    want = _logits(all_resident, NativeDecode(all_resident), prompt, 6).argmax(-1)
    model, store = _load(tiny_k3_dir, expert_memory=quarter, expert_compute="auto")
    assert store.hybrid.min_tokens == 32
    state = model.make_state(1)
    with torch.inference_mode():
        last = model(torch.tensor([prompt]), state)[0, -1]
    s = store.stats
    moe_layers = len(list(model.moe_blocks()))
    assert s.hybrid.fetch_steps == moe_layers and s.hybrid.cpu_steps == 0 and s.hybrid.cpu_experts == 0
    assert s.fast.evictions > 0 and _full(store)
    store.reset_stats()
    step, got = NativeDecode(model), [last.argmax()]
    with torch.inference_mode():
        for _ in range(6):
            got.append(step(got[-1].view(1, 1), state)[0, -1].argmax())
    s = store.stats
    assert torch.equal(torch.stack(got), want)
    assert s.hybrid.cpu_steps > 0 and s.hybrid.fetch_steps == 0
    assert (s.fast.bytes_in, s.fast.evictions, s.fast.misses) == (0, 0, 0)


@pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")
def test_a_threshold_of_one_token_makes_auto_fetch_everywhere(tiny_k3_dir, quarter):
    """--expert-gpu-min-tokens 1: every step reaches it, so auto swaps as gpu mode does, same books."""
    prompt = _prompt(20, 3)
    books = []
    for options in (dict(expert_compute="gpu"), dict(expert_compute="auto", expert_gpu_min_tokens=1)):
        model, store = _load(tiny_k3_dir, expert_memory=quarter, **options)
        tokens = generate(model, prompt, CFG).tokens
        s = store.stats
        books.append((tokens, s.hits, s.misses, s.fast.evictions, sorted(store.fast.keys())))
        assert s.hybrid.cpu_steps == 0
    assert books[0] == books[1]
    assert store.stats.hybrid.fetch_steps > 0


def test_the_accelerator_side_copies_rows_down_and_adds_outputs_back(tiny_k3_dir, quarter, monkeypatch):
    """Host experts run apart from the block's own group, as on an accelerator (rows copied down, a CPU
    accumulator added back once): here on CPU tensors, through the modules. The sum is regrouped (resident
    experts' outputs plus the host ones'), so logits agree to fp32 rounding, and the greedy tokens exactly."""
    prompt = _prompt(20, 3)
    all_resident, _ = _load(tiny_k3_dir, expert_memory=1 << 30)
    want = _logits(all_resident, all_resident, prompt, 8)
    apart = []
    monkeypatch.setattr(executors, "runs_apart", lambda device: apart.append(device) or True)
    model, store = _load(tiny_k3_dir, expert_memory=quarter, expert_compute="cpu")
    ran = []
    real = executors.OnHost.finish
    monkeypatch.setattr(executors.OnHost, "finish", lambda self, out: ran.append(1) or real(self, out))
    got = _logits(model, model, prompt, 8)
    assert apart and len(ran) == store.stats.hybrid.cpu_steps > 0
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_options_check_the_mode_the_threshold_and_prefetch():
    with pytest.raises(ValueError, match="--expert-compute 'fast': expected one of gpu, cpu, auto"):
        LoadOptions(expert_compute="fast")
    with pytest.raises(ValueError, match="--expert-gpu-min-tokens must be an integer >= 1, got 0"):
        LoadOptions(expert_gpu_min_tokens=0)
    with pytest.raises(ValueError, match="--expert-compute cpu computes missing experts where they are"):
        LoadOptions(expert_compute="cpu", prefetch="next-layer")
    options = LoadOptions(expert_compute="auto", expert_gpu_min_tokens=8, prefetch="next-layer")
    assert options.to_argv() == ["--prefetch", "next-layer", "--expert-compute", "auto",
                                 "--expert-gpu-min-tokens", "8"]


def test_a_store_recording_a_trace_fetches_the_whole_step(tiny_k3_dir, quarter):
    """A routing trace wants every step's experts in one fetch: hybrid steps aside while one records."""
    _, store = _load(tiny_k3_dir, expert_memory=quarter, expert_compute="cpu")
    recorded = []
    store.trace = type("Recorder", (), {"record": lambda self, layer, ids: recorded.append((layer, list(ids)))})()
    experts = store.hybrid.fetch(1, list(range(16)), tokens=1)
    assert recorded == [(1, list(range(16)))] and not hasattr(experts, "host")
    assert store.stats.hybrid.cpu_steps == 0


def test_stats_report_where_hybrid_experts_ran(tiny_k3_dir, quarter):
    """An empty tier with room for 20 experts: layer 1's 16 go into it (no CPU step), of layer 2's 16 the first
    4 fill the rest and 12 run from host memory; the books and the --stats line say so."""
    _, store = _load(tiny_k3_dir, expert_memory=quarter, expert_compute="cpu")
    slots = quarter // store.fast.cost(min(store.index.entries))
    assert slots == 20
    first = store.hybrid.fetch(1, range(16), tokens=1)
    assert not hasattr(first, "host") and len(list(first)) == 16  # (a fetch loads each expert when indexed)
    experts = store.hybrid.fetch(2, range(16), tokens=1)
    assert experts.host == [False] * 4 + [True] * 12 and all(w is not None for w in experts)
    assert sorted(k.expert for k in store.fast.keys() if k.layer == 2) == [0, 1, 2, 3]
    d = store.stats.as_dict()["hybrid"]
    assert d == {"cpu_steps": 1, "fetch_steps": 0, "cpu_experts": 12, "filled": 20}
    assert "hybrid: 1 layer steps computed 12 experts on the CPU, 0 fetched them" in store.stats.summary()
    assert store.stats.fast.evictions == 0 and store.fast.used == store.fast.capacity


@pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")
def test_generate_takes_the_flags_to_the_store(tiny_k3_dir, capsys, strict_json):
    """`generate --expert-compute cpu` at a quarter: the default run's tokens, and its JSON counts the CPU's
    experts; auto with the threshold at 1 token swaps like the default."""
    from moeswap.cli import main

    def run(*flags):
        assert main(["generate", str(tiny_k3_dir), "--prompt", "the quick brown fox", "--max-tokens", "6",
                     "--ignore-eos", "--json", "--expert-memory", "64KiB", *flags]) == 0
        return strict_json(capsys.readouterr().out.strip())

    want = run()
    cpu = run("--expert-compute", "cpu")
    auto = run("--expert-compute", "auto", "--expert-gpu-min-tokens", "1")
    assert cpu["tokens"] == auto["tokens"] == want["tokens"]
    assert cpu["expert_store"]["hybrid"]["cpu_experts"] > 0 and cpu["expert_store"]["tiers"]["fast"]["evictions"] == 0
    assert want["expert_store"]["hybrid"] == {"cpu_steps": 0, "fetch_steps": 0, "cpu_experts": 0, "filled": 0}
    assert auto["expert_store"]["hybrid"]["fetch_steps"] > 0 and auto["expert_store"]["hybrid"]["cpu_steps"] == 0
    assert auto["expert_store"]["tiers"]["fast"] == want["expert_store"]["tiers"]["fast"]


def test_a_group_takes_only_consecutive_pairs():
    """executors.Group computes a run of consecutive (token, expert) pairs in one kernel call. Where hybrid experts
    split a step (on an accelerator the host experts go to their own group), a group's next expert may not
    follow its pairs: it starts a new call, and each expert's output lands on its own pairs' tokens with their
    own weights (before, the call took the pairs between, which belonged to the other group)."""
    gen = torch.Generator().manual_seed(0)
    I, F = 64, 32

    def expert():
        mats = [(torch.randint(0, 256, (o, i // 2), dtype=torch.uint8, generator=gen),
                 torch.randint(122, 130, (o, i // 32), dtype=torch.uint8, generator=gen))
                for o, i in ((F, I), (F, I), (I, F))]
        return MXFP4ExpertWeights(*(t for pair in mats for t in pair))

    experts = [expert() for _ in range(4)]
    h = torch.randn(3, I, generator=gen)
    token_of = torch.tensor([0, 2, 1, 0, 2, 1])  # pairs by expert: e0 (0, 1), e1 (2, 3), e2 (4), e3 (5)
    weights = torch.rand(6, generator=gen)
    runs = [(0, 0, 2), (1, 2, 2), (2, 4, 1), (3, 5, 1)]  # (expert, first pair, pairs)
    out = torch.zeros(3, I)
    group = executors.Group(h, token_of, weights, out, "silu", (4.0, 25.0))
    for e, start, n in runs:
        if e != 1:  # expert 1's pairs go elsewhere (another group)
            group.take(experts[e], start, n)
    group.flush()
    # each pair's expert output, exact and its fp32 error bound, then the weighted sums per token: the kernel's
    # result within the bound of the exact one (docs/numerics.md), wherever its pairs landed
    exact, bound = torch.zeros(3, I, dtype=torch.float64), torch.zeros(3, I, dtype=torch.float64)
    for e, start, n in runs:
        if e != 1:
            fmt = format_of(experts[e])
            w1, w3, w2 = (fmt.weight(experts[e], p, torch.float64) for p in ("w1", "w3", "w2"))
            for p in range(start, start + n):
                t = int(token_of[p])
                y, err = glu_expert_exact(w1, w3, w2, h[t:t + 1])[0], glu_expert_bound(w1, w3, w2, h[t:t + 1])[0]
                exact[t] += float(weights[p]) * y
                g = gamma(len(runs) + 1)  # the weighted sum's own rounding, the weight's product included
                bound[t] += float(weights[p]) * (err * (1 + g) + y.abs() * g)
    assert ((out.double() - exact).abs() <= bound).all(), (out.double() - exact).abs().max()
    assert (out.double() - exact).abs().max() > 0  # the bound is checked against a result that rounded
