"""A spy on file opens, for tests that prove a reader never reaches a file it must not (the fuzz suite and
the hostile-checkpoint tests). Importable from tests (pyproject sets pytest's pythonpath to tests/)."""

from __future__ import annotations

import builtins
import contextlib
import io
import os
from pathlib import Path

import pytest


@contextlib.contextmanager
def opened_paths():
    """Every path opened through open / io.open / os.open inside the block, resolved."""
    seen: list[Path] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            seen.append(Path(os.fsdecode(file)).resolve())
        return real_open(file, *args, **kwargs)

    def spy_os_open(path, *args, **kwargs):
        seen.append(Path(os.fsdecode(path)).resolve())
        return real_os_open(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", spy_open)
        mp.setattr(io, "open", spy_open)
        mp.setattr(os, "open", spy_os_open)
        yield seen
