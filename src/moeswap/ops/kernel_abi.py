"""kernel_abi: what C and Python share, read from the C headers. Owns the parsers of csrc/cpu_kernels.h (every
exported prototype's ctypes argtypes, decode_layer's fields, the shared lists and constants) and of
csrc/expert_read.h (msw_job's fields, its states), and the field-by-field check of a ctypes mirror against a
compiled library's own table. Knows no kernel and needs no torch. Entry points: `abi()`, `job_abi()`,
`constant(name)`, and EXPERT_PROJS / KERNEL_PROJS (the routed experts' projection names).
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CSRC = Path(__file__).with_name("csrc")
HEADER = CSRC / "cpu_kernels.h"
JOB_HEADER = CSRC / "expert_read.h"

# C types as ctypes: the scalars the headers' parameters and fields may have; every pointer is a void pointer
_SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "double": ctypes.c_double}
_POINTEES = {*_SCALARS, "void", "char", "int8_t", "uint8_t", "uint16_t", "decode_layer", "msw_job"}
# the lists cpu_kernels.h must define (MOESWAP_<name>) and how many arguments each entry takes
_LISTS = {"DECODE_LAYER_FIELDS": 3, "FORMATS": 2, "LOAD_STATE": 1, "LOAD_VICTIM": 1, "LOAD_LOG": 1,
          "LOAD_KINDS": 1, "EXPERT_PROJS": 2, "ACTIVATIONS": 1}


@dataclass(frozen=True)
class Abi:
    """What csrc/cpu_kernels.h declares: each exported function's (restype, argtypes), in header order;
    `decode_layer`'s fields as ctypes `_fields_`; the shared lists by name without MOESWAP_ ({entry: value}:
    FORMATS' codes, else each entry's index, in order); the constants (MOESWAP_<name> <integer>); the
    routed experts' projections {name: role} in the checkpoint's order."""

    functions: dict[str, tuple[type, list[type]]]
    layer_fields: list[tuple[str, type]]
    lists: dict[str, dict[str, int]]
    constants: dict[str, int]
    projections: dict[str, str]


@dataclass(frozen=True)
class JobAbi:
    """What csrc/expert_read.h declares of msw_job: its fields as ctypes `_fields_`, its states {name: value}."""

    fields: list[tuple[str, type]]
    states: dict[str, int]


@functools.cache
def abi() -> Abi:
    return parse_header(HEADER.read_text(), HEADER.name)


@functools.cache
def job_abi() -> JobAbi:
    return parse_job_header(JOB_HEADER.read_text(), JOB_HEADER.name)


def constant(name: str) -> int:
    """cpu_kernels.h's MOESWAP_<name>, e.g. constant("DENSE_KERNEL_MAX_ROWS")."""
    return abi().constants[name]



def _code_lines(text: str, where: str) -> list[str]:
    """The header's lines with backslash splices joined and /* */ comments removed, as C reads them."""
    text = re.sub(r"/\*.*?\*/", " ", text.replace("\\\n", " "), flags=re.S)
    if "//" in text:
        raise ValueError(f"{where}: a // comment (the header uses /* */ only)")
    return text.splitlines()


def _integer(text: str, where: str) -> int:
    """An integer constant as the headers write one: decimal, or (a << b)."""
    m = re.fullmatch(r"\s*(\d+)\s*|\s*\(\s*(\d+)\s*<<\s*(\d+)\s*\)\s*", text)
    if not m:
        raise ValueError(f"{where}: {text.strip()!r} (expected an integer, or (a << b))")
    return int(m.group(1)) if m.group(1) else int(m.group(2)) << int(m.group(3))


def _entries(macro: str, param: str, body: str, arity: int, where: str) -> list[list[str]]:
    """The X-macro's entries `param(a, b, ...)` with `arity` arguments each, or a ValueError."""
    entry = re.compile(rf"\b{param}\(([^()]*)\)")
    rest = entry.sub(" ", body).strip()
    if rest:
        raise ValueError(f"{where}: {macro} holds {rest[:60]!r} besides {param}(...) entries")
    out = []
    for text in entry.findall(body):
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != arity or not re.fullmatch(r"[A-Za-z_]\w*", parts[0 if arity < 3 else 1]):
            raise ValueError(f"{where}: {macro} entry {param}({text}) (expected {arity} argument(s), a name)")
        out.append(parts)
    names = [p[0 if arity < 3 else 1] for p in out]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{where}: {macro}: {name} is listed twice")
    return out


