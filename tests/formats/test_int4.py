"""INT4 pack-quantized (formats/int4.py) against compressed-tensors' own unpacking and dequantisation, bit
for bit: every byte value in every position of a word, scales across bf16's range (subnormal to huge,
both signs), and odd widths; the encoder's round trip and the codec through compressed_tensors.py."""

import pytest
import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import int4

helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
forward_helpers = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward_helpers")


def _every_byte_in_every_position() -> torch.Tensor:
    """int32 words [64, 8]: byte value b at all four byte positions of each word, and random words."""
    b = torch.arange(256, dtype=torch.int64)
    words = b | (b << 8) | (b << 16) | (b << 24)
    shifted = (b << 8) | b  # different neighbours: catches nibble order mistakes
    words = torch.cat([words, shifted])
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.view(64, 8)


def _scales(rows: int, groups: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    mags = torch.tensor([2.0 ** -133, 2.0 ** -126, 1e-3, 0.0078125, 0.3, 1.0, 7.0, 3e4, 2.0 ** 120])
    picked = mags[torch.randint(0, len(mags), (rows, groups), generator=g)]
    sign = torch.where(torch.rand(rows, groups, generator=g) < 0.5, -1.0, 1.0)
    jitter = 1 + torch.rand(rows, groups, generator=g)
    return (picked * sign * jitter).to(torch.bfloat16)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_decode_is_compressed_tensors_bit_for_bit(scale_dtype):
    packed = _every_byte_in_every_position()
    shape = (packed.shape[0], 64)
    scale = _scales(*int4.scale_shape(shape)).to(scale_dtype)
    q_ref = helpers.unpack_from_int32(packed, 4, torch.Size(shape))
    assert torch.equal(int4.codes(packed, 64), q_ref)
    want = forward_helpers._dequantize(q_ref, scale.repeat_interleave(int4.GROUP, 1))  # in the scale's dtype
    got = int4.decode(packed, scale, shape, scale_dtype)
    assert torch.equal(got.view(torch.int16 if scale_dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if scale_dtype == torch.bfloat16 else torch.int32))
    # fp32 out of bf16 scales: the bf16 products widened, as compressed-tensors' weights load into fp32
    assert torch.equal(int4.decode(packed, scale, shape, torch.float32), want.float())


def test_pack_is_compressed_tensors_and_partial_words_pad():
    q = torch.randint(-8, 8, (5, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(int4.pack(q), helpers.pack_to_int32(q, 4))
    odd = q[:, :36]  # 4.5 words per row: the last word half padding
    assert int4.pack(odd).shape == (5, 5) and torch.equal(int4.codes(int4.pack(odd), 36), odd)
    assert torch.equal(int4.pack(odd), helpers.pack_to_int32(odd, 4))


def test_encode_round_trip_and_the_compressed_tensors_entry_points():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(2))
    w[3, 32:64] = 0  # an all-zero group: scale 1, codes 0
    stored = ct.encode_weight("int4", w)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in stored.items()} == ct.stored_specs("int4", (16, 96))
    assert stored["weight_shape"].tolist() == [16, 96] and stored["weight_scale"][3, 1] == 1
    back = ct.decode_weight("int4", stored, torch.float32)
    step = stored["weight_scale"].float().repeat_interleave(32, 1).abs()
    # half a step, a little more at +amax: it maps to 7.5 steps (over, by the bf16 scale's rounding); codes stop at 7
    assert ((back - w).abs() <= step * (0.5 + 2 ** -4)).all()
    assert torch.equal(back[3, 32:64], torch.zeros(32))
    with pytest.raises(ValueError, match=r"weight_shape \[16, 64\] does not match the \[16, 96\]"):
        ct.decode_weight("int4", {**stored, "weight_shape": torch.tensor([16, 64], dtype=torch.int32)})
    with pytest.raises(ValueError, match="must be int32 of shape"):
        int4.decode(stored["weight_packed"].to(torch.int64), stored["weight_scale"], (16, 96))


def test_quantization_config_parses_as_kimi_k2_thinking_writes_it():
    q = ct.quantization_config("int4", ["lm_head", "re:.*self_attn.*"])
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["type"] == "int"
    scheme = ct.parse_quantization_config(q)
    assert (scheme.format, scheme.group_size, scheme.short_name) == ("pack-quantized", 32, "int4")
    q["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(ValueError, match="asymmetric INT4"):
        ct.parse_quantization_config(q)
