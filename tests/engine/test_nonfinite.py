"""NaN and Inf: every step's logits are checked; a sequence whose logits are not finite fails with a
NonFiniteError naming its step and the first non-finite layer, on the native and the reference decode step,
greedy or sampled, and the other sequences of its batch get exactly the tokens they get alone. Also the
sampling and generation parameters' validation, and state too large for the machine."""

import pytest
import torch

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.engine.nonfinite import NonFiniteError, first_nonfinite
from moeswap.engine.sampling import MIN_TEMPERATURE, SamplingParams, sample
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler, TokenEvent
from moeswap.engine.state import SlotStates
from moeswap.models.loader import LoadOptions, load_model

PROMPT = [5, 17, 99, 3, 250, 41]
O_PROJ = "model.layers.2.self_attn.o_proj.weight"  # a bf16 dense weight in both architectures


@pytest.fixture(params=["kimi_k3", "kimi_linear"])
def model_dir(request, tiny_k3_dir, tiny_linear_dir):
    return tiny_k3_dir if request.param == "kimi_k3" else tiny_linear_dir


@pytest.fixture
def model(model_dir):
    """A fresh tiny model per test: the tests damage its weights."""
    return load_model(model_dir, LoadOptions(dtype="float32"))[0]


def _param(model, name: str) -> torch.Tensor:
    return dict(model.named_parameters())[name]


def _engine(native: bool, batch: int = 1) -> EngineConfig:
    return EngineConfig(max_batch=batch, max_len=96, native=native)


def _greedy(model, prompt, n=8, native=True) -> list[int]:
    return Scheduler(model, _engine(native)).run([Request(prompt, n)])[0].tokens


def _run(sched: Scheduler, requests: list[Request]) -> list[TokenEvent]:
    """Every event of `requests` run through `sched` step by step (run() would raise at the end)."""
    for r in requests:
        sched.submit(r)
    events = []
    while sched.busy:
        events += sched.step()
    return events


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_dense_weight_fails_at_prefill(model, native, temperature, value):
    _param(model, O_PROJ).data[0, 0] = value
    cfg = GenerationConfig(max_tokens=4, sampling=SamplingParams(temperature), seed=1, stop_ids=())
    with pytest.raises(NonFiniteError) as info:
        generate(model, PROMPT, cfg, engine=_engine(native))
    msg = str(info.value)
    assert msg.startswith("request 0: NaN or infinite logits at prefill (prompt of 6 tokens, 0 generated)"), msg
    assert "first non-finite output, re-running the step through the model's modules: decoder layer 2 " \
           "(model.layers.2.self_attn.o_proj)" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_a_weight_that_turns_nan_between_steps_fails_that_decode_step(model, native):
    """The native step reads bf16 weights in place: a NaN written after the prefill reaches its first call."""
    clean = _greedy(model, PROMPT, 4, native)
    sched = Scheduler(model, _engine(native))
    sched.submit(Request(PROMPT, 4))
    first = sched.step()  # the prefill
    assert [e.token for e in first] == clean[:1]
    with torch.no_grad():
        _param(model, O_PROJ)[0, 0] = float("nan")
    events = sched.step()
    assert events == [TokenEvent(0, None, "error", error=str(sched.finished[0].error))]
    assert sched.stats.native_steps == (1 if native else 0)  # the step that failed ran where it says
    result = sched.finished[0]
    assert result.finish_reason == "error" and result.tokens == clean[:1] and not sched.busy
    assert "at decode step 1 (prompt of 6 tokens, 1 generated)" in str(result.error)
    assert "decoder layer 2 (model.layers.2.self_attn.o_proj)" in str(result.error)


