"""TrainConfig: every setting of a training run, declared once with its help, kind, choices and default, read
from CONFIG.yaml and from flags (a flag given wins); the base model's load settings are options.LoadOptions.
Torch-free (the CLI builds its parser without torch). Entry points: `TrainConfig`, `add_train_flags`,
`resolve(config_path, args)`.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moeswap.distributed.cli import EP_MODES
from moeswap.hub import parse_repo, resolve_model
from moeswap.options import LoadOptions, add_load_flags, load_flag_names
from moeswap.units import parse_bytes

MODES = ("lora", "full")
SCHEDULES = ("cosine", "constant")
PRECISIONS = ("fp32", "bf16")
BAD_LINE = ("stop", "skip")
PACKING = ("off", "concat")


def _f(default: Any, help: str, kind: str = "str", choices: tuple[str, ...] | None = None, metavar: str | None = None):
    """A field with its flag. kind: str, path, model (a path, or a Hugging Face name resolved to its cached
    snapshot), int, float, bool, list (of strings), pair (two floats)."""
    return field(default=default, metadata={"help": help, "kind": kind, "choices": choices, "metavar": metavar})


@dataclass(frozen=True)
class TrainConfig:
    # what to train on
    model: str | None = _f(None, "base model directory (config.json + safetensors + tokenizer), or a Hugging Face "
                                 "name ORG/NAME[@REVISION] from its cache", "model", metavar="DIR")
    train_data: str | None = _f(None, "training data: JSONL, one {\"text\": ...} or {\"messages\": [...]} per line",
                                "path", metavar="JSONL")
    eval_data: str | None = _f(None, "held-out data in the same format (else --eval-split)", "path", metavar="JSONL")
    eval_split: float = _f(0.0, "fraction of the training samples held out for eval when there is no --eval-data "
                                "(chosen by --seed; 0: no eval)", "float")
    on_bad_line: str = _f("stop", "a malformed JSONL line: stop with its line number, or skip it and count it",
                          choices=BAD_LINE)
    seq_len: int = _f(2048, "tokens per row", "int")
    truncate: bool = _f(False, "cut samples longer than --seq-len instead of stopping with an error", "bool")
    packing: str = _f("off", "off: one sample per row (padded; nothing crosses samples); concat: samples "
                             "concatenated into full rows, losses masked at the joins, but attention and the KDA "
                             "state do run across them", choices=PACKING)
    # what trains
    mode: str = _f("lora", "lora: low-rank adapters on a frozen base (routed experts included); full: the model's "
                           "own parameters, routed experts included (with --target-modules: only those, the "
                           "routed experts then stay frozen in the store)", choices=MODES)
    target_modules: tuple[str, ...] | None = _f(
        None, "modules to adapt (lora) or train (full), comma-separated names or suffixes (q_proj,o_proj; w1,w2,w3: "
              "the routed experts', lora only) or one regex; default: lora q_proj,k_proj,v_proj,o_proj, full every "
              "parameter",
        "list",
        metavar="NAMES")
    router_bias_rate: float = _f(1e-3, "full mode with routed experts trained: K3's load balancing, each "
                                       "optimizer step moving every router's selection bias by this toward "
                                       "equal expert load (0: off)", "float")
    rank: int = _f(16, "LoRA rank r", "int")
    alpha: float = _f(32.0, "LoRA alpha (the update is scaled by alpha / r)", "float")
    dropout: float = _f(0.0, "LoRA dropout on the adapter's input", "float")
    shared_a: bool = _f(False, "routed-expert LoRA: one A shared by a layer's experts, a B per expert", "bool")
    # the optimiser
    lr: float = _f(1e-4, "peak learning rate (AdamW)", "float")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay (matrices only; not norms, biases, vectors)", "float")
    betas: tuple[float, float] = _f((0.9, 0.999), "AdamW betas, two numbers", "pair", metavar="B1,B2")
    max_grad_norm: float = _f(1.0, "clip the gradient's global L2 norm to this (0: no clipping)", "float")
    warmup_steps: int = _f(0, "optimizer steps of linear warm-up from 0 to --lr", "int")
    schedule: str = _f("cosine", "after warm-up: cosine decay to --min-lr-ratio x --lr, or constant",
                       choices=SCHEDULES)
    min_lr_ratio: float = _f(0.0, "where the cosine ends, as a fraction of --lr", "float")
    # how long, in what pieces
    max_steps: int = _f(0, "optimizer steps to run (0: --epochs decides)", "int")
    epochs: float = _f(1.0, "passes over the training rows when --max-steps is 0 (may be fractional)", "float")
    micro_batch: int = _f(1, "rows per forward pass", "int")
    grad_accum: int = _f(1, "forward passes per optimizer step", "int")
    # the run
    seed: int = _f(0, "seed of the data order, eval split, LoRA init and dropout", "int")
    precision: str = _f("fp32", "fp32, or bf16 autocast of the forward (trainable weights stay fp32)",
                        choices=PRECISIONS)
    gradient_checkpointing: bool = _f(False, "recompute each layer's attention and MLP in backward instead of "
                                             "keeping their activations", "bool")
    loss_chunk: int = _f(1024, "tokens whose logits the loss computes at a time, recomputing them in backward "
                               "(the full [tokens, vocab] logits are never held; 0: all at once)", "int")
    ep_mode: str = _f("data-parallel", "under torchrun, how the ranks share each step (docs/distributed.md): "
                                        "data-parallel, micro-batch k of the step on rank k mod N (the same global "
                                        "batch; set --grad-accum to a multiple of N), or replicated, every rank every "
                                        "row (one process's bits)", choices=EP_MODES)
    eval_interval: int = _f(0, "eval every N optimizer steps (eval always runs before and after; 0: only then)",
                            "int")
    save_interval: int = _f(0, "write a checkpoint every N optimizer steps (0: none; --resume needs them)", "int")
    keep_checkpoints: int = _f(2, "newest checkpoints kept (older ones are removed)", "int")
    log_interval: int = _f(10, "where no progress bar shows (stderr not a terminal, or --no-progress): one line "
                               "on stderr at the first step, every N optimizer steps and at the last (0: none)",
                           "int")
    output: str | None = _f(None, "output directory: the adapter (or trained weights), manifest.json, "
                                  "loss.csv/png, checkpoints/", "path", metavar="DIR")
    load: LoadOptions = field(default_factory=LoadOptions, metadata={"kind": "load"})

    def __post_init__(self):
        for f in fields(self):
            if f.metadata.get("choices") and getattr(self, f.name) not in f.metadata["choices"]:
                raise ValueError(f"{_flag(f.name)} {getattr(self, f.name)!r}: expected one of "
                                 f"{', '.join(f.metadata['choices'])}")
        checks = [
            (self.seq_len >= 2, "--seq-len must be >= 2 (a row needs a token and its target)"),
            (0.0 <= self.eval_split < 1.0, "--eval-split must be in [0, 1)"),
            (self.rank >= 1, "--rank must be >= 1"),
            (self.router_bias_rate >= 0, "--router-bias-rate must be >= 0"),
            (self.alpha > 0, "--alpha must be > 0"),
            (0.0 <= self.dropout < 1.0, "--dropout must be in [0, 1)"),
            (self.lr > 0, "--lr must be > 0"),
            (self.weight_decay >= 0, "--weight-decay must be >= 0"),
            (all(0.0 <= b < 1.0 for b in self.betas), "--betas must both be in [0, 1)"),
            (self.max_grad_norm >= 0, "--max-grad-norm must be >= 0"),
            (self.warmup_steps >= 0, "--warmup-steps must be >= 0"),
            (0.0 <= self.min_lr_ratio <= 1.0, "--min-lr-ratio must be in [0, 1]"),
            (self.max_steps >= 0, "--max-steps must be >= 0"),
            (self.max_steps > 0 or self.epochs > 0, "--epochs must be > 0 when --max-steps is 0"),
            (self.micro_batch >= 1, "--micro-batch must be >= 1"),
            (self.grad_accum >= 1, "--grad-accum must be >= 1"),
            (self.loss_chunk >= 0, "--loss-chunk must be >= 0"),
            (self.eval_interval >= 0, "--eval-interval must be >= 0"),
            (self.save_interval >= 0, "--save-interval must be >= 0"),
            (self.keep_checkpoints >= 1, "--keep-checkpoints must be >= 1"),
            (self.log_interval >= 0, "--log-interval must be >= 0"),
            (self.target_modules is None or len(self.target_modules) > 0, "--target-modules is empty"),
            # training's autograd path fetches each expert it computes through the store; hybrid compute is a
            # decode path (experts/hybrid.py), so a setting here would be ignored: refuse it rather
            (self.load.expert_compute == "gpu", f"--expert-compute {self.load.expert_compute}: training computes "
                                                "every expert where the model runs (hybrid experts are for "
                                                "generate and serve)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["kind"] == "float" and not math.isfinite(value):
                raise ValueError(f"{_flag(f.name)} must be a finite number, got {value!r}")

    def require_inputs(self) -> None:
        """The fields a run cannot do without (a config may leave them to flags)."""
        for name, what in (("model", "the base model directory"), ("train_data", "the training JSONL"),
                           ("output", "the output directory")):
            if getattr(self, name) is None:
                raise ValueError(f"no {name}: give {what} as `{name}:` in CONFIG.yaml or {_flag(name)}")

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.grad_accum

    def replace(self, **changes) -> TrainConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The resolved configuration as plain JSON values; `from_dict` inverts it."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "load":
                out[f.name] = {n: getattr(value, n) for n in load_flag_names()}
            else:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> TrainConfig:
        """A config from `as_dict()` output (a manifest's): every key known, values of their kinds."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping of settings, found {type(data).__name__}")
        data = dict(data)
        load = data.pop("load", {})
        if not isinstance(load, dict):
            raise ValueError(f"{where}: load: expected a mapping, found {type(load).__name__}")
        values = _typed({**data, **load}, where, base=None)
        return _build(values)


_FIELDS = {f.name: f for f in fields(TrainConfig) if f.name != "load"}
_LOAD_FIELDS = {f.name: f for f in fields(LoadOptions) if f.metadata["flag"]}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def valid_keys() -> list[str]:
    return [*_FIELDS, *_LOAD_FIELDS]


# Other trainers' names for these settings (transformers TrainingArguments, PEFT, LLaMA-Factory), for the
# hint only: each setting has one name here.
KNOWN_ELSEWHERE = {
    "learning_rate": "lr", "model_name_or_path": "model", "output_dir": "output", "num_train_epochs": "epochs",
    "per_device_train_batch_size": "micro_batch", "gradient_accumulation_steps": "grad_accum",
    "lr_scheduler_type": "schedule", "max_grad_norm": "max_grad_norm", "lora_r": "rank", "r": "rank",
    "lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_target": "target_modules",
    "cutoff_len": "seq_len", "max_seq_length": "seq_len", "max_length": "seq_len", "adam_beta1": "betas",
    "adam_beta2": "betas", "eval_steps": "eval_interval", "save_steps": "save_interval",
    "save_total_limit": "keep_checkpoints", "dataset": "train_data", "train_file": "train_data",
    "validation_file": "eval_data", "val_size": "eval_split", "bf16": "precision",
}


def _unknown(key: Any, where: str) -> ValueError:
    close = ([KNOWN_ELSEWHERE[key]] if key in KNOWN_ELSEWHERE else
             difflib.get_close_matches(str(key), valid_keys(), n=1, cutoff=0.0))
    hint = f" (closest valid key: {close[0]!r})" if close else ""
    return ValueError(f"{where}: unknown key {key!r}{hint}")


def _coerce(name: str, value: Any, where: str, base: Path | None) -> Any:
    """`value` (from YAML or JSON) as field `name` holds it; ValueError naming the key otherwise."""
    f = _FIELDS.get(name) or _LOAD_FIELDS[name]
    kind = f.metadata["kind"]
    here = f"{where}: {name}"
    if value is None:
        if f.default is None:
            return None
        raise ValueError(f"{here}: expected a value, found null")
    if kind in ("str", "path", "model"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{here}: expected a non-empty string, found {value!r}")
        if kind in ("path", "model"):
            path = Path(value).expanduser()
            local = os.path.abspath(base / path if base is not None else path)  # abspath also drops "..", "."
            if kind == "model" and not os.path.exists(local) and parse_repo(value):  # a hub name: its snapshot
                return os.path.abspath(resolve_model(value))
            return local
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{here}: expected true or false, found {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{here}: expected an integer, found {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{here}: expected a number, found {value!r}")
        return float(value)
    if kind == "bytes":
        if isinstance(value, str):
            try:
                return parse_bytes(value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{here}: {e}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{here}: expected a size such as 2GiB, found {value!r}")
        return value
    if kind == "list":
        items = _split(value) if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"{here}: expected a list of names, found {value!r}")
        return tuple(items)
    if kind == "pair":
        try:
            items = [float(x) for x in _split(value)] if isinstance(value, str) else value
        except ValueError:
            raise ValueError(f"{here}: expected two numbers such as 0.9,0.999, found {value!r}") from None
        if (not isinstance(items, (list, tuple)) or len(items) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items)):
            raise ValueError(f"{here}: expected two numbers, found {value!r}")
        return (float(items[0]), float(items[1]))
    raise AssertionError(kind)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _typed(values: dict[str, Any], where: str, base: Path | None) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in _FIELDS and key not in _LOAD_FIELDS:
            raise _unknown(key, where)
        out[key] = _coerce(key, value, where, base)
    return out


def _build(values: dict[str, Any]) -> TrainConfig:
    own = {k: v for k, v in values.items() if k in _FIELDS}
    load = {k: v for k, v in values.items() if k in _LOAD_FIELDS}
    return TrainConfig(**own, load=LoadOptions(**load))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """CONFIG.yaml's settings, typed, relative paths resolved against its directory."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e})") from None
    except IsADirectoryError:
        raise ValueError(f"{p} is a directory; expected a YAML config file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{p}:{at}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping of settings (key: value lines), found {type(data).__name__}")
    return _typed(data, str(p), base=p.resolve().parent)


def resolve(config_path: str | None, args: argparse.Namespace | None = None) -> TrainConfig:
    """CONFIG.yaml (if given) overridden by the flags present in `args` (a parser from `add_train_flags`).

    The file is read with PyYAML's safe_load, unknown keys refused with the closest valid one named; each
    field has a flag (`--micro-batch` for `micro_batch`). Load settings are top-level keys (`expert_memory: 2GiB`)
    and the usual load flags. Paths are resolved once (a file's relative paths against the file's directory), so
    `as_dict()` is the complete, resolved configuration the manifest records and `from_dict` rebuilds.
    """
    values = read_yaml(config_path) if config_path else {}
    values.update(given_flags(args))
    return _build(values)


def given_flags(args: argparse.Namespace | None) -> dict[str, Any]:
    """The settings given as flags (absent ones are not in the namespace), typed; paths against the cwd."""
    if args is None:
        return {}
    given = {k: getattr(args, k) for k in (*_FIELDS, *_LOAD_FIELDS) if hasattr(args, k)}
    return _typed(given, "flags", base=None)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per TrainConfig field plus the load flags. Defaults are left out of the namespace, so
    `given_flags` sees only what the command line said (a flag wins over CONFIG.yaml, a default does not)."""
    groups = {"model": "data", "mode": "what trains", "lr": "optimizer", "max_steps": "steps and batches",
              "seed": "the run"}
    group: argparse.ArgumentParser | argparse._ArgumentGroup = parser
    for f in fields(TrainConfig):
        if f.name == "load":
            continue
        if f.name in groups:
            group = parser.add_argument_group(groups[f.name])
        meta, default = f.metadata, f.default if f.default is not MISSING else None
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_text = meta["help"] + ("" if shown in (None, False) else f" (default {shown})")
        if meta["kind"] == "bool":
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=help_text, **kw)
            continue
        if meta["kind"] in ("int", "float"):
            kw["type"] = _number(int if meta["kind"] == "int" else float, _flag(f.name))
        if meta["choices"]:
            kw["choices"] = meta["choices"]
        if meta["metavar"]:
            kw["metavar"] = meta["metavar"]
        group.add_argument(_flag(f.name), help=help_text, **kw)
    add_load_flags(parser, title="the base model's loading and expert store")
    for action in parser._actions:  # argparse has no public way to drop an existing argument's default
        if action.dest in _LOAD_FIELDS:
            action.default = argparse.SUPPRESS


def _number(kind: type, flag: str):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None

    parse.__name__ = kind.__name__
    return parse
