"""Every architecture in moeswap.archs.REGISTRY, on its init-tiny checkpoint (a new architecture gets these
checks by being registered and written by init-tiny): the full-sequence forward equals prefill plus
token-by-token decode; the native decode step equals the forward bit for bit; the C kernels equal the
plain-torch paths; the model written back in the published layout holds the stored tensors and reloads
to the same logits. Oracle parity (transformers, llama.cpp) and the K3 parts against the spec have their
own files; so does incremental decode across a KDA prefill chunk (tests/engine/test_generate.py)."""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from moeswap import archs
from moeswap.archs import REGISTRY
from moeswap.config import load_config
from moeswap.engine.native_step import NativeDecode
from moeswap.engine.scheduler import fuse_projections
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint, TensorInfo
from moeswap.formats.writer import layout, write_index, write_shard
from moeswap.models.layers.kda import KDAState
from moeswap.models.layers.mla import MLACache
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels
from moeswap.tiny import write_tiny_model

# Within one 64-token KDA prefill chunk: a multi-token prefill, a multi-token step and single tokens
TOKENS, CUTS = 16, (5, 8)


@pytest.fixture(scope="module", params=sorted(REGISTRY))
def checkpoint(request, tmp_path_factory) -> Path:
    arch = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(arch) / "model", arch, "tiny", seed=0)
    assert load_config(path).arch == arch
    return path


def _load(path: Path, **options):
    return load_model(path, LoadOptions(dtype="float32", **options))


def _tokens(model, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, TOKENS), generator=torch.Generator().manual_seed(batch))


def _incremental(model, tokens: torch.Tensor, step=None):
    """Logits [B, T, V] of `tokens` fed in pieces through one state: the pieces up to the last cut through the
    model, then one token at a time through `step` (default the model). Returns (logits, state)."""
    step = step or model
    state = model.make_state(tokens.shape[0])
    with torch.inference_mode():
        bounds = [0, *CUTS]
        outs = [model(tokens[:, a:b], state) for a, b in zip(bounds, bounds[1:])]
        outs += [step(tokens[:, t:t + 1], state) for t in range(CUTS[-1], tokens.shape[1])]
    return torch.cat(outs, dim=1), state


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """Max abs difference within rtol of the largest reference value (as tests/models/test_k3_parts.py)."""
    assert got.shape == want.shape and torch.isfinite(got).all()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rtol * scale, f"max abs err {err:.3e} vs scale {scale:.3e} (rtol {rtol})"


def test_full_sequence_forward_equals_incremental_decode(checkpoint):
    model, _ = _load(checkpoint)
    tokens = _tokens(model)
    with torch.inference_mode():
        full = model(tokens)
    incremental, state = _incremental(model, tokens)
    assert full.std() > 0.1  # not a near-constant output
    assert_close(incremental, full, rtol=1e-5)  # the tolerance of the layers' own incremental tests
    assert all(st.lengths_B.tolist() == [TOKENS] * 2 for st in state.layers if isinstance(st, MLACache))


def _state_tensors(state) -> list[torch.Tensor]:
    out = []
    for st in state.layers:
        if isinstance(st, KDAState):
            out += [st.recurrent_BHKK, st.conv_BWC]
        elif isinstance(st, MLACache):
            out += [st.latent_BSX[:, :st.longest()], st.lengths_B]  # past the lengths: unused capacity
        else:
            raise AssertionError(f"a {type(st).__name__} layer state: list its tensors here")
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_native_decode_step_equals_the_forward_bit_for_bit(checkpoint, batch):
    """Logits, every layer's state and the store's hit count, against the same steps through the model."""
    runs = []
    for native in (False, True):
        model, store = _load(checkpoint)
        fuse_projections(model)  # the native step runs fused projections; so does the forward it matches
        step = NativeDecode(model) if native else model
        runs.append((*_incremental(model, _tokens(model, batch), step), store.stats.fast.hits, step))
    (want, want_state, want_hits, _), (got, got_state, hits, native) = runs
    if cpu_kernels.kernel() is None:
        pytest.skip(f"the native step takes the forward: {native.reason}")
    assert native.reason is None, native.reason
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(_state_tensors(got_state), _state_tensors(want_state), strict=True))
    assert hits == want_hits > 0  # hits counted for the experts the C call ran


