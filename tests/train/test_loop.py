"""train/loop.py and targets.py: the model learns a task it cannot know; runs are bit-identical by seed;
accumulation, padding and gradient checkpointing leave the losses alone; a non-finite loss stops the run
naming the step and writes nothing; what trains is what was asked for."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moeswap.models.loader import load_model
from moeswap.options import LoadOptions
from moeswap.train.config import TrainConfig
from moeswap.train.data import Sample, eval_rows
from moeswap.train.loop import NonFiniteError, _loss_sum, lr_factor, step_gradients, train
from moeswap.train.targets import prepare_model

# what full mode writes for the tiny base: one shard and its index (train/export.py)
MODEL_FILES = ("model-00001-of-00001.safetensors", "model.safetensors.index.json")


def test_learning_rate_schedule():
    cos = [lr_factor(s, 10, 2, "cosine", 0.1) for s in range(10)]
    assert cos[:3] == [0.5, 1.0, 1.0]  # warm-up to the peak, then the cosine starts at 1
    assert cos[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(cos[1:], cos[2:]))
    assert cos[2 + 7 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    assert [lr_factor(s, 10, 3, "constant", 0.0) for s in range(5)] == [1 / 3, 2 / 3, 1.0, 1.0, 1.0]


def test_heldout_loss_falls_by_a_large_margin(learned):
    m = learned.manifest
    before, after = m["eval_loss_before"], m["eval_loss_after"]
    # untrained: about ln(512) per token; the permutation once learnt predicts every target but the EOS
    assert before > 5.5
    assert after < 2.0 and before - after > 4.0, (before, after)
    assert [e["step"] for e in m["eval"]] == [0, 10, 20] and m["eval"][1]["loss"] < before
    assert m["curve"][-1]["loss"] < 0.3 * m["curve"][0]["loss"]
    # routed experts are parameters in full mode: they, the routers and the latent projections all train
    # (what gets none: the attention-residual weights of layers where they are unused)
    assert not [n for n in m["trainable"]["without_gradient"] if "block_sparse_moe" in n]
    assert set(m["expert_load"]["layers"]) == {"1", "2", "3", "4", "5"}  # every MoE layer balanced and reported
    assert all((learned.out_dir / name).is_file() for name in MODEL_FILES)


def test_two_runs_with_one_seed_are_bit_identical(small_run, tmp_path):
    one = train(small_run(output=str(tmp_path / "a")), progress=False)
    two = train(small_run(output=str(tmp_path / "b")), progress=False)
    assert one.losses == two.losses and len(one.losses) == 4
    assert one.manifest["eval"] == two.manifest["eval"]
    for name in MODEL_FILES:
        assert (one.out_dir / name).read_bytes() == (two.out_dir / name).read_bytes(), name
    other = train(small_run(output=str(tmp_path / "c"), seed=1), progress=False)
    assert other.losses != one.losses


def test_gradient_checkpointing_keeps_the_losses(small_run, tmp_path, monkeypatch):
    from moeswap.models import decoder

    base = train(small_run(output=str(tmp_path / "a")), progress=False).losses
    calls = []

    def counting(fn, *args, **kwargs):
        calls.append(1)
        return torch.utils.checkpoint.checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(decoder, "checkpoint", counting)
    ckpt = train(small_run(output=str(tmp_path / "b"), gradient_checkpointing=True), progress=False).losses
    assert ckpt == base  # the recomputed forward is the same arithmetic
    assert len(calls) == 4 * 6  # the model's per-layer checkpointing: every layer of every training forward


def test_accumulation_and_padding_leave_the_step_gradient_alone(tiny_k3_dir, k3_tok, small_run):
    """Rows of different lengths in one padded pass, or one per pass accumulated: the same gradient of the
    mean over the step's target tokens (and a row's loss never sees its batch neighbours)."""
    model, store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        params = prepare_model(model, small_run())
        texts = ("the lamp", "the lamp is lit and the fog horn is silent tonight", "and the sea")
        rows = eval_rows([Sample(tuple(ids := k3_tok.encode(t)), (False,) + (True,) * (len(ids) - 1), "x")
                          for t in texts])
        grads, losses = [], []
        for micro_batch, accum in ((3, 1), (1, 3)):
            cfg = small_run(micro_batch=micro_batch, grad_accum=accum)
            loss, _ = step_gradients(model, rows, k3_tok.eos_ids[0], cfg, torch.device("cpu"), 0)
            grads.append({n: p.grad.clone() for n, p in params if p.grad is not None})
            losses.append(loss)
            model.zero_grad(set_to_none=True)
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 100
        # equal up to rounding: batch shapes change GEMM summation orders (~1e-5 relative in this tiny
        # random model's logits); a wrong normalisation would be off by a factor of 1.5 to 3
        flat = [torch.cat([g.flatten() for g in gs.values()]) for gs in grads]
        assert float((flat[1] - flat[0]).norm() / flat[0].norm()) < 1e-3
        for name, g in grads[0].items():
            assert float((grads[1][name] - g).norm() / g.norm()) < 1e-2, name
    finally:
        store.close()


def test_bf16_autocast_computes_close_to_fp32_and_trains(small_run, tmp_path):
    base = train(small_run(output=str(tmp_path / "a")), progress=False).manifest
    bf16 = train(small_run(output=str(tmp_path / "b"), precision="bf16"), progress=False).manifest
    # the same weights at the first step and before it: bf16 rounding only (later steps drift apart: Adam's
    # early updates are about lr x the gradient's sign, which rounding flips where a gradient is near 0)
    assert bf16["curve"][0]["loss"] == pytest.approx(base["curve"][0]["loss"], abs=0.05)
    assert bf16["eval_loss_before"] == pytest.approx(base["eval_loss_before"], abs=0.05)
    assert bf16["curve"][0]["loss"] != base["curve"][0]["loss"]
    assert bf16["eval_loss_after"] < bf16["eval_loss_before"] - 0.3  # fp32 falls ~0.6 in these 4 steps


def test_a_padded_row_loses_nothing_to_its_neighbours(tiny_k3_dir, k3_tok):
    """packing off: a sample's loss is the same alone or right-padded beside longer ones."""
    model, store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        samples = [Sample(tuple(k3_tok.encode(t)), (False,) + (True,) * (len(k3_tok.encode(t)) - 1), "x")
                   for t in ("the lamp", "the lamp is lit and the fog horn is silent tonight", "and the sea")]
        rows = eval_rows(samples)
        cfg = TrainConfig()
        with torch.no_grad():
            together, _ = _loss_sum(model, rows, k3_tok.eos_ids[0], cfg, torch.device("cpu"))
            alone = sum(_loss_sum(model, [r], k3_tok.eos_ids[0], cfg, torch.device("cpu"))[0] for r in rows)
        assert float(together) == pytest.approx(float(alone), rel=1e-5)
    finally:
        store.close()


