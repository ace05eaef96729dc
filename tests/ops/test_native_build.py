"""The compiled-library cache (ops/native_build.py): libraries are keyed by everything they are built from, cache
directories are made private, and a library another user could have put in place is never loaded (it is built
afresh in a private directory instead). Uses a one-function C file, so each build takes a fraction of a second;
the kernels and the expert reader build through the same function."""

import ctypes
import os
import shutil
import subprocess
import tempfile

import pytest

from moeswap.ops import cpu_kernels, native_build

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="planting another user's files needs root (chown)")
OTHER_UID = 12345


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A C file whose library answers probe() = 7, with the cache ($MOESWAP_CACHE_DIR) and the temporary
    directory (its fallback, and the private directories) inside tmp_path."""
    monkeypatch.setenv(native_build.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(native_build, "_private", [])
    path = tmp_path / "probe.c"
    path.write_text("int probe(void) { return 7; }\n")
    return path


def _probe(library) -> int:
    return ctypes.CDLL(str(library)).probe()


def _plant(path, uid: int | None = None, mode: int | None = None) -> None:
    """A working library that answers probe() = 666, at `path` (the name the cache expects)."""
    src = path.with_name("planted.c")
    src.write_text("int probe(void) { return 666; }\n")
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", str(src), "-o", str(path)], check=True)
    src.unlink()
    if uid is not None:
        os.chown(path, uid, uid)
    if mode is not None:
        os.chmod(path, mode)


def _build(source):
    return native_build.build("probe", [source], flags=())


def _private(path) -> bool:
    st = os.stat(path)
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def test_a_fresh_cache_is_private_and_a_second_build_compiles_nothing(source, tmp_path, monkeypatch):
    out = _build(source)
    assert out.parent == tmp_path / "cache" / "kernels" and _private(out.parent) and _private(out)
    assert _probe(out) == 7
    monkeypatch.setattr(native_build, "_compile", lambda *a: pytest.fail("compiled again"))
    assert _build(source) == out


def test_the_key_covers_sources_headers_and_flags(source, tmp_path):
    header = tmp_path / "probe.h"
    header.write_text("/* one */\n")
    first = native_build.build("probe", [source], [header], flags=())
    header.write_text("/* two */\n")
    assert native_build.build("probe", [source], [header], flags=()) != first
    assert native_build.build("probe", [source], [header], flags=("-O2",)) != first
    source.write_text("int probe(void) { return 7; } /* edited */\n")
    assert native_build.build("probe", [source], [header], flags=()) != first


@needs_root
@pytest.mark.parametrize("how", ["foreign-owned", "world-writable", "under a world-writable parent"])
def test_a_library_in_an_untrusted_cache_directory_is_never_loaded(source, tmp_path, how):
    expected = _build(source)  # where the cache puts this library: the planted one takes its name
    expected.unlink()
    kernels = expected.parent
    _plant(expected)
    if how == "foreign-owned":
        os.chown(kernels, OTHER_UID, OTHER_UID)
    elif how == "world-writable":
        os.chmod(kernels, 0o777)
    else:
        os.chmod(kernels.parent, 0o777)
    with pytest.warns(RuntimeWarning, match=f"not using the kernel cache {kernels}"):
        out = _build(source)
    fallback = tmp_path / "tmp" / f"moeswap-kernels-{os.getuid()}"
    assert out == fallback / expected.name and _private(fallback)
    assert _probe(out) == 7 and _probe(expected) == 666  # the planted library is still there, never used


@needs_root
def test_a_planted_fallback_directory_leaves_a_fresh_private_one(source, tmp_path):
    """Both cache directories belong to another user (the user cache, and a $TMPDIR/moeswap-kernels-<uid>
    planted before this user made it): the library is built in this process's own mkdtemp directory."""
    expected = _build(source)
    fallback = tmp_path / "tmp" / f"moeswap-kernels-{os.getuid()}"
    for directory in (expected.parent, fallback):
        directory.mkdir(exist_ok=True)
        (directory / expected.name).unlink(missing_ok=True)
        _plant(directory / expected.name)
        os.chown(directory, OTHER_UID, OTHER_UID)
    with pytest.warns(RuntimeWarning, match="belongs to uid 12345"):
        out = _build(source)
    assert out.parent == native_build._private[0] and out.parent.parent == tmp_path / "tmp"
    assert out.parent not in (expected.parent, fallback) and _private(out.parent)
    assert _probe(out) == 7


@pytest.mark.parametrize("how", ["foreign-owned", "group-writable", "a link"])
def test_an_untrusted_library_in_a_trusted_directory_is_rebuilt_privately(source, how, monkeypatch):
    if how == "foreign-owned" and os.geteuid() != 0:
        pytest.skip("planting another user's files needs root (chown)")
    expected = _build(source)
    expected.unlink()
    if how == "a link":
        _plant(expected.with_name("elsewhere.so"))
        expected.symlink_to(expected.with_name("elsewhere.so"))
    else:
        _plant(expected, *((OTHER_UID, None) if how == "foreign-owned" else (None, 0o775)))
    with pytest.warns(RuntimeWarning, match=f"not loading the cached {expected}"):
        out = _build(source)
    assert out.parent == native_build._private[0] and _private(out.parent)
    assert _probe(out) == 7
    monkeypatch.setattr(native_build, "_compile", lambda *a: pytest.fail("compiled again"))
    with pytest.warns(RuntimeWarning, match="not loading the cached"):
        assert _build(source) == out  # then found in the private directory


def test_the_kernels_build_from_every_source_and_header_of_csrc(monkeypatch):
    calls = []
    monkeypatch.setattr(native_build, "build", lambda *args: calls.append(args) or "built")
    assert cpu_kernels.build(("-march=x86-64",)) == "built"
    name, sources, headers, flags = calls[0]
    assert name == "cpu_kernels" and flags == ("-march=x86-64",)
    assert {p.name for p in sources} == {p.name for p in cpu_kernels.CSRC.glob("*.c")} and len(sources) >= 8
    assert {p.name for p in headers} == {"cpu_kernels.h", "internal.h", "expert_read.h"}
