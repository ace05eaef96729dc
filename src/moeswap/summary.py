"""`moeswap inspect`: what a checkpoint holds, read from its headers only (no tensor data).

Parameters and bytes by component and by precision, total and active parameters per token, layers by
kind. Routed-expert MXFP4 tensors count 2 parameters per packed byte; their scales count as bytes only.
Entry point: `summarize(model_dir) -> dict`, `format_summary(dict) -> str`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from moeswap import archs
from moeswap.config import load_config
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.models.loader import is_mtp_tensor
from moeswap.units import human_bytes, human_count

# First match wins; applied to prefix-stripped parameter names.
COMPONENTS = (
    ("routed experts", r".*\.(block_sparse_moe|mlp)\.experts\..*"),  # mlp: DeepSeek-V3's names
    ("vision (skipped)", r"(vision_tower|mm_projector|multi_modal_projector)\..*"),
    ("embedding", r"model\.embed_tokens\..*"),
    ("lm_head", r"lm_head\..*"),
    ("router", r".*\.(block_sparse_moe|mlp)\.gate\..*"),
    ("shared experts", r".*\.shared_experts\..*"),
    ("latent projections", r".*\.routed_expert_(down|up)_proj\..*"),
    ("dense MLP", r".*\.mlp\.(gate|up|down)_proj\..*|.*\.block_sparse_moe\.(gate|up|down)_proj\..*"),
    ("KDA attention", r"KDA"),  # resolved by layer kind below
    ("MLA attention", r"MLA"),
    ("norms and residual scores", r".*"),
)


def _component(name: str, attn_kinds: tuple[str, ...]) -> str:
    m = re.match(r"model\.layers\.(\d+)\.self_attn\.", name)
    if m:
        if int(m.group(1)) >= len(attn_kinds):
            raise CheckpointError(f"tensor {name!r} is for layer {m.group(1)}, but config.json says the model "
                                  f"has {len(attn_kinds)} layers")
        return "KDA attention" if attn_kinds[int(m.group(1))] == "kda" else "MLA attention"
    for label, pattern in COMPONENTS:
        if pattern not in ("KDA", "MLA") and re.fullmatch(pattern, name):
            return label
    return "other"


def summarize(model_dir: str | Path) -> dict:
    config = load_config(model_dir)
    ckpt = Checkpoint.open(model_dir)
    arch = archs.get(config.arch)
    params: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    by_precision: dict[str, int] = defaultdict(int)
    prefix = config.weight_prefix
    for name in ckpt.names():
        info = ckpt.info(name)
        local = name[len(prefix):] if prefix and name.startswith(prefix) else name
        target, _ = arch.classify(local)
        comp = "MTP layers (skipped)" if is_mtp_tensor(local, config) else _component(local, config.attn_kinds)
        if name.endswith(".weight_packed"):
            count, precision = info.nbytes * 2, "mxfp4 (packed)" if info.dtype.itemsize == 1 else "int4 (packed)"
        elif name.endswith(".weight_scale"):
            count, precision = 0, "mxfp4 scales (e8m0)" if info.dtype.itemsize == 1 else "int4 group scales"
        elif name.endswith(".weight_shape"):
            count, precision = 0, "int4 shapes"
        elif name.endswith(".weight_scale_inv"):
            count, precision = 0, "block-FP8 scales"
        else:
            count, precision = info.nbytes // info.dtype.itemsize, str(info.dtype).removeprefix("torch.")
        params[comp] += count
        nbytes[comp] += info.nbytes
        by_precision[precision] += info.nbytes
    text_params = sum(v for k, v in params.items() if not k.endswith("(skipped)"))
    routed = params.get("routed experts", 0)
    m = config.moe
    active = text_params - params.get("embedding", 0) - routed + routed * m.top_k // max(1, m.num_experts)
    return {
        "path": str(model_dir), "arch": config.arch, "hidden_size": config.hidden_size,
        "layers": config.num_layers, "layers_by_kind": config.layer_summary(),
        "experts": {"routed": m.num_experts, "top_k": m.top_k, "shared": m.num_shared_experts,
                    "latent_dim": m.latent_dim, "expert_dim": m.expert_dim},
        "quantization": config.quant.format if config.quant else None,
        "total_params": text_params, "active_params": active,
        "params_by_component": dict(params), "bytes_by_component": dict(nbytes),
        "bytes_by_precision": dict(by_precision), "files": len(ckpt.files()), "total_bytes": ckpt.total_bytes,
        "tokens": _tokens(model_dir, config.eos_token_ids),
    }


def _tokens(model_dir: str | Path, model_eos) -> dict | None:
    """What ends a completion and a chat answer (Tokenizer.stop_ids, chat_stop_ids), with the chat template's
    origin; None where the directory has no tokenizer moeswap reads."""
    from moeswap.text.tokenizer import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(model_dir)
    except (TokenizerError, ValueError):  # (ChatTemplateError: a template that does not compile)
        return None

    def named(ids) -> list[dict]:
        return [{"id": i, "text": tok.id_to_special.get(i) or tok.decode([i])} for i in ids]

    return {"vocab_size": tok.vocab_size, "end_of_sequence": named(tok.stop_ids(model_eos)),
            "chat_template": "built-in" if tok.chat_template is None else tok.chat_template.origin,
            "turn_end": None if tok.turn_end_id is None else named([tok.turn_end_id])[0],
            "chat_stops": named(tok.chat_stop_ids(model_eos))}


def format_summary(s: dict) -> str:
    lines = [
        f"{s['path']}: {s['arch']}, hidden {s['hidden_size']}, {s['layers']} layers "
        f"({', '.join(f'{v} {k}' for k, v in s['layers_by_kind'].items())})",
        f"experts: {s['experts']['routed']} routed (top {s['experts']['top_k']}), {s['experts']['shared']} shared, "
        f"expert width {s['experts']['expert_dim']}, latent {s['experts']['latent_dim'] or 'none'}; "
        f"quantization: {s['quantization'] or 'none'}",
        f"parameters: {human_count(s['total_params'])} total, {human_count(s['active_params'])} active per token "
        f"(excluding the input embedding); {human_bytes(s['total_bytes'])} in {s['files']} files",
        "",
        f"{'component':<28}{'params':>12}{'bytes':>14}",
    ]
    for comp in sorted(s["bytes_by_component"], key=lambda c: -s["bytes_by_component"][c]):
        lines.append(f"{comp:<28}{human_count(s['params_by_component'][comp]):>12}"
                     f"{human_bytes(s['bytes_by_component'][comp]):>14}")
    lines += ["", f"{'precision':<28}{'bytes':>26}"]
    for prec, b in sorted(s["bytes_by_precision"].items(), key=lambda kv: -kv[1]):
        lines.append(f"{prec:<28}{human_bytes(b):>26}")
    t = s.get("tokens")
    if t is not None:
        def ids(items: list[dict]) -> str:
            return ", ".join(f"{x['text']} ({x['id']})" for x in items) or "none"

        end = t["turn_end"]
        lines += ["", f"tokens: {t['vocab_size']} ids; a completion ends at {ids(t['end_of_sequence'])}; "
                      f"chat template {t['chat_template']}, its turn end {ids([end] if end else [])}"
                      + ("" if t["chat_stops"] == t["end_of_sequence"] else
                         f", so a chat answer ends at {ids(t['chat_stops'])}")]
    return "\n".join(lines)
