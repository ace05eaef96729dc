"""LoRA tests' helpers: a loaded tiny model and an adapter with non-zero B (PEFT starts B at zero, which
would make every comparison trivially equal)."""

from __future__ import annotations

import pytest
import torch

from moeswap.lora import LoRAConfig, attach_lora, lora_modules, trainable_parameters
from moeswap.models.loader import LoadOptions, load_model


def _randomize_b(model, seed: int = 1, scale: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in lora_modules(model).values():
            lora.lora_B.weight.copy_(torch.randn(lora.lora_B.weight.shape, generator=gen) * scale)
        for block in model.moe_blocks():  # routed-expert LoRA, after the dense ones
            experts = block._modules.get("expert_lora")
            for B in () if experts is None else experts.lora_B.values():
                B.copy_(torch.randn(B.shape, generator=gen) * scale)


@pytest.fixture
def randomize_b():
    """randomize_b(model, seed=1, scale=0.1): every LoRA B of `model` drawn from N(0, scale^2), in module order
    (routed experts' last)."""
    return _randomize_b


@pytest.fixture
def load():
    """load(path, **options) -> the model (fp32 compute; dense weights as the loader keeps them by default)."""

    def make(path, **options):
        return load_model(path, LoadOptions(dtype="float32", **options))[0]

    return make


@pytest.fixture
def tokens():
    return torch.randint(3, 500, (2, 21), generator=torch.Generator().manual_seed(7))


@pytest.fixture
def float64_twin():
    """float64_twin(path, model, config) -> `path` loaded in float64 with `model`'s LoRA adapter (`config`, its
    values copied): the exact function the fp32 model computes, to measure rounding against (tests/numerics.py)."""

    def make(path, model, config: LoRAConfig):
        twin = load_model(path, LoadOptions(dtype="float64"))[0]
        attach_lora(twin, config)
        with torch.no_grad():
            theirs = trainable_parameters(model)
            for name, p in trainable_parameters(twin).items():
                p.copy_(theirs[name])
        return twin

    return make