def test_a_non_finite_loss_stops_naming_the_step_and_writes_nothing(small_run, tmp_path):
    cfg = small_run(lr=1e30, max_grad_norm=0.0, save_interval=1)
    with pytest.raises(NonFiniteError, match=r"^step (2|3): the (loss|gradient norm) is (nan|inf)"):
        train(cfg, progress=False)
    out = tmp_path / "out"
    assert not any((out / name).exists() for name in MODEL_FILES) and not (out / "manifest.json").exists()


def test_full_mode_targets(tiny_k3_dir, small_run):
    model, store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        params = prepare_model(model, small_run(target_modules=("self_attn.o_proj", "model.norm")))
        names = [n for n, _ in params]
        assert names == [n for n, _ in model.named_parameters() if n.endswith("self_attn.o_proj.weight")
                         or n == "model.norm.weight"]
        assert all(p.requires_grad == (n in names) for n, p in model.named_parameters())
        every = [n for n, _ in prepare_model(model, small_run())]
        assert "model.embed_tokens.weight" in every and not any("e_score_correction_bias" in n for n in every)
        regex = [n for n, _ in prepare_model(model, small_run(target_modules=(r"model\.layers\.[01]\..*_proj",)))]
        assert regex and all(n.startswith(("model.layers.0.", "model.layers.1.")) for n in regex)
        # moeswap.lora's rule: whole dotted name parts, and a module above selects its parameters
        attn = [n for n, _ in prepare_model(model, small_run(target_modules=("self_attn",)))]
        assert attn == [n for n, _ in model.named_parameters() if ".self_attn." in n]
        with pytest.raises(ValueError, match="--target-modules 'nope_proj' matches no module or parameter"):
            prepare_model(model, small_run(target_modules=("o_proj", "nope_proj")))
        with pytest.raises(ValueError, match="--target-modules 'proj' matches no module or parameter"):
            prepare_model(model, small_run(target_modules=("proj",)))
        with pytest.raises(ValueError, match=r"is a regex, which must be the only pattern"):
            prepare_model(model, small_run(target_modules=("o_proj", r".*\.q_proj")))
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_run_refused_for_a_bad_target_leaves_nothing(tiny_k3_dir, chains, tmp_path, capsys, mode):
    """The pattern is checked after the model loads, the output directory already made: the refusal
    removes it (and a directory the user made stays, empty)."""
    from moeswap import cli

    made = tmp_path / "mine"
    made.mkdir()
    for out in (tmp_path / "a" / "b", made):
        assert cli.main(["train", "--model", str(tiny_k3_dir), "--train-data", str(chains), "--output", str(out),
                         "--mode", mode, "--target-modules", "nope_proj", "--max-steps", "1", "--seq-len", "32",
                         "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moeswap: error: ") and "'nope_proj' matches no module" in err and err.count("\n") == 1
    assert not (tmp_path / "a").exists() and list(made.iterdir()) == []


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_kda_backpropagates_when_its_state_is_written_back_in_place(form):
    """What a training forward does (models/layers/kda.py): run the core from state S0, then copy the final
    state into S0. The gradient must be the one of the same math without the write (it failed with 'modified
    by an inplace operation' when the core kept S0 itself for backward)."""
    from moeswap.ops.kda import kda_chunked, kda_recurrent

    run = kda_chunked if form == "chunked" else kda_recurrent
    g = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 5, 2, 8
    q, k, v = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1) for _ in range(3))
    decay, beta = -torch.rand(B, T, H, K, generator=g), torch.rand(B, T, H, generator=g)
    grads = []
    for write_back in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, decay, beta)]
        state = torch.randn(B, H, K, K, generator=torch.Generator().manual_seed(1))
        out, final = run(*leaves, state)
        if write_back:
            state.copy_(final.detach())
        (out.square().sum() + final.square().sum()).backward()
        grads.append([t.grad for t in leaves])
    for with_write, without in zip(*grads[::-1]):
        torch.testing.assert_close(with_write, without, rtol=0, atol=0)