def test_cpu_kernels_equal_the_torch_paths(checkpoint, monkeypatch):
    """The same prefill and decode steps with the C kernels and with none (every caller's torch path)."""
    if cpu_kernels.kernel() is None:
        pytest.skip(f"no CPU kernel: {cpu_kernels.build_error()}")
    calls = Counter()
    for name, fn in list(vars(cpu_kernels.CpuKernels).items()):
        if callable(fn) and not name.startswith("_"):
            monkeypatch.setattr(cpu_kernels.CpuKernels, name,
                                lambda self, *a, _fn=fn, _name=name, **k: calls.update([_name]) or _fn(self, *a, **k))
    model, _ = _load(checkpoint)
    with_kernels, _ = _incremental(model, _tokens(model))
    assert calls, "no C kernel ran: the comparison below would compare the torch paths with themselves"
    monkeypatch.setattr(cpu_kernels, "kernel", lambda flags=None: None)
    monkeypatch.setattr(cpu_kernels, "kernel_ready", lambda: False)
    calls.clear()
    model, _ = _load(checkpoint)
    torch_only, _ = _incremental(model, _tokens(model))
    assert not calls
    assert_close(with_kernels, torch_only, rtol=1e-4)  # as the KDA kernel's own test: other summation orders


def _as_stored(value: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """A parameter in its checkpoint tensor's dtype and shape; a shorter one zero-padded (K3's A_log)."""
    flat = value.detach().reshape(-1)
    if flat.numel() < math.prod(info.shape):
        flat = torch.cat([flat, flat.new_zeros(math.prod(info.shape) - flat.numel())])
    return flat.reshape(info.shape).to(info.dtype)


def _published_tensors(model, store) -> dict[str, torch.Tensor]:
    """The loaded model under its checkpoint names: dense tensors from its parameters (through the loader's
    checkpoint_map), routed experts as the store reads them (it never makes them parameters)."""
    arch, prefix = archs.get(model.config.arch), model.config.weight_prefix
    params = dict(model.named_parameters())
    out = {}
    for name in store.ckpt.names():
        target, _ = arch.classify(name.removeprefix(prefix))
        if target == "expert":
            out[name] = store.ckpt.read(name)
        elif target != "skip":
            out[name] = _as_stored(params[target], store.ckpt.info(name))
    return out


def _write_checkpoint(src: Path, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """formats/writer.py's shards (dense tensors, then routed experts) and index, beside src's other files."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != INDEX_NAME:
            shutil.copy(f, out / f.name)
    experts = {n for n in tensors if ".experts." in n}
    groups = [[n for n in tensors if n not in experts], sorted(experts)]
    weight_map, total = {}, 0
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        specs = layout((n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names)
        total += write_shard(out / file, specs, ((n, tensors[n]) for n, _, _ in specs))
        weight_map.update(dict.fromkeys(names, file))
    write_index(out, weight_map, total)


def test_written_back_in_the_published_layout_it_reloads_the_same(checkpoint, tmp_path):
    model, store = _load(checkpoint)
    tensors = _published_tensors(model, store)
    for name, t in tensors.items():  # the loaded parameters hold exactly the stored values
        assert torch.equal(t, store.ckpt.read(name)), name
    _write_checkpoint(checkpoint, tmp_path / "copy", tensors)
    with Checkpoint.open(tmp_path / "copy") as copy, Checkpoint.open(checkpoint) as original:
        assert sorted(copy.names()) == sorted(original.names())
        assert len(copy.files()) == 2
    reloaded, _ = _load(tmp_path / "copy")
    want, _ = _incremental(model, _tokens(model))
    got, _ = _incremental(reloaded, _tokens(reloaded))
    assert torch.equal(got, want)
