"""Outputs written all at once, so that a destination is always complete or absent: a directory (init-tiny,
quantize) through a hidden staging sibling renamed into place, a file (trace) through a temporary sibling.
Knows nothing of what is written. Entry points: `atomic_directory(dst)`, `atomic_file(path)`,
`move_into(src, dst, last)`, `writing(path)`, `remove_stale(dst)`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO, Iterator

_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_READ_ONLY = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
              errno.EPERM: "operation not permitted"}
# What follows ".<destination name>." in a staging directory's name; the last part is mkdtemp's.
_STAGING = re.compile(r"staging-([0-9a-f]{8})-(\d+)-(\d+)\.[a-z0-9_]+")


class OutOfSpaceError(OSError):
    """The disk (or the user's quota) filled up while writing; the partial output is already removed."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class UnwritableError(OSError):
    """The output's place cannot be written (a read-only file system, no permission); nothing was left there."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass(frozen=True)
class Owner:
    """The process that owns a staging directory. `host` hashes the host name and the pid namespace: a
    pid means something only where it was issued."""

    host: str
    pid: int
    start: int  # clock ticks after boot (/proc/<pid>/stat field 22); 0 where there is no /proc

    @classmethod
    def me(cls) -> Owner:
        return cls(_host(), os.getpid(), _start_time(os.getpid()) or 0)

    def token(self) -> str:
        return f"{self.host}-{self.pid}-{self.start}"

    def is_gone(self) -> bool:
        """True only when provably so: this host and pid namespace, and no process with this pid, or one
        that started at another time (the pid was reused)."""
        if self.host != _host():
            return False
        start = _start_time(self.pid)
        return start is None or (self.start != 0 and start != self.start)


@cache
def _host() -> str:
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def _start_time(pid: int) -> int | None:
    """When process `pid` started (0 where /proc is absent); None when there is no such process (a zombie
    still counts as one until its parent reaps it)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # exists, owned by someone else
            pass
        return 0
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])  # the name in (...) may hold spaces; field 22 overall


def remove_stale_in(parent: str | os.PathLike) -> list[Path]:
    """`remove_stale` for every destination in `parent` that has staging directories (a run killed while
    it wrote any of them leaves nothing that blocks the next one)."""
    try:
        names = {e.name for e in os.scandir(os.fspath(parent)) if e.name.startswith(".") and ".staging-" in e.name}
    except (FileNotFoundError, NotADirectoryError):
        return []
    dsts = {name[1:name.index(".staging-")] for name in names}
    return [path for dst in sorted(dsts) for path in remove_stale(Path(parent) / dst)]


