"""Structured output (text/structured.py through the scheduler): for generated JSON schemas, what a tiny random
model samples under the schema's constraint parses as JSON and follows the schema (an oracle validator for the
subset the strategy writes); json_object gives an object; specials never come inside the JSON; response_format's
shape and the schema's problems are one-line errors naming the field, invalid apart from unsupported. After a
reasoning section (Kimi K3's layout): no mask while the turn reasons (the tokens are an unconstrained
request's), the markup into the response forced once the reasoning closes, then the grammar's mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeswap.engine.sampling import SamplingParams
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
from moeswap.models.loader import load_model
from moeswap.text.reasoning import KIMI_K3
from moeswap.text.structured import (
    AfterReasoning,
    GrammarConstraint,
    StructuredOutput,
    StructuredOutputError,
    response_schema,
)
from moeswap.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir)
    tok = load_tokenizer(tiny_k3_dir)
    eos = tok.stop_ids(model.config.eos_token_ids)
    yield model, tok, StructuredOutput(tok, eos, model.config.vocab_size), eos
    store.close()


def _generate(tiny, schema, seeds, max_tokens=600) -> list[tuple[str, str, list[int]]]:
    """(text, finish reason, tokens) of one request per seed, sampled at temperature 1, decoded together."""
    model, tok, so, eos = tiny
    grammar = so.grammar(schema)
    reqs = [Request(tok.encode("The answer:"), max_tokens, SamplingParams(temperature=1.0), eos, seed,
                    constraint=so.constraint(grammar)) for seed in seeds]
    results = Scheduler(model, EngineConfig(max_batch=len(reqs), max_len=1024)).run(reqs)
    return [(tok.decode([t for t in r.tokens if t not in eos]), r.finish_reason, r.tokens) for r in results]


# -- the oracle: a validator for the subset of JSON Schema the strategy writes ----------------------------
def _valid(value, schema) -> bool:
    if "enum" in schema:
        return value in schema["enum"] and type(value) in {type(v) for v in schema["enum"]}
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind in ("integer", "number"):
        ok = isinstance(value, int) if kind == "integer" else isinstance(value, (int, float))
        return (ok and not isinstance(value, bool) and schema.get("minimum", value) <= value
                <= schema.get("maximum", value))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
                and all(_valid(v, schema["items"]) for v in value))
    assert kind == "object"
    props = schema["properties"]
    return (isinstance(value, dict) and set(schema["required"]) <= set(value)
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(_valid(v, props[k]) for k, v in value.items() if k in props))


_names = st.text(st.sampled_from("abcdefgh_"), min_size=1, max_size=6)
_scalars = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.just({"type": "integer", "minimum": 0, "maximum": 9}),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(_names, st.integers(-9, 9)), min_size=1, max_size=4,
                                                 unique=True)),
)


def _object(children, min_required: int = 0):
    """Objects closed to other keys, as OpenAI's strict mode asks; `required` a subset of the properties."""
    def with_required(props):
        return st.lists(st.sampled_from(sorted(props)), min_size=min_required, unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req), "additionalProperties": False})
    return st.dictionaries(_names, children, min_size=1, max_size=4).flatmap(with_required)


_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, inner, st.integers(0, 3)),
    _object(inner)), max_leaves=6)
_schemas = _object(_values, min_required=1)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schemas)
def test_sampled_answers_parse_and_follow_the_schema(tiny, schema, strict_json):
    for text, finish, _ in _generate(tiny, schema, seeds=[1, 2]):
        assert finish == "stop", (text, schema)
        value = strict_json(text)
        assert _valid(value, schema), (value, schema)


def test_json_object_gives_an_object_and_no_special_tokens(tiny, strict_json):
    _, tok, _, _ = tiny
    for text, finish, tokens in _generate(tiny, response_schema({"type": "json_object"}), seeds=[3, 4, 5]):
        assert finish == "stop" and isinstance(strict_json(text), dict)
        specials = set(tok.id_to_special)
        assert not specials & set(tokens[:-1])  # (the last may be end-of-sequence, where the object may end)


