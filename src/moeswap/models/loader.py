"""The one loader: config.json + safetensors -> model with dense weights, routed experts in a store.

Builds the model on `meta`, classifies every checkpoint tensor through the architecture's
checkpoint map (moeswap.archs), fills each parameter from exactly its byte range (pread into owned memory, so the
process holds the dense weights once and maps nothing), indexes routed experts for the store, and
fails on any unmapped, missing, misshapen or wrongly typed tensor. Under `--dense-weights int8|int4` the dense
weights weights.dense_quant picks are quantised as they are read (unless stored so already). Entry point: `load_model(path, LoadOptions)`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from moeswap import archs
from moeswap.config import ModelConfig, load_config
from moeswap.experts.build import build_store
from moeswap.experts.source import ExpertIndex
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.models import build_model
from moeswap.models.layers.basic import StoredEmbedding
from moeswap.options import LoadOptions
from moeswap.weights import dense_quant, registry
from moeswap.weights.dense import FLOAT_LINEAR, LinearMethod, WeightLinear
from moeswap.weights.floating import FLOAT
from moeswap.weights.format import FP8_DTYPES, WeightFormat
from moeswap.weights.registry import choose_linear_method


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"--dtype {name!r} is not a floating-point torch dtype (try float32, bfloat16, float16)")
    return dtype


def check_device(name: str) -> torch.device:
    """A device the model can run on: the CPU or an existing CUDA device (meta holds no values; other
    backends lack the kernels the model calls)."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"--device {name!r} is not a torch device ({err})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: moeswap runs on cpu or cuda devices, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: no CUDA device is available here (use --device cpu)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def load_model(path: str | Path, options: LoadOptions = LoadOptions()):
    """Returns (model, store). The model is in eval mode with requires_grad=False everywhere."""
    check_device(options.device)
    config = load_config(path)
    ckpt = Checkpoint.open(path)
    dtype = resolve_dtype(options.dtype, options.device)
    check_expert_activations(options.expert_activations)
    model = build_model(config, device="meta")
    index = fill_from_checkpoint(model, ckpt, config, dtype, options.device, options.dense_weights)
    index.validate(ckpt, config)
    store = build_store(ckpt, index, config, dtype, options.device, options)
    attach_store(model, store)
    for block in model.moe_blocks():
        block.int8_activations = options.expert_activations == "int8"
        block.gate.top_p = float(options.expert_top_p)
    model.gemm_precision = options.gemm_precision
    return model.eval(), store


def check_expert_activations(choice: str) -> None:
    """int8 activations need this CPU's kernel build to have them (LoadOptions checked the name)."""
    if choice == "int8":
        from moeswap.ops import cpu_kernels

        kernel = cpu_kernels.kernel()
        if kernel is None or not kernel.has_int8_activations:
            why = cpu_kernels.build_error() if kernel is None else f"this CPU's build is {kernel.isa} without VNNI"
            raise ValueError(f"--expert-activations int8 needs the CPU kernel with AVX-512 VNNI ({why}); use fp32")


def attach_store(model: nn.Module, store) -> None:
    """Every MoE block fetches from `store`; with a prefetcher, the model also gets the next-layer
    lookahead hook (layer l+1's norm and router applied to layer l's hidden state)."""
    for block in model.moe_blocks():
        block.store = store
    model.expert_lookahead = None
    if not getattr(getattr(store, "prefetcher", None), "lookahead", False):
        return
    from moeswap.experts.prefetch import NextLayerLookahead

    routes = {}
    for i, layer in enumerate(model.model.layers):
        if i > 0 and hasattr(layer, "block_sparse_moe"):
            gate, norm = layer.block_sparse_moe.gate, layer.post_attention_layernorm
            routes[i - 1] = (i, lambda h, gate=gate, norm=norm: gate(norm(h))[0])
    model.expert_lookahead = NextLayerLookahead(routes, store.prefetcher)


def is_mtp_tensor(local_name: str, config: ModelConfig) -> bool:
    """A tensor of a multi-token-prediction layer (DeepSeek-V3's num_nextn_predict_layers, stored as
    layers after the last): not part of the model moeswap runs."""
    m = re.match(r"model\.layers\.(\d+)\.", local_name)
    return m is not None and config.num_layers <= int(m[1]) < config.num_layers + config.mtp_layers


