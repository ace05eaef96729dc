"""Which dense weights `--dense-weights int8|int4` and `moeswap quantize --dense int8|int4` store as integer codes:
one rule, as data, for every architecture (Kimi K3, Kimi Linear, DeepSeek-V3): a 2-D [out, in] Linear weight
with `in` a multiple of IN_MULTIPLE whose module's last name segment is not in KEPT. There is no size floor: at
K3's shapes the smallest matrix it takes (KDA's b_proj, 64 x 7168) holds 0.46 M weights, and a floor would split
a KDA layer's fused input projections between two formats in smaller models. So attention and MLA projections, KDA's input projections (q/k/v, the gates' down projections
f_a/g_a or the full-rank g, beta's b: one fused product of one format in the decode step) and o_proj, the dense
MLP, shared experts, the latent projections and lm_head are quantised; norms, biases, convolutions, A_log and
the AttnRes scores are not Linear weights (nor quantised), and the router, KDA's low-rank gate up-projections and the
embedding stay as stored. Torch-free. Entry points: `FORMATS`, `quantizable(module, shape)`.
"""

from __future__ import annotations

from collections.abc import Sequence

# --dense-weights / quantize --dense choice -> weights format name (weights.registry.FORMATS)
FORMATS = {"int8": "int8", "int4": "int4"}
IN_MULTIPLE = 32  # INT4's group (and the kernels' 32-column blocks)
# last name segments kept as stored: the router (`gate`, [experts, hidden], its scores pick experts), the
# embedding (a row lookup: quantising it saves memory, not time), KDA's low-rank gate up-projections f_b / g_b
# ([H K, K]: few weights, and the forget gate's feeds an exponential), and the AttnRes score vectors ([1, hidden]
# matrices in the checkpoint, not Linears: quantize sees only names and shapes)
KEPT = frozenset({"gate", "embed_tokens", "f_b_proj", "g_b_proj", "self_attention_res_proj", "mlp_res_proj",
                  "output_attn_res_proj"})


def quantizable(module: str, shape: Sequence[int]) -> bool:
    """Whether a dense weight of `module` (its model or checkpoint name) of `shape` is stored as codes."""
    return (len(shape) == 2 and shape[0] > 0 and shape[1] > 0 and shape[1] % IN_MULTIPLE == 0
            and module.rpartition(".")[2] not in KEPT)


ENCODE_ROW_BYTES = 64 << 20  # fp32 bytes of the rows encoded at a time


def encode_by_rows(fmt, w):
    """fmt.encode(w.float()) a slice of rows at a time, the same codes and scales: every dense format here scales
    within a row (int8 one scale a row, int4 one per 32 of a row), so a slice's encoding is that of its rows.
    The peak is one slice's temporaries, not the whole matrix's (K3's lm_head is 4.7 GB in fp32, and its encoding
    takes several times that). `w` may be a zero-copy view of the checkpoint in any float dtype."""
    import torch

    rows = max(1, ENCODE_ROW_BYTES // (4 * max(1, w.shape[1])))
    parts = [fmt.encode(w[i:i + rows].float()) for i in range(0, w.shape[0], rows)]
    out = {}
    for suffix, first in parts[0].items():
        if suffix == "weight_shape":  # the matrix's [out, in] (compressed-tensors pack-quantized), not a slice's
            out[suffix] = torch.tensor(list(w.shape), dtype=first.dtype)
        else:
            out[suffix] = torch.cat([p[suffix] for p in parts]) if len(parts) > 1 else first
    return out
