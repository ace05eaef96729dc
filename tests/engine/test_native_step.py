"""The native decode step (engine/native_step.py): the decoder layers of a decode step in one C call give
the model's forward bit for bit (for every architecture's plain decode: tests/models/test_registry.py;
here growing caches, llama.cpp's arithmetic, every kernel build, swapping stores, weights changed in
place), fall back to the forward, per layer, for experts not yet in a resident table, and refuse, with a
reason, what they do not cover."""

import ctypes

import pytest
import torch

from moeswap.engine import native_step
from moeswap.engine.native_step import NativeDecode
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler, fuse_projections
from moeswap.models.layers.kda import KDAState
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")


def _load(path, **options):
    model, store = load_model(path, LoadOptions(**{"expert_memory": 1 << 30, **options}))
    fuse_projections(model)
    return model, store


def _prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 400, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))


def _decode(step, model, batch: int, prompt_len: int, steps: int, state=None):
    """Prefill through the model, then `steps` greedy decode steps through `step`: logits [steps + 1, B, V]."""
    state = state or model.make_state(batch)
    with torch.inference_mode():
        outs = [model(_prompts(batch, prompt_len), state)[:, -1]]
        for _ in range(steps):
            outs.append(step(outs[-1].argmax(-1, keepdim=True), state)[:, -1])
    return torch.stack(outs), state


def _forward_then_native(path, batch: int, prompt_len: int, steps: int, prepare=lambda model: model, **options):
    """The same decode on two fresh loads of `path`: through the model's forward, then through NativeDecode.
    Returns (want, got, native), got/want as `_decode` gives them, with the store: (logits, state, store)."""
    runs = []
    for native in (False, True):
        model, store = _load(path, **options)
        model = prepare(model)
        step = NativeDecode(model) if native else model
        runs.append((*_decode(step, model, batch, prompt_len, steps), store, step))
    return runs[0][:3], runs[1][:3], runs[1][3]


@pytest.fixture(params=["k3", "linear"])
def model_dir(request, tiny_k3_dir, tiny_linear_dir):
    return tiny_k3_dir if request.param == "k3" else tiny_linear_dir


def test_layers_whose_experts_are_not_in_the_table_yet_run_through_the_store(tiny_k3_dir, monkeypatch):
    """A fresh model's tables are empty: the first native step stops at each MoE layer, runs its FFN through the
    store and resumes, and the table takes the experts the store hands over (it keeps them for good), so the
    same steps again need no stop. Same logits as the forward at every step."""
    from moeswap.models.decoder import DecoderLayer

    def steps(step, model, n=6):
        state, tokens, outs = model.make_state(2), _prompts(2, 1), []
        with torch.inference_mode():
            for _ in range(n):
                outs.append(step(tokens, state))
                tokens = outs[-1].argmax(-1)
        return torch.cat(outs)

    model, _ = _load(tiny_k3_dir)
    want = steps(model, model)
    model, _ = _load(tiny_k3_dir)
    native = NativeDecode(model)
    ran = []
    real = DecoderLayer.feed_forward
    monkeypatch.setattr(DecoderLayer, "feed_forward", lambda self, x: ran.append(1) or real(self, x))
    first = []
    monkeypatch.setattr(NativeDecode, "_step", lambda self, *a: first.append(len(ran)) or real_step(self, *a))
    got = steps(native, model)
    moe_layers = len(model.moe_blocks())
    assert first[:2] == [0, moe_layers]  # the first step: a stop at every MoE layer
    assert native.reason is None and torch.equal(got, want)
    ran.clear()
    assert torch.equal(steps(native, model), want) and ran == []  # the same steps again: no stop


real_step = NativeDecode._step


def test_mla_caches_grow_past_their_capacity(tiny_k3_dir):
    # make_state's caches hold 64 tokens: steps 3-5 grow them
    (want, _, _), (got, state, _), native = _forward_then_native(tiny_k3_dir, 2, 62, 5)
    assert native.reason is None and torch.equal(got, want)
    assert all(st.latent_BSX.shape[1] >= 67 for st in state.layers if not isinstance(st, KDAState))


@pytest.mark.parametrize("options", [{"gemm_precision": "bf16"}, {"expert_activations": "int8"},
                                     {"gemm_precision": "bf16", "expert_activations": "int8"}])
