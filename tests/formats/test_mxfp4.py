"""MXFP4 codec: formats.md vectors, bit parity with compressed-tensors, and property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moeswap.formats import mxfp4

WORKED_BLOCK = [0, 0.1, -0.25, 0.3, 0.75, -1.25, 1.75, 2.5, -3.5, 5.0, 6.5, 7.0] + [0.0] * 20
# mode -> (scale byte, first 12 decoded values, first 6 packed bytes), from docs/formats.md
WORKED_EXPECTED = {
    "floor": (0x7F, [0, 0, -0.0, 0.5, 1, -1, 2, 2, -4, 4, 6, 6], "00 18 A2 44 6E 77"),
    "even": (0x80, [0, 0, -0.0, 0, 1, -1, 2, 2, -4, 4, 6, 8], "00 08 91 22 4C 65"),
    "rceil": (0x80, [0, 0, -0.0, 0, 1, -1, 2, 2, -4, 4, 6, 8], "00 08 91 22 4C 65"),
}
ROUNDING_VECTORS = [
    (0.25, 0), (0.4, 0.5), (0.5, 0.5), (0.6, 0.5), (0.75, 1), (1.25, 1), (1.75, 2), (2.5, 2),
    (2.9, 3), (3.1, 3), (3.5, 4), (5.0, 4), (5.9, 6), (6.1, 6),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit pattern, so -0 vs 0 and NaN payloads count."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def block_with(values: list[float], mode: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    return mxfp4.encode(torch.tensor(values + [0.0] * (32 - len(values))), mode)


# -- known vectors ------------------------------------------------------------------------------------


def test_e2m1_table_and_nibble_order():
    assert mxfp4.E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    code = torch.arange(16, dtype=torch.uint8)
    packed = torch.cat([code | (code << 4), torch.zeros(16, dtype=torch.uint8)])
    decoded = mxfp4.decode(packed, torch.tensor([127, 127], dtype=torch.uint8), torch.float32)
    signed = [*mxfp4.E2M1_VALUES, *(-v for v in mxfp4.E2M1_VALUES)]
    assert decoded[0:32:2].tolist() == signed and decoded[1:32:2].tolist() == signed
    assert torch.signbit(decoded[16])  # code 8 is -0
    one_byte = torch.tensor([0x71] + [0] * 15, dtype=torch.uint8)  # low nibble 1 (0.5), high nibble 7 (6)
    assert mxfp4.decode(one_byte, torch.tensor([127], dtype=torch.uint8))[:2].tolist() == [0.5, 6.0]


@pytest.mark.parametrize("mode", mxfp4.MODES)
def test_worked_block(mode):
    scale_byte, decoded, packed_hex = WORKED_EXPECTED[mode]
    packed, scale = mxfp4.encode(torch.tensor(WORKED_BLOCK), mode)
    assert scale.tolist() == [scale_byte]
    assert bytes(packed[:6].tolist()).hex(" ").upper() == packed_hex
    assert packed[6:].tolist() == [0] * 10
    out = mxfp4.decode(packed, scale, torch.float32)
    assert out[:12].tolist() == decoded
    assert torch.signbit(out[2])  # -0.25 keeps its sign as -0


@pytest.mark.parametrize("value,expected", ROUNDING_VECTORS)
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("mode", mxfp4.MODES)
def test_rounding_vectors(value, expected, sign, mode):
    # A 4.0 in the block pins the scale at 2^0, so `value` is encoded as is (rceil raises the scale for
    # 6.1 instead of clipping, and 6.1/2 then rounds to 3: the same 6).
    packed, scale = block_with([4.0, sign * value], mode)
    assert scale.tolist() == [128 if mode == "rceil" and value > 6 else 127]
    assert mxfp4.decode(packed, scale, torch.float32)[1].item() == sign * expected


@pytest.mark.parametrize(
    "byte,expected", [(127, 1.0), (128, 2.0), (126, 0.5), (254, 2.0**127), (1, 2.0**-126), (0, 2.0**-127)]
)
def test_scale_bytes(byte, expected):
    assert mxfp4.scale_to_float(torch.tensor([byte], dtype=torch.uint8)).item() == expected


def test_scale_byte_0_is_not_flushed_and_255_is_nan():
    values = mxfp4.scale_to_float(torch.tensor([0, 255], dtype=torch.uint8))
    assert values[0].item() == math.ldexp(1.0, -127) and values[0].item() > 0
    assert math.isnan(values[1].item())
    packed = torch.full((16,), 0x21, dtype=torch.uint8)  # 0.5, 1.0 repeated
    out = mxfp4.decode(packed, torch.tensor([0], dtype=torch.uint8), torch.float32)
    assert out[:2].tolist() == [math.ldexp(1.0, -128), math.ldexp(1.0, -127)]


def test_zero_block_and_nan_inf_blocks():
    w = torch.zeros(4, 32)
    w[1, 3] = float("nan")
    w[2, 0] = float("inf")
    w[3, 5] = -float("inf")
    w[1:, 7] = 1.0
    for mode in mxfp4.MODES:
        packed, scale = mxfp4.encode(w, mode)
        assert scale[:, 0].tolist() == [0, 255, 255, 255]
        assert packed.eq(0).all()
        out = mxfp4.decode(packed, scale, torch.float32)
        assert out[0].eq(0).all() and not torch.signbit(out[0]).any()
        assert out[1:].isnan().all()


def test_decode_batched_shapes_and_float8_scale():
    torch.manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8)
    scale = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8)
    out = mxfp4.decode(packed, scale)
    assert out.shape == (3, 5, 128) and out.dtype == torch.bfloat16
    assert torch.equal(bits(out[1]), bits(mxfp4.decode(packed[1], scale[1])))
    assert torch.equal(bits(mxfp4.decode(packed, scale.view(torch.float8_e8m0fnu))), bits(out))


# -- errors -------------------------------------------------------------------------------------------


def test_encode_rejects_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        mxfp4.encode(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="floating-point.*int32"):
        mxfp4.encode(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="mode"):
        mxfp4.encode(torch.zeros(32), "nearest")


def test_decode_rejects_bad_inputs():
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    scale = torch.zeros(4, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"packed \(4, 16\) and scale \(4, 2\)"):
        mxfp4.decode(packed, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"packed \(4, 16\) and scale \(3, 1\)"):
        mxfp4.decode(packed, torch.zeros(3, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed weights must be uint8.*int8"):
        mxfp4.decode(packed.to(torch.int8), scale)
    with pytest.raises(ValueError, match="scale must be uint8.*float32"):
        mxfp4.decode(packed, scale.float())


# -- parity with compressed-tensors --------------------------------------------------------------------

ct_mxfp4 = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")


def ct_scheme():
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("MXFP4A16", ["Linear"])


def ct_decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own decompression path (outputs bf16)."""
    state = {"weight_packed": packed, "weight_scale": scale}
    return ct_mxfp4.MXFP4PackedCompressor.decompress(state, ct_scheme())["weight"]


