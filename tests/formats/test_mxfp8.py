"""MXFP8 codec: worked vectors per scale mode, bit parity with compressed-tensors, and property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswap.formats import mx, mxfp8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def block_with(values: list[float], mode: str = "floor", element: str = "e4m3"):
    return mxfp8.encode(torch.tensor(values + [0.0] * (32 - len(values))), mode, element)


# -- known vectors ------------------------------------------------------------------------------------

# amax -> scale byte per mode (E4M3: max 448 = 1.75 * 2^8, so emax 8).
#   floor: floor(log2 amax) - 8; even: the same after rounding amax to 1 mantissa bit (carry at 1.75);
#   rceil: ceil(log2(amax / 448)).
SCALE_VECTORS = [
    # amax, floor, even, rceil, decoded amax under floor, even, rceil
    (1.0, 119, 119, 119, 1.0, 1.0, 1.0),
    (256.0, 127, 127, 127, 256.0, 256.0, 256.0),
    (440.0, 127, 127, 127, 448.0, 448.0, 448.0),  # 440 rounds to 448 (step 32), no carry below 1.75
    (450.0, 127, 128, 128, 448.0, 448.0, 448.0),  # floor clips; 450/2 = 225 rounds to 224
    (480.0, 127, 128, 128, 448.0, 480.0, 480.0),  # floor clips 480 to 448; 240 is exact in E4M3
    (511.0, 127, 128, 128, 448.0, 512.0, 512.0),  # 255.5 rounds up to 256
    (2.0**-140, 0, 0, 0, 0.0, 0.0, 0.0),  # exponent clamps at -127: the value underflows
]


@pytest.mark.parametrize("amax,floor,even,rceil,dec_floor,dec_even,dec_rceil", SCALE_VECTORS)
def test_scale_rule_vectors(amax, floor, even, rceil, dec_floor, dec_even, dec_rceil):
    for mode, byte, decoded in (("floor", floor, dec_floor), ("even", even, dec_even), ("rceil", rceil, dec_rceil)):
        data, scale = block_with([amax, -amax / 4], mode)
        assert scale.tolist() == [byte], mode
        out = mxfp8.decode(data, scale, torch.float32)
        assert out[0].item() == decoded, mode
        assert out[1].item() == -amax / 4 or amax < 2.0**-120 or math.isclose(out[1].item(), -amax / 4, rel_tol=2**-4)


# E4M3 round to nearest even at scale 2^0 (a 256 in the block pins the scale byte at 127 in every mode).
E4M3_ROUNDING = [
    (17.0, 16.0), (19.0, 20.0), (1.0625, 1.0), (1.1875, 1.25), (300.0, 288.0), (440.0, 448.0),
    (2.0**-9, 2.0**-9), (2.0**-10, 0.0), (3 * 2.0**-10, 2.0**-8), (5 * 2.0**-11, 2.0**-9), (0.013671875, 0.013671875),
]


@pytest.mark.parametrize("value,expected", E4M3_ROUNDING)
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("mode", ["floor", "even"])
def test_e4m3_rounding_and_saturation(value, expected, sign, mode):
    data, scale = block_with([256.0, sign * value], mode)
    assert scale.tolist() == [127]
    out = mxfp8.decode(data, scale, torch.float32)[1]
    assert out.item() == sign * expected and bool(torch.signbit(out)) == (sign < 0)


@pytest.mark.parametrize("value", [449.0, 464.0, 500.0, 511.0])
def test_floor_saturates_at_448(value):
    data, scale = block_with([256.0, value, -value], "floor")
    assert scale.tolist() == [127]
    assert mxfp8.decode(data, scale, torch.float32)[1:3].tolist() == [448.0, -448.0]


def test_e5m2_elements():
    data, scale = block_with([57344.0, 3.0, -1e-9], "floor", "e5m2")  # E5M2 max = 1.75 * 2^15
    assert data.dtype == torch.float8_e5m2 and scale.tolist() == [127]
    out = mxfp8.decode(data, scale, torch.float32)
    assert out[:2].tolist() == [57344.0, 3.0] and out[2].item() == 0 and torch.signbit(out[2])
    data, scale = block_with([1e6], "rceil", "e5m2")
    assert scale.tolist() == [127 + 5]  # ceil(log2(1e6 / 57344)) = 5
    with pytest.raises(ValueError, match="unknown MXFP8 element format 'e3m4'"):
        block_with([1.0], "even", "e3m4")


def test_zero_and_non_finite_blocks():
    w = torch.zeros(4, 32)
    w[0, 3] = -0.0
    w[1, 3], w[2, 0], w[3, 5] = float("nan"), float("inf"), -float("inf")
    w[1:, 7] = 1.0
    for mode in mx.MODES:
        data, scale = mxfp8.encode(w, mode)
        assert scale[:, 0].tolist() == [0, 255, 255, 255]
        out = mxfp8.decode(data, scale, torch.float32)
        assert out[0].eq(0).all() and not torch.signbit(out[0]).any()
        assert out[1:].isnan().all()
        assert bits(data[1:]).eq(0).all()


def test_decode_scale_bytes_and_nan_elements():
    data = torch.tensor([1.0, -2.0, float("nan")] + [0.0] * 29).to(torch.float8_e4m3fn)
    out = mxfp8.decode(data, torch.tensor([0], dtype=torch.uint8), torch.float32)
    assert out[:2].tolist() == [2.0**-127, -(2.0**-126)]  # byte 0 is 2^-127, not flushed
    assert math.isnan(out[2].item())
    assert mxfp8.decode(data, torch.tensor([255], dtype=torch.uint8), torch.float32).isnan().all()
    as_e8m0 = torch.tensor([130], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert mxfp8.decode(data, as_e8m0, torch.float32)[0].item() == 8.0


def test_errors():
    data = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    message = r"data \(4, 64\) and scale \(4, 4\).*imply 16 per scale byte: wrong group size"
    with pytest.raises(ValueError, match=message):
        mxfp8.decode(data, torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"must agree in every dim but the last"):
        mxfp8.decode(data, torch.zeros(3, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2, got dtype torch.uint8"):
        mxfp8.decode(data.view(torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale must be uint8"):
        mxfp8.decode(data, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="multiple of 32, got 33"):
        mxfp8.encode(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="mode must be one of even, floor, rceil, got 'nearest'"):
        mxfp8.encode(torch.zeros(32), "nearest")


# -- parity with compressed-tensors --------------------------------------------------------------------

ct_mxfp8 = pytest.importorskip("compressed_tensors.compressors.mxfp8.base")


def ct_scheme():
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("MXFP8A16", ["Linear"])


def ct_compress(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = ct_scheme()
    groups = w.reshape(w.shape[0], -1, 32)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    out = ct_mxfp8.MXFP8QuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    return out["weight"], out["weight_scale"]


def ct_decompress(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    state = {"weight": data, "weight_scale": scale}
    return ct_mxfp8.MXFP8QuantizationCompressor.decompress(state, ct_scheme())["weight"]


def test_decode_bit_identical_to_compressed_tensors():
    # Every fp8 byte against every finite scale byte (0..254), in bf16 as compressed-tensors returns it.
    gen = torch.Generator().manual_seed(0)
    data = torch.arange(256, dtype=torch.uint8).repeat(255, 2)[:, torch.randperm(512, generator=gen)]
    data = data.view(torch.float8_e4m3fn)
    scale = torch.arange(255, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    ours, theirs = mxfp8.decode(data, scale), ct_decompress(data, scale)
    assert theirs.dtype == torch.bfloat16
    nan = ours.isnan()
    assert torch.equal(nan, theirs.isnan())
    assert torch.equal(bits(ours)[~nan], bits(theirs)[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_even_encode_bit_identical_to_compressed_tensors(dtype):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-30, 30, 64).unsqueeze(1)
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2] = w[2].sign() * 448.0  # amax exactly at the 1.75 carry point
    w[3, :32] = torch.tensor([480.0, 450.0, 1e-3, -2.0**-10] + [1.0] * 28)
    w = w.to(dtype)
    data, scale = mxfp8.encode(w, "even")
    ct_data, ct_scale = ct_compress(w)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(bits(data), bits(ct_data))


def test_even_encode_bit_identical_to_compressed_tensors_on_random_bf16_bit_patterns():
    gen = torch.Generator().manual_seed(4)
    raw = torch.randint(-(2**15), 2**15, (1024, 64), generator=gen, dtype=torch.int32)
    w = raw.to(torch.int16).view(torch.bfloat16)
    w = torch.where(w.isfinite() & (w.float().abs() < 1.75 * 2.0**127), w, torch.zeros_like(w))
    data, scale = mxfp8.encode(w, "even")
    ct_data, ct_scale = ct_compress(w)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(bits(data), bits(ct_data))


# -- properties ---------------------------------------------------------------------------------------

finite_floats = st.floats(-(2.0**100), 2.0**100, width=32)
modes = st.sampled_from(mx.MODES)


@settings(max_examples=150, deadline=None)
@given(codes=st.lists(st.integers(0, 255), min_size=32, max_size=32), top=st.sampled_from([256.0, 384.0, -256.0]),
       byte=st.integers(1, 240), mode=modes)
def test_representable_values_roundtrip_exactly(codes, top, byte, mode):
    # Blocks whose largest magnitude is 256 or 384 (x 2^(s-127)) pick back their own scale in every mode.
    data = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    data = torch.where(data.isnan(), 0.0, data).clamp(-abs(top), abs(top))  # keep `top` the largest
    data[0] = top
    scale = torch.tensor([byte], dtype=torch.uint8)
    w = mxfp8.decode(data.to(torch.float8_e4m3fn), scale, torch.float32)
    re_data, re_scale = mxfp8.encode(w, mode)
    assert re_scale.tolist() == [byte]
    assert torch.equal(mxfp8.decode(re_data, re_scale, torch.float32), w)


@settings(max_examples=150, deadline=None)
@given(values=st.lists(finite_floats, min_size=32, max_size=32), mode=modes)
def test_sign_symmetry(values, mode):
    w = torch.tensor(values)
    data, scale = mxfp8.encode(w, mode)
    neg_data, neg_scale = mxfp8.encode(-w, mode)
    assert torch.equal(scale, neg_scale)
    # The sign bit flips on every value that is nonzero after scaling; exact zeros encode as +0 either way.
    nonzero = (w * mx.scale_to_float(scale).reciprocal() != 0).to(torch.uint8)
    assert torch.equal(bits(data) ^ (nonzero << 7), bits(neg_data))


@settings(max_examples=150, deadline=None)
@given(values=st.lists(finite_floats, min_size=32, max_size=32), mode=modes)
def test_saturation_and_error_bound(values, mode):
    w = torch.tensor(values)
    data, scale = mxfp8.encode(w, mode)
    out = mxfp8.decode(data, scale, torch.float32)
    step = mx.scale_to_float(scale).item()
    assert (out.abs() <= 448 * step).all()
    # Round to nearest at 3 mantissa bits: relative error <= 2^-4, plus half the subnormal step, plus any clip.
    clip = (w.abs() - 448 * step).clamp(min=0)
    assert ((out - w).abs() <= w.abs() * 2.0**-4 + 2.0**-10 * step + clip).all()
    if mode != "floor":
        assert (w.abs() <= 448 * step).all()  # even and rceil never clip E4M3 (448 = 1.75 * 2^8)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(finite_floats, min_size=64, max_size=64), position=st.integers(0, 63),
       bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]), mode=modes)
def test_non_finite_poisons_only_its_block(values, position, bad, mode):
    w = torch.tensor(values)
    clean_data, clean_scale = mxfp8.encode(w, mode)
    w[position] = bad
    data, scale = mxfp8.encode(w, mode)
    block, other = position // 32, 1 - position // 32
    assert scale[block] == 255
    assert mxfp8.decode(data, scale, torch.float32)[block * 32 : block * 32 + 32].isnan().all()
    assert scale[other] == clean_scale[other]
    assert torch.equal(bits(data[other * 32 : other * 32 + 32]), bits(clean_data[other * 32 : other * 32 + 32]))


@settings(max_examples=50, deadline=None)
@given(mode=modes, negative=st.lists(st.booleans(), min_size=32, max_size=32))
def test_zero_blocks(mode, negative):
    w = torch.tensor([-0.0 if n else 0.0 for n in negative])
    data, scale = mxfp8.encode(w, mode)
    assert scale.tolist() == [0]
    assert bits(data).eq(0).all()  # +0 whatever the sign of the zero
