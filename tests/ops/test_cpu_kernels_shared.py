"""What C and Python share has one source, the headers: the weight format codes, the load-state slots and load
entries' columns, msw_job's fields and states, decode_layer's fields, the projection names and the kernel
constants. Python's view, parsed from the header text, is checked here against the compiled libraries entry by
entry and field by field, and a field or entry added on one side only is caught (a modified copy of a header
parsed, or compiled)."""

import ctypes
import re
import shutil

import pytest

from moeswap.engine import native_step
from moeswap.experts import incall, reads
from moeswap.ops import cpu_kernels, expert_mxfp4, expert_quant, kernel_abi, linear, native_build
from moeswap.ops.kernel_library import MXFP4_Q8, resident_format_code
from moeswap.planner import roofline
from moeswap.weights import format as weight_format

HEADER_TEXT = kernel_abi.HEADER.read_text()
JOB_TEXT = kernel_abi.JOB_HEADER.read_text()


def _kernel():
    kernel = cpu_kernels.kernel()
    if kernel is None:
        pytest.skip(f"the kernel does not build here: {cpu_kernels.build_error()}")
    return kernel


def _reader():
    lib = reads.native_library()
    if lib is None:
        pytest.skip("the native reader does not build here")
    return ctypes.PyDLL(native_build.build("native_reads", [reads.SOURCE], [reads.HEADER], flags=()).as_posix())


def _compiled_rows(struct: type[ctypes.Structure]) -> list[tuple[str, int, int]]:
    return [(name, getattr(struct, name).offset, getattr(struct, name).size) for name, _ in struct._fields_]


def test_every_shared_list_entry_is_the_librarys():
    """Each format code, load_state slot, victim and log column and log kind: name and value as the library
    was compiled equal the header's as Python parsed it, in order."""
    kernel = _kernel()
    lists = kernel_abi.abi().lists
    assert set(lists) == {"FORMATS", "ACTIVATIONS", "LOAD_STATE", "LOAD_VICTIM", "LOAD_LOG", "LOAD_KINDS"}
    assert cpu_kernels.ACTS == {"silu": 0, "situ": 1}
    for name, entries in lists.items():
        assert kernel._list(name) == list(entries.items()), name
    assert lists["FORMATS"] == {"MXFP4": 0, "BF16": 1, "MXFP4_Q8": 2, "FP8": 3, "INT4": 4, "INT8": 5}
    assert len(lists["LOAD_STATE"]) == 21 and len(incall.LS.__dict__) == 21
    assert kernel._list("NO_SUCH_LIST") == []


def test_python_names_come_from_the_header():
    lists = kernel_abi.abi().lists
    assert cpu_kernels.FORMAT_CODES == {k.lower(): v for k, v in lists["FORMATS"].items() if k != "MXFP4_Q8"}
    assert MXFP4_Q8 == lists["FORMATS"]["MXFP4_Q8"]
    for kind, code in cpu_kernels.FORMAT_CODES.items():
        assert resident_format_code(kind, False) == code
    assert resident_format_code("mxfp4", True) == MXFP4_Q8 and resident_format_code("bf16", True) == 1
    assert resident_format_code(None, False) == lists["FORMATS"]["MXFP4"]
    assert vars(incall.LS) == lists["LOAD_STATE"]
    assert (incall.VICTIM_ENTRY, incall.LOG_ENTRY) == (len(lists["LOAD_VICTIM"]), len(lists["LOAD_LOG"]))
    assert vars(incall.KIND) == lists["LOAD_KINDS"] and vars(incall.LOG) == lists["LOAD_LOG"]
    assert (reads._DONE, reads._CANCELLED) == (kernel_abi.job_abi().states["DONE"],
                                               kernel_abi.job_abi().states["CANCELLED"])


