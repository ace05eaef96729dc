"""The card (README.md) of a model that moeswap makes from another: `moeswap merge` (base + adapter) and
`moeswap quantize` (re-encoded weights). The source's card describes the source, so it is not copied; the
new one says what the directory is: which source, when, what was changed and how closely, from the
command's report. The source card's license lines are kept (the result is a derivative of the source).
Entry points: `merge_card(report, adapter_config, base_card, date)`, `quantize_card(report, source_card, date)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CARD_NAME = "README.md"
LICENSE_KEYS = ("license", "license_name", "license_link")


def is_card(name: str) -> bool:
    return name.lower() == CARD_NAME.lower()


def _license_lines(source_card: str | None) -> list[str]:
    """The source card's license keys as the new card's front matter (none: no lines)."""
    front = {k: v for k, v in _front_matter(source_card).items() if k in LICENSE_KEYS}
    if not front:
        return []
    import yaml

    return ["---", yaml.safe_dump(front, sort_keys=False).rstrip("\n"), "---", ""]


def merge_card(report: dict[str, Any], adapter_config: dict[str, Any], base_card: str | None, date: str) -> str:
    """The card for the merge `report` describes (merge.merge_checkpoint's), made on `date` (ISO, UTC)."""
    lines = _license_lines(base_card)
    front = bool(lines)
    r, alpha, targets = (adapter_config.get(k) for k in ("r", "lora_alpha", "target_modules"))
    targets = ", ".join(targets) if isinstance(targets, list) else targets
    experts = report["merged_expert_weights"]
    lines += [
        "# A base model with a LoRA adapter merged in",
        "",
        f"Made by `moeswap merge` on {date} (UTC).",
        "",
        f"- Base model: `{report['base']}` (its own card describes the base and is not copied here"
        + ("; its license lines are kept above" if front else "") + ")",
        f"- Adapter: `{report['adapter']}`" + (f" (LoRA r={r}, alpha={alpha}" if r is not None else "")
        + (f", targets {targets}" if r is not None and targets else "") + (")" if r is not None else ""),
        f"- Merged: {report['merged_tensors']} dense weight tensors, each W + s·B·A (s the adapter's scaling) "
        "computed in fp32 and "
        f"rounded once to its stored dtype (largest rounding {report['max_abs_rounding']:.3g})"
        + (f"; {experts} routed-expert projections decoded, updated and re-encoded in their stored format "
           f"(largest error {report['expert_max_abs_error']:.3g})" if experts else ""),
        "- Everything else (config.json, the tokenizer, other weights) is the base's, unchanged.",
        "",
        "Per-tensor figures: `merge_report.json`.",
    ]
    return "\n".join(lines) + "\n"


def quantize_card(report: dict[str, Any], source_card: str | None, date: str) -> str:
    """The card for the quantization `report` describes (quantize.quantize_checkpoint's), made on `date`."""
    lines = _license_lines(source_card)
    front, s = bool(lines), report["summary"]
    lines += [
        f"# {Path(report['source']).name}, quantized",
        "",
        f"Made by `moeswap quantize` on {date} (UTC).",
        "",
        f"- Source model: `{report['source']}` (its own card describes the source and is not copied here"
        + ("; its license lines are kept above" if front else "") + ")",
        f"- Routed experts: {report['format']}, {s['encoded']} of {s['expert_weights']} weight tensors encoded"
        + (f" (mean relative error {s['mean_rel_error']:.3g}, largest {s['max_rel_error']:.3g})" if s["encoded"] else "")
        + (f", {s['copied']} copied as they were" if s["copied"] else ""),
    ]
    dense = report.get("dense")
    if dense is not None:
        d = dense["summary"]
        lines.append(f"- Dense weights: {dense['format']}, {d['encoded']} tensors encoded"
                     + (f" (mean relative error {d['mean_rel_error']:.3g}, largest {d['max_rel_error']:.3g})"
                        if d["encoded"] else "")
                     + f", {d['bytes_in'] / 2**20:.1f} MiB to {d['bytes_out'] / 2**20:.1f} MiB")
    if report.get("dequantized_to_bf16"):
        lines.append(f"- Dequantized to bf16: {len(report['dequantized_to_bf16'])} modules")
    lines += [
        f"- Weights in all: {s['bytes_in'] / 2**20:.1f} MiB to {s['bytes_out'] / 2**20:.1f} MiB.",
        "- Everything else (the tokenizer, the generation config) is the source's; config.json says the new "
        "formats (`quantization_config`).",
        "",
        "Per-tensor errors: `quantization_report.json`.",
    ]
    return "\n".join(lines) + "\n"


def _front_matter(card: str | None) -> dict[str, Any]:
    """The YAML block a model card starts with (between `---` lines), or {} when there is none or it does
    not parse."""
    if not card or not card.startswith("---"):
        return {}
    head, sep, _ = card[3:].partition("\n---")
    if not sep:
        return {}
    import yaml

    try:
        data = yaml.safe_load(head)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}
