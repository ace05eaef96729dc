"""The contract every registered weight format keeps (weights.registry.FORMATS), so a new format gets these
tests by being registered: encode/decode round trip, the bytes and shapes it declares, the kept expert's fast
path = its torch reference, checks that refuse misshapen tensors and non-finite bytes, autograd's dx against
float64, and its dense Linear method against the decoded weight. TOY (below) is a format defined here in one
class plus its registration: the suite and the loader take it like the built-in ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.formats import fp8_block
from moeswap.formats.checkpoint import Checkpoint, CheckpointError, TensorInfo
from moeswap.formats.writer import layout, write_shard
from moeswap.models.loader import load_model
from moeswap.options import LoadOptions
from moeswap.weights import autograd as ag
from moeswap.weights import registry
from moeswap.weights.dense import LinearMethod, WeightLinear, linear_method
from moeswap.weights.floating import FloatFormat
from moeswap.weights.format import PROJS, expect
from moeswap.weights.registry import format_of

I, F_ = 64, 96  # expert input width and width: whole MX/INT4 groups, partial FP8 blocks
BETAS = (4.0, 25.0)
SHAPES = {"w1": (F_, I), "w3": (F_, I), "w2": (I, F_)}


class ToyLinear(LinearMethod):
    """TOY's dense method: a Linear keeps the int16 bit patterns, multiplied as their bf16 values in fp32."""

    name = "toy_bf16_bits"
    weight_is_values = False

    def keeps(self, stored, dtypes, block, compute, device):
        return stored == self.name and compute == torch.float32

    def apply(self, layer, x):
        return F.linear(x, self.values(layer).to(x.dtype))

    def values(self, layer):
        return layer.weight_packed.view(torch.bfloat16).float()

    def sources(self, layer):
        return (layer.weight_packed,)


class ToyFormat(FloatFormat):
    """bf16 weights stored as their bit patterns in an int16 `weight_packed` (no scale): experts decoded at
    read (computed as FLOAT), dense Linears kept as stored (ToyLinear)."""

    name, label = "toy_bf16_bits", "toy bf16 bits"
    suffixes = frozenset({"weight_packed"})
    main = "weight_packed"
    kept_form = None
    linear_method = ToyLinear()

    def dtypes_fit(self, dtypes):
        return dtypes["weight_packed"] == torch.int16

    def check_expert_tensors(self, ckpt, names, shape, where):
        expect(ckpt.info(names["weight_packed"]), shape, torch.int16, where)

    def logical_shape(self, infos):
        return tuple(infos["weight_packed"].shape)

    def decode(self, stored, dtype, block=None):
        return stored["weight_packed"].view(torch.bfloat16).to(dtype)

    def stored_specs(self, shape):
        return {"weight_packed": (torch.int16, tuple(shape))}

    def encode(self, w, mode="even"):
        return {"weight_packed": w.to(torch.bfloat16).view(torch.int16)}


TOY = ToyFormat()
NAMES = [*registry.FORMATS, TOY.name]


@pytest.fixture
def toy_registered():
    registry.register(TOY)
    yield TOY
    registry.unregister(TOY.name)


@pytest.fixture(params=NAMES)
def fmt(request):
    if request.param == TOY.name:
        request.getfixturevalue("toy_registered")
    return registry.FORMATS[request.param]


def stored(fmt, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [out, in] as `fmt` stores it (a float weight as bf16: the format writes nothing of its own)."""
    try:
        return fmt.encode(w)
    except NotImplementedError:
        return {"weight": w.to(torch.bfloat16)}


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {p: torch.randn(*SHAPES[p], generator=gen) * 0.1 for p in PROJS}


def expert_tensors(fmt, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """(checkpoint name -> tensor, proj -> suffix -> name) of one expert in `fmt`."""
    tensors, names = {}, {}
    for p, w in weights(seed).items():
        names[p] = {}
        for suffix, t in stored(fmt, w).items():
            names[p][suffix] = f"experts.0.{p}.{suffix}"
            tensors[names[p][suffix]] = t
    return tensors, names


class FakeCheckpoint:
    """What check_expert_tensors reads of a checkpoint: each tensor's info."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.infos = {n: TensorInfo(n, Path("toy.safetensors"), t.dtype, tuple(t.shape), 0,
                                    t.numel() * t.element_size()) for n, t in tensors.items()}

    def info(self, name: str) -> TensorInfo:
        return self.infos[name]