def test_no_literal_format_or_activation_code_is_left():
    """The C files name formats and activations through the header's lists, never by number."""
    for path in sorted(kernel_abi.CSRC.glob("*.c")):
        code = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
        assert not re.search(r"\bformat\s*[=!<>]=?\s*\d", code), path.name
        assert not re.search(r"moeswap_(quant_linear|quant_moe|moe_resident|latent_moe_resident)\(\s*\d", code), \
            path.name
        assert not re.search(r"enum\s*\{[^}]*\bMXFP4\s*=", code), path.name
        assert not re.search(r"\bact\s*(==|!=|>=?)\s*\d", code), path.name  # nor activations


def test_msw_job_is_the_reader_librarys_field_by_field():
    """ReadJob's fields (built from MSW_JOB_FIELDS) against the reader library's own table: name, offset,
    size and type of each, the size, and the job states."""
    lib = _reader()
    fields, size, states = reads.compiled_job(lib)
    assert [(n, o, s) for n, o, s, _ in fields] == _compiled_rows(reads.ReadJob)
    assert [kernel_abi.ctype_of(t) for *_, t in fields] == [t for _, t in reads.ReadJob._fields_]
    assert size == ctypes.sizeof(reads.ReadJob) and reads.layout_problem(lib) is None
    assert states == list(kernel_abi.job_abi().states.items())
    assert [n for n, *_ in fields] == ["fd", "offset", "nbytes", "dst", "drop", "state", "error", "nchecks",
                                       "check_off", "check_len", "check_max", "bad", "direct_fd1", "align", "head",
                                       "tail", "direct", "spare", "t0_ns", "t1_ns", "next"]
    assert reads._CHECKS == 4 and reads.ReadJob.check_off.size == 4 * 8


def test_decode_layer_is_the_kernels_field_by_field():
    kernel = _kernel()
    assert [(n, o, s) for n, o, s, _ in kernel.layer_layout] == _compiled_rows(native_step._Layer)
    assert kernel.layout_problem(native_step._Layer) is None


def _struct(fields):
    return type("Mirror", (ctypes.Structure,), {"_fields_": fields})


