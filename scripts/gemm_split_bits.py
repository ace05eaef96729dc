"""Whether torch's CPU GEMM gives a part of a product the bits of that part's own product, on this CPU.

Three questions about y = x @ W.T in fp32 (torch's GEMM: MKL in the PyTorch CPU wheels), one thread:
  columns  does F.linear(x, W).split(sizes, -1)[i] equal F.linear(x, W.split(sizes)[i])?
           (a fused projection against its own; docs/numerics.md, issue 34)
  rows     does F.linear(x, W)[:m] equal F.linear(x[:m], W)? (a token's row in a batch against alone)
  aligned  does F.linear(x, W) equal it for x a column slice of a wider matrix (rows 8 bytes off a
           16-byte boundary: a fused product's part, fed to the next projection)?
Prints one JSON object per shape: M, K, the parts' sizes, the sizes of the parts whose bits differ, the
row counts m whose rows differ, and the parts whose own product differs for the misaligned x. MKL chooses its kernels by CPU and matrix sizes; run it under
MKL_ENABLE_INSTRUCTIONS=AVX2 to see what an AMD CPU gets:

    python scripts/gemm_split_bits.py
    MKL_ENABLE_INSTRUCTIONS=AVX2 python scripts/gemm_split_bits.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

# the parts' output sizes over input width K: tiny K3's KDA and MLP input projections, a wider KDA, K3's MLA,
# LoRA A products (rank 4 and 16)
SHAPES = [(32, (4, 16)), (64, (64, 64, 64, 32, 2, 64)), (64, (128, 128)), (256, (256, 256, 256, 64, 4, 256)), (7168, (1536, 576))]
ROWS = (1, 8, 32, 33, 40, 64, 150, 512)


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for M in ROWS:
        for K, sizes in SHAPES:
            x, W = torch.randn(M, K, generator=gen), torch.randn(sum(sizes), K, generator=gen)
            whole = F.linear(x, W)
            columns = [n for n, w, y in zip(sizes, W.split(sizes), whole.split(sizes, -1)) if not torch.equal(F.linear(x, w), y)]
            rows = [m for m in (1, 7, 32) if m < M and not torch.equal(F.linear(x[:m], W), whole[:m])]
            wide = torch.zeros(M, K + 6)
            wide[:, 2:K + 2] = x  # rows K + 6 floats apart: every other row starts 8 bytes off 16
            misaligned = [n for n, w in zip(sizes, W.split(sizes)) if not torch.equal(F.linear(wide[:, 2:K + 2], w), F.linear(x, w))]
            print(json.dumps({"M": M, "K": K, "sizes": list(sizes), "parts_differing": columns,
                              "rows_differing_alone": rows, "parts_differing_misaligned": misaligned}))


if __name__ == "__main__":
    main()
