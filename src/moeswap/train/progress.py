"""What a run shows while it goes, beside the progress bar: loss.csv written a row per step as the run goes
(flushed, so a run watched by `tail -f` or killed mid-way has its curve so far), and, where no bar is shown
(stderr not a terminal: nohup, CI, a batch job; or --no-progress), one plain line every --log-interval
steps. Entry points: `LossLog`, `StepLines`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from moeswap.atomic_dir import atomic_file
from moeswap.train import manifest as record


class LossLog:
    """OUT/loss.csv during the run, in manifest.loss_csv's format (the published one replaces it at the end
    with the same rows). Opening writes the rows the history holds so far, whole and atomically: a resumed
    run's file is its checkpoint's rows, whatever an interrupted segment had appended past them."""

    def __init__(self, out_dir: Path, history: dict[str, Any]):
        self.path = Path(out_dir) / record.LOSS_CSV
        with atomic_file(self.path) as f:
            f.write(record.loss_csv(history["curve"], _evals(history)).encode())
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open across steps)

    def append(self, point: dict[str, Any], eval_loss: float | None) -> None:
        assert self._file is not None
        self._file.write(record.loss_csv_row(point, eval_loss) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _evals(history: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in history["eval"] if e["loss"] is not None]


class StepLines:
    """Plain progress lines on stderr: at the first step of a segment, every `interval` steps and at the
    last, each with step/total, loss, learning rate, tokens/s over the segment, elapsed time and ETA.
    interval 0: none."""

    def __init__(self, interval: int, total: int, first: int):
        self.interval, self.total, self.first = interval, total, first

    def due(self, step: int, end: int) -> bool:
        """Whether step `step` (1-based, just done) gets a line in a segment that stops at `end`."""
        return bool(self.interval) and (step == self.first + 1 or step % self.interval == 0 or step == end)

    def show(self, step: int, loss: float, lr: float, tokens_per_s: float, elapsed_s: float,
             eta_s: float) -> None:
        print(step_line(step, self.total, loss, lr, tokens_per_s, elapsed_s, eta_s), file=sys.stderr, flush=True)


def step_line(step: int, total: int, loss: float, lr: float, tokens_per_s: float, elapsed_s: float,
              eta_s: float) -> str:
    return (f"train step {step}/{total}: loss {loss:.4f}, lr {lr:.3e}, {tokens_per_s:.0f} tokens/s, "
            f"elapsed {duration(elapsed_s)}, eta {duration(eta_s)}")


def duration(seconds: float) -> str:
    """H:MM:SS."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