def test_llama_cpp_arithmetic_equals_the_forward_bit_for_bit(model_dir, options):
    """--gemm-precision bf16 (every bf16-weight product on bf16-rounded inputs) and int8 expert activations:
    the call rounds where the forward does."""
    if options.get("expert_activations") == "int8" and not cpu_kernels.kernel().has_int8_activations:
        pytest.skip("int8 activations need AVX-512 VNNI")
    (want, _, _), (got, _, _), native = _forward_then_native(model_dir, 3, 6, 4, **options)
    assert native.reason is None and torch.equal(got, want)


@pytest.mark.parametrize("case", ["gradients", "unfused"])
def test_what_it_does_not_cover_takes_the_forward_and_says_why(tiny_k3_dir, case):
    model, _ = load_model(tiny_k3_dir, LoadOptions(expert_memory=1 << 30))
    if case != "unfused":
        fuse_projections(model)
    if case == "gradients":
        model.model.norm.weight.requires_grad_(True)
    native = NativeDecode(model)
    state = model.make_state(1)
    with torch.no_grad() if case != "gradients" else torch.enable_grad():
        got = native(_prompts(1, 1), state)
    assert got.shape == (1, 1, model.config.vocab_size)
    expected = {"gradients": "gradients", "unfused": "not fused"}[case]
    assert native.reason is not None and expected in native.reason, native.reason


