"""Several LoRA adapters served at once (lora.serving, lora.multi): requests with different adapters, and none,
share the engine's batch, and each gets what the model with only its adapter (load_adapter, LoRALinear, the
expert hook) gives it alone; base-only batches still take the C decode step; bad adapters are refused whole."""

from __future__ import annotations

import pytest
import torch

from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
from moeswap.lora import load_adapter
from moeswap.lora.serving import load_adapters, read_adapters
from moeswap.models.loader import LoadOptions, load_model

# adapter A: dense projections of every kind (fused attention inputs, MLA's kv_b_proj in the absorbed form, the
# MLP, the latent routed projection, the head); adapter B: others, kv_b_proj again, and routed-expert LoRA
TARGETS = {
    "kimi_k3": (("q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj", "routed_expert_up_proj", "lm_head"),
                ("k_proj", "f_b_proj", "kv_b_proj", "up_proj", "w1", "w3")),
    "kimi_linear": (("q_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj", "lm_head"),
                    ("k_proj", "f_b_proj", "kv_b_proj", "up_proj", "w1", "w3")),
}


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def setup(request, tiny_k3_dir, tiny_linear_dir, tmp_path_factory, make_lora_adapter):
    """(base dir, {name: adapter dir}) per architecture."""
    base = tiny_k3_dir if request.param == "kimi_k3" else tiny_linear_dir
    tmp = tmp_path_factory.mktemp("adapters")
    a, b = TARGETS[request.param]
    return base, {"A": make_lora_adapter(base, tmp / "A", a, 0), "B": make_lora_adapter(base, tmp / "B", b, 10)}