def _relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def test_the_registry_is_consistent(fmt):
    """A format's tensors (their suffixes, and their dtypes where another format shares the suffixes: MXFP8's
    float8 `weight` against INT8's int8 one) pick it and no other."""
    dtypes = {s: t.dtype for s, t in stored(fmt, weights()["w1"]).items()}
    assert registry.for_suffixes(fmt.suffixes, dtypes) is fmt and fmt.main in fmt.suffixes
    assert [f for f in registry.BY_SUFFIXES[fmt.suffixes] if f.dtypes_fit(dtypes)] == [fmt]
    if fmt.kept_form is not None:
        assert registry.BY_FORM[fmt.kept_form] is fmt
    if fmt.linear_method is not None:
        assert registry.LINEAR_METHODS[fmt.linear_method.name] is fmt.linear_method


def test_round_trip_and_declared_sizes(fmt):
    """decode(encode(w)) is close to w and encodes again to values close to itself, and has the logical shape, stored and decoded bytes the format declares for those tensors."""
    w = weights()["w1"]
    try:
        enc = fmt.encode(w)
    except NotImplementedError:
        pytest.skip(f"{fmt.label} weights are stored as they are: nothing to encode")
    dec = fmt.decode(enc, torch.float32)
    assert dec.dtype == torch.float32 and dec.shape == w.shape
    assert _relative_rms(dec, w) < 0.2  # 4-bit formats' rounding, at worst
    again = fmt.encode(dec)  # the decoded values encode again to (nearly) themselves
    assert again.keys() == enc.keys() and _relative_rms(fmt.decode(again, torch.float32), dec) < 0.2
    specs = fmt.stored_specs(tuple(w.shape))
    assert {s: (t.dtype, tuple(t.shape)) for s, t in enc.items()} == specs
    infos = FakeCheckpoint(enc).infos
    assert tuple(fmt.logical_shape(infos)) == tuple(w.shape)
    assert fmt.stored_bytes(infos) == sum(t.numel() * t.element_size() for t in enc.values())
    assert fmt.decoded_bytes(infos, 2) == w.numel() * 2


@pytest.mark.parametrize("keep_bytes", [True, False])
@pytest.mark.parametrize("rows", [3, 40])  # decode-sized (the kernels) and prefill-sized inputs
def test_the_fast_path_is_the_reference(fmt, keep_bytes, rows):
    """A kept expert (as stored, or decoded) computed by its format's fastest path here equals the format's
    plain-torch reference on the decoded weights, which equal the format's decode of each projection."""
    tensors, names = expert_tensors(fmt)
    w = fmt.read_expert(tensors.__getitem__, names, torch.float32, "cpu", keep_bytes)
    kept = format_of(w)
    for p in PROJS:
        want = fmt.decode({s: tensors[n] for s, n in names[p].items()}, torch.float32)
        assert torch.equal(kept.weight(w, p, torch.float32), want), p
        assert tuple(kept.shape(w, p)) == SHAPES[p]
    x = torch.randn(rows, I, generator=torch.Generator().manual_seed(rows))
    ref = kept.reference(w, x, "situ", BETAS)
    got = kept.forward(w, x, "situ", BETAS)
    assert got.dtype == ref.dtype and got.shape == ref.shape == (rows, I)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_checks_refuse_misshapen_tensors(fmt):
    tensors, names = expert_tensors(fmt)
    ckpt = FakeCheckpoint(tensors)
    for p in PROJS:
        fmt.check_expert_tensors(ckpt, names[p], SHAPES[p], "the expert")  # as written: accepted
        O, N = SHAPES[p]
        with pytest.raises(CheckpointError):
            fmt.check_expert_tensors(ckpt, names[p], (O, N + 32), "the expert")


@pytest.mark.parametrize("keep_bytes", [True, False])
def test_checks_find_non_finite_bytes(fmt, keep_bytes):
    """Every matrix byte set to 0xFF (NaN in every float and E8M0 scale encoding) gives an expert whose
    check_finite names a tensor of the poisoned projection; the untouched expert passes."""
    tensors, names = expert_tensors(fmt)
    w = fmt.read_expert(tensors.__getitem__, names, torch.float32, "cpu", keep_bytes)
    assert fmt.check_finite(w, names) is None
    for n in names["w3"].values():
        if tensors[n].ndim == 2:  # the matrices, not a weight_shape
            tensors[n] = tensors[n].clone()
            tensors[n].view(torch.uint8).fill_(0xFF)
    bad = fmt.read_expert(tensors.__getitem__, names, torch.float32, "cpu", keep_bytes)
    problem = fmt.check_finite(bad, names)
    assert problem is not None and problem[1] == "w3" and problem[0] in names["w3"].values()


