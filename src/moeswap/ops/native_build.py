"""native_build: compiles moeswap's C sources into shared libraries at first use and caches them, for
ops/cpu_kernels.py (csrc/) and experts/reads.py (native_reads.c). Entry point: `build(name, sources, ...)`.

A library is keyed by the bytes of its sources and headers, the compiler, the flags and the CPU, and kept in
$MOESWAP_CACHE_DIR/kernels, else $XDG_CACHE_HOME (or ~/.cache)/moeswap/kernels, else $TMPDIR/moeswap-kernels-<uid>;
a cached one is loaded only where no other user can have put it, else it is built in a private directory.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Sequence

ENV_CACHE = "MOESWAP_CACHE_DIR"
BASE_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-pthread")

_lock = threading.Lock()
_private: list[Path] = []  # this process's fresh directory, once one was needed


def build(name: str, sources: Sequence[Path], headers: Sequence[Path] = (), flags: tuple[str, ...] | None = None
          ) -> Path:
    """Compile `sources` (which include `headers`) into one library `name`, or find it cached, and return its
    path. Default flags: this CPU's instruction set (-march=native, else -mcpu=native, else none), with
    OpenMP when the compiler has it (without, the kernels run on one thread)."""
    sources, headers = [Path(p) for p in sources], [Path(p) for p in headers]
    if not sources:
        raise RuntimeError(f"no C sources for {name} in this installation")
    for path in (*sources, *headers):
        if not path.is_file():
            raise RuntimeError(f"{path} is missing from this installation")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    candidates = [tuple(flags)] if flags is not None else [("-march=native",), ("-mcpu=native",), ()]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as err:
        raise RuntimeError(f"cannot run the C compiler {compiler!r}: {err}") from None
    out = cache_dir() / f"{name}-{_key(name, [*sources, *headers], compiler, version, candidates)}.so"
    if os.path.lexists(out):
        problem = _untrusted(out)
        if problem is None:
            return out
        warnings.warn(f"moeswap: not loading the cached {out}: {problem}; building it in a private directory",
                      RuntimeWarning, stacklevel=2)
        out = private_dir() / out.name
        if os.path.lexists(out) and _untrusted(out) is None:
            return out
    return _compile(compiler, candidates, sources, out)


def _compile(compiler: str, candidates: list[tuple[str, ...]], sources: list[Path], out: Path) -> Path:
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.{threading.get_ident()}.tmp.so")
    errors = []
    for candidate in candidates:
        for openmp in (["-fopenmp"], []):
            command = [compiler, *BASE_FLAGS, *candidate, *openmp, *map(str, sources), "-lm", "-o", str(tmp)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                os.chmod(tmp, 0o700)  # whatever the umask: a group-writable file would not be trusted later
                os.replace(tmp, out)  # atomic: concurrent builders all end with a whole file
                return out
            errors.append(result.stderr.strip()[-2000:])
    tmp.unlink(missing_ok=True)
    raise RuntimeError(f"compiling {', '.join(p.name for p in sources)} with {compiler} failed: {errors[0]}")


def _key(name: str, files: list[Path], compiler: str, version: str, candidates: list[tuple[str, ...]]) -> str:
    """16 hex digits of a hash of everything the library's bytes depend on (each part length-prefixed)."""
    h = hashlib.sha256()

    def part(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    for text in (name, compiler, version, repr(BASE_FLAGS), repr(candidates), _cpu_id()):
        part(text.encode())
    for path in files:
        part(path.name.encode())
        part(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """The first of the cache directories (module docstring) that exists or can be made (mode 0700), is
    trusted and takes files; else this process's private directory."""
    root = os.environ.get(ENV_CACHE) or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "moeswap")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    for path in (Path(root).expanduser() / "kernels", Path(tempfile.gettempdir()) / f"moeswap-kernels-{uid}"):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        problem = _untrusted(path)
        if problem is not None:
            warnings.warn(f"moeswap: not using the kernel cache {path}: {problem}", RuntimeWarning, stacklevel=3)
            continue
        try:
            tempfile.NamedTemporaryFile(dir=path, delete=True).close()
        except OSError:
            continue  # read-only: the next one
        return path
    return private_dir()


def private_dir() -> Path:
    """A directory of this process's own (tempfile.mkdtemp: mode 0700), removed at exit."""
    with _lock:
        if not _private:
            path = Path(tempfile.mkdtemp(prefix="moeswap-kernels-"))
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            _private.append(path)
        return _private[0]


def _untrusted(path: Path) -> str | None:
    """Why `path` (a cached library or its directory) may hold another user's bytes, or None: it must be this
    user's own regular file (not a link) or directory, not writable by group or others, and each directory
    above it must be this user's or root's and writable by no one else, or sticky (as /tmp is)."""
    if not hasattr(os, "getuid"):
        return None  # no POSIX owners to check (Windows)
    uid = os.getuid()
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"cannot stat it ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "it is not a regular file or directory"
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"group or others may write to it (mode {stat.S_IMODE(st.st_mode):o})"
    for parent in path.resolve().parents:
        st = os.stat(parent)
        if st.st_uid not in (uid, 0):
            return f"{parent} belongs to uid {st.st_uid}, who could replace what is in it"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"group or others may write to {parent} (mode {stat.S_IMODE(st.st_mode):o}) and replace it"
    return None


def _cpu_id() -> str:
    """-march=native output depends on the CPU: a shared cache must not hand one machine's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next((line for line in info.splitlines() if line.startswith("model name")), "")
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.machine() + platform.processor()
