"""Facts about this machine and its processes from Linux's /proc, for reports and manifests: resident and
peak resident memory of a process, the machine's memory and its CPU model. The one reader of /proc's
`Key:   N kB` lines."""

from __future__ import annotations

import platform
import resource


def _kib_field(path: str, key: str) -> int | None:
    """The `key:  N kB` line of a /proc file, in bytes; None where the file or the line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes(pid: int | str = "self") -> int | None:
    """A process's resident memory now (VmRSS); None when it is gone or unreadable."""
    return _kib_field(f"/proc/{pid}/status", "VmRSS")


def peak_rss_bytes() -> int:
    """This process's own high-water resident memory (VmHWM). Not ru_maxrss first: Linux carries that across
    exec, so a child spawned by a big parent (pytest holding a model) would report the parent's peak."""
    peak = _kib_field("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_total_bytes() -> int | None:
    """The machine's memory (MemTotal)."""
    return _kib_field("/proc/meminfo", "MemTotal")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
