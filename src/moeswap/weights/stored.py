"""Any stored linear weight as a float tensor, whatever its storage: plain float, compressed-tensors
MXFP4 / MXFP8 / INT4 pack-quantized, or DeepSeek block FP8 (`weight_scale_inv`).

`group_modules` sorts checkpoint names into modules and their weight tensors; `storage_of` finds the
storage's format object (weights.registry, whose formats own what each storage looks like, its shapes and
decoding) from which tensors exist and their dtypes, checked against what config.json declares;
`read_float` decodes. Knows module names only as strings. Entry point: `StoredWeight`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import fp8_block
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.weights import registry


@dataclass(frozen=True)
class Declared:
    """The quantization a config.json declares: none, compressed-tensors MX, or block FP8."""

    scheme: ct.Scheme | None = None
    fp8_block: tuple[int, int] | None = None

    @classmethod
    def from_config(cls, raw: dict, source: str = "config.json") -> Declared:
        q = (raw.get("text_config") or {}).get("quantization_config") or raw.get("quantization_config")
        if not q:
            return cls()
        if q.get("quant_method") == "fp8":
            return cls(fp8_block=fp8_block.block_size(q, source))
        return cls(scheme=ct.parse_quantization_config(q, source))


@dataclass(frozen=True)
class StoredWeight:
    module: str
    kind: str  # the name of its format object (weights.registry.FORMATS)
    tensors: dict[str, str]  # suffix -> checkpoint name

    @property
    def format(self):
        """The weights format object of this storage."""
        return registry.FORMATS[self.kind]

    def shape(self, ckpt: Checkpoint) -> tuple[int, int]:
        """Logical [out, in] of the weight."""
        return self.format.logical_shape({suffix: ckpt.info(name) for suffix, name in self.tensors.items()})

    def read_float(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32, declared: Declared = Declared()
                   ) -> torch.Tensor:
        get = {suffix: ckpt.read(name) for suffix, name in self.tensors.items()}
        try:
            return self.format.decode(get, dtype, declared.fp8_block)
        except ValueError as err:
            file = ckpt.info(next(iter(self.tensors.values()))).file.name
            raise CheckpointError(f"{self.module} in {file}: cannot decode its {self.kind} weight: {err}") from None


def group_modules(names: Iterable[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """-> ({module: {suffix: name}} for weight tensors, [other names]) in first-seen order."""
    weight_suffixes = set().union(*registry.BY_SUFFIXES)  # every registered format's tensors
    modules: dict[str, dict[str, str]] = {}
    others = []
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in weight_suffixes and module:
            modules.setdefault(module, {})[suffix] = name
        else:
            others.append(name)
    return modules, others


def storage_of(ckpt: Checkpoint, module: str, tensors: dict[str, str], declared: Declared) -> StoredWeight:
    """Which storage a module's tensors are in; fails naming the module when they fit none."""
    dtypes = {suffix: ckpt.info(name).dtype for suffix, name in tensors.items()}
    where = f"{module} in {ckpt.info(next(iter(tensors.values()))).file.name}"
    fmt = registry.for_suffixes(tensors, dtypes)
    if fmt is None or not fmt.dtypes_fit(dtypes):
        found = ", ".join(f"{s} ({d})" for s, d in sorted(dtypes.items()))
        raise CheckpointError(
            f"{where}: tensors {found} fit no known storage (float weight; weight_packed + weight_scale for "
            f"MXFP4; float8 weight + weight_scale for MXFP8; int8 weight + weight_scale for INT8; float8 weight + "
            f"weight_scale_inv for block FP8)")
    scheme = declared.scheme
    # a dense group's format (a second compressed-tensors group) is declared too
    said = None if scheme is None else fmt.ct_format if fmt.ct_format == scheme.dense_format else scheme.format
    fmt.check_declared(where, said, declared.fp8_block)
    fmt.check_dtypes(dtypes, where)
    return StoredWeight(module, fmt.name, dict(tensors))