@pytest.mark.parametrize("policy, prefetch", [("lru", "none"), ("lfru", "none"), ("lru", "next-layer")])
def test_a_swapping_store_computes_its_experts_in_the_call(tiny_k3_dir, policy, prefetch, monkeypatch):
    """A fast tier at 10 % of the experts: the layers' tables mirror what it holds; the call computes the
    layers whose experts are all there and, where one is missing, stops, fetches them through the store and
    resumes at that FFN: the model runs no FFN after the prefill. Logits bit for bit as the forward's; without
    prefetch the store makes the same decisions (hits, misses, evictions, what it holds at the end)."""
    from moeswap.models.decoder import DecoderLayer

    _, probe = load_model(tiny_k3_dir, LoadOptions(expert_memory=1 << 30))
    total = sum(probe.fast.cost(k) for k in probe.index.entries)

    def run(step_of):
        model, store = _load(tiny_k3_dir, expert_memory=total // 10, expert_policy=policy, prefetch=prefetch)
        try:
            got, _ = _decode(step_of(model), model, 2, 5, 6)
        finally:
            store.close()
        return got, store

    ran = []
    real = DecoderLayer.feed_forward
    want, want_store = run(lambda model: model)
    monkeypatch.setattr(DecoderLayer, "feed_forward", lambda self, x: ran.append(1) or real(self, x))
    natives = []
    got, got_store = run(lambda model: natives.append(NativeDecode(model)) or natives[-1])
    assert natives[0].reason is None and torch.equal(got, want)
    assert len(ran) == len(natives[0].model.model.layers)  # the prefill's FFNs (the model's own) only
    assert got_store.can_evict and got_store.stats.misses > 0 and got_store.stats.tiers["fast"].evictions > 0
    if prefetch == "none":
        books = lambda s: (s.stats.hits, s.stats.misses, s.stats.tiers["fast"].evictions, sorted(s.fast.keys()))
        assert books(got_store) == books(want_store)
    for moe in natives[0].model.moe_blocks():  # each table holds exactly the layer's experts in the tier
        table = moe.resident_table()
        held = {k.expert for k in got_store.fast.keys() if k.layer == moe.layer_idx}
        assert set(table.experts) == held
        assert {e for e in range(moe.num_experts) if table.rows[e, 0]} == held


def test_a_prefetching_store_reads_a_stopped_layers_first_miss_on_the_models_thread(tiny_k3_dir):
    """With next-layer prefetch the call guesses at each layer that stops, fetches that layer's experts (the
    first miss read on the model's thread, only the rest handed to the reader threads: it takes them all
    before it computes) and, before it resumes, takes in the next layer's hinted loads that are read (settle)."""
    from moeswap.experts.keys import Key

    _, probe = load_model(tiny_k3_dir, LoadOptions(expert_memory=1 << 30))
    total = sum(probe.fast.cost(k) for k in probe.index.entries)
    model, store = _load(tiny_k3_dir, expert_memory=total // 10, expert_policy="lru", prefetch="next-layer")
    native, state = NativeDecode(model), model.make_state(2)
    readaheads, wanted, settled = [], [], []
    try:
        with torch.inference_mode():
            tokens = model(_prompts(2, 5), state)[:, -1:].argmax(-1)  # the prefill: the forward, with read-ahead
            store.prefetcher.readahead = lambda keys: readaheads.append(list(keys))
            real_fetch, real_settle = store.fetch, store.settle

            def fetch(layer, ids, takes_all=False):
                missing = [Key(layer, int(e)) for e in ids if Key(layer, int(e)) not in store.fast
                           and Key(layer, int(e)) not in store._inflight]
                wanted.extend([missing[1:]] if len(missing) > 1 else [])
                assert takes_all
                return real_fetch(layer, ids, takes_all)

            def settle(layer):
                settled.append(layer)
                real_settle(layer)

            store.fetch, store.settle = fetch, settle
            misses = store.stats.misses
            for _ in range(4):
                tokens = native(tokens, state)[:, -1:].argmax(-1)
        assert native.reason is None and store.stats.misses > misses and settled
        assert wanted and readaheads == wanted
    finally:
        store.close()


def test_the_calls_own_guess_hints_what_the_lookahead_hook_would(tiny_k3_dir):
    """At a stop the call routes the next MoE layer on the stopped layer's input (its `chosen` row) and the
    lookahead only counts those ids: the same hints, in the same order, as the hook routing them with the
    model's norm and router modules; the same logits."""
    _, probe = load_model(tiny_k3_dir, LoadOptions(expert_memory=1 << 30))
    total = sum(probe.fast.cost(k) for k in probe.index.entries)
    runs = []
    for hook_routes in (False, True):
        model, store = _load(tiny_k3_dir, expert_memory=total // 10, expert_policy="lru", prefetch="next-layer")
        hook, routed = model.expert_lookahead, []
        hook.routes = {i: (t, lambda h, fn=fn, routed=routed: routed.append(1) or fn(h)) for i, (t, fn) in hook.routes.items()}
        if hook_routes:  # a plain callable: the step cannot hand it a guess and calls it
            model.expert_lookahead = lambda i, x, hook=hook: hook(i, x)
        hints, real_hint = [], store.prefetcher.hint
        store.prefetcher.hint = lambda layer, ids, hints=hints, real_hint=real_hint: hints.append((layer, list(ids))) or real_hint(layer, ids)
        native = NativeDecode(model)
        try:
            state = model.make_state(2)
            with torch.inference_mode():
                tokens, outs = model(_prompts(2, 5), state)[:, -1:].argmax(-1), []
                hints.clear()  # the prefill's, made by the forward
                routed.clear()
                for _ in range(4):
                    outs.append(native(tokens, state))
                    tokens = outs[-1][:, -1:].argmax(-1)
        finally:
            store.close()
        assert native.reason is None
        assert (len(routed) == len(hints)) if hook_routes else routed == []  # who routed the guesses
        runs.append((torch.cat(outs), hints))
    assert runs[0][1] and runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][0], runs[1][0])


def test_scheduler_uses_it_with_the_same_tokens(model_dir):
    model, _ = _load(model_dir)
    reqs = [Request(_prompts(1, n)[0].tolist(), m) for n, m in [(5, 6), (9, 3), (2, 8)]]
    native = Scheduler(model, EngineConfig(max_batch=2, max_len=64)).run(reqs)
    plain = Scheduler(model, EngineConfig(max_batch=2, max_len=64, native=False)).run(reqs)
    assert [r.tokens for r in native] == [r.tokens for r in plain]


def test_a_state_that_does_not_fit_the_batch_is_refused(tiny_k3_dir):
    model, _ = _load(tiny_k3_dir)
    native = NativeDecode(model)
    state = model.make_state(2)
    with torch.inference_mode(), pytest.raises(ValueError, match="does not fit 1 sequences"):
        native(_prompts(1, 1), state)


def test_sigmoid_gate_kernel_matches_torch_and_reads_column_slices():
    k = cpu_kernels.kernel()
    g = torch.randn(3, 40)
    x = torch.randn(3, 16)
    want = x * torch.sigmoid(g[:, 8:24])
    got = k.sigmoid_gate(x.clone(), g[:, 8:24])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="sigmoid_gate"):
        k.sigmoid_gate(x.clone(), g[:, :8])


def test_the_ctypes_layer_matches_the_library_field_by_field():
    """The ctypes decode_layer (from the header's field list) and the compiled one (the library's own table of
    offsetof / sizeof): every field's name, offset, size and type, in order, and the whole size."""
    kernel = cpu_kernels.kernel()
    layout = kernel.layer_layout
    assert [name for name, *_ in layout] == [name for name, _ in native_step._Layer._fields_]
    assert [(getattr(native_step._Layer, n).offset, getattr(native_step._Layer, n).size) for n, *_ in layout] == [
        (offset, size) for _, offset, size, _ in layout]
    assert dict((n, t) for n, _, _, t in layout)["off"] == "int64_t[6]"
    assert kernel.layout_problem(native_step._Layer) is None