def _edited(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


def test_a_field_added_to_a_python_side_header_copy_is_named():
    """Python parsing a header that has a field the library lacks (or lacks one it has) finds the field."""
    kernel = _kernel()
    grown = kernel_abi.parse_header(_edited(HEADER_TEXT, "FIELD(int64_t, stop, )",
                                            "FIELD(int64_t, stop, ) FIELD(int64_t, extra, )"))
    assert "extra" in kernel.layout_problem(_struct(grown.layer_fields))
    shrunk = kernel_abi.parse_header(_edited(HEADER_TEXT, "FIELD(int64_t, stop, )", ""))
    assert "stop" in kernel.layout_problem(_struct(shrunk.layer_fields))
    lib = _reader()
    fields, size, states = reads.compiled_job(lib)
    job = kernel_abi.parse_job_header(_edited(JOB_TEXT, "FIELD(int32_t, bad, )",
                                              "FIELD(int32_t, bad, ) FIELD(int32_t, extra, )"))
    problem = kernel_abi.struct_problem("msw_job", fields, size, _struct(job.fields))
    assert problem is not None and "extra" in problem
    moved = kernel_abi.parse_job_header(_edited(JOB_TEXT, "FIELD(int32_t, drop, )", "FIELD(int64_t, drop, )"))
    assert "drop" in kernel_abi.struct_problem("msw_job", fields, size, _struct(moved.fields))
    job = kernel_abi.parse_job_header(_edited(JOB_TEXT, "STATE(CANCELLED)", "STATE(CANCELLED) STATE(LOST)"))
    assert "LOST" in kernel_abi.list_problem("MSW_JOB_STATES", job.states, states)


@pytest.mark.parametrize("old, new, name", [
    ("FORMAT(INT8, 5)", "FORMAT(INT8, 5) FORMAT(INT2, 6)", "INT2"),
    ("FORMAT(FP8, 3)", "FORMAT(FP8, 6)", "FP8"),
    ("SLOT(CORRECT)", "SLOT(CORRECT) SLOT(SPARE)", "SPARE"),
    ("SLOT(ROOM) SLOT(FREE)", "SLOT(FREE) SLOT(ROOM)", "FREE"),
    ("COLUMN(COST) COLUMN(STATE) COLUMN(BUFFER)", "COLUMN(COST) COLUMN(STATE)", "BUFFER"),
    ("KIND(AHEAD_BAD)", "", "AHEAD_BAD"),
])
def test_a_list_entry_on_one_side_only_is_named(old, new, name):
    kernel = _kernel()
    lists = kernel_abi.parse_header(_edited(HEADER_TEXT, old, new)).lists
    problems = [kernel_abi.list_problem(n, entries, kernel._list(n)) for n, entries in lists.items()]
    problems = [p for p in problems if p is not None]
    assert len(problems) == 1 and name in problems[0]


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_a_field_added_to_the_c_side_only_is_named(tmp_path):
    """The reader library compiled from a copy of expert_read.h with one more field, against the ctypes mirror
    Python builds from the real header: the check names the field."""
    (tmp_path / "experts").mkdir()
    (tmp_path / "ops" / "csrc").mkdir(parents=True)
    source = tmp_path / "experts" / "native_reads.c"
    header = tmp_path / "ops" / "csrc" / "expert_read.h"
    source.write_text(reads.SOURCE.read_text())
    header.write_text(_edited(JOB_TEXT, "FIELD(int32_t, nchecks, )",
                              "FIELD(int32_t, nchecks, ) FIELD(int64_t, added, )"))
    lib = ctypes.PyDLL(str(native_build.build("native_reads_test", [source], [header], flags=())))
    problem = reads.layout_problem(lib)
    assert problem is not None and "added" in problem
    assert reads.layout_problem(_reader()) is None


def test_constants_have_one_source():
    c = kernel_abi.abi().constants
    assert c == {"TABLE_ROW": 6, "DENSE_KERNEL_MAX_ROWS": 32, "EXPERT_GEMM_MIN_ROWS": 32, "ROW_CHUNK_BYTES": 1 << 20}
    assert dict(kernel_abi.abi().layer_fields)["load_row"] == ctypes.c_int64 * c["TABLE_ROW"]
    assert linear.KERNEL_MAX_ROWS == roofline.NATIVE_MAX_TOKENS == c["DENSE_KERNEL_MAX_ROWS"]
    assert expert_mxfp4.GEMM_MIN_TOKENS == c["EXPERT_GEMM_MIN_ROWS"]
    assert (weight_format.ROW_CHUNK_BYTES == expert_mxfp4.ROW_CHUNK_BYTES == expert_quant.ROW_CHUNK_BYTES
            == c["ROW_CHUNK_BYTES"])
    from moeswap.lora.targets import EXPERT_PROJECTIONS
    from moeswap.models.layers.expert_lora import PROJS

    assert weight_format.PROJS == PROJS == EXPERT_PROJECTIONS == kernel_abi.EXPERT_PROJS == ("w1", "w2", "w3")
    assert kernel_abi.KERNEL_PROJS == ("w1", "w3", "w2")


@pytest.mark.parametrize("old, new, message", [
    ("#define MOESWAP_ROW_CHUNK_BYTES (1 << 20)", "#define MOESWAP_ROW_CHUNK_BYTES 1 MB", "expected an integer"),
    ("PROJ(w3, up)", "PROJ(w3, side)", "roles"),
    ("FORMAT(FP8, 3)", "FORMAT(FP8, 1)", "share a code"),
    ("SLOT(KEEP)", "SLOT(KEEP) SLOT(ROOM)", "ROOM is listed twice"),
    ("#define MOESWAP_LOAD_KINDS(KIND)", "#define MOESWAP_LOAD_SORTS(KIND)", "no #define MOESWAP_LOAD_KINDS"),
])
def test_the_parser_refuses_bad_shared_lists(old, new, message):
    with pytest.raises(ValueError, match=message):
        kernel_abi.parse_header(_edited(HEADER_TEXT, old, new))