def parse_header(text: str, where: str = "cpu_kernels.h") -> Abi:
    """The Abi of a header in cpu_kernels.h's restricted form, or a ValueError naming what is not in it."""
    macros: dict[str, list[list[str]]] = {}
    constants: dict[str, int] = {}
    code = []
    for line in _code_lines(text, where):
        if not line.lstrip().startswith("#"):
            code.append(line)
            continue
        m = re.fullmatch(r"\s*#\s*define\s+MOESWAP_(\w+)\((\w+)\)(.*)", line)
        c = re.fullmatch(r"\s*#\s*define\s+MOESWAP_(\w+)\s+(\S.*)", line)
        if m and m.group(1) in _LISTS:
            macros[m.group(1)] = _entries(f"MOESWAP_{m.group(1)}", m.group(2), m.group(3), _LISTS[m.group(1)], where)
        elif c and "(" not in c.group(1):
            constants[c.group(1)] = _integer(c.group(2), f"{where}: MOESWAP_{c.group(1)}")
        elif not re.match(r"\s*#\s*(ifndef|endif|include|undef|define MOESWAP_[A-Z_]+\b)", line):
            # no conditional declarations, and no macro that could rename what the prototypes say
            raise ValueError(f"{where}: {line.strip()[:80]!r} (expected only the include guard, #include, "
                             f"and MOESWAP_ macros)")
    for name in _LISTS:
        if name not in macros:
            raise ValueError(f"{where}: no #define MOESWAP_{name}(...)")
    named = {f"MOESWAP_{name}": value for name, value in constants.items()}  # dimensions may name a constant
    fields = [(n, ctype_of(t + d, f"{where}: decode_layer field {n}")) for t, n, d in _dims(
        macros.pop("DECODE_LAYER_FIELDS"), named, where)]
    projections = {name: role for name, role in macros.pop("EXPERT_PROJS")}
    if sorted(projections.values()) != ["down", "gate", "up"]:
        raise ValueError(f"{where}: MOESWAP_EXPERT_PROJS roles {list(projections.values())} (expected gate, up, down)")
    lists = {name: {e[0]: i for i, e in enumerate(entries)} for name, entries in macros.items()}
    lists["FORMATS"] = {e[0]: _integer(e[1], f"{where}: format {e[0]}") for e in macros["FORMATS"]}
    if len(set(lists["FORMATS"].values())) != len(lists["FORMATS"]):
        raise ValueError(f"{where}: two formats share a code ({lists['FORMATS']})")
    functions: dict[str, tuple[type, list[type]]] = {}
    for statement in " ".join(code).split(";"):
        statement = " ".join(statement.split())
        if not statement or re.fullmatch(r"typedef struct \{ MOESWAP_DECODE_LAYER_FIELDS\(\w+\) \} decode_layer",
                                         statement):
            continue
        m = re.fullmatch(r"(.+?)\b(moeswap_\w+) ?\((.*)\)", statement)
        if not m:
            raise ValueError(f"{where}: {statement[:80]!r} is not an exported function's prototype")
        ret, name, params = m.groups()
        argtypes = [] if params.strip() == "void" else [_declared(p, f"{where}: {name}") for p in params.split(",")]
        if name in functions:
            raise ValueError(f"{where}: {name} is declared twice")
        functions[name] = (ctype_of(ret, f"{where}: {name}'s return type"), argtypes)
    return Abi(functions, fields, lists, constants, projections)


def _dims(entries: list[list[str]], constants: dict[str, int], where: str) -> list[tuple[str, str, str]]:
    """FIELD(type, name, dims) entries as (type, name, "[n]" or ""), a named dimension replaced by its value."""
    out = []
    for t, name, d in entries:
        m = re.fullmatch(r"\[(\w+)\]", d)
        if m and m.group(1) in constants:
            d = f"[{constants[m.group(1)]}]"
        if not re.fullmatch(r"(\[\d+\])?", d):
            raise ValueError(f"{where}: field FIELD({t}, {name}, {d}) (expected FIELD(type, name, [n] or nothing))")
        out.append((t, name, d))
    return out


def parse_job_header(text: str, where: str = "expert_read.h") -> JobAbi:
    """msw_job's fields (MSW_JOB_FIELDS) and states (MSW_JOB_STATES) in expert_read.h, which also holds C code:
    only those macros and the integer constants MSW_<name> are read."""
    constants: dict[str, int] = {}
    macros: dict[str, tuple[str, str]] = {}
    for line in _code_lines(text, where):
        m = re.fullmatch(r"\s*#\s*define\s+(MSW_\w+)\((\w+)\)(.*)", line)
        c = re.fullmatch(r"\s*#\s*define\s+(MSW_\w+)\s+(\d+)\s*", line)
        if m:
            macros[m.group(1)] = (m.group(2), m.group(3))
        elif c:
            constants[c.group(1)] = int(c.group(2))
    for name in ("MSW_JOB_FIELDS", "MSW_JOB_STATES"):
        if name not in macros:
            raise ValueError(f"{where}: no #define {name}(...)")
    fields = [(n, ctype_of(t + d, f"{where}: msw_job field {n}"))
              for t, n, d in _dims(_entries("MSW_JOB_FIELDS", *macros["MSW_JOB_FIELDS"], 3, where), constants, where)]
    states = {e[0]: i for i, e in enumerate(_entries("MSW_JOB_STATES", *macros["MSW_JOB_STATES"], 1, where))}
    return JobAbi(fields, states)


