"""Training data: JSONL lines -> token samples with loss masks -> rows -> batches. Order and eval split come
from the seed alone. Torch-free except `batch`. Entry points: `load_data(cfg, tok)`, `RowStream`, `batch`.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IGNORE = -100  # label of a position without a target (torch cross_entropy's default ignore_index)


class DataError(ValueError):
    """A data file or line moeswap cannot train on."""


@dataclass(frozen=True)
class Sample:
    ids: tuple[int, ...]
    mask: tuple[bool, ...]  # mask[t]: token t is a target, predicted from the tokens before it
    where: str  # file:line

    @property
    def targets(self) -> int:
        return sum(self.mask)


@dataclass
class FileInfo:
    path: str
    sha256: str
    lines: int = 0  # non-blank lines
    samples: int = 0
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of lines left out
    formats: dict[str, int] = field(default_factory=lambda: {"text": 0, "chat": 0})
    truncated: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "lines": self.lines, "samples": self.samples,
                "skipped": len(self.skipped), "skipped_first": self.skipped[:5], "formats": dict(self.formats),
                "truncated": self.truncated}


@dataclass
class Data:
    train: list[Sample]
    eval: list[Sample]
    files: list[FileInfo]
    eval_from: str  # "file", "split" or "none"

    def summary(self) -> dict[str, Any]:
        """What the manifest records about the data."""
        return {"files": [f.as_dict() for f in self.files], "eval_from": self.eval_from,
                "train_samples": len(self.train), "eval_samples": len(self.eval),
                "train_tokens": sum(len(s.ids) for s in self.train),
                "train_target_tokens": sum(s.targets for s in self.train),
                "eval_target_tokens": sum(s.targets for s in self.eval)}


# ----------------------------------------------------------------------------------------------------
# Encoding one line


class Encoder:
    """Samples from records with one tokenizer (text.tokenizer.Tokenizer)."""

    def __init__(self, tok, seq_len: int, truncate: bool):
        if not tok.eos_ids:
            raise DataError("the tokenizer has no end-of-sequence token (eos_token in tokenizer_config.json or "
                            "eos_token_id in config.json); text samples end with it")
        self.tok, self.eos, self.seq_len, self.truncate = tok, tok.eos_ids[0], seq_len, truncate

    def encode(self, record: Any) -> tuple[str, list[int], list[bool]]:
        """(format, ids, mask) of one JSONL record; DataError says what is wrong with it."""
        if not isinstance(record, dict):
            raise DataError(f"expected a JSON object, found {type(record).__name__}")
        has_text, has_messages = "text" in record, "messages" in record
        if has_text == has_messages:
            raise DataError("expected exactly one of \"text\" or \"messages\"" + (", found both" if has_text else ""))
        if has_text:
            text = record["text"]
            if not isinstance(text, str) or not text:
                raise DataError(f"\"text\" must be a non-empty string, found {text!r:.60}")
            ids = self.tok.encode(text) + [self.eos]
            return "text", ids, [False] + [True] * (len(ids) - 1)
        ids, mask = self.chat(record["messages"], record.get("tools"))
        return "chat", ids, mask

    def chat(self, messages: Any, tools: Any = None) -> tuple[list[int], list[bool]]:
        """The conversation's ids and a mask that is True on the assistant turns' tokens."""
        if not isinstance(messages, list) or not messages:
            raise DataError("\"messages\" must be a non-empty list of messages")
        if not all(isinstance(m, dict) for m in messages):
            raise DataError("every message must be an object with \"role\" and \"content\"")
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise DataError("no assistant message: nothing to train on")
        encode = lambda msgs, gen: self.tok.encode_chat(msgs, gen, tools=tools)  # noqa: E731
        try:
            full = encode(messages, False)
            mask = [False] * len(full)
            for i in turns:
                upto = encode(messages[:i + 1], False)
                if full[:len(upto)] != upto:
                    raise DataError(f"the chat template renders messages[{i}] differently once later messages "
                                    "follow it, so its tokens cannot be found in the conversation; split the "
                                    "conversation into one sample per assistant turn")
                start = _common_prefix(encode(messages[:i], True), upto)
                mask[start:len(upto)] = [True] * (len(upto) - start)
        except ValueError as e:  # the template's own errors (ChatTemplateError) and bad contents
            if isinstance(e, DataError):
                raise
            raise DataError(str(e)) from None
        return full, mask


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------------------------------
# Files


def read_file(path: str, encoder: Encoder, on_bad_line: str) -> tuple[list[Sample], FileInfo]:
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{p} is a directory; expected a JSONL file")
    if p.exists() and not p.is_file():  # a FIFO or device would block or never end
        raise DataError(f"{p} is not a regular file; expected a JSONL file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: no such data file") from None
    except OSError as e:
        raise DataError(f"{p}: cannot read it ({e.strerror or e})") from None
    info = FileInfo(str(p), hashlib.sha256(raw).hexdigest())
    samples: list[Sample] = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        info.lines += 1
        where = f"{p}:{n}"
        try:
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise DataError(f"not valid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise DataError("not a sample (JSON nested too deeply)") from None
            except ValueError as e:  # an integer of more digits than Python converts
                raise DataError(f"not valid JSON ({e})") from None
            kind, ids, mask = encoder.encode(record)
        except DataError as e:
            if on_bad_line == "stop":
                raise DataError(f"{where}: {e} (--on-bad-line skip leaves such lines out)") from None
            info.skipped.append(f"{where}: {e}")
            continue
        cut = len(ids) > encoder.seq_len
        if cut:
            if not encoder.truncate:
                raise DataError(f"{where}: the sample is {len(ids)} tokens, longer than --seq-len "
                                f"{encoder.seq_len}; raise --seq-len, shorten it, or pass --truncate")
            ids, mask = ids[:encoder.seq_len], mask[:encoder.seq_len]
            info.truncated += 1
        mask[0] = False  # nothing before it within the sample to predict it from
        if not any(mask):
            info.skipped.append(f"{where}: no target tokens" + (" within --seq-len" if cut else ""))
            continue
        info.formats[kind] += 1
        samples.append(Sample(tuple(ids), tuple(mask), where))
    info.samples = len(samples)
    if not samples:
        raise DataError(f"{p}: no usable samples ({info.lines} lines, {len(info.skipped)} skipped"
                        + (f"; first: {info.skipped[0]}" if info.skipped else "") + ")")
    return samples, info


def load_data(cfg, tok) -> Data:
    """The training and eval samples of a TrainConfig, with what the manifest says about them.

    A line is `{"text": ...}` (tokens + EOS, every token but the first a target) or `{"messages": [...]}`
    (optionally with "tools"), rendered with the model's chat template (text/tokenizer.py, the same ids
    inference sees) and trained on the assistant turns only: each assistant turn's tokens are the ones its
    rendering adds after the conversation so far plus the generation prompt, found by diffing token ids.
    """
    encoder = Encoder(tok, cfg.seq_len, cfg.truncate)
    train, info = read_file(cfg.train_data, encoder, cfg.on_bad_line)
    files = [info]
    if cfg.eval_data is not None:
        held, eval_info = read_file(cfg.eval_data, encoder, cfg.on_bad_line)
        files.append(eval_info)
        return Data(train, held, files, "file")
    if cfg.eval_split == 0:
        return Data(train, [], files, "none")
    n_eval = max(1, round(len(train) * cfg.eval_split))
    if n_eval >= len(train):
        raise DataError(f"--eval-split {cfg.eval_split} of {len(train)} samples leaves none to train on")
    chosen = set(random.Random(f"moeswap-eval-split:{cfg.seed}").sample(range(len(train)), n_eval))
    return (Data([s for i, s in enumerate(train) if i not in chosen], [s for i, s in enumerate(train) if i in chosen],
                 files, "split"))


# ----------------------------------------------------------------------------------------------------
# Rows and batches


Row = tuple[tuple[int, ...], tuple[bool, ...]]


def pack(samples: Sequence[Sample], seq_len: int) -> list[Row]:
    """Samples concatenated in order into rows of at most seq_len tokens; a sample never straddles two
    rows (it starts a new one when it does not fit), and its first token is never a target."""
    rows: list[Row] = []
    ids: list[int] = []
    mask: list[bool] = []
    for s in samples:
        if ids and len(ids) + len(s.ids) > seq_len:
            rows.append((tuple(ids), tuple(mask)))
            ids, mask = [], []
        ids += s.ids
        mask += s.mask  # s.mask[0] is False: the join is never a target
    if ids:
        rows.append((tuple(ids), tuple(mask)))
    return rows


class RowStream:
    """The training rows of all epochs as one sequence: epoch e is the samples in the order
    random.Random(seed, e) shuffles them, as rows (one per sample, or packed). A run's position in its
    data is one number, the rows consumed so far.

    Rows: one sample per row (packing "off", the default; a batch is right-padded, which a causal model
    cannot see), or samples concatenated into rows of seq_len (packing "concat": the loss is masked where a
    sample starts, but attention and the KDA state run across the join).
    """

    def __init__(self, samples: Sequence[Sample], seed: int, seq_len: int, packing: str):
        self.samples, self.seed, self.seq_len, self.packing = list(samples), seed, seq_len, packing
        self._epochs: dict[int, list[Row]] = {}

    def epoch(self, e: int) -> list[Row]:
        rows = self._epochs.get(e)
        if rows is None:
            order = list(range(len(self.samples)))
            random.Random(f"moeswap-order:{self.seed}:{e}").shuffle(order)
            ordered = [self.samples[i] for i in order]
            rows = pack(ordered, self.seq_len) if self.packing == "concat" else [(s.ids, s.mask) for s in ordered]
            self._epochs = {e: rows}  # one epoch at a time is all a run reads
        return rows

    def rows(self, start: int, n: int) -> list[Row]:
        """Rows start .. start+n-1 of the stream."""
        out: list[Row] = []
        e, k = 0, start
        while len(out) < n:
            rows = self.epoch(e)
            if k >= len(rows):
                k -= len(rows)
                e += 1
                continue
            take = rows[k:k + n - len(out)]
            out += take
            k += len(take)
        return out

    def total_rows(self, epochs: float) -> int:
        """Rows in `epochs` passes (the last one possibly partial)."""
        whole, frac = int(epochs), epochs - int(epochs)
        total = sum(len(self.epoch(e)) for e in range(whole))
        if frac:
            total += math.ceil(frac * len(self.epoch(whole)))
        return total


def eval_rows(samples: Sequence[Sample]) -> list[Row]:
    return [(s.ids, s.mask) for s in samples]


def batch(rows: Sequence[Row], pad_id: int):
    """(tokens [B, T] int64, labels [B, T] int64) for rows right-padded to the longest: labels[b, t] is
    the token t+1 where it is a target, else IGNORE."""
    import torch

    T = max(len(ids) for ids, _ in rows)
    tokens = torch.full((len(rows), T), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.int64)
    for b, (ids, mask) in enumerate(rows):
        tokens[b, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        targets = torch.tensor(ids[1:], dtype=torch.int64)
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        labels[b, :len(ids) - 1] = torch.where(keep, targets, IGNORE)
    return tokens, labels