def fill_from_checkpoint(model: nn.Module, ckpt: Checkpoint, config: ModelConfig, dtype: torch.dtype,
                         device: str, dense_weights: str = "compute") -> ExpertIndex:
    arch = archs.get(config.arch)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    index = ExpertIndex()
    prefix = config.weight_prefix

    def local_name(name: str) -> str:
        return name[len(prefix):] if prefix and name.startswith(prefix) else name

    # dense weights stored as several tensors (block FP8: `weight_scale_inv` beside a float8 weight), kept as
    # stored by their format's dense method or decoded at load
    stored = _stored_dense(ckpt, lambda n: arch.classify(local_name(n))[0] == "expert")
    # --dense-weights int8 / int4: the weights dense_quant picks, in that format (quantised here unless stored so)
    quantized = registry.FORMATS[dense_quant.FORMATS[dense_weights]] if dense_weights in dense_quant.FORMATS else None
    names_in = list(ckpt.names())
    bar = _progress(len(names_in), quantized)
    for name in names_in:
        bar.update()
        module, _, suffix = name.rpartition(".")
        if module in stored and suffix != stored[module][0].main:
            continue  # the weight's other tensors, read with its main one
        local = local_name(module + ".weight" if module in stored else name)
        target, match = arch.classify(local)
        if target == "skip" or is_mtp_tensor(local, config):
            continue
        if target == "expert":
            index.add(*arch.expert_key(match), name)
            continue
        if target not in params:
            info = ckpt.info(name)
            raise CheckpointError(
                f"unmapped tensor {name} in {info.file.name}: the {config.arch} model built from config.json "
                f"has no parameter {target!r} (does config.json match this checkpoint?)")
        param = params[target]
        info = ckpt.info(name)
        if not info.dtype.is_floating_point and module not in stored:
            raise CheckpointError(f"{name} in {info.file.name}: expected a float tensor, found {info.dtype}")
        fmt, names = stored.get(module, (FLOAT, {"weight": name}))
        if quantized is not None and fmt is not quantized and _quantizes(model, target, param.shape):
            tensor = arch.sanitize(target, _read_dense(ckpt, name, fmt, names, config, decode=True)["weight"], config)
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(f"{name} in {info.file.name}: expected shape {list(param.shape)} from "
                                      f"config.json, found {list(info.shape)}")
            _place_quantized(model, target, quantized, dense_quant.encode_by_rows(quantized, tensor), dtype, device)
            filled.add(target)
            continue
        if quantized is not None and target == EMBEDDING and fmt is FLOAT and _rows_stay_stored(config, device):
            table = arch.sanitize(target, ckpt.get(name), config)
            if tuple(table.shape) != tuple(param.shape):
                raise CheckpointError(f"{name} in {info.file.name}: expected shape {list(param.shape)} from "
                                      f"config.json, found {list(info.shape)}")
            model.model.embed_tokens = StoredEmbedding(table, dtype)
            filled.add(target)
            continue
        method = _dense_method(model, ckpt, fmt, names, target, config, dtype, device, dense_weights)
        tensors = _read_dense(ckpt, name, fmt, names, config, decode=method is FLOAT_LINEAR)
        main = "weight" if method is FLOAT_LINEAR else fmt.main  # decoded, or as stored
        tensor = arch.sanitize(target, tensors[main], config)
        shape = tensor.shape if main == "weight" else fmt.logical_shape({s: ckpt.info(n) for s, n in names.items()})
        if tuple(shape) != tuple(param.shape):
            raise CheckpointError(
                f"{name} in {info.file.name}: expected shape {list(param.shape)} from config.json, "
                f"found {list(info.shape)}")
        if method is FLOAT_LINEAR:
            _set_param(model, target, tensor, dtype, device)
        else:
            _install(model, target, method, {**tensors, main: tensor}, device)
        filled.add(target)
    bar.close()
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(prefix + m for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensors in {ckpt.root}: {shown}{more}")
    return index


EMBEDDING = "model.embed_tokens.weight"


def _rows_stay_stored(config: ModelConfig, device: str) -> bool:
    """--dense-weights int8|int4 keeps the embedding table as the checkpoint's mapping (StoredEmbedding) where
    only lookups read it: on the CPU, and not tied to the output head (which reads all of it every token)."""
    return torch.device(device).type == "cpu" and not config.tie_word_embeddings


def _progress(total: int, quantized: WeightFormat | None):
    """A progress bar over the checkpoint's tensors while dense weights are quantised at load (on a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"quantising dense weights to {quantized.label}" if quantized else "",
                unit=" tensors", disable=True if quantized is None else None, leave=False)


def _owner(model: nn.Module, target: str) -> tuple[nn.Module, str]:
    owner_name, _, attr = target.rpartition(".")
    return (model.get_submodule(owner_name) if owner_name else model), attr


def _keepable(model: nn.Module, target: str) -> bool:
    """Whether `target` is a bias-free nn.Linear's weight (what a dense method may hold)."""
    owner, attr = _owner(model, target)
    return attr == "weight" and type(owner) is nn.Linear and owner.bias is None


def _quantizes(model: nn.Module, target: str, shape) -> bool:
    """Whether --dense-weights int8 / int4 stores this parameter as codes (weights.dense_quant's rule)."""
    return _keepable(model, target) and dense_quant.quantizable(target.rpartition(".")[0], tuple(shape))


def _place_quantized(model: nn.Module, target: str, fmt: WeightFormat, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype, device: str) -> None:
    """A weight quantised at load: kept as its codes where fmt's dense method runs here, else its decoded
    values in `dtype` (the same rounding either way)."""
    dtypes = {s: t.dtype for s, t in tensors.items()}
    method = choose_linear_method(fmt.name, dtypes, None, dtype, device, "auto", True)
    if method is FLOAT_LINEAR:
        _set_param(model, target, fmt.decode(tensors, torch.float32), dtype, device)
    else:
        _install(model, target, method, tensors, device)


def _stored_dense(ckpt: Checkpoint, is_expert) -> dict[str, tuple[WeightFormat, dict[str, str]]]:
    """module -> (format, suffix -> tensor name) of the dense weights stored as more tensors than a float
    `weight`, in a registered format the loader takes for dense Linears (one with a dense method:
    weights.registry); routed experts' tensors are the store's."""
    suffixes = set().union(*(f.suffixes for f in registry.FORMATS.values() if f.linear_method is not None)) - {"weight"}
    modules: dict[str, dict[str, str]] = {}
    for name in ckpt.names():
        module, _, suffix = name.rpartition(".")
        if suffix in suffixes and not is_expert(name):
            modules.setdefault(module, {})[suffix] = name
    found = {}
    for module, names in modules.items():
        if module + ".weight" in ckpt:
            names["weight"] = module + ".weight"
        fmt = registry.for_suffixes(names, {s: ckpt.info(n).dtype for s, n in names.items()})
        if fmt is not None and fmt.linear_method is not None:
            found[module] = fmt, names
    return found


def _dense_method(model: nn.Module, ckpt: Checkpoint, fmt: WeightFormat, names: dict[str, str], target: str,
                  config: ModelConfig, dtype: torch.dtype, device: str, dense_weights: str) -> LinearMethod:
    """The method the Linear owning `target` gets (weights.registry.choose_linear_method): its weight kept as
    stored where it is a bias-free nn.Linear's and a kernel runs it, else decoded to `dtype` (FLOAT_LINEAR)."""
    keepable = _keepable(model, target)
    dtypes = {suffix: ckpt.info(n).dtype for suffix, n in names.items()}
    block = config.quant.fp8_block if config.quant is not None else None
    return choose_linear_method(fmt.name, dtypes, block, dtype, device, dense_weights, keepable)


def _read_dense(ckpt: Checkpoint, name: str, fmt: WeightFormat, names: dict[str, str], config: ModelConfig,
                decode: bool) -> dict[str, torch.Tensor]:
    """A dense weight's tensors by suffix: as stored (a float tensor, or a format's tensors for its dense
    method, checked as decoding would check them), or decoded to fp32 `weight` (`decode`; config.json must
    declare the format, e.g. its FP8 block size)."""
    info = ckpt.info(name)
    if fmt is FLOAT:
        if info.dtype in FP8_DTYPES:
            raise CheckpointError(f"{name} in {info.file.name}: a float8 weight without a weight_scale_inv "
                                  f"(block FP8) beside it; expected a float weight or both tensors")
        return {"weight": ckpt.read(name)}
    where = f"{name} in {info.file.name}"
    declared = config.quant.dense() if config.quant is not None else None
    block = config.quant.fp8_block if config.quant is not None else None
    if decode:
        fmt.check_declared(where, declared, block)
    tensors = {suffix: ckpt.read(n) for suffix, n in names.items()}
    try:
        if decode:
            return {"weight": fmt.decode(tensors, torch.float32, block)}
        fmt.check_stored(tensors, block)
    except ValueError as err:
        raise CheckpointError(f"{where}: cannot decode its {fmt.label} weight: {err}") from None
    return tensors


def _install(model: nn.Module, target: str, method: LinearMethod, tensors: dict[str, torch.Tensor],
             device: str) -> None:
    """The bias-free Linear owning `target` becomes a WeightLinear of `method` holding `tensors` as stored
    (the checkpoint's names: state_dict unchanged but for a block-FP8 weight's weight_scale_inv)."""
    owner_name = target.rpartition(".")[0]
    parent_name, _, child = owner_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = parent._modules[child]
    layer = WeightLinear(old.in_features, old.out_features, method).train(old.training)
    method.load_weights(layer, tensors, device)
    parent._modules[child] = layer


def _set_param(model: nn.Module, target: str, tensor: torch.Tensor, dtype: torch.dtype, device: str) -> None:
    owner_name, _, attr = target.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    # Keep fp32 where the reference computes in fp32 (router bias, gate constants); the rest in `dtype`.
    keep_fp32 = attr in ("A_log", "dt_bias", "e_score_correction_bias")
    value = tensor.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