def test_epochs_set_the_step_count(small_run):
    samples = [Sample((1, 2, 3), (False, True, True), str(i)) for i in range(10)]
    from moeswap.train.data import RowStream
    from moeswap.train.loop import total_steps

    stream = RowStream(samples, 0, 8, "off")
    assert total_steps(small_run(max_steps=0, epochs=1.5, micro_batch=2, grad_accum=2), stream) == 4  # 15 rows / 4
    assert total_steps(small_run(max_steps=0, epochs=2, micro_batch=5), stream) == 4
    assert total_steps(small_run(max_steps=7, epochs=2), stream) == 7
    packed = RowStream(samples, 0, 8, "concat")  # two samples a row
    assert total_steps(small_run(max_steps=0, epochs=1, micro_batch=1, packing="concat"), packed) == 5


def test_cli_trains_chat_data_from_a_yaml_config_with_a_progress_bar(tiny_k3_dir, k3_tok, tmp_path, capsys):
    from moeswap import cli
    from moeswap.train.data import Encoder

    convo = [{"role": "user", "content": "Is the lamp lit?"}, {"role": "assistant", "content": "Yes."}]
    lines = [json.dumps({"messages": convo}), json.dumps({"messages": convo[:1] + [{"role": "assistant",
                                                                                   "content": "No, not yet."}]})]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines * 3) + "\n")
    (tmp_path / "run.yaml").write_text(f"model: {tiny_k3_dir}\ntrain_data: chat.jsonl\nmode: full\nlr: 1.0e-3\n"
                                       "max_steps: 2\nmicro_batch: 2\nseq_len: 64\noutput: out\n")
    assert cli.main(["train", str(tmp_path / "run.yaml"), "--eval-data", str(tmp_path / "chat.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trained 2 steps, ") and f"wrote {tmp_path / 'out'}" in out
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    encoder = Encoder(k3_tok, 64, False)
    masks = [encoder.chat(json.loads(line)["messages"])[1] for line in lines * 3]
    assert m["data"]["files"][0]["formats"] == {"text": 0, "chat": 6}
    assert m["data"]["train_target_tokens"] == sum(sum(mask) for mask in masks)
    assert m["data"]["eval_from"] == "file" and m["eval_loss_before"] is not None

    cfg = TrainConfig(model=str(tiny_k3_dir), train_data=str(tmp_path / "chat.jsonl"), mode="full", max_steps=1,
                      output=str(tmp_path / "bar"))
    train(cfg, progress=True)
    err = capsys.readouterr().err
    assert "train: 100%" in err and all(f"{key}=" in err for key in ("loss", "tok_s", "load", "lr"))
