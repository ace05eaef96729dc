"""Shared fixtures: tiny models written once per session by `write_tiny_model` (the published layouts),
and two oracles: `greedy_oracle` (greedy tokens from the model's full forward) and `strict_json`.

Tests that damage a model take a copy (`copy_model`); the session directories are never modified.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run only in its interpreter, whose mode is fixed when triton is first
# imported (tests/ops/test_triton_mxfp4.py): set it before any test module (or torch) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_k3_dir(tmp_path_factory) -> Path:
    """A tiny Kimi K3 (seed 0): multimodal config, `language_model.` prefix, MXFP4 routed experts."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny_k3", "kimi_k3", "tiny", 0)


@pytest.fixture(scope="session")
def tiny_linear_dir(tmp_path_factory) -> Path:
    """A tiny Kimi Linear (seed 0): flat config, no prefix, bf16 routed experts."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny_linear", "kimi_linear", "tiny", 0)


@pytest.fixture
def copy_model(tmp_path):
    """copy_model(src) -> a private copy of a model directory, safe to damage."""

    def copy(src: Path, name: str = "model") -> Path:
        return Path(shutil.copytree(src, tmp_path / name))

    return copy


@pytest.fixture(scope="session", autouse=True)
def single_thread():
    """One intra-op thread per test process: tiny models run ~6x faster without OpenMP hand-offs, and
    `make test` runs two processes on two cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def greedy_oracle():
    """greedy_oracle(model, prompt_ids, n) -> n greedy tokens, each the argmax of the model's full forward
    over the prompt and the tokens before it: no state, no engine, no decode step; what greedy
    generation must reproduce."""
    import torch

    @torch.no_grad()
    def tokens(model, prompt, n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        return seq[len(prompt):]

    return tokens


@pytest.fixture(scope="session")
def strict_json():
    """strict_json(text) -> the parsed value; fails on NaN / Infinity / -Infinity, which Python's parser
    takes but JSON does not have (an undefined value must be written as null)."""

    def reject(constant: str):
        raise AssertionError(f"invalid JSON: {constant}")

    return lambda text: json.loads(text, parse_constant=reject)


@pytest.fixture(scope="session", autouse=True)
def private_tiktoken_cache(tmp_path_factory):
    """tiktoken copies every ranks file it loads into a cache (by default under the system temp
    directory); the suite keeps its copies in its own temporary directory."""
    import os

    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("tiktoken-cache"))
    yield
    if before is None:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def make_lora_adapter():
    """make_lora_adapter(base, out, targets, seed) -> out: a rank-4 LoRA adapter for the model in `base` on
    `targets` (dense and routed-expert), every B drawn non-zero (PEFT starts B at zero, which would make every
    comparison trivially equal), saved in PEFT's format with the base's fingerprint."""
    import torch

    from moeswap.lora import LoRAConfig, attach_lora, fingerprint, lora_modules, save_adapter
    from moeswap.models.loader import load_model

    def make(base, out, targets, seed: int, scale: float = 0.1):
        model, store = load_model(base)
        attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=targets),
                    generator=torch.Generator().manual_seed(seed))
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            Bs = [m.lora_B.weight for m in lora_modules(model).values()]
            for block in model.moe_blocks():
                experts = block._modules.get("expert_lora")
                Bs += list(experts.lora_B.values()) if experts is not None else []
            for B in Bs:
                B.copy_(torch.randn(B.shape, generator=gen) * scale)
        save_adapter(model, out, base_fingerprint=fingerprint(base))
        store.close()
        return out

    return make
