"""Expert formats: one strategy object per way a checkpoint stores a linear weight (FLOAT bf16/fp16/fp32
`weight`; MXFP4 `weight_packed` + `weight_scale`; MXFP8 float8 `weight` + `weight_scale`; FP8_BLOCK `weight` +
`weight_scale_inv`; INT4 `weight_packed` + `weight_scale` + `weight_shape`), chosen once at load from the
tensors' suffixes (`for_suffixes`) and used instead of per-call checks (vLLM's quantization methods). Each
owns its facts: what the tensors must look like, bytes stored and decoded, decoding and encoding, how an
expert is read and kept (MXFP4, block FP8 and INT4 stay their bytes: ops.expert's MXFP4ExpertWeights,
FP8ExpertWeights, Int4ExpertWeights; float and MXFP8 are decoded, ExpertWeights), and the compute of a kept
expert through `w.fmt` (the format of its kept form): `forward` (the
kernel choice), `reference` (plain torch), `project` (x W^T under autograd: the fast kernel forward, backward
dx = dy W decoded in row chunks, no weight gradient) and `train_forward` (an expert from three `project`s,
plus adapters); `frozen_group` / `frozen_moe`: a layer step's frozen float experts without adapters as one
autograd node (without / with the gather and the weighted sum), whose bf16 products run on the stored weights
in C (cpu_kernels.bf16_gemm, both directions) and fp32/float64 ones in torch.
In ops/, not formats/, because kernels and backward are ops; formats/weights.py imports it lazily.
Shapes: T tokens, I expert input width, F expert width, O/N one projection's output/input width.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping

import numpy as np
import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import fp8_block, int4, mxfp4, mxfp8
from moeswap.formats.checkpoint import Checkpoint, CheckpointError, TensorInfo
from moeswap.ops import cpu_kernels, expert_mxfp4, expert_quant
from moeswap.ops.activation import glu, glu_reference
from moeswap.ops.expert import ExpertWeights, FP8ExpertWeights, Int4ExpertWeights, MXFP4ExpertWeights, tensors
from moeswap.ops.kernel_abi import EXPERT_PROJS, KERNEL_PROJS, constant
from moeswap.ops.linear import linear

PROJS = EXPERT_PROJS  # gate, down, up (csrc/cpu_kernels.h MOESWAP_EXPERT_PROJS)
DENSE_FIELDS = {"w1": "w1_FI", "w3": "w3_FI", "w2": "w2_IF"}  # ExpertWeights' field of each projection
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
ROW_CHUNK_BYTES = constant("ROW_CHUNK_BYTES")  # decoded bytes per chunk in a backward product (cpu_kernels.h)

Adapter = Callable[[str, torch.Tensor], "torch.Tensor | None"]  # (projection, its input) -> added output


class ExpertFormat:
    name = ""  # "float" | "mxfp4" | "mxfp8" | "fp8_block" (formats.weights.StoredWeight.kind)
    label = ""  # in messages
    suffixes: frozenset[str] = frozenset()  # the tensors one weight is stored as, by name suffix
    main = "weight"  # the one that holds the weights (named in messages)
    ct_format: str | None = None  # compressed-tensors' name for it (MX formats)
    keeps_bytes = False  # an expert may be kept as its stored bytes (else decoded at read)
    # (suffix, limit): in an expert kept as bytes, the tensors whose name ends in suffix must hold no byte
    # above limit; that is all check_finite looks for, so a reader may check it on its own thread
    byte_limit: tuple[str, int] | None = None

    def __repr__(self) -> str:
        return f"<{self.label} expert format>"

    # -- the checkpoint side ------------------------------------------------------------------------

    def dtypes_fit(self, dtypes: Mapping[str, torch.dtype]) -> bool:
        """Whether tensors of these dtypes (by suffix) can be this format (the dense-module classifier's
        second question, after the suffixes)."""
        raise NotImplementedError

    def check_declared(self, where: str, declared: str | None, fp8_block_size: tuple[int, int] | None = None) -> None:
        """Fails when config.json's quantization_config (its compressed-tensors format name, or the block
        FP8 block size) does not declare this format."""
        if self.ct_format is None:
            return
        if declared is None:
            raise CheckpointError(f"{where}: stored as {self.label} ({self.ct_format}) but config.json has no "
                                  f"compressed-tensors quantization_config")
        if declared != self.ct_format:
            raise CheckpointError(f"{where}: stored as {self.label} ({self.ct_format}) but config.json's "
                                  f"quantization_config says format {declared}")

    def check_dtypes(self, dtypes: Mapping[str, torch.dtype], where: str) -> None:
        """A dense module's tensors (by suffix) beyond `dtypes_fit`."""

    def check_expert_tensors(self, ckpt: Checkpoint, names: Mapping[str, str], shape: tuple[int, int],
                             where: str) -> None:
        """One expert projection's tensors against its [out, in] shape from config.json."""
        raise NotImplementedError

    def logical_shape(self, infos: Mapping[str, TensorInfo]) -> tuple[int, ...]:
        return tuple(infos["weight"].shape)

    def stored_bytes(self, infos: Mapping[str, TensorInfo]) -> int:
        return sum(i.nbytes for i in infos.values())

    def decoded_bytes(self, infos: Mapping[str, TensorInfo], itemsize: int) -> int:
        return math.prod(self.logical_shape(infos)) * itemsize

    def decode(self, stored: Mapping[str, torch.Tensor], dtype: torch.dtype,
               block: tuple[int, int] | None = None) -> torch.Tensor:
        """The weight as `dtype` from its stored tensors (by suffix)."""
        raise NotImplementedError

    def stored_specs(self, shape: tuple[int, int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        raise NotImplementedError(f"moeswap does not write {self.label} weights")

    def encode(self, w: torch.Tensor, mode: str = "even") -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"moeswap does not write {self.label} weights")

    # -- reading an expert ------------------------------------------------------------------------------

    def read_expert(self, read: Callable[[str], torch.Tensor], names: Mapping[str, Mapping[str, str]],
                    dtype: torch.dtype, device, keep_bytes: bool):
        """An expert's three projections (names: proj -> suffix -> checkpoint name), decoded to `dtype`
        (or kept as bytes where the format keeps them and `keep_bytes`), on `device`."""
        mats = {p: self.decode({s: read(n) for s, n in names[p].items()}, dtype).to(device) for p in PROJS}
        return ExpertWeights(w1_FI=mats["w1"], w3_FI=mats["w3"], w2_IF=mats["w2"])

    def check_finite(self, w, names: Mapping[str, Mapping[str, str]]) -> tuple[str, str, str] | None:
        """(checkpoint tensor, projection, what is wrong) for the first projection of a just-read expert
        whose bytes cannot give finite weights, else None."""
        for proj in KERNEL_PROJS:
            t = getattr(w, DENSE_FIELDS[proj])
            # a NaN or Inf anywhere makes the fp32 sum non-finite, so a finite sum clears the matrix (~12x faster
            # than isfinite on bf16, which torch does not vectorize); a sum that overflows gets the full check
            if math.isfinite(float(t.sum(dtype=torch.float32))):
                continue
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                at = [int(i) for i in (~finite).nonzero()[0]]
                verb = "holds" if self.name == "float" else "decodes to"
                return names[proj]["weight"], proj, (f"{verb} non-finite weights (NaN or Inf), first at {at}; "
                                                     f"expected finite values")
        return None

    # -- a kept expert (the format of its kept form: FLOAT or MXFP4) -------------------------------------

    def forward(self, w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        """w2 act(w1 x, w3 x) by the fastest path for this kept form (inference: no autograd graph)."""
        raise NotImplementedError

    def reference(self, w, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        """The same in plain torch on the decoded weights (the oracle every path matches)."""
        h = glu_reference(act, x_TI @ self.weight(w, "w1", x_TI.dtype).T, x_TI @ self.weight(w, "w3", x_TI.dtype).T,
                          situ_betas)
        return h @ self.weight(w, "w2", x_TI.dtype).T

    def weight(self, w, proj: str, dtype: torch.dtype) -> torch.Tensor:
        """One projection's whole matrix [O, N] as `dtype` (references, merges; never on a hot path)."""
        raise NotImplementedError

    def shape(self, w, proj: str) -> tuple[int, int]:
        raise NotImplementedError

    def project_forward(self, w, proj: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T by this form's fast kernel, without autograd."""
        raise NotImplementedError

    def project_backward(self, w, proj: str, dy: torch.Tensor) -> torch.Tensor:
        """dy @ W (the input gradient of x @ W^T), W never whole in a wider dtype than it is kept in."""
        raise NotImplementedError

    def group_kind(self, w) -> str | None:
        """"mxfp4", "bf16", "fp8" or "int4" where the grouped CPU kernel (cpu_kernels.moe) runs this expert, else None."""
        return None

    def width(self, w) -> int:
        """F, the expert's hidden width."""
        return self.shape(w, "w1")[0]

    def kernel_mats(self, w, I: int) -> list[torch.Tensor]:
        """The matrices the CPU kernels read, in their order, contiguous, for input width I."""
        raise NotImplementedError

    def convert(self, w, decoded: bool, dtype: torch.dtype, device: torch.device, pin: bool = False):
        """`w` in a tier's form: decoded `dtype` weights (or kept bytes), on `device`, pinned if asked."""
        return _placed(w, device, pin)


class FloatFormat(ExpertFormat):
    name, label = "float", "float"
    suffixes = frozenset({"weight"})

    def dtypes_fit(self, dtypes):
        return dtypes["weight"].is_floating_point and dtypes["weight"] not in FP8_DTYPES

    def check_expert_tensors(self, ckpt, names, shape, where):
        info = ckpt.info(names["weight"])
        _expect(info, shape, None, where)
        if not info.dtype.is_floating_point:
            raise CheckpointError(f"{info.name} in {info.file.name}: expected a float tensor, found {info.dtype}")
        if info.dtype.itemsize == 1:
            raise CheckpointError(f"{info.name} in {info.file.name} ({where}): float8 weight without a "
                                  f"weight_scale: expected bf16/fp16/fp32, or MXFP8 weight + weight_scale")

    def decode(self, stored, dtype, block=None):
        return stored["weight"].to(dtype)

    # the kept form of every decoded expert (ops.expert.ExpertWeights)

    def forward(self, w, x_TI, act, situ_betas):
        # ops.linear: weights may be bf16 under fp32 math (kept as stored on the CPU)
        h_TF = glu(act, linear(x_TI, w.w1_FI), linear(x_TI, w.w3_FI), situ_betas)
        return linear(h_TF, w.w2_IF)

    def weight(self, w, proj, dtype):
        return getattr(w, DENSE_FIELDS[proj]).to(dtype)

    def shape(self, w, proj):
        return tuple(getattr(w, DENSE_FIELDS[proj]).shape)

    def project_forward(self, w, proj, x):
        return linear(x, getattr(w, DENSE_FIELDS[proj]))

    def project_backward(self, w, proj, dy):
        W = getattr(w, DENSE_FIELDS[proj])
        if W.dtype == dy.dtype:
            return dy @ W
        dy_PO = dy.reshape(-1, W.shape[0])
        dx = torch.zeros(dy_PO.shape[0], W.shape[1], dtype=dy.dtype, device=dy.device)
        rows = max(1, ROW_CHUNK_BYTES // (W.shape[1] * dy.element_size()))
        for r in range(0, W.shape[0], rows):  # widen a chunk of rows at a time
            dx.addmm_(dy_PO[:, r : r + rows], W[r : r + rows].to(dy.dtype))
        return dx.reshape(*dy.shape[:-1], W.shape[1])

    def group_kind(self, w):
        mats = [getattr(w, f, None) for f in ("w1_FI", "w3_FI", "w2_IF")]
        return "bf16" if all(m is not None and m.dtype == torch.bfloat16 and m.is_cpu for m in mats) else None

    def kernel_mats(self, w, I):
        mats = [w.w1_FI, w.w3_FI, w.w2_IF]
        F = mats[0].shape[0]
        if mats[0].shape[1] != I or tuple(mats[1].shape) != (F, I) or tuple(mats[2].shape) != (I, F):
            raise ValueError(f"bf16 expert: w1 {tuple(mats[0].shape)}, w3 {tuple(mats[1].shape)}, w2 "
                             f"{tuple(mats[2].shape)} do not form an expert of input width {I}")
        return [t if t.is_contiguous() else t.contiguous() for t in mats]

    def convert(self, w, decoded, dtype, device, pin=False):
        return _placed(ExpertWeights(*(t.to(dtype) for t in (w.w1_FI, w.w3_FI, w.w2_IF))), device, pin)


class _MXFormat(FloatFormat):
    """The compressed-tensors MX formats: E8M0 scale bytes per 32 weights, declared in config.json."""

    def check_dtypes(self, dtypes, where):
        if dtypes["weight_scale"] not in SCALE_DTYPES:
            raise CheckpointError(f"{where}: weight_scale must be uint8 E8M0 bytes, found {dtypes['weight_scale']}")

    def _check_scale(self, ckpt, names, shape, where) -> None:
        _expect(ckpt.info(names["weight_scale"]), (shape[0], shape[1] // 32), torch.uint8, where)

    def stored_specs(self, shape):
        return ct.stored_specs(self.name, shape)

    def encode(self, w, mode="even"):
        return ct.encode_weight(self.name, w, mode)


class MXFP8Format(_MXFormat):
    """Read and decoded to float (kept as FLOAT experts)."""

    name, label, ct_format = "mxfp8", "MXFP8", ct.FORMATS["mxfp8"]
    suffixes = frozenset({"weight", "weight_scale"})

    def dtypes_fit(self, dtypes):
        return dtypes["weight"] in FP8_DTYPES

    def check_expert_tensors(self, ckpt, names, shape, where):
        info = ckpt.info(names["weight"])
        _expect(info, shape, None, where)
        if info.dtype not in FP8_DTYPES:
            raise CheckpointError(f"{info.name} in {info.file.name} ({where}): MXFP8 weight must be float8_e4m3fn "
                                  f"or float8_e5m2, found {info.dtype}")
        self._check_scale(ckpt, names, shape, where)

    def decode(self, stored, dtype, block=None):
        # exact in fp32, then cast: the same bits as decoding straight to `dtype`
        return mxfp8.decode(stored["weight"], stored["weight_scale"], torch.float32).to(dtype)


class _KeptBytes(FloatFormat):
    """Block FP8 and INT4 routed experts, kept as their stored bytes (FP8ExpertWeights, Int4ExpertWeights)
    unless decoded copies are asked for, computed from them by ops.expert_quant (csrc/quant.c)."""

    keeps_bytes = True
    kept: type = object  # the kept form
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
        if not isinstance(w, self.kept):
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

    def group_kind(self, w):
        return expert_quant.group_kind(w)

    def width(self, w):
        return expert_quant.shape(w, "w1")[0]

    def kernel_mats(self, w, I):
        return expert_quant.kernel_mats(w, I)

    def convert(self, w, decoded, dtype, device, pin=False):
        if decoded:
            mats = {p: self.weight(w, p, dtype) for p in PROJS}
            return _placed(ExpertWeights(w1_FI=mats["w1"], w3_FI=mats["w3"], w2_IF=mats["w2"]), device, pin)
        return _placed(w, device, pin)


def _first_true(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0]]


class Int4Format(_KeptBytes):
    """compressed-tensors `pack-quantized` INT4 (Kimi K2-Thinking's routed experts: `weight_packed` int32,
    bf16 `weight_scale` per 32 inputs, `weight_shape`); the bf16 products compressed-tensors forms are the
    weights (formats/int4.py). Kept as Int4ExpertWeights (the codes and scales; weight_shape is checked at
    load and not kept)."""

    name, label, ct_format = "int4", "INT4", ct.FORMATS["int4"]
    suffixes = frozenset({"weight_packed", "weight_scale", "weight_shape"})
    main = "weight_packed"
    kept, scale_suffix = Int4ExpertWeights, "weight_scale"

    def _kept(self, parts):
        return Int4ExpertWeights.unchecked(**{k: (v.view(torch.int32) if k.endswith("_packed") and v.dtype == torch.uint8
                                                  else v) for k, v in parts.items() if not k.endswith("_shape")})

    def _check_kept(self, w, names):
        # codes are finite: a weight is not when its scale is not, or when code * scale overflows the scale's dtype
        for proj in PROJS:
            scale = getattr(w, f"{proj}_scale")
            bad = ~(scale.float() * -8).to(scale.dtype).isfinite()
            if bool(bad.any()):
                return (names[proj]["weight_scale"], proj, f"decodes to non-finite weights (NaN or Inf), first at "
                        f"scale {_first_true(bad)}; expected finite scales")
        return None

    def dtypes_fit(self, dtypes):
        return dtypes["weight_packed"] == torch.int32

    def check_dtypes(self, dtypes, where):
        if not dtypes["weight_scale"].is_floating_point:
            raise CheckpointError(f"{where}: INT4 weight_scale must be a float tensor, found {dtypes['weight_scale']}")

    def check_expert_tensors(self, ckpt, names, shape, where):
        _expect(ckpt.info(names["weight_packed"]), int4.packed_shape(shape), torch.int32, where)
        scale = ckpt.info(names["weight_scale"])
        _expect(scale, int4.scale_shape(shape), None, where)
        self.check_dtypes({"weight_scale": scale.dtype}, f"{scale.name} in {scale.file.name} ({where})")
        _expect(ckpt.info(names["weight_shape"]), (2,), torch.int32, where)

    def logical_shape(self, infos):
        return infos["weight_packed"].shape[0], infos["weight_scale"].shape[1] * int4.GROUP

    def decode(self, stored, dtype, block=None):
        return ct.decode_weight("int4", stored, dtype)

    def stored_specs(self, shape):
        return ct.stored_specs(self.name, shape)

    def encode(self, w, mode="even"):
        return ct.encode_weight(self.name, w, mode)


class FP8BlockFormat(_KeptBytes):
    """DeepSeek block FP8 (float8_e4m3fn `weight` + fp32 `weight_scale_inv` per 128 x 128 block): dense
    modules (decoded at load, formats/weights.py) and routed experts, kept as FP8ExpertWeights (the codes,
    and the scales as fp32: exact from bf16 or fp16)."""

    name, label = "fp8_block", "block FP8"
    suffixes = frozenset({"weight", "weight_scale_inv"})
    kept, scale_suffix = FP8ExpertWeights, "weight_scale_inv"

    def _kept(self, parts):
        return FP8ExpertWeights.unchecked(**{
            k: (v.view(torch.float8_e4m3fn) if v.dtype == torch.uint8 else v) if k.endswith("_weight")
            else v.to(torch.float32) for k, v in parts.items()})

    def _check_kept(self, w, names):
        # a weight is NaN for a NaN code (S.1111.111) or scale, infinite for an infinite scale or a product past
        # fp32's range (a scale above 3.4e38 / 448)
        for proj in PROJS:
            codes = getattr(w, f"{proj}_weight").view(torch.uint8)
            nan = (codes | 0x80) == 0xFF
            if bool(nan.any()):
                return (names[proj]["weight"], proj, f"holds NaN codes (E4M3 S.1111.111), first at "
                        f"{_first_true(nan)}; expected finite weights")
            scale = getattr(w, f"{proj}_scale_inv")
            bad = ~(scale * fp8_block.E4M3_MAX).isfinite()
            if bool(bad.any()):
                return (names[proj]["weight_scale_inv"], proj, f"decodes to non-finite weights (NaN or Inf), "
                        f"first at block {_first_true(bad)}; expected finite scales below 3.4e38 / 448")
        return None

    def dtypes_fit(self, dtypes):
        return True  # fp8_block.decode names a wrong dtype

    def check_declared(self, where, declared, fp8_block_size=None):
        if fp8_block_size is None:
            raise CheckpointError(f"{where}: has weight_scale_inv (block FP8) but config.json has no "
                                  f"quant_method 'fp8' quantization_config with weight_block_size")

    def check_expert_tensors(self, ckpt, names, shape, where):
        info = ckpt.info(names["weight"])
        _expect(info, shape, torch.float8_e4m3fn, where)
        scale = ckpt.info(names["weight_scale_inv"])
        _expect(scale, fp8_block.scale_shape(shape), None, where)
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(f"{scale.name} in {scale.file.name} ({where}): weight_scale_inv must be a float "
                                  f"tensor, found {scale.dtype}")

    def decode(self, stored, dtype, block=None):
        return fp8_block.decode(stored["weight"], stored["weight_scale_inv"], block or fp8_block.BLOCK, dtype)

    def stored_specs(self, shape):
        return {"weight": (torch.float8_e4m3fn, tuple(shape)),
                "weight_scale_inv": (torch.float32, fp8_block.scale_shape(tuple(shape)))}

    def encode(self, w, mode="even"):
        q, scale_inv = fp8_block.encode(w)
        return {"weight": q, "weight_scale_inv": scale_inv}


class MXFP4Format(_MXFormat):
    """Kept as its stored bytes (4.25 bits per weight) unless decoded copies are asked for; computes
    straight from them (ops.expert_mxfp4)."""

    name, label, ct_format = "mxfp4", "MXFP4", ct.FORMATS["mxfp4"]
    suffixes = frozenset({"weight_packed", "weight_scale"})
    main = "weight_packed"
    keeps_bytes = True
    byte_limit = ("_scale", mxfp4.MAX_SCALE_BYTE)  # what check_finite checks of the kept form

    def dtypes_fit(self, dtypes):
        return True

    def check_expert_tensors(self, ckpt, names, shape, where):
        _expect(ckpt.info(names["weight_packed"]), (shape[0], shape[1] // 2), torch.uint8, where)
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
            return MXFP4ExpertWeights.unchecked(views, nbytes)
        return MXFP4ExpertWeights(**views)

    def check_finite(self, w, names):
        """MXFP4 elements are always finite: a scale byte above mxfp4.MAX_SCALE_BYTE (its block can decode
        to ±Inf; 0xFF is NaN) is all there is to find, in 1/16 of the bytes."""
        if not isinstance(w, MXFP4ExpertWeights):
            return super().check_finite(w, names)
        for proj in PROJS:
            scale = getattr(w, f"{proj}_scale").numpy()  # numpy: a third of torch's per-call overhead on 16 KB
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

    def group_kind(self, w):
        return "mxfp4" if w.w1_packed.is_cpu else None  # (is_cpu: ~0.1 us, .device.type ~5 us)

    def width(self, w):
        return w.w1_packed.shape[0]

    def kernel_mats(self, w, I):
        mats = [w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, w.w2_packed, w.w2_scale]
        if mats[0].shape[1] * 2 != I:
            raise ValueError(f"MXFP4 expert of input width {mats[0].shape[1] * 2} given inputs of width {I}")
        if not all(t.is_cpu for t in mats):  # (is_cpu: no device object per tensor; this runs on every load)
            raise ValueError("MXFP4 expert: the CPU kernel needs CPU tensors")
        return [t if t.is_contiguous() else t.contiguous() for t in mats]

    def convert(self, w, decoded, dtype, device, pin=False):
        if decoded:
            mats = {p: self.weight(w, p, dtype) for p in PROJS}
            return _placed(ExpertWeights(w1_FI=mats["w1"], w3_FI=mats["w3"], w2_IF=mats["w2"]), device, pin)
        return _placed(w, device, pin)


FLOAT, MXFP4, MXFP8, FP8_BLOCK, INT4 = FloatFormat(), MXFP4Format(), MXFP8Format(), FP8BlockFormat(), Int4Format()
FORMATS = {f.name: f for f in (FLOAT, MXFP4, MXFP8, FP8_BLOCK, INT4)}
_BY_SUFFIXES = {f.suffixes: f for f in FORMATS.values()}


def for_suffixes(suffixes) -> ExpertFormat | None:
    """The format whose tensors are exactly these suffixes (weight, weight_packed, ...), or None."""
    return _BY_SUFFIXES.get(frozenset(suffixes))


def _expect(info: TensorInfo, shape, dtype, what: str) -> None:
    if tuple(info.shape) != tuple(shape):
        raise CheckpointError(f"{info.name} in {info.file.name} ({what}): expected shape {list(shape)} "
                              f"from config.json, found {list(info.shape)}")
    if dtype is not None and info.dtype != dtype:
        raise CheckpointError(f"{info.name} in {info.file.name} ({what}): expected dtype {dtype}, found {info.dtype}")


def _placed(w, device: torch.device, pin: bool):
    parts = tensors(w)
    if all(t.device == device and (not pin or t.is_pinned()) for t in parts.values()):
        return w  # already in this form (the CPU fast tier keeps what the disk read gave)
    return type(w)(**{k: _place(t, device, pin) for k, t in parts.items()})


def _place(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if pin and device.type == "cpu" and not t.is_pinned():
        return t.pin_memory()
    return t.to(device, non_blocking=device.type == "cuda")


# -- autograd through a frozen expert ----------------------------------------------------------------


class Held:
    """An expert as an autograd graph keeps it for its backward: `get()` gives the weights. This one holds
    them; an expert store hands out its own kind (experts.store), which lets go when the store evicts the
    expert and fetches it again for the backward, so a graph never holds bytes the store's budget does not
    count."""

    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w

    def get(self):
        return self.w


class _Project(torch.autograd.Function):
    """y = x W^T for one projection of a frozen expert: no gradient for W, which only `held` keeps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, held, proj: str) -> torch.Tensor:
        ctx.held, ctx.proj = held, proj
        w = held.get()
        return w.fmt.project_forward(w, proj, x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        w = ctx.held.get()
        return w.fmt.project_backward(w, ctx.proj, dy.contiguous()), None, None


def project(held, proj: str, x: torch.Tensor) -> torch.Tensor:
    """x W_proj^T for a held expert (see Held), differentiable in x."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Project.apply(x, held, proj)
    w = held.get()
    return w.fmt.project_forward(w, proj, x)


def train_forward(held, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float],
                  adapter: Adapter | None = None) -> torch.Tensor:
    """w2 act(w1 x, w3 x) as three `project`s and the activation in torch ops, so autograd sees it all;
    `adapter(proj, input)` (LoRA) returns what to add to that projection's output, or None."""

    def proj(name: str, inp: torch.Tensor) -> torch.Tensor:
        y = project(held, name, inp)
        delta = adapter(name, inp) if adapter is not None else None
        return y if delta is None else y + delta.to(y.dtype)

    h_TF = glu(act, proj("w1", x_TI), proj("w3", x_TI), situ_betas)
    return proj("w2", h_TF)


GROUP_WIDE_BYTES = 64 << 20  # one expert's widened weights `frozen_group` holds at once, at most (torch path)


def groupable(w, x: torch.Tensor) -> bool:
    """Whether `frozen_group` takes this kept expert with inputs like x: a decoded (float) expert whose weights
    widened to x's dtype would fit GROUP_WIDE_BYTES (where `_direct` they are not widened at all), under fp32
    or float64 x on the same device."""
    if not isinstance(w, ExpertWeights) or not x.dtype.is_floating_point or x.dtype.itemsize < 4:
        return False
    return w.w1_FI.device == x.device and 3 * w.w1_FI.numel() * x.element_size() <= GROUP_WIDE_BYTES


def frozen_group(helds: list, x_PI: torch.Tensor, counts: list[int], act: str,
                 situ_betas: tuple[float, float]) -> torch.Tensor:
    """`train_forward` without adapters for consecutive experts' pairs (x_PI: each expert's rows in turn,
    counts[i] of them for helds[i], all `groupable`): [P, I], differentiable in x_PI, as one autograd node
    (`_FrozenGroup`) instead of four per expert."""
    if not helds:
        return x_PI.new_zeros(0, x_PI.shape[-1])
    return _FrozenGroup.apply(x_PI, tuple(helds), tuple(counts), act, situ_betas)


class _Widened:
    """An expert's three matrices as the products (`_xwT`, `_dyW`) take them: as kept where they already are
    in the compute dtype or `_direct`, else widened into buffers reused from expert to expert (no allocation
    per call)."""

    FIELDS = ("w1_FI", "w3_FI", "w2_IF")

    def __init__(self, dtype: torch.dtype, device):
        self.dtype, self.device = dtype, device
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [F, I], w3 [F, I], w2 [I, F]) of expert w."""
        return tuple(self._one(f, getattr(w, f)) for f in self.FIELDS)

    def each(self, helds):
        """(w1, w3, w2) of each held expert in turn (fetched again where the store let it go), widened
        into the same buffers: use each before asking for the next."""
        for held in helds:
            w = held.get()
            mats = self.get(w)
            del w
            yield mats

    def _one(self, field: str, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == self.dtype or _direct(t, self.dtype):
            return t
        buf = self.bufs.get(field)
        if buf is None or buf.shape != t.shape:
            buf = self.bufs[field] = torch.empty(t.shape, dtype=self.dtype, device=self.device)
        return buf.copy_(t)


def _direct(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the products take weight t as stored: bf16 on the CPU under fp32 math, where the C kernel is
    (csrc/gemm_bf16.c widens it panel by panel inside the GEMM: no fp32 copy of the weights)."""
    return t.dtype == torch.bfloat16 and dtype == torch.float32 and t.is_cpu and cpu_kernels.kernel() is not None


def _xwT(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x w^T (w [O, N] from `_Widened`): torch's GEMM on weights in x's dtype, else the bf16 kernel."""
    if w.dtype == x.dtype:
        return torch.mm(x, w.T, out=out)
    return cpu_kernels.kernel().bf16_gemm(x, w, trans=True, out=out)


def _dyW(dy: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False
         ) -> torch.Tensor:
    """dy w (w [O, N] from `_Widened`) into out (accumulate: out += dy w) or a new tensor, as `_xwT` chooses."""
    if w.dtype == dy.dtype:
        if accumulate:
            return out.addmm_(dy, w)
        return torch.mm(dy, w) if out is None else torch.mm(dy, w, out=out)
    return cpu_kernels.kernel().bf16_gemm(dy, w, trans=False, out=out, accumulate=accumulate)


def _glu_products(x, w1, w3, w2, gate_out, up_out, y_out, act: str, situ_betas) -> torch.Tensor:
    """w2 act(w1 x, w3 x) into y_out, the pre-activations into gate_out and up_out (kept for backward)."""
    _xwT(x, w1, gate_out)
    _xwT(x, w3, up_out)
    return _xwT(glu(act, gate_out, up_out, situ_betas), w2, y_out)


def _step_buffers(like: torch.Tensor, P: int, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer step's gate and up pre-activations [P, F] and outputs [P, I] for P pairs, like `like`."""
    return like.new_empty(P, w1.shape[0]), like.new_empty(P, w1.shape[0]), like.new_empty(P, w2.shape[0])


def _glu_grads(gate, up, dh, act: str, situ_betas) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of glu(act, gate, up) from d of its output: the C kernel on fp32 CPU rows, else
    torch's own derivative of the plain activation (float64 gradient checks)."""
    kernel = cpu_kernels.kernel() if gate.dtype == torch.float32 and gate.is_cpu else None
    if kernel is not None:
        return kernel.glu_backward(gate, up, dh, act, situ_betas)
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        return torch.autograd.grad(glu_reference(act, g, u, situ_betas), (g, u), dh)


class _FrozenGroup(torch.autograd.Function):
    """w2 act(w1 x, w3 x) for consecutive frozen float experts as one node: per expert (fetched once a
    pass, as `train_forward`'s projections fetch it) the gate, up and down products and the activation,
    written into whole-step outputs (contiguous rows: the activation kernels need no copies). Keeps the
    gate and up pre-activations (as GLUFunction does) and the held experts; backward per expert:
    dh = dy W2, (dg, du) from the activation, dx = dg W1 + du W3, on the weights as `_Widened` gives them
    again (bf16 ones as stored: `_xwT`, `_dyW`)."""

    @staticmethod
    def forward(ctx, x_PI, helds, counts, act, situ_betas):
        wide = _Widened(x_PI.dtype, x_PI.device)
        gate_PF = up_PF = y_PI = None
        starts = list(itertools.accumulate(counts, initial=0))
        for i, (w1, w3, w2) in enumerate(wide.each(helds)):
            lo, hi = starts[i], starts[i + 1]
            if gate_PF is None:
                gate_PF, up_PF, y_PI = _step_buffers(x_PI, x_PI.shape[0], w1, w2)
            _glu_products(x_PI[lo:hi], w1, w3, w2, gate_PF[lo:hi], up_PF[lo:hi], y_PI[lo:hi], act, situ_betas)
        ctx.save_for_backward(gate_PF, up_PF)
        ctx.helds, ctx.starts, ctx.act, ctx.situ_betas = helds, starts, act, situ_betas
        return y_PI

    @staticmethod
    def backward(ctx, dy_PI):
        gate_PF, up_PF = ctx.saved_tensors
        dy_PI = dy_PI.contiguous()
        wide = _Widened(dy_PI.dtype, dy_PI.device)
        dx_PI = torch.empty_like(dy_PI)
        for i, (w1, w3, w2) in enumerate(wide.each(ctx.helds)):
            lo, hi = ctx.starts[i], ctx.starts[i + 1]
            dh = _dyW(dy_PI[lo:hi], w2)
            dg, du = _glu_grads(gate_PF[lo:hi], up_PF[lo:hi], dh, ctx.act, ctx.situ_betas)
            dx = _dyW(dg, w1, out=dx_PI[lo:hi])
            _dyW(du, w3, out=dx, accumulate=True)
        return dx_PI, None, None, None, None


def frozen_moe(helds: list, h_TI: torch.Tensor, token_of: torch.Tensor, weights: torch.Tensor, counts: list[int],
               act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """A layer step's routed output when every expert is `groupable` without adapters: each token's pairs'
    `frozen_group` outputs times their routing weights, added from zero in pair order (models.layers.moe's
    combine_pairs, the same bits) — [T, I], differentiable in h_TI and weights, as one autograd node that
    gathers and scatters each expert's rows itself (no [P, I] copies of the inputs or outputs)."""
    return _FrozenMoE.apply(h_TI, weights, token_of, tuple(helds), tuple(counts), act, situ_betas)


class _FrozenMoE(torch.autograd.Function):
    """`frozen_moe`: _FrozenGroup's per-expert products with the gather, routing weights and sum inside.
    Keeps gate, up and each pair's unweighted output (the weights' gradient is dy · y)."""

    @staticmethod
    def forward(ctx, h_TI, weights, token_of, helds, counts, act, situ_betas):
        wide = _Widened(h_TI.dtype, h_TI.device)
        P = token_of.shape[0]
        w_P1 = weights.to(h_TI.dtype)[:, None]
        out_TI = torch.zeros_like(h_TI)
        gate_PF = up_PF = y_PI = None
        starts = list(itertools.accumulate(counts, initial=0))
        for i, (w1, w3, w2) in enumerate(wide.each(helds)):
            lo, hi = starts[i], starts[i + 1]
            if gate_PF is None:
                gate_PF, up_PF, y_PI = _step_buffers(h_TI, P, w1, w2)
            rows = token_of[lo:hi]
            y = _glu_products(h_TI.index_select(0, rows), w1, w3, w2, gate_PF[lo:hi], up_PF[lo:hi], y_PI[lo:hi],
                              act, situ_betas)
            out_TI.index_add_(0, rows, y * w_P1[lo:hi])
        ctx.save_for_backward(gate_PF, up_PF, y_PI, w_P1, token_of)
        ctx.helds, ctx.starts, ctx.act, ctx.situ_betas, ctx.w_dtype = helds, starts, act, situ_betas, weights.dtype
        return out_TI

    @staticmethod
    def backward(ctx, dout_TI):
        gate_PF, up_PF, y_PI, w_P1, token_of = ctx.saved_tensors
        dout_TI = dout_TI.contiguous()
        wide = _Widened(dout_TI.dtype, dout_TI.device)
        dh_TI = torch.zeros_like(dout_TI)
        dw_P = dout_TI.new_empty(token_of.shape[0])
        for i, (w1, w3, w2) in enumerate(wide.each(ctx.helds)):
            lo, hi = ctx.starts[i], ctx.starts[i + 1]
            rows = token_of[lo:hi]
            dc = dout_TI.index_select(0, rows)  # d (weighted output) of each pair
            torch.sum(dc * y_PI[lo:hi], 1, out=dw_P[lo:hi])
            dh = _dyW(dc.mul_(w_P1[lo:hi]), w2)
            dg, du = _glu_grads(gate_PF[lo:hi], up_PF[lo:hi], dh, ctx.act, ctx.situ_betas)
            dh_TI.index_add_(0, rows, _dyW(du, w3, out=_dyW(dg, w1), accumulate=True))
        return dh_TI, dw_P.to(ctx.w_dtype), None, None, None, None, None
