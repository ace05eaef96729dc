"""The kernels' C ABI has one source, csrc/cpu_kernels.h: every function the library exports is declared there,
Python calls each one with the argtypes parsed from its prototype, the C definitions take the parameters the
prototypes list, and the parser refuses any declaration it does not understand instead of guessing."""

import ctypes
import re
import shutil
import subprocess

import pytest

from moeswap.ops import cpu_kernels

HEADER_TEXT = cpu_kernels.HEADER.read_text()


def _exported(path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("moeswap_")}


@pytest.mark.parametrize("flags", cpu_kernels.build_variants(), ids=lambda f: "native" if f is None else " ".join(f))
def test_every_exported_function_is_declared_and_called_with_the_header_argtypes(flags):
    kernel = cpu_kernels.kernel(flags)
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    functions = cpu_kernels.abi().functions
    for name, (restype, argtypes) in functions.items():
        fn = getattr(kernel.lib, name)
        assert (fn.restype, fn.argtypes) == (restype, argtypes), name
    if shutil.which("nm"):
        assert _exported(kernel.path) == set(functions)  # nothing exported that the header does not declare


def test_the_c_definitions_take_the_parameters_the_header_declares():
    """An oracle for the parser: the definitions in csrc/*.c, parsed parameter by parameter, give the header's
    argtypes (the compiler already holds each definition to its prototype: every file includes the header)."""
    defined: dict[str, list[type]] = {}
    for path in sorted(cpu_kernels.CSRC.glob("*.c")):
        text = path.read_text()
        assert '#include "internal.h"' in text, path.name
        for _ret, name, params in re.findall(r"^(int) (moeswap_\w+)\(([^)]*)\) *\{", text, re.M):
            args = [] if params.strip() == "void" else [cpu_kernels.ctype_of(re.sub(r"\w+$", "", p.strip()))
                                                         for p in params.split(",")]
            assert defined.setdefault(name, args) == args, f"{name} is defined twice with different parameters"
    assert '#include "cpu_kernels.h"' in (cpu_kernels.CSRC / "internal.h").read_text()
    assert {name: args for name, (_, args) in cpu_kernels.abi().functions.items()} == defined


def test_the_header_parses_into_every_function_and_field():
    abi = cpu_kernels.abi()
    assert len(abi.functions) == 34 and abi.functions["moeswap_glu"] == (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
        ctypes.c_float, ctypes.c_int])
    assert abi.functions["moeswap_int4_decode"] == (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int])
    fields = dict(abi.layer_fields)
    assert len(fields) == 73 and fields["s_in"] is ctypes.c_void_p and fields["off"] == ctypes.c_int64 * 6 and fields["lower"] is ctypes.c_double
    assert fields["table"] is ctypes.c_void_p and fields["stop"] is ctypes.c_int64 and fields["chosen"] is ctypes.c_void_p
    assert fields["rope_cos"] is ctypes.c_void_p and fields["rope_interleave"] is ctypes.c_int64
    assert fields["load_row"] == ctypes.c_int64 * 6 and fields["load_log"] is ctypes.c_void_p


def _edited(old: str, new: str) -> str:
    assert old in HEADER_TEXT
    return HEADER_TEXT.replace(old, new, 1)


@pytest.mark.parametrize("old, new, message", [
    ("int moeswap_mxfp4_isa(void);", "int moeswap_mxfp4_isa(size_t n);", "parameter 'size_t n'"),
    ("int moeswap_mxfp4_isa(void);", "int moeswap_mxfp4_isa(int);", "parameter 'int'"),
    ("int moeswap_mxfp4_isa(void);", "int moeswap_mxfp4_isa(float const *x);", "parameter 'float const \\*x'"),
    ("int moeswap_mxfp4_isa(void);", "struct extra { int x; };", "not an exported function's prototype"),
    ("int moeswap_mxfp4_isa(void);", "int moeswap_glu(void);", "moeswap_glu is declared twice"),
    ("int moeswap_mxfp4_isa(void);", "int moeswap_mxfp4_isa(void); // ok", "// comment"),
    ("int moeswap_mxfp4_isa(void);", "#if 0\nint moeswap_mxfp4_isa(void);\n#endif", "'#if 0'"),
    ("int moeswap_mxfp4_isa(void);", "#define float double\nint moeswap_mxfp4_isa(void);", "'#define float double'"),
    ("FIELD(double, lower, )", "FIELD(long double, lower, )", "field lower: type 'long double'"),
    ("FIELD(int64_t, off, [6])", "FIELD(int64_t, off, [n])", "field FIELD\\(int64_t, off, \\[n\\]\\)"),
    ("FIELD(int64_t, stop, )", "FIELD(int64_t, mla, )", "mla is listed twice"),
    ("FIELD(int64_t, stop, )", "FIELD(int64_t, stop, ) extra", "holds 'extra'"),
])
def test_the_parser_refuses_what_it_does_not_know(old, new, message):
    with pytest.raises(ValueError, match=message):
        cpu_kernels.parse_header(_edited(old, new))


def test_ctype_of_spellings():
    assert cpu_kernels.ctype_of("int64_t") is ctypes.c_int64
    assert cpu_kernels.ctype_of("const uint8_t *const *") is ctypes.c_void_p
    assert cpu_kernels.ctype_of("int64_t[6]") == ctypes.c_int64 * 6
    for bad in ("uint8_t", "decode_layer", "unsigned", "const", ""):
        with pytest.raises(ValueError, match="type"):
            cpu_kernels.ctype_of(bad)
