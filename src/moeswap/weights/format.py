"""The base of every weight format: `WeightFormat`, one strategy object per way a checkpoint stores a linear
weight, chosen once at load from the tensors' suffixes (registry.for_suffixes). Its checkpoint side: the
tensors it expects, their checks, bytes stored and decoded, decode and encode; its compute side for a kept
routed expert: `forward` (the kernel choice), `reference` (plain torch), `project_forward` /
`project_backward` (weights.autograd's products). Knows no format by name. Shapes: O/N one matrix's out/in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from moeswap.formats.checkpoint import Checkpoint, CheckpointError, TensorInfo
from moeswap.ops.activation import glu_reference
from moeswap.ops.expert import ExpertWeights, tensors
from moeswap.ops.kernel_abi import EXPERT_PROJS, KERNEL_PROJS, constant
from moeswap.weights.dense import LinearMethod

PROJS = EXPERT_PROJS  # gate, down, up (csrc/cpu_kernels.h MOESWAP_EXPERT_PROJS)
DENSE_FIELDS = {"w1": "w1_FI", "w3": "w3_FI", "w2": "w2_IF"}  # ExpertWeights' field of each projection
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
ROW_CHUNK_BYTES = constant("ROW_CHUNK_BYTES")  # decoded bytes per chunk in a backward product (cpu_kernels.h)

Adapter = Callable[[str, torch.Tensor], "torch.Tensor | None"]  # (projection, its input) -> added output


class WeightFormat:
    """One way a checkpoint stores a linear weight. Subclass it in one file, make one object, and
    `registry.register` it: the loader, the expert store, quantize and the contract tests then take it."""

    name = ""  # its key in registry.FORMATS (weights.stored.StoredWeight.kind)
    label = ""  # in messages
    suffixes: frozenset[str] = frozenset()  # the tensors one weight is stored as, by name suffix
    main = "weight"  # the one that holds the weights (named in messages)
    ct_format: str | None = None  # compressed-tensors' name for it (MX formats)
    keeps_bytes = False  # an expert may be kept as its stored bytes (else decoded at read)
    # (suffix, limit): in an expert kept as bytes, the tensors whose name ends in suffix must hold no byte
    # above limit; that is all check_finite looks for, so a reader may check it on its own thread
    byte_limit: tuple[str, int] | None = None
    kept_form: type | None = None  # the ops.expert form this format computes (registry.format_of), if any
    linear_method: LinearMethod | None = None  # the dense method that keeps a weight of this format as stored

    def __repr__(self) -> str:
        return f"<{self.label} weight format>"

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

    def check_stored(self, stored: Mapping[str, torch.Tensor], block: tuple[int, int] | None = None) -> None:
        """Raises ValueError where a weight's stored tensors (by suffix) would not decode: the check for a
        weight kept as stored (by decoding once, unless the format checks more cheaply)."""
        self.decode(stored, torch.float32, block)

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
            # a NaN or Inf anywhere makes the fp32 sum non-finite, so a finite sum clears the matrix (faster
            # than isfinite on bf16, which torch does not vectorize); a sum that overflows gets the full check
            if math.isfinite(float(t.sum(dtype=torch.float32))):
                continue
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                at = [int(i) for i in (~finite).nonzero()[0]]
                verb = "holds" if self.name == "float" else "decodes to"
                return names[proj][self.main], proj, (f"{verb} non-finite weights (NaN or Inf), first at {at}; "
                                                     f"expected finite values")
        return None

    # -- a kept expert (the format of its kept form: FLOAT, MXFP4, FP8_BLOCK, INT4) ----------------------

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

    def width(self, w) -> int:
        """F, the expert's hidden width."""
        return self.shape(w, "w1")[0]

    def convert(self, w, decoded: bool, dtype: torch.dtype, device: torch.device, pin: bool = False):
        """`w` in a tier's form: decoded `dtype` weights (or kept bytes), on `device`, pinned if asked."""
        return placed(w, device, pin)


def expect(info: TensorInfo, shape, dtype, what: str) -> None:
    """A checkpoint tensor's shape (and dtype, unless None) as config.json says, else a CheckpointError."""
    if tuple(info.shape) != tuple(shape):
        raise CheckpointError(f"{info.name} in {info.file.name} ({what}): expected shape {list(shape)} "
                              f"from config.json, found {list(info.shape)}")
    if dtype is not None and info.dtype != dtype:
        raise CheckpointError(f"{info.name} in {info.file.name} ({what}): expected dtype {dtype}, found {info.dtype}")


def placed(w, device: torch.device, pin: bool):
    """Expert w with its tensors on `device` (pinned if asked): w itself where they already are."""
    parts = tensors(w)
    if all(t.device == device and (not pin or t.is_pinned()) for t in parts.values()):
        return w  # already in this form (the CPU fast tier keeps what the disk read gave)
    return type(w)(**{k: _place(t, device, pin) for k, t in parts.items()})


def _place(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if pin and device.type == "cpu" and not t.is_pinned():
        return t.pin_memory()
    return t.to(device, non_blocking=device.type == "cuda")


def first_true(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0]]
