"""train/budget.py: the trainable-value count equals what prepare_model makes trainable (LoRA with routed
experts, full mode with and without targets), and a run that cannot fit is refused before allocating."""

from __future__ import annotations

import pytest

from moeswap.models.loader import load_model
from moeswap.train.budget import check_fits, trainable_values
from moeswap.train.config import TrainConfig
from moeswap.train.loop import train
from moeswap.train.targets import lora_config, prepare_model


@pytest.mark.parametrize("changes", [
    dict(mode="lora"),
    dict(mode="lora", target_modules=("q_proj", "w1", "w2"), shared_a=True),
    dict(mode="full", target_modules=("lm_head", "q_proj")),
    dict(mode="full"),
])
def test_the_count_is_what_prepare_model_trains(tiny_k3_dir, tmp_path, changes):
    cfg = TrainConfig(model=str(tiny_k3_dir), train_data="x", output=str(tmp_path / "o"), **changes)
    model, _ = load_model(tiny_k3_dir, cfg.load.replace(dense_weights="compute"))
    counted = trainable_values(model, cfg, lora_config(cfg))
    params = prepare_model(model, cfg)
    assert counted == sum(p.numel() for _, p in params)


def test_a_run_that_cannot_fit_is_refused_with_its_estimate(small_run, tiny_k3_dir, tmp_path):
    for huge in (dict(rank=1_000_000_000, mode="lora"), dict(micro_batch=1_000_000_000)):
        with pytest.raises(ValueError, match=r"this run needs at least .* more than this machine's"):
            train(small_run(**huge), progress=False)
        assert not (tmp_path / "out").exists()  # a refused run leaves no output directory behind
    cfg = small_run()
    model, _ = load_model(tiny_k3_dir, cfg.load)
    check_fits(model, cfg, lora_config(cfg), total=1 << 40)  # a small run fits a large machine
    with pytest.raises(ValueError, match="lower --rank, --micro-batch or --seq-len"):
        check_fits(model, cfg, lora_config(cfg), total=1 << 10)