def _layer_like(fields) -> type[ctypes.Structure]:
    return type("DriftedLayer", (ctypes.Structure,), {"_fields_": fields})


def _drifted(change: str) -> list:
    fields = list(native_step._Layer._fields_)
    names = [n for n, _ in fields]
    if change == "swap":  # two pointers: the same size, so only names tell them apart
        a, b = names.index("ln_in"), names.index("ln_post")
        fields[a], fields[b] = fields[b], fields[a]
    elif change == "type":  # a double read as an int64: the same offset and size
        fields[names.index("lower")] = ("lower", ctypes.c_int64)
    elif change == "array":
        fields[names.index("off")] = ("off", ctypes.c_int64 * 5)
    elif change == "missing":
        fields = fields[:-1]
    return fields


@pytest.mark.parametrize("change, field", [("swap", "ln_in"), ("type", "lower"), ("array", "off"),
                                           ("missing", "load_log")])
def test_a_drifted_ctypes_layout_is_refused_naming_the_field(change, field):
    problem = cpu_kernels.kernel().layout_problem(_layer_like(_drifted(change)))
    assert problem is not None and field in problem, problem


def test_a_model_whose_ctypes_layout_drifted_takes_the_forward(tiny_k3_dir, monkeypatch):
    """The check runs before the first call: a table in a drifted layout is never handed to C; the step says
    why and runs through the model."""
    monkeypatch.setattr(native_step, "_Layer", _layer_like(_drifted("swap")))
    (want, _, _), (got, _, _), native = _forward_then_native(tiny_k3_dir, 1, 4, 2)
    assert native.reason is not None and "ln_in" in native.reason and "ln_post" in native.reason
    assert torch.equal(got, want)


def test_weights_changed_in_place_are_used(tiny_k3_dir):
    """The table reads bf16 weights and fp32 parameters live and rebuilds its copies (absorbed MLA weights,
    conv taps, AttnRes scores) when their sources change in place: a step after a change equals the forward."""
    model, _ = _load(tiny_k3_dir)
    native = NativeDecode(model)
    state = model.make_state(2)
    tokens = _prompts(2, 1)
    with torch.inference_mode():
        native(tokens, state)
    with torch.no_grad():
        mla = next(layer.self_attn for layer in model.model.layers if layer.attn_kind == "mla")
        kda = next(layer.self_attn for layer in model.model.layers if layer.attn_kind == "kda")
        layers = model.model.layers
        for w in (mla.kv_b_proj.weight, kda.q_conv1d.weight, kda.q_proj.weight, layers[1].input_layernorm.weight,
                  layers[2].mlp_res_norm.weight):
            w.mul_(1.5)
    want_state = model.make_state(2)
    with torch.inference_mode():
        want = model(tokens, want_state)
        got = native(tokens, model.make_state(2))
    assert native.reason is None and torch.equal(got, want)


def test_group_limited_routing_runs_in_the_call_and_an_fp32_head_after_it(tiny_k3_dir):
    """A router with expert groups (DeepSeek-V3's) routes in the call (the C router keeps the best groups, as
    the forward's); an lm_head that is not a bf16 stored weight runs after the call. The forward's logits,
    bit for bit."""
    from torch import nn

    def prepare(model):
        for moe in model.moe_blocks():
            moe.gate.groups, moe.gate.topk_group = 2, 1
        head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        head.weight = nn.Parameter(model.lm_head.weight.detach().float(), requires_grad=False)
        model.lm_head = head
        return model

    (want, _, _), (got, _, _), native = _forward_then_native(tiny_k3_dir, 2, 5, 3, prepare)
    assert native.reason is None and torch.equal(got, want)
    plan = native._plan
    assert plan.head is None and plan.module_ffn == set()
    assert [(plan.table[i].groups, plan.table[i].topk_group) for i, _ in plan.moe] == [(2, 1)] * len(plan.moe)


@pytest.mark.parametrize("flags", cpu_kernels.build_variants()[1:], ids=" ".join)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_kernel_build_gives_the_forward_bit_for_bit(tiny_k3_dir, monkeypatch, flags, precision):
    """The AVX2 and portable builds (a CI machine may have no AVX-512): the call still equals the forward,
    which then runs on the same build; under bf16 without AVX-512 BF16, the rounded inputs take the fp32 kernel."""
    kernel = cpu_kernels.kernel(flags)
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    monkeypatch.setattr(cpu_kernels, "kernel", lambda flags=None: kernel)
    (want, _, _), (got, _, _), native = _forward_then_native(tiny_k3_dir, 2, 6, 3, gemm_precision=precision)
    assert native.reason is None and native._plan.kernel is kernel and torch.equal(got, want)


