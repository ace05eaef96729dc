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
