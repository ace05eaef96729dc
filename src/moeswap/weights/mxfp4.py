"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`: uint8 `weight_packed` of two E2M1 codes, E8M0
`weight_scale` bytes per 32). Routed experts are kept as their bytes (ops.expert.MXFP4ExpertWeights, 4.25 bits
a weight) and computed from them by ops.expert_mxfp4's selected implementation; the codec is formats/mxfp4.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import mxfp4
from moeswap.ops import cpu_kernels, expert_mxfp4
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights
from moeswap.weights.format import PROJS, ROW_CHUNK_BYTES, expect, placed
from moeswap.weights.mxfp8 import MXFormat


class MXFP4Format(MXFormat):
    """Kept as its stored bytes (4.25 bits per weight) unless decoded copies are asked for; computes
    straight from them (ops.expert_mxfp4)."""

    name, label, ct_format = "mxfp4", "MXFP4", ct.FORMATS["mxfp4"]
    suffixes = frozenset({"weight_packed", "weight_scale"})
    main = "weight_packed"
    keeps_bytes = True
    kept_form = MXFP4ExpertWeights
    byte_limit = ("_scale", mxfp4.MAX_SCALE_BYTE)  # what check_finite checks of the kept form

    def dtypes_fit(self, dtypes):
        return True

    def check_expert_tensors(self, ckpt, names, shape, where):
        expect(ckpt.info(names["weight_packed"]), (shape[0], shape[1] // 2), torch.uint8, where)
        self._check_scale(ckpt, names, shape, where)

    def logical_shape(self, infos):
        out_dim, half = infos["weight_packed"].shape
        return out_dim, half * 2

    def decode(self, stored, dtype, block=None):
        return mxfp4.decode(stored["weight_packed"], stored["weight_scale"], torch.float32).to(dtype)

    def read_expert(self, read, names, dtype, device, keep_bytes):
        if not keep_bytes:
            return super().read_expert(read, names, dtype, device, keep_bytes)
        parts = {f"{proj}_{kind.removeprefix('weight_')}": read(n).to(device)
                 for proj, kinds in names.items() for kind, n in kinds.items()}
        return MXFP4ExpertWeights(**parts)

    def from_bytes(self, views: Mapping[str, torch.Tensor], checked: bool,
                   nbytes: int | None = None) -> MXFP4ExpertWeights:
        """An expert from views of one read buffer ({proj}_packed / {proj}_scale); `checked`: laid out
        exactly like one that passed MXFP4ExpertWeights' checks, and then `nbytes` (their bytes, if the
        caller knows them) spares counting them."""
        if checked:
            return MXFP4ExpertWeights.unchecked(dict(views), nbytes)
        return MXFP4ExpertWeights(**views)

    def check_finite(self, w, names):
        """MXFP4 elements are always finite: a scale byte above mxfp4.MAX_SCALE_BYTE (its block can decode
        to ±Inf; 0xFF is NaN) is all there is to find, in 1/16 of the bytes."""
        if not isinstance(w, MXFP4ExpertWeights):  # decoded: blamed on the scale, as the kept form's check
            problem = super().check_finite(w, names)
            return problem if problem is None else (names[problem[1]]["weight_scale"], *problem[1:])
        for proj in PROJS:
            scale = getattr(w, f"{proj}_scale").numpy()  # numpy: less per-call overhead than torch (docs/benchmarks.md)
            top = int(scale.max()) if scale.size else 0
            if top > mxfp4.MAX_SCALE_BYTE:
                row, block = (int(i) for i in np.unravel_index(np.argmax(scale > mxfp4.MAX_SCALE_BYTE), scale.shape))
                what = ("NaN scale bytes (E8M0 0xFF)" if top == mxfp4.SCALE_NAN else
                        f"scale bytes above {mxfp4.MAX_SCALE_BYTE} (2^{mxfp4.MAX_SCALE_BYTE - 127}), whose blocks "
                        f"decode to ±Inf")
                return names[proj]["weight_scale"], proj, (f"{what}, first at row {row} block {block}; expected "
                                                           f"E8M0 bytes of at most {mxfp4.MAX_SCALE_BYTE}")
        return None

    # the kept form MXFP4ExpertWeights

    def forward(self, w, x_TI, act, situ_betas):
        return expert_mxfp4.select()(w, x_TI, act, situ_betas)

    def reference(self, w, x_TI, act, situ_betas):
        return expert_mxfp4.reference(w, x_TI, act, situ_betas)

    def weight(self, w, proj, dtype):
        return mxfp4.decode(getattr(w, f"{proj}_packed"), getattr(w, f"{proj}_scale"), torch.float32).to(dtype)

    def shape(self, w, proj):
        packed = getattr(w, f"{proj}_packed")
        return packed.shape[0], packed.shape[1] * 2

    def project_forward(self, w, proj, x):
        packed, scale = getattr(w, f"{proj}_packed"), getattr(w, f"{proj}_scale")
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        kernel = cpu_kernels.kernel() if x.is_cpu and packed.is_cpu else None
        if 0 < rows < expert_mxfp4.GEMM_MIN_TOKENS and kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
            (y,) = kernel.linear(x.reshape(rows, x.shape[-1]).float().contiguous(), [(packed, scale)])
            return y.to(x.dtype).reshape(*x.shape[:-1], packed.shape[0])
        if x.dtype in (torch.float32, torch.bfloat16):
            return expert_mxfp4.rows_linear(x, packed, scale)
        return x @ self.weight(w, proj, x.dtype).T  # float64 (gradient checks): decoding is exact in any float

    def project_backward(self, w, proj, dy):
        packed, scale = getattr(w, f"{proj}_packed"), getattr(w, f"{proj}_scale")
        O, N = packed.shape[0], packed.shape[1] * 2
        dy_PO = dy.reshape(-1, O)
        dx = torch.zeros(dy_PO.shape[0], N, dtype=dy.dtype, device=dy.device)
        rows = max(1, ROW_CHUNK_BYTES // (N * 4))
        for r in range(0, O, rows):
            chunk = expert_mxfp4.decode_rows(packed[r : r + rows], scale[r : r + rows], rows, torch.float32)
            dx.addmm_(dy_PO[:, r : r + rows], chunk if dy.dtype == torch.float32 else chunk.to(dy.dtype))
        return dx.reshape(*dy.shape[:-1], N)

    def width(self, w):
        return w.w1_packed.shape[0]

    def convert(self, w, decoded, dtype, device, pin=False):
        if decoded:
            mats = {p: self.weight(w, p, dtype) for p in PROJS}
            return placed(ExpertWeights(w1_FI=mats["w1"], w3_FI=mats["w3"], w2_IF=mats["w2"]), device, pin)
        return placed(w, device, pin)


MXFP4 = MXFP4Format()