def _declared(param: str, where: str) -> type:
    """The ctypes type of one parameter `[const] T [* [const]]... name`."""
    m = re.fullmatch(r"(.*?[\s*])([A-Za-z_]\w*)", param.strip())
    if not m or m.group(2) in _POINTEES or m.group(2) == "const":
        raise ValueError(f"{where}: parameter {param.strip()!r} (expected a type and a name)")
    return ctype_of(m.group(1), f"{where}: parameter {param.strip()!r}")


def ctype_of(spelling: str, where: str = "C type") -> type:
    """The ctypes type of a C type as the headers spell it ("int64_t", "const float *", "int64_t[6]",
    "struct msw_job *"): int, int32_t, int64_t, float, double as themselves, any pointer as a void pointer,
    [n] as an array."""
    m = re.fullmatch(r"(.*?)\s*(?:\[(\d+)\])?", spelling.strip())
    assert m is not None  # (every string matches)
    tokens = re.findall(r"[A-Za-z_]\w*|\S", m.group(1))
    if tokens[:1] == ["const"]:
        tokens = tokens[1:]
    if tokens[:1] == ["struct"] and "*" in tokens:  # a pointer to a struct by its tag
        tokens = tokens[1:]
    base, rest = (tokens[0], tokens[1:]) if tokens else ("", [])
    if (base not in _POINTEES or any(t not in ("*", "const") for t in rest) or rest[:1] == ["const"]
            or (not rest and base not in _SCALARS)):
        raise ValueError(f"{where}: type {spelling.strip()!r} (expected [const] int, int32_t, int64_t, float or "
                         f"double, or a pointer to one of {', '.join(sorted(_POINTEES))})")
    ctype: Any = ctypes.c_void_p if rest else _SCALARS[base]
    return ctype * int(m.group(2)) if m.group(2) else ctype


Layout = list[tuple[str, int, int, str]]  # a compiled struct's (name, offset, size, C type) per field, in order


def struct_problem(what: str, compiled: Layout, compiled_size: int, struct: type[ctypes.Structure]) -> str | None:
    """None when the ctypes `struct` lays out `what` as a library compiled it (`compiled`, `compiled_size`),
    field for field (name, offset, size and type); else a sentence naming the first field that differs."""
    mirror = list(struct._fields_)
    for i in range(max(len(compiled), len(mirror))):
        if i >= len(compiled):
            return f"{what}: the ctypes mirror has a field {mirror[i][0]!r} past the library's last one"
        name, offset, size, spelling = compiled[i]
        if i >= len(mirror):
            return f"{what}: the ctypes mirror lacks the library's field {name} ({spelling})"
        py_name, py_type = mirror[i][:2]
        got = getattr(struct, py_name)
        if (py_name, got.offset, got.size) != (name, offset, size) or not _same_ctype(py_type, ctype_of(spelling)):
            return (f"{what} field {i}: the library has {name} ({spelling}, offset {offset}, {size} "
                    f"bytes), the ctypes mirror {py_name} ({_ctype_name(py_type)}, offset {got.offset}, "
                    f"{got.size} bytes)")
    if ctypes.sizeof(struct) != compiled_size:
        return f"{what}: {compiled_size} bytes in the library, {ctypes.sizeof(struct)} in the ctypes mirror"
    return None


def list_problem(what: str, header: dict[str, int], compiled: list[tuple[str, int]]) -> str | None:
    """None when a shared list as the header gives it ({name: value}, in order) is the library's, entry for
    entry; else a sentence naming the first entry that differs."""
    ours = list(header.items())
    for i in range(max(len(ours), len(compiled))):
        mine = ours[i] if i < len(ours) else None
        theirs = compiled[i] if i < len(compiled) else None
        if mine != theirs:
            return f"{what} entry {i}: the library has {theirs}, the header {mine}"
    return None


def _same_ctype(a: Any, b: Any) -> bool:
    if issubclass(a, ctypes.Array) or issubclass(b, ctypes.Array):
        return (issubclass(a, ctypes.Array) and issubclass(b, ctypes.Array) and a._length_ == b._length_
                and _same_ctype(a._type_, b._type_))
    return a is b


def _ctype_name(t: Any) -> str:
    return f"{_ctype_name(t._type_)}[{t._length_}]" if issubclass(t, ctypes.Array) else t.__name__


# the routed experts' projections in the checkpoint's order ("w1", "w2", "w3"), and as the kernels take them
# (gate, up, down: "w1", "w3", "w2")
EXPERT_PROJS = tuple(abi().projections)
KERNEL_PROJS = tuple({role: name for name, role in abi().projections.items()}[r] for r in ("gate", "up", "down"))
