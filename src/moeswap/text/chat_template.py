"""Chat templates: a checkpoint's own Jinja `chat_template`, rendered as transformers renders it.

Owns: finding the template (`chat_template.jinja`, else tokenizer_config.json's), transformers' sandboxed
environment, and `ChatTemplate.segments`, which keeps the caller's special-token strings (contents, tool
calls, tools) text so only the template's markup holds special tokens; tokenizer.py encodes the segments
and has the built-in template for checkpoints without one. Entry point: `find_chat_template`."""

from __future__ import annotations

import bisect
import json
import re
import secrets
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moeswap.formats.files import confined

CHAT_TEMPLATE_FILE = "chat_template.jinja"

# tokenizer_config.json's named special tokens, which transformers passes to every template as variables
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# The names transformers passes a message's reasoning under; templates read `reasoning_content` (and
# gpt-oss style ones `thinking`), so every copy is filled from whichever the caller used.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template moeswap cannot load, or messages it cannot render."""


# ----------------------------------------------------------------------------------------------------
# The Jinja environment (the one transformers' chat_template_utils builds, option for option)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks in
    transformers; rendering a prompt needs only its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, as transformers' does: templates are the
    checkpoint's code, and dunder names are the way out of a sandbox."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` may be a keyword
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        _check_size(value)  # a namespace is how a loop grows a string: each store is bounded
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` without the rest of the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps and these options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# A template is the checkpoint's code run on every request: bounded in what it may build and how long it may run
MAX_RENDER_CHARS = 1 << 26  # the prompt text and any one string it builds on the way
MAX_RENDER_ITEMS = 1 << 20  # any one list or tuple it builds
MAX_RENDER_SECONDS = 10.0
MAX_POWER_BITS = 1 << 16  # `a ** b` on integers: a result wider than this is refused, not computed
_deadline = threading.local()


class _RenderLimit(Exception):
    """A template went past a bound (MAX_RENDER_*); carried out of Jinja and worded by ChatTemplate._render."""


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox plus bounds on size and time: products and powers are checked before they are computed,
    and every call, attribute and item lookup checks the render's deadline (loops always do some of these)."""

    intercepted_binops = frozenset(["*", "**", "+"])

    def call_binop(self, context, operator, left, right):
        _check_deadline()
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_size(left, len(left) + len(right))
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > _bound(seq):
                    raise _RenderLimit(f"it repeats a {type(seq).__name__} into more than {_bound(seq)} items")
        if (operator == "**" and isinstance(left, int) and isinstance(right, int)
                and right > 0 and max(left.bit_length(), 1) * right > MAX_POWER_BITS):
            raise _RenderLimit(f"it raises an integer to a power wider than {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)

    def call(self, *args, **kwargs):
        _check_deadline()
        return _check_size(super().call(*args, **kwargs))  # a macro's or filter's result, e.g. a joined list

    def getattr(self, obj, attribute):
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _check_deadline()
        return super().getitem(obj, argument)


def _bound(seq: str | list | tuple) -> int:
    return MAX_RENDER_CHARS if isinstance(seq, str) else MAX_RENDER_ITEMS


def _check_size(value: Any, size: int | None = None) -> Any:
    if isinstance(value, (str, list, tuple)) and (len(value) if size is None else size) > _bound(value):
        raise _RenderLimit(f"it builds a {type(value).__name__} of more than {_bound(value)} items")
    return value


def _check_deadline() -> None:
    end = getattr(_deadline, "end", None)
    if end is not None and time.monotonic() > end:
        raise _RenderLimit(f"it ran for more than {MAX_RENDER_SECONDS:g} s")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_Namespace)
    return env


_ENV = _environment()


# ----------------------------------------------------------------------------------------------------
# Finding a checkpoint's template


def find_chat_template(model_dir: str | Path, tok_cfg: Mapping[str, Any]) -> ChatTemplate | None:
    """The checkpoint's template, None when it ships none. As in transformers, `chat_template.jinja` wins
    over tokenizer_config.json's `chat_template`, which is a string or a list of named templates (the
    one named "default", or "tool_use" when tools are given and it exists)."""
    d = Path(model_dir)
    tokens = {}
    for key in TEMPLATE_TOKENS:
        value = tok_cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
    file = confined(d, CHAT_TEMPLATE_FILE, ChatTemplateError, str(d))  # a link out of the model: refused
    if file.is_file():
        try:
            return ChatTemplate(file.read_text(encoding="utf-8"), origin=CHAT_TEMPLATE_FILE, tokens=tokens)
        except UnicodeDecodeError as e:
            raise ChatTemplateError(f"{file}: not UTF-8 text ({e}); replace it") from e
    value = tok_cfg.get("chat_template")
    origin = "tokenizer_config.json"
    if value is None:
        return None
    if isinstance(value, str):
        return ChatTemplate(value, origin=origin, tokens=tokens)
    named = {}
    if isinstance(value, list):
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                named = {}
                break
            named[entry["name"]] = entry["template"]
    if not named:
        raise ChatTemplateError(f"{d / origin}: chat_template must be a string or a list of "
                                f"{{'name': ..., 'template': ...}}, found {value!r:.80}")
    if "default" not in named:
        raise ChatTemplateError(f"{d / origin}: chat_template has no template named 'default' "
                                f"(found {', '.join(sorted(named))})")
    tool_use = named.get("tool_use")
    return ChatTemplate(named["default"], origin=f"{origin} (default)", tokens=tokens,
                        tool_use=None if tool_use is None else ChatTemplate(tool_use, origin=f"{origin} (tool_use)",
                                                                            tokens=tokens))


# ----------------------------------------------------------------------------------------------------
# Rendering


class ChatTemplate:
    """One compiled Jinja chat template. `render` gives the prompt text transformers'
    `apply_chat_template(tokenize=False)` gives; `segments` gives the same text split for encoding.
    `tokens`: the checkpoint's named special tokens (bos_token, ...), template variables as in transformers."""

    def __init__(self, source: str, *, origin: str, tokens: Mapping[str, str] | None = None,
                 tool_use: ChatTemplate | None = None) -> None:
        self.source = source
        self.origin = origin
        self.tokens = dict(tokens or {})
        self._tool_use = tool_use
        self._scan: tuple[frozenset[str], _SpecialScan] | None = None  # the last vocabulary's, reused
        try:
            self._compiled = _ENV.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template in {origin}: line {e.lineno}: {e.message}; "
                                    "the checkpoint's template is damaged") from e

    def _pick(self, tools: Any) -> ChatTemplate:
        return self._tool_use if tools is not None and self._tool_use is not None else self

    def render(self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text. `variables`: the caller's further template variables (the template's own
        switches, such as K3's `thinking`), as transformers' **kwargs; they override `tokens`."""
        return self._pick(tools)._render(normalize_messages(messages), _check_tools(tools),
                                         add_generation_prompt, _check_variables(variables))

    def _render(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool,
                variables: dict[str, Any]) -> str:
        outer = getattr(_deadline, "end", None)
        _deadline.end = time.monotonic() + MAX_RENDER_SECONDS if outer is None else outer
        try:
            out, size = [], 0
            for piece in self._compiled.generate(**{**self.tokens, **variables, "messages": messages, "tools": tools,
                                                    "documents": None, "add_generation_prompt": add_generation_prompt}):
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise _RenderLimit(f"its output passes {MAX_RENDER_CHARS} characters")
                _check_deadline()
                out.append(piece)
            return "".join(out)
        except _RenderLimit as e:
            raise ChatTemplateError(f"chat template ({self.origin}) refused: {e}") from None
        except RecursionError:
            raise ChatTemplateError(f"chat template ({self.origin}) refused: it recurses too deeply") from None
        except MemoryError:
            raise ChatTemplateError(f"chat template ({self.origin}) refused: it needs more memory than there "
                                    "is") from None
        except jinja2.exceptions.TemplateError as e:  # raise_exception(), sandbox refusals, undefined names
            raise ChatTemplateError(f"chat template ({self.origin}): {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # the template tripped on input
            raise ChatTemplateError(f"chat template ({self.origin}) failed on these messages: "
                                    f"{type(e).__name__}: {e}") from e
        finally:
            _deadline.end = outer

    def segments(self, messages: Any, specials: Collection[str], *, add_generation_prompt: bool = True,
                 tools: Any = None, variables: Mapping[str, Any] | None = None) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, specials_allowed) pieces whose concatenation is `render(...)`.
        In pieces marked True, special-token strings (`specials`) are the template's: encode them with
        specials. A special-token string that comes from a caller's string lies in a piece marked False,
        together with the text around it up to the template's neighbouring special tokens, so it is
        encoded as the text it spells, split no differently from other text.

        How the caller's strings are told apart: strings that could spell, or help spell, a special token
        are replaced by unique sentinels and the template rendered again; the sentinel rendering, aligned
        with the real one, says which characters came from those strings. A template that changes such a
        string beyond recognition (slices it, splits it, upper-cases it) defeats the alignment; then
        the prompt is used as rendered when no string holds a whole special token, else refused."""
        template = self._pick(tools)
        msgs, tools, variables = normalize_messages(messages), _check_tools(tools), _check_variables(variables)
        real = template._render(msgs, tools, add_generation_prompt, variables)
        key = frozenset(specials)
        if self._scan is None or self._scan[0] != key:
            self._scan = key, _SpecialScan(key)
        scan = self._scan[1]
        if scan.pattern is None:
            return [(real, True)]
        _refuse_specials_in_keys({"messages": msgs, "tools": tools, "variables": variables}, scan)
        table = _Sentinels(scan)
        sent_msgs, sent_tools = table.replace(msgs, "messages"), table.replace(tools, "tools")
        sent_vars = {k: table.replace(v, f"variables.{k}") for k, v in variables.items()}
        if not table.strings:  # nothing the caller wrote can spell a special token
            return [(real, True)]
        try:
            sent = template._render(sent_msgs, sent_tools, add_generation_prompt, sent_vars)
            spans = table.align(sent, real)
        except ChatTemplateError:  # the template refused a sentinel where it wanted the real string
            spans = None
        if spans is None:
            for text, path in table.strings.items():
                m = scan.pattern.search(text)
                if m:
                    raise ChatTemplateError(
                        f"{path} contains the special token {m[0]!r}, and the chat template ({template.origin}) "
                        "changes or tests that string as it renders it, so moeswap cannot keep the token as text; "
                        "remove it from the message")
            return [(real, True)]
        return _split_at_caller_specials(real, spans, scan)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: each an object with a string role, keys whose
    value is None dropped (templates test for absent keys), reasoning under all of its names."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages: expected a list of messages, found {type(messages).__name__}")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{n}]: expected an object with a string 'role', found {m!r:.80}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _check_variables(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    variables = dict(variables or {})
    taken = {"messages", "tools", "documents", "add_generation_prompt"} & set(variables)
    if taken:
        raise ChatTemplateError(f"template variable {sorted(taken)[0]!r} is set by moeswap itself; pass it "
                                "as its own argument")
    return variables


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError(f"tools: expected a list of JSON-schema objects, found {tools!r:.80}")
    return list(tools)


# ----------------------------------------------------------------------------------------------------
# Telling the caller's special-token strings from the template's


class _SpecialScan:
    """Finds special-token strings, longest first where two start at one place (as the tokenizers do),
    and says whether a string could help spell one across its ends."""

    def __init__(self, specials: Collection[str]) -> None:
        toks = sorted({s for s in specials if s}, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, toks))) if toks else None
        self._heads = {s[:k] for s in toks for k in range(1, len(s))}  # proper prefixes
        self._tails = {s[-k:] for s in toks for k in range(1, len(s))}  # proper suffixes
        self._longest = len(toks[0]) if toks else 0

    def touches(self, text: str) -> bool:
        """Whether `text` holds a special token, or could complete one with text rendered before or after it."""
        if self.pattern is None or not text:
            return False
        if self.pattern.search(text):
            return True
        n = min(len(text), self._longest - 1)
        return any(text[-k:] in self._heads or text[:k] in self._tails for k in range(1, n + 1))


def _refuse_specials_in_keys(value: Any, scan: _SpecialScan, path: str = "") -> None:
    """Object keys render as the template's own text (templates sort and compare them), so a key cannot
    be kept as text: one that spells a special token is refused."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and scan.pattern is not None and (m := scan.pattern.search(k)):
                raise ChatTemplateError(f"{path or 'input'} has the key {k!r}, which contains the special token "
                                        f"{m[0]!r}; keys are rendered as template markup, rename it")
            _refuse_specials_in_keys(v, scan, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_specials_in_keys(v, scan, f"{path}[{i}]")


class _Sentinels:
    """Replaces the caller's strings that touch a special token with sentinels: letters and digits only,
    so escaping filters (tojson, attribute escapes) leave them whole, with a per-render random part no
    caller can predict. Equal strings share one sentinel so templates comparing them (a tool result's
    tool_call_id against the call's id) take the same branches."""

    def __init__(self, scan: _SpecialScan) -> None:
        self._scan = scan
        self._nonce = secrets.token_hex(8)
        self._re = re.compile(rf"moeswap{self._nonce}s(\d+)e")
        self.strings: dict[str, str] = {}  # string -> path of its first appearance, in sentinel order
        self._index: dict[str, int] = {}

    def replace(self, value: Any, path: str) -> Any:
        if isinstance(value, str):
            if not self._scan.touches(value):
                return value
            if value not in self._index:
                self._index[value] = len(self._index)
                self.strings[value] = path
            return f"moeswap{self._nonce}s{self._index[value]}e"
        if isinstance(value, dict):
            return {k: self.replace(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.replace(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return value

    def align(self, sent: str, real: str) -> list[tuple[int, int]] | None:
        """Spans of `real` that came from the replaced strings, or None when the two renderings do not
        line up: everything outside a sentinel must be identical, and each sentinel must stand for its
        string as written or in a form a template prints strings in (trimmed, JSON- or attribute-escaped)."""
        strings = list(self.strings)
        parts = self._re.split(sent)  # markup, index, markup, index, ..., markup
        if not real.startswith(parts[0]):
            return None
        pos, spans = len(parts[0]), []
        for i in range(1, len(parts), 2):
            after = parts[i + 1]
            for form in _printed_forms(strings[int(parts[i])]):
                if real.startswith(form, pos) and real.startswith(after, pos + len(form)):
                    spans.append((pos, pos + len(form)))
                    pos += len(form) + len(after)
                    break
            else:
                return None
        return spans if pos == len(real) else None


def _printed_forms(s: str) -> Iterator[str]:
    seen = set()
    for form in (s, s.strip(), json.dumps(s, ensure_ascii=False)[1:-1], json.dumps(s)[1:-1],
                 s.replace("&", "&amp;").replace('"', "&quot;")):
        if form not in seen:
            seen.add(form)
            yield form


def _split_at_caller_specials(real: str, spans: list[tuple[int, int]], scan: _SpecialScan) -> list[tuple[str, bool]]:
    assert scan.pattern is not None
    starts = [a for a, _ in spans]

    def from_caller(m: re.Match) -> bool:
        i = bisect.bisect_right(starts, m.start()) - 1  # the last span starting at or before the token
        if i >= 0 and spans[i][1] > m.start():
            return True
        return i + 1 < len(spans) and spans[i + 1][0] < m.end()

    found = list(scan.pattern.finditer(real))
    if not any(from_caller(m) for m in found):
        return [(real, True)]
    # Text runs between the template's own special tokens; a run holding a caller's special is text
    ours = [m for m in found if not from_caller(m)]
    cuts = [0] + [x for m in ours for x in (m.start(), m.end())] + [len(real)]
    runs = [(cuts[k], cuts[k + 1]) for k in range(0, len(cuts), 2)]
    theirs = [m.start() for m in found if from_caller(m)]
    out: list[tuple[str, bool]] = []
    pos = 0
    for a, b in runs:
        if any(a <= t < b for t in theirs):
            if a > pos:
                out.append((real[pos:a], True))
            out.append((real[a:b], False))
            pos = b
    if pos < len(real):
        out.append((real[pos:], True))
    return out
