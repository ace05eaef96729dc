"""Write a directory all at once: into a temporary sibling, renamed into place only on success.

A failed or interrupted write (init-tiny, quantize) leaves nothing half-written behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_directory(dst: Path) -> Iterator[Path]:
    """Yields a temporary directory next to `dst`; on success it becomes `dst` (which must be absent or empty)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        yield tmp
        for file in tmp.iterdir():  # mkdtemp (and safetensors) create owner-only files
            if file.is_file():
                file.chmod(0o644)
        tmp.chmod(0o755)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
