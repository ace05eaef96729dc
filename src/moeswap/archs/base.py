"""`Arch`: everything moeswap knows of one architecture besides its torch modules, as declared fields
with generic defaults: how its config.json is recognised and which of config.py's per-architecture
choices it takes, its checkpoint name map (and the inverse, for writers), its routed-expert names, and
its init-tiny config layout. Torch-free and config-free: config.py, the loader and tiny/ read these
fields and never branch on an architecture's name. Entry point: subclass `Arch` in one file of archs/.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# A name map's last rule: every other name is itself
IDENTITY: tuple[tuple[str, str], ...] = ((r"(.*)", r"\1"),)


class Arch:
    """One architecture. Subclasses set the fields below and override the methods where they differ."""

    name: str = ""  # ModelConfig.arch, the CLI's --arch and the REGISTRY key
    # config.json: `model_type` values and `architectures` class names that are this architecture
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    # a config.json naming several architectures is the one recognising it with the highest rank
    rank: int = 0
    # "module:Class" of the torch model, imported only when one is built
    model_class: str = "moeswap.models.decoder:DecoderModel"

    # config.json choices config.py makes per architecture
    attention: str | None = None  # "mla": every layer MLA; None: per-layer kinds from the config's layer lists
    rotary: bool = False  # MLA's shared key rotated (rope_scaling / rope_parameters); False: NoPE by default
    mtp_key: str | None = None  # the key counting multi-token-prediction layers stored after the last one

    # Checkpoint tensor name (prefix stripped) -> what it is, first match wins, the last a catch-all:
    #   "expert": a routed-expert tensor (groups: layer, expert, projection, tensor kind)
    #   "skip":   not part of the text model (vision tower, projector)
    #   a template: the model parameter it fills (\1.. refer to groups)
    checkpoint_map: tuple[tuple[str, str], ...] = IDENTITY
    # model parameter -> checkpoint name, for writers of the published layout (init-tiny); first match wins
    published_map: tuple[tuple[str, str], ...] = IDENTITY
    # one routed expert projection's checkpoint module, {proj} its published projection name
    expert_module: str = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}"
    # published routed-expert projection -> the expert store's w1 / w2 / w3 (absent: the same name)
    expert_projs: Mapping[str, str] = MappingProxyType({})
    # module names of transformers' port of the architecture (PEFT adapters) -> ours; first match wins
    module_aliases: tuple[tuple[str, str], ...] = ()
    # init-tiny --quant variants this architecture has a published layout for
    tiny_quants: tuple[str, ...] = ()

    def recognises(self, model_type: object, architectures: tuple[str, ...], text: dict) -> int | None:
        """The rank with which config.json (its model_type, architectures list and text part) is this
        architecture; None: it is not."""
        named = model_type in self.model_types or any(a in self.architectures for a in architectures)
        return self.rank if named else None

    def classify(self, name: str) -> tuple[str, re.Match]:
        """A (prefix-stripped) checkpoint name through checkpoint_map: ('expert'|'skip'|param name, match)."""
        for pattern, target in self.checkpoint_map:
            m = re.fullmatch(pattern, name)
            if m:
                return (target if target in ("expert", "skip") else m.expand(target)), m
        raise AssertionError(f"{self.name}: checkpoint_map ends with a catch-all")

    def expert_key(self, match: re.Match) -> tuple[int, int, str, str]:
        """(layer, expert, store projection w1/w2/w3, tensor kind) of a checkpoint_map "expert" match."""
        layer, expert, proj, kind = match.groups()
        return int(layer), int(expert), self.expert_projs.get(proj, proj), kind

    def published_name(self, param_name: str) -> str:
        """The checkpoint name of a model parameter (the inverse of checkpoint_map for parameters)."""
        for pattern, template in self.published_map:
            m = re.fullmatch(pattern, param_name)
            if m:
                return m.expand(template)
        raise AssertionError(f"{self.name}: published_map ends with a catch-all")

    def expert_name(self, layer: int, expert: int, proj: str) -> str:
        """The checkpoint module name of one routed expert projection (proj: the store's w1 / w2 / w3)."""
        published = {v: k for k, v in self.expert_projs.items()}.get(proj, proj)
        return self.expert_module.format(layer=layer, expert=expert, proj=published)

    def sanitize(self, param_name: str, tensor: Any, config: Any) -> Any:
        """A checkpoint tensor in its parameter's shape (checkpoint quirks, in one place)."""
        return tensor

    def publish(self, param_name: str, tensor: Any, config: Any) -> Any:
        """A parameter's value in the published checkpoint's layout: sanitize's inverse (init-tiny)."""
        return tensor

    def tiny_config(self, dims: Mapping[str, int], size: str, quant: str) -> dict | None:
        """config.json as the published model ships it, at init-tiny's `dims` (tiny/sizes.py) for `size`;
        None: init-tiny has no layout for this architecture."""
        return None

    def model(self):
        """The torch model class (imported here, on first use)."""
        module, cls = self.model_class.split(":")
        return getattr(importlib.import_module(module), cls)

    def __repr__(self) -> str:
        return f"<arch {self.name}>"