def test_autograd_dx_is_dy_w_in_float64(fmt):
    """One projection through weights.autograd in float64: y = x W^T and dx = dy W on the decoded W, with no
    gradient kept for the frozen weights."""
    tensors, names = expert_tensors(fmt)
    w = fmt.read_expert(tensors.__getitem__, names, torch.float32, "cpu", True)
    kept = format_of(w)
    gen = torch.Generator().manual_seed(5)
    for p in PROJS:
        W = kept.weight(w, p, torch.float64)
        x = torch.randn(4, W.shape[1], dtype=torch.float64, generator=gen, requires_grad=True)
        y = ag.project(ag.Held(w), p, x)
        torch.testing.assert_close(y, x.detach() @ W.T)
        dy = torch.randn(y.shape, dtype=torch.float64, generator=gen)
        y.backward(dy)
        torch.testing.assert_close(x.grad, dy @ W)


def test_the_dense_method_multiplies_the_decoded_weight(fmt):
    """A format's dense Linear method, where this machine keeps it: the layer's output is x times the values
    it reports, which are the format's decode; `with_values` gives a plain Linear of the same outputs."""
    method = fmt.linear_method
    w = weights()["w1"]
    enc = stored(fmt, w)
    if method is None or not method.keeps(fmt.name, {s: t.dtype for s, t in enc.items()}, fp8_block.BLOCK,
                                          torch.float32, "cpu"):
        pytest.skip(f"no dense method keeps {fmt.label} weights here")
    layer = WeightLinear(w.shape[1], w.shape[0], method)
    method.load_weights(layer, enc, "cpu")
    values = method.values(layer).float()
    assert torch.equal(values, fmt.decode(enc, torch.float32))
    for rows in (1, 40):
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, values), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(method.with_values(layer)(x), F.linear(x, values), rtol=1e-5, atol=1e-5)
    assert set(layer.state_dict()) == set(enc)  # the checkpoint's own names


def test_a_toy_format_loads_like_the_built_in_ones(tiny_linear_dir, tmp_path, toy_registered):
    """The tiny Kimi Linear with its bf16 routed experts and dense Linear weights rewritten in TOY: the loader
    takes them through the registry (no other change anywhere): each expert decodes to the original values,
    each Linear gets TOY's method holding the checkpoint's tensor, and greedy tokens match."""
    original, original_store = load_model(tiny_linear_dir, LoadOptions(dtype="float32"))
    linears = {n for n, m in original.named_modules() if isinstance(m, nn.Linear) and m.bias is None}
    out = tmp_path / "toy"
    out.mkdir()
    with Checkpoint.open(tiny_linear_dir) as ckpt:
        tensors, rewritten = {}, set()
        for name in ckpt.names():
            t, module = ckpt.read(name), name.removesuffix(".weight")
            if name.endswith(".weight") and (".experts." in name or module in linears):
                tensors.update({f"{module}.{s}": part for s, part in TOY.encode(t).items()})
                rewritten.add(module)
            else:
                tensors[name] = t
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    write_shard(out / "model.safetensors", specs, ((n, tensors[n]) for n, _, _ in layout(specs)))
    for side in Path(tiny_linear_dir).iterdir():
        if side.suffix != ".safetensors" and side.name != "model.safetensors.index.json":
            (out / side.name).write_bytes(side.read_bytes())
    toy, toy_store = load_model(out, LoadOptions(dtype="float32"))
    assert toy_store.index.format is TOY
    kept = [n for n in linears if linear_method(toy.get_submodule(n)) is TOY.linear_method]
    assert kept and set(kept) == linears & rewritten
    for n in kept:
        got, want = toy.get_submodule(n), original.get_submodule(n)
        assert torch.equal(linear_method(got).values(got), linear_method(want).values(want).float()), n
    layer = next(b.layer_idx for b in toy.moe_blocks())
    (a,), (b,) = original_store.fetch(layer, [0]), toy_store.fetch(layer, [0])
    for p in PROJS:
        assert torch.equal(format_of(a).weight(a, p, torch.float32), format_of(b).weight(b, p, torch.float32)), p
    cfg = GenerationConfig(max_tokens=6, stop_ids=())
    assert generate(toy, [5, 9, 2], cfg).tokens == generate(original, [5, 9, 2], cfg).tokens
