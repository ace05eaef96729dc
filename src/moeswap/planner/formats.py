"""Bytes per stored weight of every weight format the planner sizes: one table, `FORMATS`.

Owns the storage arithmetic of a format (value bytes plus its scales), nothing about compute or time.
Kept free of planner types so that the weights package can read the same table later. Entry points:
`bytes_per_weight(fmt, in_features)` and `matrix_bytes(fmt, out_features, in_features)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError

ROW = 0  # StorageFormat.group for one scale per output row (the row's in_features weights share it)


@dataclass(frozen=True)
class StorageFormat:
    """How a format stores a matrix: `value_bytes` per weight, plus one `scale_bytes` scale per `group`
    weights along a row (ROW: per output row)."""

    value_bytes: float
    scale_bytes: float = 0.0
    group: int = 1

    def bytes_per_weight(self, in_features: int | None = None) -> float:
        if not self.scale_bytes:
            return self.value_bytes
        if self.group == ROW:
            if not in_features:
                raise PlanError("a per-row scaled format needs the matrix's in_features to size its scales")
            return self.value_bytes + self.scale_bytes / in_features
        return self.value_bytes + self.scale_bytes / self.group


FORMATS: dict[str, StorageFormat] = {
    "fp32": StorageFormat(4.0),
    "bf16": StorageFormat(2.0),
    # moeswap's int8 dense weights: int8 values, one fp32 scale per output row
    "int8": StorageFormat(1.0, 4.0, ROW),
    # int4 group-32 (moeswap's int4 dense weights and compressed-tensors pack-quantized experts): packed
    # 4-bit values, one bf16 scale per 32 weights of a row
    "int4": StorageFormat(0.5, 2.0, 32),
    # OCP MX (compressed-tensors mxfp4/mxfp8-pack-quantized): one E8M0 byte per 32 weights
    "mxfp4": StorageFormat(0.5, 1.0, 32),
    "mxfp8": StorageFormat(1.0, 1.0, 32),
    # block FP8 (DeepSeek-V3 / Kimi K2 checkpoints): e4m3 values, one fp32 scale per 128 x 128 block
    "fp8": StorageFormat(1.0, 4.0, 128 * 128),
}


def storage_format(fmt: str) -> StorageFormat:
    try:
        return FORMATS[fmt]
    except KeyError:
        raise PlanError(f"unknown weight format {fmt!r}; expected one of {', '.join(FORMATS)}") from None


def bytes_per_weight(fmt: str, in_features: int | None = None) -> float:
    """Stored bytes per weight of `fmt`; per-row scaled formats (int8) need the row length."""
    return storage_format(fmt).bytes_per_weight(in_features)


def matrix_bytes(fmt: str, out_features: int, in_features: int) -> float:
    """Stored bytes of one [out_features, in_features] matrix in `fmt`, scales included."""
    return out_features * in_features * bytes_per_weight(fmt, in_features)
