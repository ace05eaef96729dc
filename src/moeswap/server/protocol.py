"""The OpenAI wire format the server speaks: request models (pydantic, strict types, unknown fields refused),
error bodies, and the JSON objects of responses and stream chunks.

Knows nothing of the engine or the tokenizer. A request body that does not parse or validate becomes an
`APIError` (400) whose message names the parameter. Entry points: `parse_body(model_cls, raw)`, `APIError`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions' legacy `logprobs` gets the same


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ----------------------------------------------------------------------------------------------------
# Requests


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1.0 is not an integer, as in OpenAI's API; unknown fields are
    # refused rather than ignored, so a parameter the server does not implement never silently changes nothing
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ...: the template decides
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class GenerationFields(_Strict):
    """Fields both endpoints share. Parameters that exist in OpenAI's API but not here are accepted only at
    their neutral value (see NEUTRAL), so that clients which always send them keep working."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM): 0 or -1 = off
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    seed: int | None = None
    return_token_ids: bool = False  # extension (vLLM): token ids of the prompt and of each choice
    skip_special_tokens: bool = True  # extension (vLLM): False keeps control tokens in the text
    user: str | None = None  # for the client's own records; not used
    safety_identifier: str | None = None  # OpenAI's successor of `user` for abuse tracking: not used either
    prompt_cache_key: str | None = None  # OpenAI's prompt-cache routing hint: one server, nothing to route
    presence_penalty: float = 0.0  # OpenAI's, over the output so far (engine/sampling.py)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM): over the prompt and the output so far
    logit_bias: dict[str, float] | None = None
    # text / json_object / json_schema (vLLM takes it on completions too); its shape is checked by
    # text.structured.response_schema, the one owner of it
    response_format: dict[str, Any] | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None  # rendered by the checkpoint's chat template; calls parsed (text/tool_calls.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): the template's own switches
    # OpenAI's, only at the value that changes nothing here (NEUTRAL): nothing is stored, one tier of service,
    # text out
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class LoadLoRARequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's body; server/runtime_lora.py)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's body; its optional lora_int_id is not taken)."""
    lora_name: str = Field(min_length=1)


# Parameters accepted only at the value that leaves generation as it is: anything else is refused by name.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}), "echo": (False,),
    "suffix": (None, ""), "best_of": (None, 1), "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "modalities": (None, ["text"]),
}


MAX_NESTING = 64  # objects and arrays in one request (a tool's JSON schema is the deepest thing a client sends)


def nesting(value) -> int:
    """How deeply `value`'s objects and arrays nest (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_body(cls: type[_Strict], raw: bytes) -> _Strict:
    """The request `cls` a body holds: UTF-8 JSON, an object, valid against `cls`; APIError (400) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})",
                       code="invalid_body") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_NESTING} levels", code="invalid_body") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(data).__name__}",
                       code="invalid_body")
    if nesting(data) > MAX_NESTING:  # before anything walks it recursively
        raise APIError(400, f"the request body nests deeper than {MAX_NESTING} levels", code="invalid_body")
    _check_text(data, "")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        errors = [(_param(x["loc"]), x) for x in e.errors(include_url=False)]
        # a union's alternatives each fail: the one that got furthest into the value says the most, and
        # alternatives that fail at the same place say together what was expected
        depth = max(len(_PARTS.findall(p)) for p, _ in errors)
        param, err = next((p, x) for p, x in errors if len(_PARTS.findall(p)) == depth)
        said = " or ".join(dict.fromkeys(x["msg"][0].lower() + x["msg"][1:] for p, x in errors if p == param))
        if err["type"] == "extra_forbidden":  # a parameter this server does not know
            raise APIError(400, f"'{param}' is not a parameter this server knows", param=param,
                           code="unsupported_parameter") from None
        got = "" if err["type"] == "missing" else f", got {_short(err['input'])}"
        raise APIError(400, f"'{param}': {said}{got}", param=param,
                       code="invalid_type" if err["type"].endswith("_type") else "invalid_value") from None
    for name, neutral in NEUTRAL.items():
        if name in req.model_fields_set and getattr(req, name, None) not in neutral:
            raise APIError(400, f"'{name}' is not supported by this server (accepted only as "
                                f"{' or '.join(json.dumps(v) for v in neutral)}), got {_short(getattr(req, name))}",
                           param=name, code="unsupported_parameter")
    return req


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _check_text(value: Any, where: str) -> None:
    """JSON's \\ud800 escapes can spell lone surrogates, which are not Unicode text: refuse them by field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            param = where or "body"
            raise APIError(400, f"'{param}' is not valid Unicode text (lone surrogate {ord(value[e.start]):#06x} "
                                f"at character {e.start})", param=param, code="invalid_text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_PARTS = re.compile(r"[a-z_][a-z0-9_]*|\[\d+\]")


def _param(loc: tuple) -> str:
    """OpenAI's spelling of a location: messages[0].content. pydantic also puts union members' tags in the
    path ('str', 'list[int]', 'TextPart'); field names are snake_case, so the tags are told apart and left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or "body"


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, BaseModel) else value.model_dump_json()
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------------------------------
# Responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int, max_context: int, parent: str | None = None) -> dict:
    """/v1/models' entry; parent: the base model of a LoRA adapter (vLLM's field; null for the base model)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "moeswap", "max_model_len": max_context,
            "parent": parent}
