"""The merged model's own card (README.md) that `moeswap merge` writes: the base's card describes the base, so
it is not copied; this one says what the directory is: which base, which adapter, when, what was merged and
how closely, from the merge's report. The base card's license lines are kept (the merge is a derivative
of the base). Entry point: `card_text(report, adapter_config, base_card, date)`.
"""

from __future__ import annotations

from typing import Any

CARD_NAME = "README.md"
LICENSE_KEYS = ("license", "license_name", "license_link")


def is_card(name: str) -> bool:
    return name.lower() == CARD_NAME.lower()


def card_text(report: dict[str, Any], adapter_config: dict[str, Any], base_card: str | None, date: str) -> str:
    """The card for the merge `report` describes (merge.merge_checkpoint's), made on `date` (ISO, UTC)."""
    front = {k: v for k, v in _front_matter(base_card).items() if k in LICENSE_KEYS}
    lines = []
    if front:
        import yaml

        lines += ["---", yaml.safe_dump(front, sort_keys=False).rstrip("\n"), "---", ""]
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
