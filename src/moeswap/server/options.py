"""ServeOptions: the knobs of `moeswap serve` that shape the server, one frozen dataclass mirrored by its
flags (host and port stay with the CLI). Torch- and FastAPI-free, so the CLI builds its parser without them.
Entry point: `ServeOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeOptions:
    model_name: str = "model"  # the name clients send as `model` (the CLI: the model directory's name)
    model_aliases: tuple[str, ...] = ()  # other names of the base model (the CLI: MODEL as given, its path)
    api_key: str | None = None  # Bearer token every /v1 request must carry; None: no check
    max_batch: int = 16  # sequences decoded together
    max_queue: int = 64  # accepted requests waiting for a slot beyond max_batch; more get 429
    # prompt + generated tokens per request; None: the model's max_position_embeddings, at most
    # DEFAULT_MAX_CONTEXT (per-sequence state is sized by it)
    max_context: int | None = None
    native: bool = True  # decode steps' layers in one C call where it applies (EngineConfig.native)
    # LoRA adapters served beside the base model, (name, adapter directory) each (--lora NAME=PATH): a request
    # whose `model` is NAME is generated with that adapter (lora.serving)
    lora: tuple[tuple[str, str], ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (server/runtime_lora.py): off unless asked, as
    # they let any client with the API key read adapter directories on the server's disk and change the model
    allow_runtime_lora: bool = False
    max_loras: int = 16  # adapters served at once, --lora and runtime loads together (each stays in memory)

    def __post_init__(self):
        for name in ("max_batch", "max_context", "max_loras"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not _is_int(self.max_queue) or self.max_queue < 0:
            raise ValueError(f"--max-queue must be an integer >= 0, got {self.max_queue!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key is empty: give a key, or leave the flag out to accept every request")
        names = [name for name, _ in self.lora]
        for name in names:
            if not name or name == self.model_name:
                raise ValueError(f"--lora: the adapter name {name!r} " + ("is empty" if not name else
                                 "is the served model's name (--served-model-name); give the adapter another"))
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise ValueError(f"--lora: the adapter name {twice!r} is given twice")
        if len(names) > self.max_loras:
            raise ValueError(f"--lora: {len(names)} adapters, more than --max-loras {self.max_loras}")

    def resolve_max_context(self, model_max: int) -> int:
        """The context a request may fill, given the model's max_position_embeddings."""
        if self.max_context is None:
            return min(model_max, DEFAULT_MAX_CONTEXT)
        if self.max_context > model_max:
            raise ValueError(f"--max-context {self.max_context} is more than the model's max_position_embeddings "
                             f"{model_max}")
        return self.max_context


DEFAULT_MAX_CONTEXT = 4096


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
