"""experts/tiers.py pieces not covered through the store: typed views of one read buffer."""

import torch

from moeswap.experts.tiers import _typed


def test_read_buffer_views_take_each_tensor_dtype_even_unaligned():
    """A kept expert's fp32 or bf16 scales are read as views of one byte buffer where their offset allows, else
    copied (safetensors does not align tensors); one-byte tensors stay uint8 for the format to reinterpret."""
    values = torch.arange(6, dtype=torch.float32)
    buf = torch.zeros(64, dtype=torch.uint8)
    buf[8:32] = values.view(torch.uint8)
    buf[33:57] = values.view(torch.uint8)
    aligned, unaligned = _typed(buf[8:32], torch.float32), _typed(buf[33:57], torch.float32)
    assert torch.equal(aligned, values) and aligned.data_ptr() == buf.data_ptr() + 8  # a view
    assert torch.equal(unaligned, values) and unaligned.dtype == torch.float32  # a copy
    raw = buf[8:32]
    assert _typed(raw, torch.float8_e4m3fn) is raw
