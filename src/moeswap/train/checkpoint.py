"""Training checkpoints: everything a run needs to continue as if it had never stopped.

OUT/checkpoints/step-00000040/ holds params.safetensors (the trainable parameters by name),
optimizer.pt (AdamW's state and the torch RNG states; read back with weights_only) and state.json (step,
rows consumed, Python's RNG state, the loss history, the resolved config, the data and base fingerprints,
and the SHA-256 of the two binary files). Each is written into a staging directory renamed into place
(atomic_dir), so a checkpoint is complete or absent; one damaged afterwards is refused with a clear error.
Entry points: `save_checkpoint`, `latest_checkpoint`, `load_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory, writing
from moeswap.formats.files import confined, show

FORMAT = 1
CHECKPOINTS = "checkpoints"
PARAMS, OPTIMIZER, STATE = "params.safetensors", "optimizer.pt", "state.json"
_NAME = re.compile(r"step-(\d{8})")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from."""


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss]}


def _torch_rng() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def save_checkpoint(out_dir: Path, step: int, params: list[tuple[str, torch.nn.Parameter]], optimizer,
                    state: dict[str, Any], keep: int) -> Path:
    """Writes checkpoint `step` (atomically) and removes all but the newest `keep`."""
    from safetensors.torch import save_file

    dst = checkpoint_dir(out_dir, step)
    with atomic_directory(dst) as tmp:
        with writing(tmp / PARAMS):
            save_file({name: p.detach().contiguous() for name, p in params}, str(tmp / PARAMS))
        with writing(tmp / OPTIMIZER):
            torch.save({"optimizer": optimizer.state_dict(), "torch_rng": _torch_rng()}, tmp / OPTIMIZER)
        files = {name: file_sha256(tmp / name) for name in (PARAMS, OPTIMIZER)}
        record = {"format": FORMAT, "step": step, **state, "rng": rng_state(), "files": files}
        (tmp / STATE).write_text(jsonio.dumps(record, indent=1), encoding="utf-8")
    for old in all_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dst


def all_checkpoints(out_dir: Path) -> list[Path]:
    """Published checkpoints, oldest first (staging directories are hidden and never match)."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()), key=lambda p: p.name)


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = all_checkpoints(out_dir)
    return found[-1] if found else None


def read_state(path: Path) -> dict[str, Any]:
    """state.json of checkpoint `path`, its binary files checked against the hashes it records; none of the
    three may resolve outside the run's output directory (a link there is refused, whatever it points to)."""
    damaged = f"checkpoint {path} is damaged"
    hint = "; delete it to resume from an earlier checkpoint, or start the run again"
    for name in (STATE, PARAMS, OPTIMIZER):  # the model and adapter directories' rule, for the run's output
        confined(path.parent.parent, f"{CHECKPOINTS}/{path.name}/{name}", CheckpointError, f"checkpoint {path}")
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{damaged}: {STATE} is missing{hint}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{damaged}: {STATE} is not valid JSON ({e}){hint}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("files"), dict):
        raise CheckpointError(f"{damaged}: {STATE} is not a format-{FORMAT} checkpoint record{hint}")
    problem = _state_problem(state)
    if problem:
        raise CheckpointError(f"{damaged}: {STATE} {problem}{hint}")
    for name in (PARAMS, OPTIMIZER):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{damaged}: {name} is missing{hint}")
        if file_sha256(file) != state["files"].get(name):
            raise CheckpointError(f"{damaged}: {name} does not match the SHA-256 recorded in {STATE}{hint}")
    return state


def _state_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with the fields resuming reads from a state.json, or None (a record edited by hand or
    planted must fail here, by name, not deep in the resume)."""
    if not isinstance(state.get("step"), int) or isinstance(state.get("step"), bool) or state["step"] < 0:
        return f"has step {show(state.get('step'))}; expected a whole number >= 0"
    rng = state.get("rng")
    python = rng.get("python") if isinstance(rng, dict) else None
    if not (isinstance(python, list) and len(python) == 3 and isinstance(python[0], int)
            and isinstance(python[1], list) and len(python[1]) == 625
            and all(isinstance(x, int) and 0 <= x < 2**32 for x in python[1])
            and (python[2] is None or isinstance(python[2], float))):
        return "has no valid Python random-number state (rng.python: [version, 625 words, gauss])"
    for key, kind in (("config", dict), ("data_sha256", list), ("base_digest", str), ("history", dict)):
        if not isinstance(state.get(key), kind):
            return f"has no {key!r} {kind.__name__}"
    history = state["history"]
    if history.get("step") != state["step"]:
        return f"has history.step {show(history.get('step'))} where step is {state['step']}"
    for key, kind in (("curve", list), ("eval", list), ("segments", list), ("rows", int), ("tokens", int),
                      ("train_s", (int, float)), ("wall_s", (int, float))):
        if not isinstance(history.get(key), kind):
            return f"has no valid history.{key}"
    return None


def load_checkpoint(path: Path, params: list[tuple[str, torch.nn.Parameter]], optimizer,
                    state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restores the parameters, optimizer and RNG states of checkpoint `path`; returns its state.json
    (`state`: read_state's answer when the caller has it already)."""
    from safetensors.torch import load_file

    state = read_state(path) if state is None else state
    tensors = load_file(str(path / PARAMS))
    names = [n for n, _ in params]
    if sorted(tensors) != sorted(names):
        missing = sorted(set(names) - set(tensors)) or sorted(set(tensors) - set(names))
        raise CheckpointError(f"checkpoint {path} holds other trainable parameters than this run has "
                              f"(first difference: {missing[0]}); it belongs to another configuration")
    with torch.no_grad():
        for name, p in params:
            t = tensors[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise CheckpointError(f"checkpoint {path}: {name} is {t.dtype} {list(t.shape)}, this run's is "
                                      f"{p.dtype} {list(p.shape)}")
            p.copy_(t)
    try:  # weights_only: a planted pickle is refused, never run
        blob = torch.load(path / OPTIMIZER, weights_only=True, map_location="cpu")
        optimizer.load_state_dict(blob["optimizer"])
        torch.set_rng_state(blob["torch_rng"]["cpu"])
        if "cuda" in blob["torch_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(blob["torch_rng"]["cuda"])
    except Exception as err:  # noqa: BLE001 - whatever the bytes make torch raise, the file is what is wrong
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint {path} is damaged: {OPTIMIZER} is not an optimizer state this run "
                              f"can load ({show(first)}); delete the checkpoint to resume from an earlier one, "
                              f"or start the run again") from None
    version, internal, gauss = state["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    return state


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