def test_a_lookahead_with_every_expert_resident_costs_nothing(tiny_k3_dir, monkeypatch):
    """--prefetch next-layer with a fast tier that holds every expert: nothing can be evicted, so nothing is left
    to load; the decode steps run whole in the call, without stops or guesses, and give the forward's logits."""
    from moeswap.models.decoder import DecoderLayer

    model, store = _load(tiny_k3_dir, prefetch="next-layer")
    assert store.can_evict is False and model.expert_lookahead is not None
    want, _ = _decode(model, model, 2, 6, 4)
    model, store = _load(tiny_k3_dir, prefetch="next-layer")
    native = NativeDecode(model)
    guesses = []
    real_lookahead = model.expert_lookahead
    model.expert_lookahead = lambda i, x: guesses.append(i) or real_lookahead(i, x)
    _decode(native, model, 2, 6, 4)  # the same steps once: the tables take every expert they use
    ran = []
    real = DecoderLayer.feed_forward
    monkeypatch.setattr(DecoderLayer, "feed_forward", lambda self, x: ran.append(1) or real(self, x))
    guesses.clear()
    got, _ = _decode(native, model, 2, 6, 4)
    layers = len(model.model.layers)
    assert native.reason is None and len(ran) == layers and len(guesses) == layers  # the prefill's only
    assert torch.equal(got, want)
    store.close()


@pytest.fixture(scope="module")
def fp8_dsv3_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 with every Linear but the router and lm_head block FP8, as published; q-LoRA and expert
    widths of one 128-row block, so the fused projections' scales line up as in the published models."""
    from moeswap.tiny import SIZES, write_tiny_model

    saved = SIZES["tiny"]
    SIZES["tiny"] = {**saved, "q_lora": 128, "expert_dim": 128}
    try:
        return write_tiny_model(tmp_path_factory.mktemp("ds") / "fp8", "deepseek_v3", "tiny", seed=4, quant="fp8")
    finally:
        SIZES["tiny"] = saved


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_block_fp8_dense_weights_run_in_the_call_bit_for_bit(fp8_dsv3_dir, precision):
    """DeepSeek-V3 as published (dense weights block FP8, kept as their codes): the call multiplies from the
    codes as the modules do (csrc/quant.c, fp32 inputs under either precision) and gives their bits; no layer
    stops for the model."""
    (want, _, _), (got, _, _), native = _forward_then_native(fp8_dsv3_dir, 3, 6, 4, gemm_precision=precision)
    assert native.reason is None and torch.equal(got, want)
    plan = native._plan
    assert all(t.s_in and t.s_o and t.s_qb and t.s_gu and t.s_down for t in plan.table)  # read as FP8
    assert not plan.module_ffn and plan.head is not None  # lm_head stays bf16, as published


def test_block_fp8_projections_whose_scales_do_not_line_up_take_the_forward(tmp_path):
    """init-tiny's own tiny size (q-LoRA 32 rows): the fused codes' scales would not line up, so no fusion, and
    the step says why."""
    from moeswap.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "fp8", "deepseek_v3", "tiny", seed=4, quant="fp8")
    (want, _, _), (got, _, _), native = _forward_then_native(path, 1, 4, 1)
    assert "not fused bf16 weights or codes" in native.reason and torch.equal(got, want)


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_int_dense_weights_run_in_the_call_bit_for_bit(model_dir, dense):
    """--dense-weights int8|int4 (weights.int8 / weights.int4 kept as codes): the call multiplies from the codes
    with the kernels the modules run (csrc/int8.c, csrc/quant.c) and gives their bits, MLA, KDA and MLPs alike;
    K3's latent expert projections in codes leave those FFNs to the model."""
    (want, _, _), (got, _, _), native = _forward_then_native(model_dir, 3, 5, 3, dense_weights=dense)
    assert native.reason is None and torch.equal(got, want)
    plan = native._plan
    code = cpu_kernels.FORMAT_CODES[dense]
    assert all(t.dense_format == code and t.s_in and t.s_o for t in plan.table)
    assert all(t.s_gu and t.s_down for t in plan.table if t.w_gu)
    latent = hasattr(next(iter(native._plan._blocks)), "routed_expert_down_proj")
    assert bool(plan.module_ffn) == latent and plan.head is None  # lm_head in codes: the model's own product
