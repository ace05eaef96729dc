"""atomic_dir: a destination is complete or absent whatever happens while it is written (an error, a
full disk, SIGTERM, SIGKILL then another run, a second writer), and staging directories of live writers
are never touched."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeswap.atomic_dir import (
    OutOfSpaceError,
    Owner,
    UnwritableError,
    atomic_directory,
    atomic_file,
    remove_stale,
    writing,
)
from moeswap.cli import USER_ERRORS


def staging_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_success_publishes_everything_at_once(tmp_path):
    dst = tmp_path / "out"
    with atomic_directory(dst) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.staging-") and not dst.exists()
        (tmp / "a.bin").write_bytes(b"x" * 100)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (dst / "a.bin").read_bytes() == b"x" * 100 and (dst / "sub" / "b").read_text() == "y"
    assert (dst / "a.bin").stat().st_mode & 0o777 == 0o644 and dst.stat().st_mode & 0o777 == 0o755


def test_an_existing_empty_directory_is_replaced(tmp_path):
    (tmp_path / "out").mkdir()
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "f").write_text("new")
    assert (tmp_path / "out" / "f").read_text() == "new" and staging_dirs(tmp_path) == []


def test_an_error_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "f").write_text("half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_destination_created_meanwhile_is_kept_and_this_output_discarded(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(FileExistsError, match=f"{dst} was created by another process while this one was writing"):
        with atomic_directory(dst) as tmp:
            (tmp / "mine").write_text("loser")
            dst.mkdir()  # the other writer renamed its complete output into place first
            (dst / "theirs").write_text("winner")
    assert [p.name for p in dst.iterdir()] == ["theirs"] and staging_dirs(tmp_path) == []
    assert issubclass(FileExistsError, USER_ERRORS)


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left on device"),
                                         (errno.EDQUOT, "disk quota exceeded")])
def test_a_full_disk_is_a_user_error_naming_the_file(tmp_path, code, words):
    dst = tmp_path / "out"
    with pytest.raises(OutOfSpaceError) as info:
        with atomic_directory(dst) as tmp:
            with writing(tmp / "model-00002-of-00003.safetensors"):
                raise OSError(code, os.strerror(code))  # what a failed write() raises: no file name
    assert str(info.value) == (f"{words} writing {dst / 'model-00002-of-00003.safetensors'}; free some space and "
                               f"run again (the partial output was removed)")
    assert info.value.errno == code and isinstance(info.value, USER_ERRORS)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutOfSpaceError, match=f"no space left on device writing {dst};"):
        with atomic_directory(dst):
            raise OSError(errno.ENOSPC, "No space left on device")  # no file known: the destination is named
    with pytest.raises(UnwritableError, match=f"cannot write {dst}: permission denied; choose another place"):
        with atomic_directory(dst):
            raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(OSError, match="Input/output error") as info:  # other OS errors pass through unchanged
        with atomic_directory(dst):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    assert type(info.value) is OSError


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: no process has this pid now (it may be reused much later, with another start time)
    return child.pid


def test_remove_stale_removes_only_provably_dead_owners(tmp_path):
    me = Owner.me()
    dead = Owner(me.host, _dead_pid(), me.start)
    reused = Owner(me.host, me.pid, me.start + 1)  # our pid, but issued to a process that started earlier
    foreign = Owner("0" * 8 if me.host != "0" * 8 else "1" * 8, _dead_pid(), 1)  # another host or pid namespace
    names = {f".out.staging-{o.token()}.abcd1234": o for o in (me, dead, reused, foreign)}
    names[".out.abcd1234"] = None  # an old-style or foreign name: no owner to prove anything about
    names[".other.staging-" + dead.token() + ".abcd1234"] = None  # another destination's
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard").write_bytes(b"0" * 10)
    removed = remove_stale(tmp_path / "out")
    gone = {f".out.staging-{dead.token()}.abcd1234", f".out.staging-{reused.token()}.abcd1234"}
    assert {p.name for p in removed} == gone
    assert set(staging_dirs(tmp_path)) == set(names) - gone
    assert remove_stale(tmp_path / "missing" / "out") == []


def test_sigterm_handler_is_restored_and_an_ignored_sigterm_stays_ignored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with atomic_directory(tmp_path / "a"):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with atomic_directory(tmp_path / "b"):
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_atomic_file(tmp_path):
    path = tmp_path / "trace.bin"
    with atomic_file(path, overwrite=False) as f:
        f.write(b"first")
    assert path.read_bytes() == b"first" and path.stat().st_mode & 0o777 == 0o644
    with pytest.raises(FileExistsError, match="trace.bin already exists"):
        with atomic_file(path, overwrite=False) as f:
            f.write(b"second")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as f:
            f.write(b"half")
            raise RuntimeError
    assert path.read_bytes() == b"first"
    with atomic_file(path) as f:
        f.write(b"third")
    assert path.read_bytes() == b"third" and [p.name for p in tmp_path.iterdir()] == ["trace.bin"]
    with pytest.raises(IsADirectoryError, match="is a directory"):
        with atomic_file(tmp_path):
            pass
    with pytest.raises(FileNotFoundError, match="does not exist"):
        with atomic_file(tmp_path / "no" / "t.bin"):
            pass


# -- init-tiny killed in a process ---------------------------------------------------------------------


def _start(*argv: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "moeswap", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_for_staging(parent: Path, proc: subprocess.Popen, timeout: float = 120) -> str:
    """The staging directory's name, once it holds a file (the process is writing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in parent.iterdir() if parent.exists() else ():
            if p.name.startswith(".") and any(p.iterdir()):
                return p.name
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    raise AssertionError("no staging directory appeared")


def test_init_tiny_sigterm_leaves_nothing(tmp_path):
    parent = tmp_path / "w"
    proc = _start("init-tiny", str(parent / "m"), "--size", "small")
    wait_for_staging(parent, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert list(parent.iterdir()) == []


def test_init_tiny_sigkill_then_a_second_run(tmp_path, tiny_k3_dir):
    parent = tmp_path / "w"
    proc = _start("init-tiny", str(parent / "m"), "--size", "small")
    stale = wait_for_staging(parent, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert staging_dirs(parent) == [stale] and not (parent / "m").exists()  # SIGKILL cannot clean up

    from moeswap.tiny import write_tiny_model

    write_tiny_model(parent / "m", "kimi_k3", "tiny", 0)
    assert sorted(p.name for p in parent.iterdir()) == ["m"]  # the dead run's staging directory is gone
    for file in tiny_k3_dir.iterdir():  # complete: the same bytes as any other run with this seed
        assert (parent / "m" / file.name).read_bytes() == file.read_bytes(), file.name
