"""Resolve the `--model` argument: a preset name, a model directory or a config.json path.

Presets are copies of the published configs shipped as package data (presets/*.json).
Config problems surface as PlanError naming the file and field; parsing itself is config.py's job.
"""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

from moeswap.config import ConfigError, ModelConfig, load_config, parse_config

from .errors import PlanError

PRESETS = {
    "kimi-k3": "kimi_k3.json",
    "kimi-linear-48b": "kimi_linear_48b.json",
    # config.json of deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct (block FP8, DeepseekV3ForCausalLM)
    "deepseek-v3": "deepseek_v3.json",
    "kimi-k2": "kimi_k2.json",
}


def preset_path(name: str) -> Path:
    return Path(str(resources.files("moeswap.planner") / "presets" / PRESETS[name]))


def resolve_model(spec: str) -> tuple[ModelConfig, str]:
    """Return (config, label) for a preset name, a directory holding config.json, or a config.json file."""
    try:
        with warnings.catch_warnings():
            # Unknown keys do not change sizes; the parser's warning is noise for planning.
            warnings.simplefilter("ignore")
            if spec in PRESETS:
                return load_config(preset_path(spec)), spec
            path = Path(spec)
            if path.exists():
                return load_config(path), str(path)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    raise PlanError(
        f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing model directory "
        "or config.json path"
    )


def parse_model_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    """parse_config with the planner's error type (used by the Python API and tests)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return parse_config(raw, source=source)
    except ConfigError as e:
        raise PlanError(str(e)) from None