class Recording(Scheduler):
    """The engine, keeping each request's logits of every step (the rows it samples from)."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.logits: dict = {}

    def _sample(self, logits_BV, seqs, skip=frozenset()):
        for i, seq in enumerate(seqs):
            self.logits.setdefault(seq.req.id, []).append(logits_BV[i].clone())
        return super()._sample(logits_BV, seqs, skip)


def run(model, requests, max_batch: int):
    sched = Recording(model, EngineConfig(max_batch=max_batch, max_len=64))
    results = sched.run(requests)
    return {r.id: r.tokens for r in results}, sched.logits, sched.stats


def served(base, adapters: dict):
    model, store = load_model(base, LoadOptions())
    names = list(adapters)
    table = load_adapters(model, read_adapters([(n, adapters[n]) for n in names], base))
    return model, store, {None: 0, **{n: table.slot(n) for n in names}}


def alone(base, adapter_dir, prompt, max_tokens):
    """The oracle: a fresh model with only this adapter (load_adapter: LoRALinear and the MoE expert hook), the
    request alone in the engine."""
    model, store = load_model(base, LoadOptions())
    if adapter_dir is not None:
        load_adapter(model, adapter_dir, base_dir=base)
    tokens, logits, _ = run(model, [Request(prompt, max_tokens, stop_ids=(), id=0)], 1)
    store.close()
    return tokens[0], logits[0]


PROMPTS = [[5, 17, 301, 44, 9], [8, 8, 120, 7], [400, 3, 91, 12, 60, 2], [33, 250, 11], [70, 71, 72, 73, 74, 75, 76]]


def test_each_adapter_alone_in_a_mixed_batch_is_bit_exact(setup):
    """One request per adapter (and two base ones) in one batch, leaving at different steps: each request's
    logits at every step are those of its run alone with only its adapter, bit for bit. Once only base rows
    are left, the C decode step runs again."""
    base, adapters = setup
    model, store, slot = served(base, adapters)
    plan = [(None, 9), ("A", 4), ("B", 6), (None, 3)]
    reqs = [Request(PROMPTS[i], n, stop_ids=(), id=i, adapter=slot[name]) for i, (name, n) in enumerate(plan)]
    tokens, logits, stats = run(model, reqs, 4)
    assert stats.native_steps == 9 - 6  # the steps after B left: base rows only
    for i, (name, n) in enumerate(plan):
        want_tokens, want_logits = alone(base, adapters.get(name), PROMPTS[i], n)
        assert tokens[i] == want_tokens
        assert all(torch.equal(g, w) for g, w in zip(logits[i], want_logits, strict=True)), (name, i)
    base_tokens = alone(base, None, PROMPTS[1], 4)[0]
    assert tokens[1] != base_tokens and tokens[2] != alone(base, None, PROMPTS[2], 6)[0]  # the adapters act
    store.close()


def test_rows_sharing_an_adapter(setup):
    """Several rows per adapter share its products: each request equals its run alone to fp32 rounding of the
    LoRA deltas, greedy tokens included."""
    base, adapters = setup
    model, store, slot = served(base, adapters)
    plan = ["A", "B", "A", None, "B", "A"]
    reqs = [Request(PROMPTS[i % 5], 5, stop_ids=(), id=i, adapter=slot[name]) for i, name in enumerate(plan)]
    tokens, logits, stats = run(model, reqs, 6)
    assert stats.native_steps == 0 and stats.native_off == "a row uses a LoRA adapter"
    for i, name in enumerate(plan):
        want_tokens, want_logits = alone(base, adapters.get(name), PROMPTS[i % 5], 5)
        assert tokens[i] == want_tokens
        for g, w in zip(logits[i], want_logits, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
    store.close()


def test_base_only_batches_take_the_native_step(setup):
    """A model serving adapters, with only base requests: every decode step in the C call, and the logits of
    the model without adapters, bit for bit."""
    base, adapters = setup
    model, store, _ = served(base, adapters)
    reqs = lambda: [Request(p, 4, stop_ids=(), id=i) for i, p in enumerate(PROMPTS[:3])]  # noqa: E731
    tokens, logits, stats = run(model, reqs(), 3)
    assert stats.native_steps == stats.decode_steps == 3 and stats.native_off is None
    plain, plain_store = load_model(base, LoadOptions())
    want_tokens, want_logits, _ = run(plain, reqs(), 3)
    assert tokens == want_tokens
    assert all(torch.equal(g, w) for i in logits for g, w in zip(logits[i], want_logits[i], strict=True))
    store.close()
    plain_store.close()


def test_refusals(tiny_k3_dir, tiny_linear_dir, tmp_path, make_lora_adapter):
    a = make_lora_adapter(tiny_k3_dir, tmp_path / "a", ("o_proj",), 0)
    with pytest.raises(ValueError, match=r"adapter 'x' .* was made for a different base model"):
        read_adapters([("x", a)], tiny_linear_dir)
    with pytest.raises(ValueError, match="given twice"):
        read_adapters([("x", a), ("x", a)], tiny_k3_dir)
    model, store = load_model(tiny_linear_dir, LoadOptions())
    with pytest.raises(ValueError, match="adapter 'x': .* does not fit this model"):
        load_adapters(model, read_adapters([("x", a)], tiny_k3_dir))  # the fingerprint checked against the other
    assert not any(type(m).__name__ == "MultiLoRALinear" for m in model.modules())  # nothing was applied
    load_adapters(model, read_adapters([("y", make_lora_adapter(tiny_linear_dir, tmp_path / "b", ("o_proj",), 0))],
                                       tiny_linear_dir))
    with pytest.raises(ValueError, match="already carries LoRA adapters"):
        load_adapters(model, read_adapters([("z", tmp_path / "b")], tiny_linear_dir))
    sched = Scheduler(model, EngineConfig(max_batch=1, max_len=32))
    with pytest.raises(ValueError, match=r"adapter 2 does not exist \(this model serves adapters 1..1"):
        sched.submit(Request([1, 2], 2, adapter=2))
    store.close()


def test_routed_expert_only_adapter(tiny_k3_dir, tmp_path, make_lora_adapter):
    """An adapter on the routed experts alone (no dense module wrapped): its rows run the experts as torch ops
    with their deltas, the base rows of the same steps the experts' fast paths; each as alone, bit for bit."""
    adapters = {"E": make_lora_adapter(tiny_k3_dir, tmp_path / "E", ("w1", "w2", "w3"), 3)}
    model, store, slot = served(tiny_k3_dir, adapters)
    assert not any(type(m).__name__ == "MultiLoRALinear" for m in model.modules())
    for plan, exact in ([(None, 5), ("E", 5), (None, 3)], True), ([("E", 4), (None, 5), ("E", 3)], False):
        reqs = [Request(PROMPTS[i], n, stop_ids=(), id=i, adapter=slot[name]) for i, (name, n) in enumerate(plan)]
        tokens, logits, _ = run(model, reqs, 3)
        for i, (name, n) in enumerate(plan):
            want_tokens, want_logits = alone(tiny_k3_dir, adapters.get(name), PROMPTS[i], n)
            assert tokens[i] == want_tokens
            for g, w in zip(logits[i], want_logits, strict=True):  # two E rows: to rounding (module docstring)
                torch.testing.assert_close(g, w, rtol=0, atol=0 if exact else 1e-4)
    assert tokens[0] != alone(tiny_k3_dir, None, PROMPTS[0], 4)[0]
    store.close()
