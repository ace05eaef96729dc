"""train/loop.py's chunked loss (--loss-chunk): the summed cross-entropy and every trainable parameter's
gradient equal the unchunked ones (the whole [tokens, vocab] logits at once) to fp32 rounding, for chunk
sizes that divide the token count, that do not, of one token and of more than all of them, with padding and
masked-out targets among the tokens; LoRA on the output head and full mode (the head's own weight) both."""

from __future__ import annotations

import pytest
import torch

from moeswap.models.loader import load_model
from moeswap.options import LoadOptions
from moeswap.train.config import TrainConfig
from moeswap.train.data import IGNORE, Sample, batch, eval_rows
from moeswap.train.loop import _loss_sum
from moeswap.train.targets import prepare_model

TEXTS = ("the lamp", "the lamp is lit and the fog horn is silent tonight", "and the sea is calm")


def rows_with_gaps(tok):
    """Three rows of different lengths (so the batch pads) whose masks also leave targets out mid-row."""
    samples = []
    for k, t in enumerate(TEXTS):
        ids = tok.encode(t)
        mask = [False] + [(i + k) % 3 != 0 for i in range(1, len(ids))]
        samples.append(Sample(tuple(ids), tuple(mask), "x"))
    return eval_rows(samples)


def loss_and_grads(model, params, rows, pad_id, cfg):
    model.zero_grad(set_to_none=True)
    loss, _ = _loss_sum(model, rows, pad_id, cfg, torch.device("cpu"))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in params if p.grad is not None}


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_chunked_loss_and_gradients_equal_the_unchunked(tiny_k3_dir, k3_tok, mode):
    model, store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        run = dict(mode="full")
        if mode == "lora":
            run = dict(mode="lora", target_modules=("q_proj", "w1", "lm_head"), rank=4)
        with torch.no_grad():  # KDA gates in their working range (this init saturates the decay: tiny gradients)
            for layer in model.model.layers:
                if layer.attn_kind == "kda":
                    layer.self_attn.A_log.fill_(-1.0)
                    layer.self_attn.dt_bias.zero_()
        params = prepare_model(model, TrainConfig(**run))
        if mode == "lora":  # B nonzero, as after some training (at init B = 0 and A gets no gradient)
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for _, p in params:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        rows = rows_with_gaps(k3_tok)
        pad = k3_tok.eos_ids[0]
        tokens, labels = batch(rows, pad)
        n, targets = tokens.numel(), int((labels != IGNORE).sum())
        assert n % 4 == 0 and n % 5 and n % 13 and 0 < targets < n - 6  # padding and masked targets both present
        ref_loss, ref = loss_and_grads(model, params, rows, pad, TrainConfig(**run, loss_chunk=0))
        assert len(ref) > len(params) // 2  # (a few of the full model's get none on this batch)
        if mode == "lora":
            assert any("lm_head" in name for name in ref)
        else:
            assert any("lm_head" in name or "embed_tokens" in name for name in ref)
        for chunk in (1, 4, 5, 13, n - 1, n, 4 * n):
            loss, grads = loss_and_grads(model, params, rows, pad, TrainConfig(**run, loss_chunk=chunk))
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=f"loss_chunk={chunk}")
            assert grads.keys() == ref.keys()
            for name, g in grads.items():
                # rtol 1e-5, and an absolute floor of 1e-5 of the tensor's largest entry for entries that
                # are sums cancelling to ~0
                atol = 1e-5 * float(ref[name].abs().max())
                torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=atol, msg=lambda m, c=chunk, n=name: f"loss_chunk={c}: {n}: {m}")
        with torch.no_grad():  # eval's path: no recomputation, the same sum
            loss, _ = _loss_sum(model, rows, pad, TrainConfig(**run, loss_chunk=5), torch.device("cpu"))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    finally:
        store.close()


def test_no_more_than_a_chunk_of_logits_is_kept_for_backward(tiny_k3_dir, k3_tok):
    """The tensors autograd saves for backward: unchunked, the whole [tokens, vocab] logits; chunked, nothing
    with more than loss_chunk x vocab elements (each chunk's logits are recomputed in backward)."""
    model, store = load_model(tiny_k3_dir, LoadOptions(dense_weights="compute"))
    try:
        run = dict(mode="lora", target_modules=("q_proj", "lm_head"), rank=4)
        prepare_model(model, TrainConfig(**run))
        rows, pad = rows_with_gaps(k3_tok), k3_tok.eos_ids[0]
        n, vocab = batch(rows, pad)[0].numel(), model.config.vocab_size
        weights = {p.data_ptr() for p in model.parameters()}

        def logits_sized(t):  # activations with a vocab axis (not the head's or embedding's weight)
            if t.ndim >= 2 and vocab in t.shape and t.data_ptr() not in weights:
                sizes.append(t.numel())
            return t

        largest = {}
        for chunk in (0, 8):
            sizes = [0]
            with torch.autograd.graph.saved_tensors_hooks(logits_sized, lambda t: t):
                loss, _ = _loss_sum(model, rows, pad, TrainConfig(**run, loss_chunk=chunk), torch.device("cpu"))
                loss.backward()
            largest[chunk] = max(sizes)
        assert largest[0] >= n * vocab
        assert largest[8] <= 8 * vocab < n * vocab
    finally:
        store.close()
