"""Acceptance of `moeswap train` in lora mode, adapters on routed experts included: held-out loss falls by a large
margin on a task the base cannot know and every routed-expert adapter learns; the adapter written is the one
trained (loaded back, it gives the run's final eval loss); runs are bit-identical by seed; a 25 % expert
budget gives the losses of all-resident; bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from moeswap import cli
from moeswap.lora import CONFIG_NAME, MOESWAP_NAME, WEIGHTS_NAME, load_adapter
from moeswap.models.loader import load_model
from moeswap.options import LoadOptions
from moeswap.text.tokenizer import load_tokenizer
from moeswap.train.checkpoint import all_checkpoints
from moeswap.train.config import TrainConfig
from moeswap.train.data import eval_rows, load_data
from moeswap.train.loop import evaluate, train
from moeswap.train.targets import prepare_model

EXPERT_KEY = ".block_sparse_moe.experts."


def adapter_tensors(out) -> dict[str, torch.Tensor]:
    with safe_open(out / WEIGHTS_NAME, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.slow
def test_lora_learns_a_task_the_base_cannot_know(lora_learned, tiny_k3_dir):
    m = lora_learned.manifest
    before, after = m["eval_loss_before"], m["eval_loss_after"]
    assert before > 5.5  # about ln(512) per token untrained
    assert after < 2.5 and before - after > 3.5, (before, after)
    assert m["mode"] == "lora" and m["trainable"]["without_gradient"] == []
    tensors = adapter_tensors(lora_learned.out_dir)
    # PEFT starts B at zero: a routed expert's B is nonzero only if its LoRA received gradients, and so is
    # every expert's B that was routed to; every layer and projection has some
    cfg = TrainConfig.from_dict(m["config"])
    model, store = load_model(tiny_k3_dir, cfg.load)
    try:
        blocks = model.moe_blocks()
        for b in blocks:
            for p in ("w1", "w2", "w3"):
                Bs = [tensors[f"base_model.model.language_model.model.layers.{b.layer_idx}{EXPERT_KEY}{e}.{p}"
                              f".lora_B.weight"] for e in range(b.num_experts)]
                assert sum(bool(B.any()) for B in Bs) >= b.num_experts // 2, (b.layer_idx, p)
        # ... and its A moved from the seed's initialisation (A's gradient is nonzero once B is)
        prepare_model(model, cfg)
        A0 = blocks[0].expert_lora.lora_A["w2"][3]
        A1 = tensors[f"base_model.model.language_model.model.layers.{blocks[0].layer_idx}{EXPERT_KEY}3.w2.lora_A.weight"]
        assert not torch.equal(A0, A1) and A0.shape == A1.shape
    finally:
        store.close()
    assert sum(EXPERT_KEY in k for k in tensors) == len(blocks) * blocks[0].num_experts * 3 * 2

    # the adapter on disk is the trained one: loaded onto the base it gives the run's last eval loss
    model, store = load_model(tiny_k3_dir, cfg.load)
    try:
        load_adapter(model, lora_learned.out_dir, base_dir=tiny_k3_dir)
        tok = load_tokenizer(tiny_k3_dir)
        rows = eval_rows(load_data(cfg, tok).eval)
        assert evaluate(model, rows, tok.eos_ids[0], cfg, torch.device("cpu")) == pytest.approx(after, rel=1e-6)
    finally:
        store.close()


def test_two_lora_runs_with_one_seed_are_bit_identical(small_run, lora_settings, tmp_path):
    one = train(small_run(output=str(tmp_path / "a"), **lora_settings), progress=False)
    two = train(small_run(output=str(tmp_path / "b"), **lora_settings), progress=False)
    assert one.losses == two.losses and len(one.losses) == 4 and one.losses[-1] < one.losses[0]
    assert one.manifest["eval"] == two.manifest["eval"]
    for name in (WEIGHTS_NAME, CONFIG_NAME, MOESWAP_NAME):
        assert (one.out_dir / name).read_bytes() == (two.out_dir / name).read_bytes()
    other = train(small_run(output=str(tmp_path / "c"), seed=1, **lora_settings), progress=False)
    assert other.losses != one.losses


def expert_bytes(model_dir) -> int:
    _, store = load_model(model_dir, LoadOptions())
    try:
        return sum(store.fast.cost(k) for k in store.index.entries)
    finally:
        store.close()


@pytest.mark.slow
def test_a_quarter_expert_budget_trains_as_all_resident(small_run, lora_settings, tiny_k3_dir, tmp_path, capsys):
    """`moeswap train --expert-memory` at 25 % of the experts' bytes: the store evicts and fetches experts again
    (for backward too) and the run is the all-resident one, loss for loss and byte for byte."""
    whole = train(small_run(output=str(tmp_path / "whole"), **lora_settings), progress=False)
    cfg = small_run(output=str(tmp_path / "quarter"), **lora_settings)
    data = cfg.as_dict()
    flags = ["train", "--no-progress", "--expert-memory", str(expert_bytes(tiny_k3_dir) // 4)]
    for key in ("model", "train_data", "output", "mode", "lr", "max_steps", "micro_batch", "seq_len", "rank",
                "alpha", "eval_split"):
        flags += ["--" + key.replace("_", "-"), str(data[key])]
    flags += ["--target-modules", ",".join(data["target_modules"])]
    assert cli.main(flags) == 0, capsys.readouterr().err
    quarter = json.loads((tmp_path / "quarter" / "manifest.json").read_text())
    assert quarter["config"] == {**whole.manifest["config"], "output": str(tmp_path / "quarter"),
                                 "load": {**whole.manifest["config"]["load"],
                                          "expert_memory": expert_bytes(tiny_k3_dir) // 4}}
    assert [p["loss"] for p in quarter["curve"]] == whole.losses and quarter["eval"] == whole.manifest["eval"]
    assert (tmp_path / "quarter" / WEIGHTS_NAME).read_bytes() == (whole.out_dir / WEIGHTS_NAME).read_bytes()
    store = quarter["expert_store"]
    fast = store["tiers"]["fast"]
    assert fast["evictions"] > 0 and store["graph"]["refetched"] > 0
    assert whole.manifest["expert_store"]["tiers"]["fast"]["evictions"] == 0


def one_line_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert cli.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeswap: error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_line_and_exit_2(small_run, lora_settings, lora_learned, tiny_k3_dir, tiny_linear_dir,
                                          tmp_path, capsys):
    cfg = small_run(**lora_settings)
    base = ["train", "--no-progress", "--model", str(tiny_k3_dir), "--train-data", cfg.train_data, "--mode", "lora",
            "--max-steps", "2", "--seq-len", "32"]
    err = one_line_error(capsys, *base, "--output", str(tmp_path / "a"), "--target-modules", "q_proj,qproj")
    assert "LoRA target 'qproj' matches no module of this model; candidates: q_proj" in err
    assert not (tmp_path / "a" / WEIGHTS_NAME).exists()  # never a silently untrained adapter
    err = one_line_error(capsys, *base, "--output", str(tmp_path / "b"), "--target-modules", r"model\.layers\.99\..*")
    assert "matches no module" in err

    # an adapter trained on one base, applied to another
    err = one_line_error(capsys, "generate", str(tiny_linear_dir), "--prompt", "the", "--lora",
                         str(lora_learned.out_dir))
    assert "was made for a different base model" in err

    # a damaged checkpoint of a lora run
    class Stop(Exception):
        pass

    def stop(step, path):
        if step == 2:
            raise Stop

    run = small_run(output=str(tmp_path / "c"), save_interval=1, **lora_settings)
    with pytest.raises(Stop):
        train(run, progress=False, on_checkpoint=stop)
    newest = all_checkpoints(tmp_path / "c")[-1]
    data = bytearray((newest / "params.safetensors").read_bytes())
    data[-3] ^= 0x40
    (newest / "params.safetensors").write_bytes(bytes(data))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**{k: v for k, v in run.as_dict().items() if k != "load"},
                                                     **run.as_dict()["load"]}))
    err = one_line_error(capsys, "train", str(tmp_path / "c.yaml"), "--resume", "--no-progress")
    assert "step-00000002 is damaged: params.safetensors does not match the SHA-256" in err
    assert not (tmp_path / "c" / WEIGHTS_NAME).exists()
