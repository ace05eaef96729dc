"""compressed-tensors checkpoints: the quantization_config block and the per-module tensors.

Formats: `mxfp4-pack-quantized` (weight_packed uint8 [out, in/2] + weight_scale uint8 [out, in/32]),
`mxfp8-quantized` (weight float8_e4m3fn [out, in] + weight_scale uint8 [out, in/32]), INT4
`pack-quantized` (Kimi K2-Thinking: weight_packed int32 [out, in/8] + weight_scale bf16 [out, in/32] +
weight_shape int32 [2]; formats/int4.py) and INT8 `int-quantized`, channel strategy (weight int8 [out, in] +
weight_scale fp32 [out, 1]; formats/int8.py: moeswap's int8 dense weights). A config may hold two groups: the
routed experts' (targets ["Linear"], less `ignore`) and the dense weights' (targets naming them with `re:`
patterns, which compressed-tensors prefers to a class name). Knows module names
only as strings the caller passes. Entry points: `parse_quantization_config`, `quantization_config`,
`encode_weight` / `decode_weight`, `ignore_patterns`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Importable without torch (config parsing and the planner use parse_quantization_config); the codecs
# are imported where tensors are handled.
QUANT_METHOD = "compressed-tensors"
FORMATS = {"mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized", "int4": "pack-quantized",
           "int8": "int-quantized"}  # short -> format
GROUP_SIZE = 32  # = mx.BLOCK = int4.GROUP
_NUM_BITS = {"mxfp4-pack-quantized": 4, "mxfp8-quantized": 8, "pack-quantized": 4, "int-quantized": 8}
_TYPE = {"mxfp4-pack-quantized": "float", "mxfp8-quantized": "float", "pack-quantized": "int", "int-quantized": "int"}
CHANNEL = frozenset({"int-quantized"})  # formats with one scale per output row (strategy channel, no group size)
EXPERTS_TARGETS = ("Linear",)  # the experts' group targets the class; a dense group names its modules


@dataclass(frozen=True)
class Scheme:
    """What a compressed-tensors quantization_config says about the quantised modules."""

    format: str  # a value of FORMATS: the routed experts' (the group targeting "Linear"), or the only group's
    group_size: int
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)
    dense_format: str | None = None  # a second group's format: the dense weights it names (None: no such group)
    dense_targets: tuple[str, ...] = ()

    @property
    def short_name(self) -> str:
        return short_name(self.format)


def short_name(fmt: str) -> str:
    for short, full in FORMATS.items():
        if fmt in (short, full):
            return short
    raise ValueError(f"unknown compressed-tensors format {fmt!r}; expected one of {', '.join(FORMATS)} "
                     f"({', '.join(FORMATS.values())})")


def parse_quantization_config(q: Mapping, source: str = "config.json") -> Scheme:
    """Checks a compressed-tensors quantization_config holding the routed experts' scheme (and at most one
    more, for named dense modules); errors name the field
    (every value is checked for type first: the block comes from a file)."""
    from moeswap.formats.files import show

    where = f"{source}: quantization_config"
    if not isinstance(q, Mapping):
        raise ValueError(f"{where} must be an object, got {show(q)}")
    method = q.get("quant_method")
    if method != QUANT_METHOD:
        hint = " (block FP8: convert it with `moeswap quantize`)" if method == "fp8" else ""
        raise ValueError(f"{where}.quant_method={show(method)} is not supported "
                         f"(moeswap reads compressed-tensors MXFP4/MXFP8 experts){hint}")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}.config_groups must name at least one scheme, got {show(groups)}")
    parsed = []  # (format, targets) per group
    for name, grp in groups.items():
        at = f"{where}.config_groups.{show(name)}"
        if not isinstance(grp, Mapping) or not isinstance(grp.get("weights") or {}, Mapping):
            raise ValueError(f"{at} must be an object with an object 'weights', got {show(grp)}")
        fmt = grp.get("format") or q.get("format")
        if not isinstance(fmt, str):
            raise ValueError(f"{at}: format must be a name, got {show(fmt)}")
        weights = grp.get("weights") or {}
        group_targets = grp.get("targets") or []
        if not isinstance(group_targets, list) or not all(isinstance(t, str) for t in group_targets):
            raise ValueError(f"{at}.targets must be a list of names, got {show(group_targets)}")
        parsed.append((fmt, tuple(group_targets) or EXPERTS_TARGETS))
        if fmt in _NUM_BITS:
            _check_group_size(fmt, weights, source)
        bits = weights.get("num_bits")
        if fmt in _NUM_BITS and bits not in (None, _NUM_BITS[fmt]):
            raise ValueError(f"{at}: format {fmt} stores {_NUM_BITS[fmt]}-bit weights, but weights.num_bits "
                             f"is {show(bits)}")
        kind = weights.get("type")
        if fmt in _TYPE and kind not in (None, _TYPE[fmt]):
            raise ValueError(f"{at}: format {fmt} stores {_TYPE[fmt]} weights, but weights.type is {show(kind)}")
        if fmt == FORMATS["int4"] and weights.get("symmetric") is False:
            raise ValueError(f"{at}: asymmetric INT4 (with zero points) is not supported; moeswap reads "
                             f"symmetric pack-quantized weights")
    for fmt, _ in parsed:
        if fmt not in _NUM_BITS:
            raise ValueError(f"{source}: quantization format {show(fmt)} is not supported "
                             f"(expected {' or '.join(FORMATS.values())})")
    experts = [g for g in parsed if g[1] == EXPERTS_TARGETS]
    dense = [g for g in parsed if g[1] != EXPERTS_TARGETS]
    if len(parsed) > 1 and (len(experts) != 1 or len({f for f, _ in dense}) != 1):
        formats = sorted({f for f, _ in parsed})
        raise ValueError(f"{where} holds {len(parsed)} schemes (formats {show(formats)}); moeswap reads one for "
                         f"the routed experts (targets ['Linear']) and at most one for named dense modules")
    fmt, targets = (experts or parsed)[0]
    dense_format = dense[0][0] if experts and dense else None
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ValueError(f"{where}.ignore must be a list of module names or 're:' regexes, got {show(ignore)}")
    for pattern in ignore:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise ValueError(f"{where}.ignore: {show(pattern)} is not a valid regex ({err})") from None
    return Scheme(fmt, GROUP_SIZE, tuple(ignore), targets, dense_format,
                  tuple(t for _, ts in dense for t in ts) if dense_format else ())


def _check_group_size(fmt: str, weights: Mapping, source: str) -> None:
    from moeswap.formats.files import show

    if fmt in CHANNEL:
        if weights.get("strategy") not in (None, "channel") or weights.get("group_size") is not None:
            raise ValueError(f"{source}: {short_name(fmt).upper()} ({fmt}) must have one scale per output row "
                             f"(strategy channel, group_size null), got strategy {show(weights.get('strategy'))} "
                             f"group_size {show(weights.get('group_size'))}")
    elif weights.get("group_size") != GROUP_SIZE:
        raise ValueError(f"{source}: {short_name(fmt).upper()} group_size must be {GROUP_SIZE}, got "
                         f"{show(weights.get('group_size'))}")


def quantization_config(fmt: str, ignore: Iterable[str], targets: Iterable[str] = ("Linear",),
                        dense: tuple[str, Iterable[str]] | None = None) -> dict:
    """The config.json block for modules stored as `fmt` (mxfp4 / mxfp8 / int4), as compressed-tensors writes it;
    `dense` (format, target patterns): a second group for the dense weights those patterns name."""
    full = FORMATS[short_name(fmt)]
    groups = {"group_0": _group(full, targets)}
    if dense is not None:
        groups["group_1"] = _group(FORMATS[short_name(dense[0])], dense[1])
    return {
        "quant_method": QUANT_METHOD, "format": full if dense is None or groups["group_1"]["format"] == full
        else "mixed-precision", "quantization_status": "compressed",
        "config_groups": groups, "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None,
    }


def _group(full: str, targets: Iterable[str]) -> dict:
    channel = full in CHANNEL
    weights = {"num_bits": _NUM_BITS[full], "type": _TYPE[full], "symmetric": True,
               "group_size": None if channel else GROUP_SIZE, "strategy": "channel" if channel else "group",
               "dynamic": False, "observer": "minmax",
               "scale_dtype": ("torch.float32" if channel else "torch.bfloat16") if _TYPE[full] == "int"
               else "torch.uint8", "actorder": None, "block_structure": None, "observer_kwargs": {}, "zp_dtype": None}
    return {"format": full, "targets": list(targets), "weights": weights, "input_activations": None,
            "output_activations": None}


def stored_specs(fmt: str, shape: tuple[int, int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """suffix -> (dtype, shape) of the tensors one [out, in] linear weight is stored as."""
    import torch

    out_dim, in_dim = shape
    _check_shape(fmt, shape)
    if short_name(fmt) == "int8":
        from moeswap.formats import int8

        return {"weight": (torch.int8, tuple(shape)), "weight_scale": (int8.SCALE_DTYPE, int8.scale_shape(shape))}
    scale = (torch.uint8, (out_dim, in_dim // GROUP_SIZE))
    if short_name(fmt) == "int4":
        from moeswap.formats import int4

        return {"weight_packed": (torch.int32, int4.packed_shape(shape)),
                "weight_scale": (torch.bfloat16, int4.scale_shape(shape)), "weight_shape": (torch.int32, (2,))}
    if short_name(fmt) == "mxfp4":
        return {"weight_packed": (torch.uint8, (out_dim, in_dim // 2)), "weight_scale": scale}
    return {"weight": (torch.float8_e4m3fn, (out_dim, in_dim)), "weight_scale": scale}


def encode_weight(fmt: str, w: torch.Tensor, mode: str = "even") -> dict[str, torch.Tensor]:
    """[out, in] float weight -> {suffix: tensor} in `fmt` (module-relative names, e.g. weight_packed)."""
    from moeswap.formats import mxfp4, mxfp8

    _check_shape(fmt, tuple(w.shape))
    if short_name(fmt) == "int8":  # round to nearest even; `mode` picks MX block exponents only
        from moeswap.formats import int8

        q, scale = int8.encode(w)
        return {"weight": q, "weight_scale": scale}
    if short_name(fmt) == "int4":  # round to nearest even; `mode` picks MX block exponents only
        import torch

        from moeswap.formats import int4

        packed, scale = int4.encode(w)
        return {"weight_packed": packed, "weight_scale": scale,
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}
    if short_name(fmt) == "mxfp4":
        packed, scale = mxfp4.encode(w, mode)
        return {"weight_packed": packed, "weight_scale": scale}
    data, scale = mxfp8.encode(w, mode, "e4m3")
    return {"weight": data, "weight_scale": scale}


def decode_weight(fmt: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """{suffix: tensor} as stored -> the float weight (bf16 unless `dtype` says otherwise)."""
    import torch

    from moeswap.formats import mxfp4, mxfp8

    dtype = dtype or torch.bfloat16
    names = stored_names(fmt)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{FORMATS[short_name(fmt)]} weight needs tensors {', '.join(names)}; missing "
                         f"{', '.join(missing)} (found {', '.join(sorted(tensors)) or 'none'})")
    if short_name(fmt) == "int4":
        from moeswap.formats import int4

        packed, scale = tensors["weight_packed"], tensors["weight_scale"]
        shape = (packed.shape[0], scale.shape[1] * GROUP_SIZE)  # group strategy: the scales give in exactly
        if "weight_shape" in tensors and tensors["weight_shape"].tolist() != list(shape):
            raise ValueError(f"INT4 weight_shape {tensors['weight_shape'].tolist()} does not match the "
                             f"{list(shape)} its weight_packed and weight_scale hold")
        return int4.decode(packed, scale, shape, dtype)
    if short_name(fmt) == "int8":
        from moeswap.formats import int8

        return int8.decode(tensors["weight"], tensors["weight_scale"], dtype)
    if short_name(fmt) == "mxfp4":
        return mxfp4.decode(tensors["weight_packed"], tensors["weight_scale"], dtype)
    return mxfp8.decode(tensors["weight"], tensors["weight_scale"], dtype)


def stored_names(fmt: str) -> tuple[str, ...]:
    short = short_name(fmt)
    if short == "int4":
        return ("weight_packed", "weight_scale", "weight_shape")
    return ("weight_packed", "weight_scale") if short == "mxfp4" else ("weight", "weight_scale")


def ignore_patterns(module_names: Iterable[str]) -> list[str]:
    """Compact ignore entries for these modules: numbered path segments (layer, block indices) become
    `\\d+` in an anchored `re:` pattern; names without numbers stay exact. Every pattern matches whole
    names only, so it cannot reach a module that differs in any non-numeric segment."""
    patterns = set()
    for name in module_names:
        parts = name.split(".")
        if not any(p.isdigit() for p in parts):
            patterns.add(name)
            continue
        patterns.add("re:^" + r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in parts) + "$")
    return sorted(patterns)


def matches(module_name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' name matching: `re:` patterns with re.match, anything else exactly."""
    return any(re.match(p[3:], module_name) if p.startswith("re:") else p == module_name for p in patterns)


def _check_shape(fmt: str, shape: tuple[int, ...]) -> None:
    name = FORMATS[short_name(fmt)]
    if len(shape) != 2:
        raise ValueError(f"{name} stores 2-D [out, in] weights, got shape {list(shape)}")
    if shape[1] % GROUP_SIZE and name not in CHANNEL:
        raise ValueError(f"{name} needs the input dim to be a multiple of {GROUP_SIZE}, got shape {list(shape)}")