def test_the_mask_is_the_grammars(tiny):
    """Before anything, only '{' (or tokens that start with it) may come; the model's padded ids never."""
    model, tok, so, _ = tiny
    c = so.constraint(so.grammar({"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}))
    mask = torch.zeros(model.config.vocab_size + 3, dtype=torch.bool)
    c.allowed(mask)
    ids = mask.nonzero().flatten().tolist()
    assert ids and all(i < tok.vocab_size and tok.token_bytes(i).startswith(b"{") for i in ids)


@pytest.mark.parametrize("fmt,param,code,says", [
    ({"type": "xml"}, "response_format.type", "invalid_value", "must be one of 'text', 'json_object', 'json_schema'"),
    ({"type": "json_object", "schema": {}}, "response_format.schema", "invalid_value", "is not a field"),
    ({"type": "json_schema"}, "response_format.json_schema", "invalid_value", "must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "invalid_value",
     "is missing"),
    ({"type": "json_schema", "json_schema": {"schema": 3}}, "response_format.json_schema.schema", "invalid_value",
     "must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict",
     "invalid_value", "must be a bool"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "nmae": "x"}}, "response_format.json_schema.nmae",
     "invalid_value", "is not a field of json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "response_format.json_schema.schema",
     "invalid_value", "is not a valid JSON schema: Invalid type: strin"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "response_format.json_schema.schema", "invalid_value", "minimum (5) is greater than maximum (1)"),
    ({"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}},
     "response_format.json_schema.schema", "unsupported_schema", "llguidance cannot follow this schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(?<=a)b"}}},
     "response_format.json_schema.schema", "unsupported_schema", "look-around"),
])
def test_bad_response_formats_are_one_line_errors_naming_the_field(tiny, fmt, param, code, says):
    so = tiny[2]
    with pytest.raises(StructuredOutputError) as e:
        so.grammar(response_schema(fmt))
    assert e.value.param == param and e.value.code == code and says in str(e.value)
    assert "\n" not in str(e.value)


def test_text_and_none_ask_for_nothing():
    assert response_schema(None) is None and response_schema({"type": "text"}) is None
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert response_schema({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True,
                                                                   "description": None}}) == schema


# -- after reasoning ----------------------------------------------------------------------------------
OBJECT_K = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"], "additionalProperties": False}


def _mask(constraint, vocab: int) -> torch.Tensor | None:
    """The constraint's mask for its next token; None where it allows any (no mask)."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    return None if constraint.allowed(mask) is False else mask


def test_after_reasoning_free_then_the_markup_into_the_response_then_the_grammar(tiny):
    model, tok, so, eos = tiny
    vocab, grammar = model.config.vocab_size, so.grammar(OBJECT_K)
    # a prompt that left the turn anywhere but in reasoning: the grammar from the first token, as before
    assert all(type(so.constraint(grammar, *at)) is GrammarConstraint
               for at in ((), (KIMI_K3, "response"), (KIMI_K3, "open"), (None, "think")))
    c = so.constraint(grammar, KIMI_K3, "think")
    assert isinstance(c, AfterReasoning)
    # reasoning: text (a split character, markup spelled as text) and specials that begin no markup of `think`
    reasoning = (tok.encode("so 北京 <|close|>think<|sep|> ") + tok.encode("<|close|>thinker<|sep|>", specials=True)
                 + tok.encode("ok<|open|>response<|sep|>", specials=True))
    for t in reasoning + tok.encode("<|close|>think<|sep|>", specials=True):
        assert _mask(c, vocab) is None and not c.done  # any token, end of sequence included
        c.advance(t)
    # the reasoning closed: the markup into the response, one forced token at a time
    for t in tok.encode("<|open|>response<|sep|>", specials=True):
        mask = _mask(c, vocab)
        assert mask is not None and mask.nonzero().flatten().tolist() == [t] and not c.done
        c.advance(t)
    # then the grammar's own masks, from its start (no end of sequence before the JSON is complete)
    fresh = so.constraint(grammar)
    for t in tok.encode('{"k":12}'):
        mask, want = _mask(c, vocab), _mask(fresh, vocab)
        assert mask is not None and torch.equal(mask, want) and not mask[list(eos)].any()
        c.advance(t)
        fresh.advance(t)
    assert c.done and _mask(c, vocab).nonzero().flatten().tolist() == sorted(eos)


def test_reasoning_tokens_are_an_unconstrained_requests(tiny):
    """Until the reasoning closes (the tiny random model never closes it), a constrained request's tokens are
    those of the same request without a constraint, bit for bit, greedy and sampled, batched together."""
    model, tok, so, eos = tiny
    grammar = so.grammar(OBJECT_K)
    prompt = tok.encode("Think first.<|open|>think<|sep|>", specials=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9)

    def requests(constrained: bool) -> list[Request]:
        def c():
            return so.constraint(grammar, KIMI_K3, "think") if constrained else None
        return [Request(prompt, 24, SamplingParams(), eos, constraint=c()),
                Request(prompt, 24, sampled, eos, seed=5, constraint=c()),
                Request(prompt[:-3], 24, sampled, eos, seed=6)]

    run = [Scheduler(model, EngineConfig(max_batch=3, max_len=128)).run(requests(c)) for c in (False, True)]
    assert [(r.tokens, r.finish_reason) for r in run[0]] == [(r.tokens, r.finish_reason) for r in run[1]]
    assert all(len(r.tokens) == 24 for r in run[1][:2])  # (cut by max_tokens in the reasoning)
