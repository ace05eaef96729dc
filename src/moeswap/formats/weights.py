"""Any stored linear weight as a float tensor, whatever its storage: plain float, compressed-tensors
MXFP4 / MXFP8, or DeepSeek block FP8 (`weight_scale_inv`).

`group_modules` sorts checkpoint names into modules and their weight tensors; `storage_of` tells the
storage from which tensors exist and their dtypes (checked against what config.json declares);
`read_float` decodes. Knows module names only as strings. Entry point: `StoredWeight`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import fp8_block
from moeswap.formats.checkpoint import Checkpoint, CheckpointError

WEIGHT_SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_scale_inv")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


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
    kind: str  # "float" | "mxfp4" | "mxfp8" | "fp8_block"
    tensors: dict[str, str]  # suffix -> checkpoint name

    def shape(self, ckpt: Checkpoint) -> tuple[int, int]:
        """Logical [out, in] of the weight."""
        if self.kind == "mxfp4":
            out_dim, half = ckpt.info(self.tensors["weight_packed"]).shape
            return out_dim, half * 2
        return tuple(ckpt.info(self.tensors["weight"]).shape)

    def read_float(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32, declared: Declared = Declared()
                   ) -> torch.Tensor:
        get = {suffix: ckpt.read(name) for suffix, name in self.tensors.items()}
        try:
            if self.kind == "float":
                return get["weight"].to(dtype)
            if self.kind == "fp8_block":
                return fp8_block.decode(get["weight"], get["weight_scale_inv"], declared.fp8_block or fp8_block.BLOCK,
                                        dtype)
            return ct.decode_weight(self.kind, get, dtype)
        except ValueError as err:
            file = ckpt.info(next(iter(self.tensors.values()))).file.name
            raise CheckpointError(f"{self.module} in {file}: cannot decode its {self.kind} weight: {err}") from None


def group_modules(names: Iterable[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """-> ({module: {suffix: name}} for weight tensors, [other names]) in first-seen order."""
    modules: dict[str, dict[str, str]] = {}
    others = []
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in WEIGHT_SUFFIXES and module:
            modules.setdefault(module, {})[suffix] = name
        else:
            others.append(name)
    return modules, others


def storage_of(ckpt: Checkpoint, module: str, tensors: dict[str, str], declared: Declared) -> StoredWeight:
    """Which storage a module's tensors are in; fails naming the module when they fit none."""
    dtypes = {suffix: ckpt.info(name).dtype for suffix, name in tensors.items()}
    suffixes = set(tensors)
    where = f"{module} in {ckpt.info(next(iter(tensors.values()))).file.name}"
    if suffixes == {"weight_packed", "weight_scale"}:
        kind = "mxfp4"
    elif suffixes == {"weight", "weight_scale"} and dtypes["weight"] in FP8_DTYPES:
        kind = "mxfp8"
    elif suffixes == {"weight", "weight_scale_inv"}:
        kind = "fp8_block"
    elif suffixes == {"weight"} and dtypes["weight"].is_floating_point and dtypes["weight"] not in FP8_DTYPES:
        kind = "float"
    else:
        found = ", ".join(f"{s} ({d})" for s, d in sorted(dtypes.items()))
        raise CheckpointError(
            f"{where}: tensors {found} fit no known storage (float weight; weight_packed + weight_scale for "
            f"MXFP4; float8 weight + weight_scale for MXFP8; float8 weight + weight_scale_inv for block FP8)")
    if kind in ("mxfp4", "mxfp8"):
        if declared.scheme is None:
            raise CheckpointError(f"{where}: stored as {kind.upper()} but config.json has no compressed-tensors "
                                  f"quantization_config")
        if declared.scheme.short_name != kind:
            raise CheckpointError(f"{where}: stored as {kind.upper()} but config.json's quantization_config says "
                                  f"{declared.scheme.format}")
        if dtypes["weight_scale"] not in SCALE_DTYPES:
            raise CheckpointError(f"{where}: weight_scale must be uint8 E8M0 bytes, found {dtypes['weight_scale']}")
    if kind == "fp8_block" and declared.fp8_block is None:
        raise CheckpointError(f"{where}: has weight_scale_inv (block FP8) but config.json has no "
                              f"quant_method 'fp8' quantization_config with weight_block_size")
    return StoredWeight(module, kind, dict(tensors))