def remove_stale(dst: str | os.PathLike) -> list[Path]:
    """Removes the staging directories of `dst` (siblings `.<name>.staging-...`) that this user owns and
    whose owner process is gone; returns them. Live writers' directories are left alone."""
    dst = Path(dst)
    prefix = f".{dst.name}."
    removed: list[Path] = []
    try:
        entries = list(os.scandir(dst.parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = _STAGING.fullmatch(entry.name[len(prefix):]) if entry.name.startswith(prefix) else None
        try:
            if m is None or not entry.is_dir(follow_symlinks=False) or \
                    entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:  # removed meanwhile
            continue
        if Owner(m[1], int(m[2]), int(m[3])).is_gone():
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


@contextmanager
def atomic_directory(dst: str | os.PathLike) -> Iterator[Path]:
    """Yields a new staging directory next to `dst`; when the block succeeds it becomes `dst`, which must
    be absent or an empty directory. If another process creates `dst` meanwhile, this one's output is
    discarded with a FileExistsError: a rename never replaces a non-empty directory.

    A failure, Ctrl-C or SIGTERM removes the staging directory; after SIGKILL or a crash the next write to
    the same destination removes the staging directories whose owner is provably gone (the owner's pid and
    start time are in the directory's name). A full disk is a user error naming the file (OutOfSpaceError).
    """
    dst = Path(dst)
    staging: list[Path] = []
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(dst)
        with _removed_on_sigterm(staging):
            tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.staging-{Owner.me().token()}.", dir=dst.parent))
            staging.append(tmp)
            try:
                yield tmp
                _seal(tmp)
                _publish(tmp, dst)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as err:
        full = _out_of_space(err, staging[0] if staging else None, dst)
        if full is None:
            raise
        raise full from None


@contextmanager
def atomic_file(path: str | os.PathLike, overwrite: bool = True) -> Iterator[BinaryIO]:
    """Yields a binary file that becomes `path` when the block succeeds (a temporary sibling, renamed).
    With overwrite=False an existing `path` is never replaced, even one created while writing."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; expected a file name")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {path.parent} does not exist")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        unwritable = _out_of_space(err, None, path)
        if unwritable is None:
            raise
        raise unwritable from None
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o644)  # mkstemp's files are owner-only
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        full = _out_of_space(err, None, path)
        if full is None:
            raise
        raise full from None


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Names `path` in a disk-full error raised inside (a failed write() does not say which file it was), and
    raises a library's own wording of a failed write (safetensors, torch.save) as the OSError it stands for."""
    try:
        yield
    except OSError as err:
        if err.errno in _FULL and not isinstance(err, OutOfSpaceError):
            err.filename = os.fspath(path)
        raise
    except Exception as err:
        mapped = _io_error(err, path)
        if mapped is err:
            raise
        raise mapped from None


def _io_error(err: BaseException, path: str | os.PathLike) -> BaseException:
    """The OSError a library's failed write stands for: safetensors names its code ("(os error 28)", or
    "IoError(Os { code: 28" in older versions); torch.save says only "unexpected pos" (a short write: the disk
    filled up). Anything else comes back as it is."""
    text = str(err)
    found = re.search(r"\(os error (\d+)\)|IoError\(Os \{ code: (\d+)", text)
    if found is not None:
        number = int(found[1] or found[2])
    elif "unexpected pos" in text:
        number = errno.ENOSPC
    else:
        return err
    return OSError(number, os.strerror(number), os.fspath(path))


def _out_of_space(err: BaseException, tmp: Path | None, dst: Path) -> OSError | None:
    """A full disk or an unwritable place as one user error naming the file, or None for anything else."""
    if isinstance(err, (OutOfSpaceError, UnwritableError)) or not isinstance(err, OSError):
        return None
    if err.errno not in _FULL and err.errno not in _READ_ONLY:
        return None
    shown = dst
    if isinstance(err.filename, str) and tmp is not None:
        try:  # a file in the staging directory is shown where it would have been
            shown = dst / Path(err.filename).relative_to(tmp)
        except ValueError:
            shown = Path(err.filename)
    if err.errno in _READ_ONLY:
        return UnwritableError(err.errno, f"cannot write {shown}: {_READ_ONLY[err.errno]}; choose another place "
                                          f"for the output (nothing was left there)")
    return OutOfSpaceError(err.errno, f"{_FULL[err.errno]} writing {shown}; free some space and run again "
                                      f"(the partial output was removed)")


@contextmanager
def _removed_on_sigterm(staging: list[Path]) -> Iterator[None]:
    """While the block runs, SIGTERM removes the staging directories and exits 143 (128 + SIGTERM). A
    process that ignores SIGTERM keeps ignoring it; one with its own handler gets it called instead (if it
    raises, the staging directory goes as on any error)."""
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if previous is None or previous == signal.SIG_IGN:  # not ours to change (None: set outside Python)
        yield
        return

    def on_term(signum, frame):
        if callable(previous):
            previous(signum, frame)
            return
        for path in staging:
            shutil.rmtree(path, ignore_errors=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def move_into(src: str | os.PathLike, dst: str | os.PathLike, last: str | None = None) -> list[str]:
    """Moves the files of directory `src` (one written by atomic_directory: complete and synced) into the
    existing directory `dst`, each by one rename that replaces a file of that name, the file named `last`
    after all others; then removes `src`. A reader who finds `last` in `dst` finds the whole set (a crash
    in between leaves some files moved and `last` absent). Returns the names moved, in order."""
    src, dst = Path(src), Path(dst)
    names = sorted((p.name for p in src.iterdir()), key=lambda n: (n == last, n))
    for name in names:
        if name == last:
            _fsync_dir(dst)  # the others' names are durable before the marker's
        os.replace(src / name, dst / name)
    src.rmdir()
    _fsync_dir(dst)
    return names


def _seal(tmp: Path) -> None:
    """Makes the staging directory readable like any output and durable before the rename: without the
    fsyncs a power cut could publish the name before the data."""
    for file in tmp.iterdir():  # mkdtemp (and safetensors) create owner-only files
        if file.is_file():
            file.chmod(0o644)
    tmp.chmod(0o755)
    for root, _, files in os.walk(tmp):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _publish(tmp: Path, dst: Path) -> None:
    try:
        os.rename(tmp, dst)  # atomic; replaces an empty directory, never a non-empty one or a file
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise FileExistsError(f"{dst} was created by another process while this one was writing; it is left "
                                  f"as that process wrote it and this output was discarded") from None
        raise
    _fsync_dir(dst.parent)


def _link_new(tmp: Path, path: Path) -> None:
    """Renames `tmp` to `path` unless `path` exists (a hard link fails where rename would replace)."""
    message = f"{path} already exists (created while this file was being written); not overwriting it"
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(message) from None
    except OSError as err:  # a filesystem without hard links: check, then rename
        if err.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        if path.exists() or path.is_symlink():
            raise FileExistsError(message) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not fsync directories; the data is synced already
        pass
    finally:
        os.close(fd)