def ct_decompress_fp32(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same helpers with the output dtype set to fp32."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    scale_f32 = decompress_mx_scale(scale).to(torch.float32)
    return dequantize(values, scale_f32, args=ct_scheme().weights, dtype=torch.float32)


def ct_compress(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' MXFP4 scale generation (calculate_qparams, fed per-group min/max the way a
    min-max observer does) followed by its compressor."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = ct_scheme()
    groups = w.reshape(w.shape[0], -1, 32)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
    out = ct_mxfp4.MXFP4PackedCompressor.compress(state, scheme)
    return out["weight_packed"], out["weight_scale"]


def every_byte_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Row r: scale byte r on every block and all 256 packed bytes (every nibble, both positions)."""
    scale = torch.arange(256, dtype=torch.uint8).repeat_interleave(16).reshape(256, 16)  # 16 blocks
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [256, 256]: 16 blocks of 16 bytes
    generator = torch.Generator().manual_seed(1)
    shuffled = torch.randperm(256, generator=generator).to(torch.uint8)
    return torch.cat([packed, shuffled.repeat(256, 1)], dim=1), torch.cat([scale, scale], dim=1)


def test_decode_bit_identical_to_compressed_tensors_for_finite_scales():
    packed, scale = every_byte_pair()
    finite = slice(0, 255)  # rows = scale bytes 0..254
    ours = mxfp4.decode(packed, scale)
    assert torch.equal(bits(ours[finite]), bits(ct_decompress(packed, scale)[finite]))
    ours32 = mxfp4.decode(packed, scale, torch.float32)
    assert torch.equal(bits(ours32[finite]), bits(ct_decompress_fp32(packed, scale)[finite]))
    assert ours32[0, 4].item() == math.ldexp(1.0, -127)  # scale byte 0 x code 2 (1.0), not flushed


def test_decode_scale_255_is_nan_where_compressed_tensors_gives_inf():
    # Deliberate difference: the OCP spec makes E8M0 0xFF NaN; compressed-tensors computes 2^128 = +Inf,
    # so its codes 0/8 decode to NaN and the rest to ±Inf. Both are non-finite; ours is NaN throughout.
    packed, scale = every_byte_pair()
    ours, theirs = mxfp4.decode(packed[255:], scale[255:]), ct_decompress(packed[255:], scale[255:])
    assert ours.isnan().all()
    assert not theirs.isfinite().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_even_encode_bit_identical_to_compressed_tensors(dtype):
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=generator) * torch.logspace(-6, 3, 64).unsqueeze(1)
    w[0, :32] = 0.0  # a zero block
    w[1, :32] = torch.tensor(WORKED_BLOCK)
    w[2] = w[2].sign() * 7.0  # amax exactly at the 1.75 carry point
    w[3, 5] = -0.0
    w = w.to(dtype)
    packed, scale = mxfp4.encode(w, "even")
    ct_packed, ct_scale = ct_compress(w)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(packed, ct_packed)


def test_even_encode_bit_identical_to_compressed_tensors_on_random_bf16_bit_patterns():
    # Every finite bf16 value is fair game (subnormals, huge and tiny values in one block), except
    # |x| >= 1.75·2^127, where compressed-tensors' power-of-two rounding overflows to Inf (we write 253).
    generator = torch.Generator().manual_seed(4)
    raw = torch.randint(-(2**15), 2**15, (2048, 64), generator=generator, dtype=torch.int32)
    w = raw.to(torch.int16).view(torch.bfloat16)
    w = torch.where(w.isfinite() & (w.float().abs() < 1.75 * 2.0**127), w, torch.zeros_like(w))
    packed, scale = mxfp4.encode(w, "even")
    ct_packed, ct_scale = ct_compress(w)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(packed, ct_packed)


def test_roundtrip_through_compressed_tensors_decompress():
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(32, 256, generator=generator).to(torch.bfloat16)
    packed, scale = mxfp4.encode(w, "even")
    assert torch.equal(bits(mxfp4.decode(packed, scale)), bits(ct_decompress(packed, scale)))


# -- properties ---------------------------------------------------------------------------------------

grid_codes = st.lists(st.integers(0, 15), min_size=32, max_size=32)
scale_bytes = st.integers(1, 254)
finite_floats = st.floats(-(2.0**100), 2.0**100, width=32)


@settings(max_examples=200, deadline=None)
@given(
    codes=grid_codes,
    top_code=st.sampled_from([6, 7, 14, 15]),
    byte=st.integers(1, 252),  # 6 * 2^(s-127) must stay finite in fp32
    mode=st.sampled_from(mxfp4.MODES),
)
def test_representable_values_roundtrip_exactly(codes, top_code, byte, mode):
    # With a largest magnitude of 4 or 6 every mode picks back the block's own scale byte.
    codes[0] = top_code
    nibbles = torch.tensor(codes, dtype=torch.uint8)
    scale = torch.tensor([byte], dtype=torch.uint8)
    w = mxfp4.decode(nibbles[0::2] | (nibbles[1::2] << 4), scale, torch.float32)
    re_packed, re_scale = mxfp4.encode(w, mode)
    assert re_scale.tolist() == [byte]
    nibbles[nibbles == 8] = 0  # a decoded -0.0 re-encodes as +0
    assert torch.equal(re_packed, nibbles[0::2] | (nibbles[1::2] << 4))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite_floats, min_size=32, max_size=32), mode=st.sampled_from(mxfp4.MODES))
def test_sign_symmetry(values, mode):
    w = torch.tensor(values)
    assume(w.abs().max() > 0)  # a zero block is all code 0 whatever the signs
    packed, scale = mxfp4.encode(w, mode)
    neg_packed, neg_scale = mxfp4.encode(-w, mode)
    assert torch.equal(scale, neg_scale)
    # The sign bit flips on every value that is nonzero after scaling (zeros, and values that underflow
    # to zero, encode as +0 either way); magnitudes are unchanged.
    nonzero = (w / mxfp4.scale_to_float(scale) != 0).reshape(16, 2).to(torch.uint8)
    sign_flip = (nonzero[:, 0] << 3) | (nonzero[:, 1] << 7)
    assert torch.equal(packed ^ sign_flip, neg_packed)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite_floats, min_size=32, max_size=32), mode=st.sampled_from(mxfp4.MODES))
def test_saturation_and_error_bound(values, mode):
    w = torch.tensor(values)
    packed, scale = mxfp4.encode(w, mode)
    out = mxfp4.decode(packed, scale, torch.float32)
    step = mxfp4.scale_to_float(scale).item()
    assert out.abs().max() <= 6 * step  # never beyond the saturation point
    # Each value lands on a grid neighbour: error <= half the widest spacing (1·step), plus any clip.
    clip = (w.abs() - 6 * step).clamp(min=0)
    assert ((out - w).abs() <= step + clip).all()
    if mode == "rceil":
        assert (w.abs() <= 6 * step).all()  # rceil never clips


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(finite_floats, min_size=64, max_size=64),
    position=st.integers(0, 63),
    bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    mode=st.sampled_from(mxfp4.MODES),
)
def test_non_finite_poisons_only_its_block(values, position, bad, mode):
    w = torch.tensor(values)
    clean_packed, clean_scale = mxfp4.encode(w, mode)
    w[position] = bad
    packed, scale = mxfp4.encode(w, mode)
    block, other = position // 32, 1 - position // 32
    assert scale[block] == 255
    assert mxfp4.decode(packed, scale, torch.float32)[block * 32 : block * 32 + 32].isnan().all()
    assert scale[other] == clean_scale[other]
    assert torch.equal(packed[other * 16 : other * 16 + 16], clean_packed[other * 16 : other * 16 + 16])


@settings(max_examples=50, deadline=None)
@given(mode=st.sampled_from(mxfp4.MODES), negative_zeros=st.lists(st.booleans(), min_size=32, max_size=32))
def test_zero_blocks(mode, negative_zeros):
    w = torch.tensor([-0.0 if n else 0.0 for n in negative_zeros])
    packed, scale = mxfp4.encode(w, mode)
    assert scale.tolist() == [0] and packed.eq(0).all()


def test_decode_bit_identical_to_compressed_tensors_on_the_init_tiny_model(tiny_k3_dir):
    from moeswap.formats.checkpoint import Checkpoint

    with Checkpoint.open(tiny_k3_dir) as ckpt:
        packed_names = [n for n in ckpt.names() if n.endswith(".weight_packed")]
        assert len(packed_names) > 100
        for name in packed_names:
            packed, scale = ckpt.get(name), ckpt.get(name.replace("weight_packed", "weight_scale"))
            assert torch.equal(bits(mxfp4.decode(packed, scale)), bits(ct_decompress(packed, scale))), name
