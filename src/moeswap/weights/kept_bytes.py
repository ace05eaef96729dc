"""What block FP8 and INT4 share: routed experts kept as their stored bytes (ops.expert's FP8ExpertWeights,
Int4ExpertWeights) unless decoded copies are asked for, computed from them by ops.expert_quant (csrc/quant.c
for decode-sized inputs, decoding in row chunks otherwise). Entry point: `KeptBytesFormat`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moeswap.ops import expert_quant
from moeswap.ops.expert import ExpertWeights
from moeswap.weights.dense import LinearMethod
from moeswap.weights.floating import FloatFormat
from moeswap.weights.format import PROJS, placed


class KeptBytesFormat(FloatFormat):
    """Block FP8 and INT4 routed experts, kept as their stored bytes (FP8ExpertWeights, Int4ExpertWeights)
    unless decoded copies are asked for, computed from them by ops.expert_quant (csrc/quant.c)."""

    keeps_bytes = True
    kept_form: type | None = object
    linear_method: LinearMethod | None = None
    scale_suffix = ""

    def _kept(self, parts: Mapping[str, torch.Tensor]):
        raise NotImplementedError

    def read_expert(self, read, names, dtype, device, keep_bytes):
        if not keep_bytes:
            return super().read_expert(read, names, dtype, device, keep_bytes)
        return self._kept({f"{proj}_{kind.removeprefix('weight_')}": read(n).to(device)
                           for proj, kinds in names.items() for kind, n in kinds.items()})

    def from_bytes(self, views: Mapping[str, torch.Tensor], checked: bool, nbytes: int | None = None):
        """An expert from views of one read buffer (experts.tiers: one-byte tensors as uint8, the others in their
        dtype); the kept form counts its own bytes (INT4 leaves weight_shape out)."""
        return self._kept(views)

    def check_finite(self, w, names):
        if not isinstance(w, self.kept_form):
            problem = super().check_finite(w, names)  # decoded: blamed on the scale, as the kept form's check
            return problem if problem is None else (names[problem[1]][self.scale_suffix], *problem[1:])
        return self._check_kept(w, names)

    def _check_kept(self, w, names) -> tuple[str, str, str] | None:
        raise NotImplementedError

    # the kept form

    def forward(self, w, x_TI, act, situ_betas):
        return expert_quant.forward(w, x_TI, act, situ_betas)

    def reference(self, w, x_TI, act, situ_betas):
        return expert_quant.reference(w, x_TI, act, situ_betas)

    def weight(self, w, proj, dtype):
        return expert_quant.weight(w, proj, dtype)

    def shape(self, w, proj):
        return expert_quant.shape(w, proj)

    def project_forward(self, w, proj, x):
        return expert_quant.project_forward(w, proj, x)

    def project_backward(self, w, proj, dy):
        return expert_quant.project_backward(w, proj, dy)

    def width(self, w):
        return expert_quant.shape(w, "w1")[0]

    def convert(self, w, decoded, dtype, device, pin=False):
        if decoded:
            mats = {p: self.weight(w, p, dtype) for p in PROJS}
            return placed(ExpertWeights(w1_FI=mats["w1"], w3_FI=mats["w3"], w2_IF=mats["w2"]), device, pin)
        return placed(w, device, pin)


def _first_true(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0]]