def _first_new(tokens: list[int], seen: list[int], start: int = 1) -> int:
    """The smallest k >= start whose token k-1 (the input of decode step k) appears nowhere before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k - 1] not in seen + tokens[:k - 1])


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_a_nan_embedding_row_fails_the_decode_step_that_reads_it(model, native):
    clean = _greedy(model, PROMPT, 8, native)
    k = _first_new(clean, PROMPT)
    _param(model, "model.embed_tokens.weight").data[clean[k - 1]] = float("nan")
    sched = Scheduler(model, _engine(native))
    events = _run(sched, [Request(PROMPT, 8, SamplingParams(), (), id="a")])
    assert [e.token for e in events] == clean[:k] + [None] and events[-1].finish_reason == "error"
    assert sched.stats.native_steps == (k if native else 0)
    result = sched.finished["a"]
    assert result.finish_reason == "error" and result.tokens == clean[:k]
    msg = str(result.error)
    assert f"request a: NaN or infinite logits at decode step {k} (prompt of 6 tokens, {k} generated)" in msg
    assert "the token embedding (model.embed_tokens)" in msg
    with pytest.raises(NonFiniteError, match=f"decode step {k} "):  # run() raises it
        Scheduler(model, _engine(native)).run([Request(PROMPT, 8)])


@pytest.mark.parametrize("mode", ["native", "reference", "bf16"])
def test_only_the_failing_request_fails_and_its_slot_is_clean_for_the_next(model_dir, mode):
    """Rows of a batch never mix, so a request whose logits turn NaN fails alone: the others (one of them
    sampled) get the tokens they get alone, including one admitted into the failed request's slot. Its
    stale cache rows (a NaN among them) must be gone: the masked attention of a decode batch (bf16 on the
    CPU, or any GPU; fp32 CPU decode reads only each sequence's own rows) multiplies them by 0, keeping NaN."""
    model = load_model(model_dir, LoadOptions(dtype="bfloat16" if mode == "bf16" else "float32"))[0]
    native = mode == "native"
    a = Request([7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], 8, id="a")  # longer than b: rows past b's end
    b = Request([300, 301, 302, 303, 304], 12, SamplingParams(1.0, top_k=40), seed=7, id="b")
    c = Request(list(range(400, 430)), 6, id="c")  # waits for a slot, long enough to attend past a's rows
    alone = {r.id: Scheduler(model, _engine(native)).run([Request(r.prompt, r.max_tokens, r.sampling, (), r.seed)])
             [0].tokens for r in (a, b, c)}
    others = list(b.prompt) + alone["b"] + list(c.prompt) + alone["c"]
    k = next(k for k in range(2, len(alone["a"]))
             if alone["a"][k - 1] not in list(a.prompt) + alone["a"][:k - 1] + others)
    _param(model, "model.embed_tokens.weight").data[alone["a"][k - 1]] = float("nan")

    sched = Scheduler(model, _engine(native, batch=2))
    events = _run(sched, [a, b, c])
    assert [e.finish_reason for e in events if e.id == "a"][-1] == "error"
    assert sum(e.token is None for e in events) == 1
    results = sched.finished
    assert results["a"].finish_reason == "error" and results["a"].tokens == alone["a"][:k]
    assert f"request a: NaN or infinite logits at decode step {k}" in str(results["a"].error)
    assert results["b"].tokens == alone["b"] and results["b"].finish_reason == "length"
    assert results["c"].tokens == alone["c"] and results["c"].finish_reason == "length"
    assert results["c"].queued_s > 0  # c waited for a's slot
    with pytest.raises(NonFiniteError, match="request a: "):
        Scheduler(model, _engine(native, batch=2)).run([a, b, c])


def test_first_nonfinite_names_the_output_head_and_finite_reruns(model):
    assert first_nonfinite(model, [], PROMPT, 512) == "none (the re-run's values were finite: not reproduced)"
    head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
    head.data[3] = float("nan")
    assert first_nonfinite(model, PROMPT[:2], PROMPT[2:], 512).startswith("the output head (lm_head; every module")


# -- sampling and generation parameters ------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    (dict(temperature=1e-40), "temperature must be 0 (greedy) or at least 1.18e-38"),
    (dict(temperature="hot"), "temperature must be a finite number, got 'hot'"),
    (dict(top_k=-1), "top_k must be >= 0, got -1"),
    (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_p=float("nan")), "top_p must be in (0, 1], got nan"),
])
def test_sampling_params_are_validated(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1, got -3"),
    (dict(max_tokens=2.5), "max_tokens must be an integer >= 1, got 2.5"),
    (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
    (dict(seed=1 << 64), "seed must be an integer in [-2**63, 2**64), got 18446744073709551616"),
    (dict(seed=1.0), "seed must be an integer in [-2**63, 2**64), got 1.0"),
    (dict(max_prompt_tokens=0), "max_prompt_tokens must be an integer >= 1, got 0"),
    (dict(sampling=0.7), "sampling must be SamplingParams, got float"),
])
def test_generation_config_is_validated(kwargs, message):
    with pytest.raises(ValueError) as info:
        GenerationConfig(**kwargs)
    assert str(info.value) == message


def test_a_tiny_temperature_samples_the_argmax_and_nan_logits_raise():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    for t in (MIN_TEMPERATURE, 1e-37):  # logits / t overflow fp32; the shifted logits do not
        assert (logits / t).isinf().any()
        got = sample(logits, SamplingParams(t, top_k=5, top_p=0.5), torch.Generator().manual_seed(1))
        assert got.tolist() == logits.argmax(-1).tolist()
    logits[1, 7] = float("nan")
    with pytest.raises(NonFiniteError, match="cannot sample from logits that hold NaN or Inf"):
        sample(logits, SamplingParams(1.0), torch.Generator().manual_seed(1))


def test_state_larger_than_the_machine_is_refused_before_allocating(model):
    with pytest.raises(ValueError, match=r"the state of 4 sequence\(s\) of 1000000000000 tokens needs .* TiB, "
                                         r"more than this device's .*: ask for fewer tokens"):
        SlotStates(model, 4, 10**12)
