"""kernel_library: the ctypes binding of the C kernels of csrc/ (one library, built and loaded by cpu_kernels).
`CpuKernels(path)` sets every exported function's argtypes from the header (kernel_abi), checks the shared lists
against the library's own, and has one method per kernel: each checks shapes and dtypes and raises a ValueError
naming them; the C side only sees contiguous CPU buffers. It takes tensors, data pointers and plain ints: which
expert object holds which matrix is kernel_experts' business, not this module's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import torch

from moeswap.formats import mx
from moeswap.ops.kernel_abi import HEADER, Layout, abi, constant, list_problem, struct_problem

ACTS = {name.lower(): code for name, code in abi().lists["ACTIVATIONS"].items()}  # `act` (MOESWAP_ACTIVATIONS)
# the grouped kernels' weight formats by Python's kind (csrc/cpu_kernels.h MOESWAP_FORMATS, names in lower case);
# MXFP4_Q8 is no kind of its own: MXFP4 experts with int8 activations
_CODES = {name.lower(): code for name, code in abi().lists["FORMATS"].items()}
MXFP4_Q8 = _CODES.pop("mxfp4_q8")
FORMAT_CODES = _CODES
TABLE_ROW = constant("TABLE_ROW")  # an expert's pointers in a resident-table row, and for the expert kernels


class CpuKernels:
    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in abi().functions.items():
            fn = getattr(self.lib, name, None)
            if fn is None:
                raise RuntimeError(f"{path.name} lacks {name}, which {HEADER.name} declares")
            fn.restype, fn.argtypes = restype, argtypes
        self.has_bf16_dot = bool(self.lib.moeswap_has_bf16_dot())  # AVX-512 BF16 builds: bf16x_linear
        self.isa = {512: "avx512", 256: "avx2", 0: "portable"}[self.lib.moeswap_mxfp4_isa()]
        self.has_int8_activations = bool(self.lib.moeswap_mxfp4_q8())  # AVX-512 VNNI builds
        self.layer_layout = self._layer_layout()
        for name, entries in abi().lists.items():  # (a library built from another header than this one)
            problem = list_problem(f"MOESWAP_{name}", entries, self._list(name))
            if problem is not None:
                raise RuntimeError(f"{path.name} does not match {HEADER.name}: {problem}")

    def _layer_layout(self) -> Layout:
        """decode_layer as this library was compiled: (name, offset, size, C type) per field, in order."""
        out: Layout = []
        name, ctype, offset, size = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()
        while not self.lib.moeswap_decode_layer_field(len(out), ctypes.byref(name), ctypes.byref(offset),
                                                      ctypes.byref(size), ctypes.byref(ctype)):
            out.append((_text(name), offset.value, size.value, _text(ctype)))
        return out

    def _list(self, name: str) -> list[tuple[str, int]]:
        """A shared list of cpu_kernels.h (MOESWAP_<name>) as this library was compiled: (entry, value) in order."""
        out: list[tuple[str, int]] = []
        entry, value = ctypes.c_char_p(), ctypes.c_int64()
        while not self.lib.moeswap_abi_entry(name.encode(), len(out), ctypes.byref(entry), ctypes.byref(value)):
            out.append((_text(entry), value.value))
        return out

    def layout_problem(self, struct: type[ctypes.Structure]) -> str | None:
        """None when the ctypes `struct` lays out decode_layer as this library does, field for field (name,
        offset, size and type); else a sentence naming the first field that differs."""
        return struct_problem("decode_layer", self.layer_layout, self.lib.moeswap_decode_layer_size(), struct)

    @staticmethod
    def _threads() -> int:
        return max(1, torch.get_num_threads())

    @staticmethod
    def _fail(status: int, what: str) -> None:
        """Raises for a kernel's non-zero status (callers test it first: the message costs a few us)."""
        reason = {1: "bad sizes", 2: "out of memory",
                  3: "int8 activations need a build with AVX-512 VNNI"}.get(status, f"status {status}")
        raise RuntimeError(f"CPU kernel {what} failed: {reason}")

    def linear(self, x_TI: torch.Tensor, mats: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """MXFP4: x fp32 contiguous [T, I]; each (packed [O, I/2], scale [O, I/32]) -> y fp32 [T, O]."""
        T, I = x_TI.shape
        mats = [_checked(p, s, I) for p, s in mats]
        outs = [torch.empty(T, p.shape[0], dtype=torch.float32) for p, _ in mats]
        n = len(mats)
        status = self.lib.moeswap_mxfp4_linear(
            x_TI.data_ptr(), T, I, n, _ptrs([p for p, _ in mats]), _ptrs([s for _, s in mats]),
            (ctypes.c_int64 * n)(*[p.shape[0] for p, _ in mats]), _ptrs(outs), self._threads())
        if status:
            self._fail(status, f"mxfp4_linear (x {tuple(x_TI.shape)})")
        return outs

    def mxfp4_expert(self, x_TI: torch.Tensor, F: int, mats: Sequence[int], act: str,
                     situ_betas: tuple[float, float]) -> torch.Tensor:
        """MXFP4 expert of width F: x fp32 contiguous [T, I] -> w2 · act(w1 x, w3 x), fp32 [T, I]; mats: the data
        pointers of w1's packed bytes and scales, then w3's, then w2's (kernel_experts.expert gathers them)."""
        T, I = x_TI.shape
        if len(mats) != TABLE_ROW or F < 1 or x_TI.dtype != torch.float32 or not x_TI.is_contiguous():
            raise ValueError(f"mxfp4_expert: x {tuple(x_TI.shape)} {x_TI.dtype}, width {F}, {len(mats)} pointers "
                             f"(expected contiguous fp32 x and six pointers)")
        y = torch.empty(T, I, dtype=torch.float32)
        status = self.lib.moeswap_mxfp4_expert(
            x_TI.data_ptr(), T, I, F, *mats, _act(act), float(situ_betas[0]), float(situ_betas[1]), y.data_ptr(),
            self._threads())
        if status:
            self._fail(status, f"mxfp4_expert (x {tuple(x_TI.shape)})")
        return y

    def moe(self, x_TI: torch.Tensor, kind: str, F: int, table: Sequence[Sequence[int]], tokens: torch.Tensor,
            offsets: Sequence[int], weights: torch.Tensor, act: str, situ_betas: tuple[float, float],
            y_TI: torch.Tensor, int8_activations: bool = False) -> None:
        """The experts of one layer step, summed into y: for pair k of expert e (k in offsets[e]..offsets[e+1]),
        y[tokens[k]] += weights[k] * expert_e(x[tokens[k]]). The experts are all of one `kind` (FORMAT_CODES)
        and width F; table[e]: expert e's data pointers in the kernel's order, w1, w3, w2, each matrix's
        data then its scales (bf16: the three matrices only); kernel_experts.moe gathers them from expert
        objects. x, y fp32 contiguous [T, I]; tokens int64 [P]; weights fp32 [P].
        int8_activations (MXFP4 only, needs `has_int8_activations`): the inputs of each matrix are quantized
        to int8 per 32-column block and the dot products run in integers (expert_mxfp4.reference_int8)."""
        T, I = x_TI.shape
        E = len(table)
        slots = 3 if kind == "bf16" else TABLE_ROW
        if (len(offsets) != E + 1 or tokens.dtype != torch.int64 or weights.dtype != torch.float32
                or tokens.numel() != offsets[-1] or weights.numel() != offsets[-1] or y_TI.shape != x_TI.shape
                or y_TI.dtype != torch.float32 or not y_TI.is_contiguous() or kind not in FORMAT_CODES
                or any(len(row) != slots for row in table)):
            raise ValueError(f"moe: {E} {kind} experts, offsets {list(offsets)[:4]}..., tokens "
                             f"{tuple(tokens.shape)} {tokens.dtype}, weights {tuple(weights.shape)} {weights.dtype}, "
                             f"y {tuple(y_TI.shape)} {y_TI.dtype} do not fit x {tuple(x_TI.shape)}")
        if int8_activations and kind != "mxfp4":
            raise ValueError(f"moe: int8 activations are for MXFP4 experts, not {kind} ones")
        tokens, weights = tokens.contiguous(), weights.contiguous()
        columns = zip(*table)  # per matrix slot, one pointer per expert
        args = [x_TI.data_ptr(), T, I, F, E, *[(ctypes.c_void_p * E)(*c) for c in columns],
                (ctypes.c_int64 * (E + 1))(*offsets), tokens.data_ptr(), weights.data_ptr(), _act(act),
                float(situ_betas[0]), float(situ_betas[1]), y_TI.data_ptr(), self._threads()]
        if kind == "bf16":
            status = self.lib.moeswap_bf16_moe(*args)
        elif kind == "mxfp4":
            status = self.lib.moeswap_mxfp4_moe(*args, int(int8_activations))
        else:
            status = self.lib.moeswap_quant_moe(FORMAT_CODES[kind], *args)
        if status:
            self._fail(status, f"moe (x {tuple(x_TI.shape)}, {E} {kind} experts, "
                               f"{offsets[-1]} pairs)")

    def moe_resident(self, x_TI: torch.Tensor, table_E6: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                     F: int, kind: str, act: str, situ_betas: tuple[float, float], y_TI: torch.Tensor,
                     int8_activations: bool = False) -> int | None:
        """`moe` for a decode step straight from the router's output: ids [T, K] int64 and weights [T, K] fp32
        choose rows of `table_E6` (int64 [E, 6], an expert's `resident_row` each; zeros where unknown), and
        the kernel groups the pairs as `moe`'s caller would, so y gets the same sums. kind: a `grouped_kind`.
        Returns the number of distinct experts, or None when a chosen expert has no row (nothing computed)."""
        T, I = x_TI.shape
        fmt = _resident_format("moe_resident", table_E6, ids_TK, w_TK, T, kind, int8_activations)
        if (x_TI.dtype != torch.float32 or y_TI.shape != x_TI.shape or y_TI.dtype != torch.float32
                or not all(t.is_contiguous() and t.is_cpu for t in (x_TI, y_TI))):
            raise ValueError(f"moe_resident: x {tuple(x_TI.shape)} {x_TI.dtype}, y {tuple(y_TI.shape)} {y_TI.dtype} "
                             f"(expected contiguous fp32 CPU tensors of one shape [T, I])")
        used = ctypes.c_int64()
        status = self.lib.moeswap_moe_resident(
            fmt, x_TI.data_ptr(), T, I, F, table_E6.shape[0], table_E6.data_ptr(), ids_TK.data_ptr(),
            w_TK.data_ptr(), ids_TK.shape[1], _act(act), float(situ_betas[0]), float(situ_betas[1]),
            y_TI.data_ptr(), self._threads(), ctypes.byref(used))
        if status == 4:
            return None
        if status:
            self._fail(status, f"moe_resident (x {tuple(x_TI.shape)}, ids {tuple(ids_TK.shape)}, {kind} experts)")
        return used.value

    def latent_moe_resident(self, x_TD: torch.Tensor, w_down: torch.Tensor, norm_w: torch.Tensor | None, eps: float,
                            w_up: torch.Tensor, table_E6: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                            F: int, kind: str, act: str, situ_betas: tuple[float, float],
                            int8_activations: bool = False) -> tuple[torch.Tensor, int] | None:
        """K3's latent routed experts for a decode step in one call: x fp32 [T, D] down-projected by w_down bf16
        [I, D], the experts as `moe_resident`, RMSNorm by norm_w fp32 [I] (None: none), up-projected by w_up
        bf16 [D, I]. Returns (y fp32 [T, D], distinct experts), or None when a chosen expert has no row."""
        T, D = x_TD.shape
        I = w_down.shape[0] if w_down.ndim == 2 else 0
        if (x_TD.dtype != torch.float32 or w_down.dtype != torch.bfloat16 or w_up.dtype != torch.bfloat16
                or tuple(w_down.shape) != (I, D) or tuple(w_up.shape) != (D, I) or I < 1
                or (norm_w is not None and (norm_w.dtype != torch.float32 or tuple(norm_w.shape) != (I,)))
                or not all(t.is_cpu and t.is_contiguous() for t in (x_TD, w_down, w_up, norm_w) if t is not None)):
            raise ValueError(f"latent_moe_resident: x {tuple(x_TD.shape)} {x_TD.dtype}, down {tuple(w_down.shape)} "
                             f"{w_down.dtype}, up {tuple(w_up.shape)} {w_up.dtype}, norm "
                             f"{None if norm_w is None else (tuple(norm_w.shape), norm_w.dtype)} (expected contiguous "
                             f"CPU tensors: fp32 x [T, D], bf16 [I, D] and [D, I], fp32 norm [I])")
        fmt = _resident_format("latent_moe_resident", table_E6, ids_TK, w_TK, T, kind, int8_activations)
        y = torch.empty(T, D, dtype=torch.float32)
        used = ctypes.c_int64()
        status = self.lib.moeswap_latent_moe_resident(
            fmt, x_TD.data_ptr(), T, D, w_down.data_ptr(), I,
            None if norm_w is None else norm_w.data_ptr(), float(eps), w_up.data_ptr(), F, table_E6.shape[0],
            table_E6.data_ptr(), ids_TK.data_ptr(), w_TK.data_ptr(), ids_TK.shape[1], _act(act),
            float(situ_betas[0]), float(situ_betas[1]), y.data_ptr(), self._threads(), ctypes.byref(used))
        if status == 4:
            return None
        if status:
            self._fail(status, f"latent_moe_resident (x {tuple(x_TD.shape)}, latent {I}, {kind} experts)")
        return y, used.value

    def quant_linear(self, kind: str, x_TI: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Block FP8 (kind "fp8": E4M3 codes [O, I] + fp32 scales [ceil(O/128), ceil(I/128)]) or INT4 ("int4": int32
        words [O, I/8] + bf16 scales [O, I/32]): x fp32 contiguous [T, I] -> x W^T fp32 [T, O] (csrc/quant.c)."""
        T, I = x_TI.shape
        O = q.shape[0] if q.ndim == 2 else 0
        expected = {"fp8": ((O, I), (-(-O // 128), -(-I // 128)), torch.float32),
                    "int4": ((O, I // 8), (O, I // 32), torch.bfloat16)}.get(kind)
        if (expected is None or I % 32 or tuple(q.shape) != expected[0] or q.element_size() != (1 if kind == "fp8" else 4)
                or tuple(scale.shape) != expected[1] or scale.dtype != expected[2] or x_TI.dtype != torch.float32
                or not all(t.is_cpu and t.is_contiguous() for t in (x_TI, q, scale))):
            raise ValueError(f"quant_linear: {kind} weights {tuple(q.shape)} {q.dtype} with scales {tuple(scale.shape)} "
                             f"{scale.dtype} do not fit x {tuple(x_TI.shape)} {x_TI.dtype} (expected contiguous CPU "
                             f"tensors, inputs a multiple of 32)")
        y = torch.empty(T, O, dtype=torch.float32)
        status = self.lib.moeswap_quant_linear(FORMAT_CODES[kind], x_TI.data_ptr(), T, I, q.data_ptr(),
                                               scale.data_ptr(), O, y.data_ptr(), self._threads())
        if status:
            self._fail(status, f"quant_linear ({kind}, x {tuple(x_TI.shape)}, weights {tuple(q.shape)})")
        return y

    def int4_decode(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """INT4 words [O, I/8] (int32) + bf16 scales [O, I/32] -> fp32 [O, I], equal to formats.int4.decode's
        fp32 (each weight bf16(code * scale)); written into `out` (fp32, contiguous, O * I elements) when given."""
        O = q.shape[0] if q.ndim == 2 else 0
        I = q.shape[1] * 8 if q.ndim == 2 else 0
        if (q.ndim != 2 or q.dtype != torch.int32 or tuple(scale.shape) != (O, I // 32) or scale.dtype != torch.bfloat16
                or not all(t.is_cpu and t.is_contiguous() for t in (q, scale))):
            raise ValueError(f"int4_decode: words {tuple(q.shape)} {q.dtype} with scales {tuple(scale.shape)} "
                             f"{scale.dtype} (expected contiguous CPU int32 [O, I/8] and bf16 [O, I/32])")
        if out is None:
            out = torch.empty(O, I, dtype=torch.float32)
        elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != O * I:
            raise ValueError(f"int4_decode: out {tuple(out.shape)} {out.dtype} cannot hold [{O}, {I}] fp32")
        out = out.view(O, I)
        status = self.lib.moeswap_int4_decode(q.data_ptr(), scale.data_ptr(), O, I, out.data_ptr(), self._threads())
        if status:
            self._fail(status, f"int4_decode (words {tuple(q.shape)})")
        return out

    def int8_linear(self, x_TI: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """INT8 channel weights (int8 codes [O, I] + fp32 scales [O, 1]): x fp32 contiguous [T, I] -> x W^T fp32
        [T, O] with W = q * scale, each weight one fp32 product (csrc/int8.c)."""
        T, I = x_TI.shape
        O = q.shape[0] if q.ndim == 2 else 0
        if (I % 32 or q.dtype != torch.int8 or tuple(q.shape) != (O, I) or scale.dtype != torch.float32
                or scale.numel() != O or x_TI.dtype != torch.float32
                or not all(t.is_cpu and t.is_contiguous() for t in (x_TI, q, scale))):
            raise ValueError(f"int8_linear: weights {tuple(q.shape)} {q.dtype} with scales {tuple(scale.shape)} "
                             f"{scale.dtype} do not fit x {tuple(x_TI.shape)} {x_TI.dtype} (expected contiguous CPU "
                             f"tensors, int8 codes, fp32 scales, inputs a multiple of 32)")
        y = torch.empty(T, O, dtype=torch.float32)
        status = self.lib.moeswap_int8_linear(x_TI.data_ptr(), T, I, q.data_ptr(), scale.data_ptr(), O, y.data_ptr(),
                                              self._threads())
        if status:
            self._fail(status, f"int8_linear (x {tuple(x_TI.shape)}, weights {tuple(q.shape)})")
        return y

    def mxfp4_decode(self, packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """MXFP4 packed [O, I/2] + E8M0 scale [O, I/32] -> [O, I] in `dtype`, fp32 or bf16 (exact either
        way), equal to formats.mxfp4.decode; written into `out` (that dtype, contiguous, O * I elements)
        when given."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"mxfp4_decode: dtype {dtype} (expected float32 or bfloat16)")
        I = packed.shape[1] * 2 if packed.ndim == 2 else 0
        packed, scale = _checked(packed, scale, I)
        if out is None:
            out = torch.empty(packed.shape[0], I, dtype=dtype)
        elif out.dtype != dtype or not out.is_contiguous() or out.numel() != packed.shape[0] * I:
            raise ValueError(f"mxfp4_decode: out {tuple(out.shape)} {out.dtype} cannot hold [{packed.shape[0]}, {I}] "
                             f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}")
        out = out.view(packed.shape[0], I)
        status = self.lib.moeswap_mxfp4_decode(packed.data_ptr(), scale.data_ptr(), packed.shape[0], I,
                                               out.data_ptr(), int(dtype == torch.bfloat16), self._threads())
        if status:
            self._fail(status, f"mxfp4_decode (packed {tuple(packed.shape)})")
        return out

    def bf16_linear(self, x_TI: torch.Tensor, w_OI: torch.Tensor, bf16_inputs: bool = False) -> torch.Tensor:
        """x fp32 contiguous [T, I] @ w bf16 [O, I]^T -> fp32 [T, O] (weights widened exactly, fp32 sums).
        bf16_inputs (needs `has_bf16_dot` and I % 32 == 0): x is rounded to bf16 first and the pairs'
        products summed by AVX-512 BF16 dot products, llama.cpp's arithmetic (--gemm-precision bf16)."""
        T, I = x_TI.shape
        if (w_OI.dtype != torch.bfloat16 or w_OI.ndim != 2 or w_OI.shape[1] != I or not w_OI.is_cpu
                or x_TI.dtype != torch.float32 or not x_TI.is_cpu):
            raise ValueError(f"bf16_linear: x {tuple(x_TI.shape)} {x_TI.dtype} and weight {tuple(w_OI.shape)} "
                             f"{w_OI.dtype} on {w_OI.device} (expected fp32 [T, I] and bf16 [O, I] on the CPU)")
        if bf16_inputs and not (self.has_bf16_dot and I % 32 == 0):
            raise ValueError(f"bf16_linear: bf16 inputs need an AVX-512 BF16 build and inputs of a multiple of 32 "
                             f"(this build: {self.has_bf16_dot}, width {I})")
        w_OI = w_OI.contiguous()
        x_TI = x_TI.to(torch.bfloat16).contiguous() if bf16_inputs else x_TI.contiguous()
        y = torch.empty(T, w_OI.shape[0], dtype=torch.float32)
        run = self.lib.moeswap_bf16x_linear if bf16_inputs else self.lib.moeswap_bf16_linear
        status = run(x_TI.data_ptr(), T, I, w_OI.data_ptr(), w_OI.shape[0], y.data_ptr(), self._threads())
        if status:
            self._fail(status, f"bf16_linear (x {tuple(x_TI.shape)}, weight {tuple(w_OI.shape)})")
        return y

    def bf16_gemm(self, a: torch.Tensor, w: torch.Tensor, trans: bool, out: torch.Tensor | None = None,
                  accumulate: bool = False) -> torch.Tensor:
        """a fp32 [M, K] @ (w^T if trans, w [N, K]; else w, w [K, N]) for w bf16 as stored (csrc/gemm_bf16.c:
        widened per panel, fp32 sums, each output one chain in k order whatever the threads or tiling), into
        `out` (contiguous fp32 [M, N]; accumulate: out += the product) or a new tensor. Called per expert and
        direction in training: the checks are few attribute reads (their cost adds up over the calls)."""
        sa, sw = a.shape, w.shape
        if (a.dtype is not torch.float32 or w.dtype is not torch.bfloat16 or len(sa) != 2 or len(sw) != 2
                or sa[1] != sw[1 if trans else 0] or not a.is_cpu or not w.is_cpu):
            raise ValueError(f"bf16_gemm: a {tuple(sa)} {a.dtype} and w {tuple(sw)} {w.dtype} "
                             f"(trans={trans}; expected fp32 [M, K] and bf16 {'[N, K]' if trans else '[K, N]'} "
                             f"on the CPU)")
        M, K = sa
        N = sw[0 if trans else 1]
        if out is None:
            if accumulate:
                raise ValueError("bf16_gemm: accumulate needs an out tensor")
            out = torch.empty(M, N, dtype=torch.float32)
        elif out.dtype is not torch.float32 or out.shape != (M, N) or not out.is_contiguous() or not out.is_cpu:
            raise ValueError(f"bf16_gemm: out {tuple(out.shape)} {out.dtype} (expected contiguous fp32 [{M}, {N}] "
                             f"on the CPU)")
        a, w = a.contiguous(), w.contiguous()  # held until the call returns
        status = self.lib.moeswap_bf16_gemm(a.data_ptr(), M, K, w.data_ptr(), N, int(trans), int(accumulate),
                                            out.data_ptr(), self._threads())
        if status:
            self._fail(status, f"bf16_gemm (a {tuple(sa)}, w {tuple(sw)}, trans={trans})")
        return out

    def glu(self, gate: torch.Tensor, up: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        """act(gate) * up (ops.activation.glu) for fp32 CPU tensors of one shape, in one pass; a new tensor.
        Within a few ulp of torch's tanh/sigmoid (its own exp), the same bits for any shape or split."""
        if (gate.shape != up.shape or gate.dtype != torch.float32 or up.dtype != torch.float32
                or not gate.is_cpu or not up.is_cpu):
            raise ValueError(f"glu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                             f"(expected fp32 CPU tensors of one shape)")
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        status = self.lib.moeswap_glu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), _act(act),
                                      float(situ_betas[0]), float(situ_betas[1]), self._threads())
        if status:
            self._fail(status, f"glu ({act}, {tuple(gate.shape)})")
        return out

    def glu_backward(self, gate: torch.Tensor, up: torch.Tensor, d_out: torch.Tensor, act: str,
                     situ_betas: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gate, d up) of `glu` from its output's gradient, in one pass (fp32 CPU tensors of one shape)."""
        if (not gate.shape == up.shape == d_out.shape
                or any(t.dtype != torch.float32 or not t.is_cpu for t in (gate, up, d_out))):
            raise ValueError(f"glu_backward: gate {tuple(gate.shape)}, up {tuple(up.shape)}, d_out "
                             f"{tuple(d_out.shape)} (expected fp32 CPU tensors of one shape)")
        gate, up, d_out = gate.contiguous(), up.contiguous(), d_out.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        status = self.lib.moeswap_glu_backward(gate.data_ptr(), up.data_ptr(), d_out.data_ptr(), dg.data_ptr(),
                                               du.data_ptr(), gate.numel(), _act(act), float(situ_betas[0]),
                                               float(situ_betas[1]), self._threads())
        if status:
            self._fail(status, f"glu_backward ({act}, {tuple(gate.shape)})")
        return dg, du

    def bf16_mlp(self, x_TD: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor, act: str,
                 situ_betas: tuple[float, float]) -> torch.Tensor:
        """down(act(gate x) * up x) for fp32 x [T, D] and bf16 weights w_gu [2H, D] (gate rows, then up rows)
        and w_down [D, H], in one call: `bf16_linear`, `glu`, `bf16_linear`, the same bits. fp32 [T, D]."""
        T, D = x_TD.shape
        H = w_down.shape[1] if w_down.ndim == 2 else 0
        if (x_TD.dtype != torch.float32 or w_gu.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16
                or tuple(w_gu.shape) != (2 * H, D) or tuple(w_down.shape) != (D, H) or H < 1
                or not all(t.is_cpu and t.is_contiguous() for t in (x_TD, w_gu, w_down))):
            raise ValueError(f"bf16_mlp: x {tuple(x_TD.shape)} {x_TD.dtype}, gate/up {tuple(w_gu.shape)} {w_gu.dtype}, "
                             f"down {tuple(w_down.shape)} {w_down.dtype} (expected contiguous CPU tensors: fp32 "
                             f"x [T, D], bf16 [2H, D] and [D, H])")
        y = torch.empty(T, D, dtype=torch.float32)
        status = self.lib.moeswap_bf16_mlp(x_TD.data_ptr(), T, D, w_gu.data_ptr(), H, w_down.data_ptr(), _act(act),
                                           float(situ_betas[0]), float(situ_betas[1]), y.data_ptr(), self._threads())
        if status:
            self._fail(status, f"bf16_mlp (x {tuple(x_TD.shape)}, hidden {H})")
        return y

    def kda_layer(self, qkv: torch.Tensor, conv: torch.Tensor, taps: torch.Tensor, z: torch.Tensor,
                  dt_bias: torch.Tensor, decay_rate: torch.Tensor, lower_bound: float | None,
                  b_in: torch.Tensor, state: torch.Tensor, gate: torch.Tensor, o_norm: torch.Tensor,
                  norm_eps: float, scale: float, l2_eps: float) -> torch.Tensor:
        """A KDA layer between its projections for T tokens of B sequences (moeswap_kda_layer in the C
        file): qkv [B, T, 3C], conv [B, W-1, 3C] and state [B, H, K, K] (both updated in place), taps
        [W, 3C], z, gate [B, T, C], dt_bias [C], decay_rate [H] (exp A_log), b_in [B, T, H], o_norm [K];
        C = H K. lower_bound None: Kimi Linear's unbounded gate. Returns y [B, T, C] fp32, for o_proj."""
        B, H, K, _ = state.shape
        T = qkv.shape[1] if qkv.dim() == 3 else 0
        C = H * K
        W = taps.shape[0]
        tensors = (qkv, conv, taps, z, dt_bias, decay_rate, b_in, state, gate, o_norm)
        shapes = ((B, T, 3 * C), (B, W - 1, 3 * C), (W, 3 * C), (B, T, C), (C,), (H,), (B, T, H), (B, H, K, K),
                  (B, T, C), (K,))
        # one comparison on the fast path (a decode step calls this per KDA layer); names only on failure
        if (tuple(t.shape for t in tensors) != shapes or K > 1024 or T < 1
                or not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)):
            names = ("qkv", "conv", "taps", "z", "dt_bias", "decay_rate", "b_in", "state", "gate", "o_norm")
            bad = [f"{name} {tuple(t.shape)} {t.dtype}" for name, t, shape in zip(names, tensors, shapes)
                   if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous()]
            raise ValueError(f"kda_layer: {', '.join(bad) or f'head dim {K}, {T} tokens'} (expected contiguous "
                             f"fp32 CPU tensors for {B} sequences of {T} tokens, {H} heads of {K}, conv width {W})")
        y = torch.empty(B, T, C, dtype=torch.float32)
        status = self.lib.moeswap_kda_layer(
            qkv.data_ptr(), conv.data_ptr(), taps.data_ptr(), W, z.data_ptr(), dt_bias.data_ptr(),
            decay_rate.data_ptr(), float(lower_bound or 0.0), int(lower_bound is not None), b_in.data_ptr(),
            state.data_ptr(), gate.data_ptr(), o_norm.data_ptr(), float(norm_eps), float(scale), float(l2_eps),
            y.data_ptr(), B, T, H, K, self._threads())
        if status:
            self._fail(status, f"kda_layer ({B} x {T} tokens, {H} heads of {K})")
        return y

    def route(self, x_TD: torch.Tensor, w_ED: torch.Tensor, bias_E: torch.Tensor, top_k: int, softmax: bool,
              renormalize: bool, scale: float, groups: int = 1,
              topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE router (moe.Router) for fp32 CPU x [T, D], router weight [E, D] and correction bias [E], with
        `groups` expert groups of which `topk_group` stay eligible (DeepSeek-V3; 1: none): (expert ids int64
        [T, K] best first, fp32 weights [T, K])."""
        T, D = x_TD.shape
        E = w_ED.shape[0]
        per = E // groups if groups > 0 else 0
        if (tuple(w_ED.shape) != (E, D) or tuple(bias_E.shape) != (E,) or not 0 < top_k <= E or E > 4096
                or groups < 1 or E % groups or (groups > 1 and (per < 2 or top_k > topk_group * per))
                or not 0 < topk_group <= groups
                or any(t.dtype != torch.float32 or not t.is_cpu for t in (x_TD, w_ED, bias_E))):
            raise ValueError(f"route: x {tuple(x_TD.shape)} {x_TD.dtype}, weight {tuple(w_ED.shape)} {w_ED.dtype}, "
                             f"bias {tuple(bias_E.shape)} {bias_E.dtype}, top-{top_k}, {topk_group} of {groups} groups "
                             f"(expected fp32 CPU tensors, weight [E <= 4096, D], bias [E], 0 < k <= E, groups "
                             f"of >= 2 experts dividing E, k within the kept groups)")
        x_TD, w_ED, bias_E = x_TD.contiguous(), w_ED.contiguous(), bias_E.contiguous()
        ids = torch.empty(T, top_k, dtype=torch.int64)
        weights = torch.empty(T, top_k, dtype=torch.float32)
        status = self.lib.moeswap_route(x_TD.data_ptr(), T, D, w_ED.data_ptr(), E, bias_E.data_ptr(), top_k,
                                        int(softmax), int(renormalize), float(scale), groups, topk_group,
                                        ids.data_ptr(), weights.data_ptr(), self._threads())
        if status:
            self._fail(status, f"route ({T} tokens, {E} experts, top-{top_k}, {topk_group} of {groups} groups)")
        return ids, weights

    def mla_decode(self, q_BHX: torch.Tensor, latent_BCX: torch.Tensor, lengths_B: torch.Tensor,
                   w_k_HNL: torch.Tensor, w_v_HLV: torch.Tensor, scale: float) -> torch.Tensor:
        """MLA attention of one new token per sequence, absorbed form (moeswap_mla_decode in the C file):
        q [B, H, N + R], the cache [B, capacity, L + R] with lengths [B] valid rows each (int64, the new
        token's row included), kv_b_proj split per head as keys [H, N, L] and values [H, L, V].
        Returns the heads' outputs [B, H V] fp32, before the output gate."""
        B, H, NR = q_BHX.shape
        _, N, L = w_k_HNL.shape
        V = w_v_HLV.shape[-1]
        R = NR - N
        cap = latent_BCX.shape[1] if latent_BCX.ndim == 3 else 0
        fp32 = [q_BHX, latent_BCX, w_k_HNL, w_v_HLV]
        if (any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in fp32)
                or tuple(latent_BCX.shape) != (B, cap, L + R) or tuple(w_v_HLV.shape) != (H, L, V)
                or w_k_HNL.shape[0] != H or R < 0 or L > 4096 or lengths_B.dtype != torch.int64
                or tuple(lengths_B.shape) != (B,) or not lengths_B.is_cpu):
            raise ValueError(f"mla_decode: q {tuple(q_BHX.shape)}, cache {tuple(latent_BCX.shape)}, lengths "
                             f"{tuple(lengths_B.shape)} {lengths_B.dtype}, keys {tuple(w_k_HNL.shape)}, values "
                             f"{tuple(w_v_HLV.shape)} (expected contiguous fp32 CPU tensors [B, H, N+R], "
                             f"[B, capacity, L+R], int64 [B], [H, N, L <= 4096], [H, L, V])")
        lengths_B = lengths_B.contiguous()
        out = torch.empty(B, H * V, dtype=torch.float32)
        status = self.lib.moeswap_mla_decode(q_BHX.data_ptr(), latent_BCX.data_ptr(), cap, lengths_B.data_ptr(),
                                             w_k_HNL.data_ptr(), w_v_HLV.data_ptr(), float(scale), out.data_ptr(),
                                             B, H, N, R, L, V, self._threads())
        if status == 1:
            raise ValueError(f"mla_decode: cache lengths {lengths_B.tolist()[:8]} outside 1..{cap}")
        if status:
            self._fail(status, f"mla_decode ({B} x {H} heads, {cap} cache rows)")
        return out

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate) for fp32 CPU tensors of one shape [..., W], x contiguous, gate's rows of W
        contiguous (a column slice will do); in place on x, which is returned."""
        W = x.shape[-1] if x.ndim else 0
        rows = x.numel() // W if W else 0
        g = gate.reshape(rows, W) if gate.shape == x.shape else None
        if (g is None or x.dtype != torch.float32 or g.dtype != torch.float32 or not x.is_contiguous()
                or not (x.is_cpu and g.is_cpu) or (rows > 1 and g.stride(0) < W) or (W > 1 and g.stride(1) != 1)):
            raise ValueError(f"sigmoid_gate: x {tuple(x.shape)} {x.dtype}, gate {tuple(gate.shape)} {gate.dtype} "
                             f"(expected fp32 CPU tensors of one shape, x contiguous, gate rows contiguous)")
        status = self.lib.moeswap_sigmoid_gate(x.data_ptr(), g.data_ptr(), rows, W, g.stride(0) if rows > 1 else W)
        if status:
            self._fail(status, f"sigmoid_gate ({tuple(x.shape)})")
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of an fp32 CPU tensor (weight fp32 [D] or None); a new tensor."""
        D = x.shape[-1] if x.ndim else 0
        if (x.dtype != torch.float32 or not x.is_cpu or D < 1 or (weight is not None and (
                weight.dtype != torch.float32 or not weight.is_cpu or weight.shape != (D,)))):
            raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype}, weight "
                             f"{None if weight is None else (tuple(weight.shape), weight.dtype)} (expected fp32 "
                             f"CPU tensors, weight [last dim of x])")
        x = x.contiguous()
        y = torch.empty_like(x)
        status = self.lib.moeswap_rms_norm(x.data_ptr(), x.numel() // D, D,
                                           None if weight is None else weight.contiguous().data_ptr(),
                                           float(eps), y.data_ptr(), self._threads())
        if status:
            self._fail(status, f"rms_norm ({tuple(x.shape)})")
        return y

    def res_mix(self, sources: Sequence[torch.Tensor], score_D: torch.Tensor, eps: float) -> torch.Tensor:
        """Block attention residuals' softmax mix over `sources` (fp32 CPU tensors of one shape [..., D]),
        scored by <rmsnorm(source), score> per token (models/layers/attn_res.py); a new tensor."""
        shape = sources[0].shape if sources else ()
        D = shape[-1] if shape else 0
        if (not sources or len(sources) > 64 or D < 1 or score_D.shape != (D,) or score_D.dtype != torch.float32
                or not score_D.is_cpu
                or any(t.shape != shape or t.dtype != torch.float32 or not t.is_cpu for t in sources)):
            raise ValueError(f"res_mix: {len(sources)} sources {[tuple(t.shape) for t in sources][:3]}..., score "
                             f"{tuple(score_D.shape)} {score_D.dtype} (expected 1-64 fp32 CPU tensors of one "
                             f"shape [..., D] and an fp32 [D] score)")
        sources = [t.contiguous() for t in sources]
        out = torch.empty_like(sources[0])
        status = self.lib.moeswap_res_mix(_ptrs(sources), len(sources), out.numel() // D, D,
                                          score_D.contiguous().data_ptr(), float(eps), out.data_ptr(), self._threads())
        if status:
            self._fail(status, f"res_mix ({len(sources)} x {tuple(shape)})")
        return out

    def kda_decode(self, q_NK: torch.Tensor, k_NK: torch.Tensor, v_NV: torch.Tensor, g_NK: torch.Tensor,
                   beta_N: torch.Tensor, state_NKV: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
        """One KDA token for N heads (raw q, k: normalised here), updating state in place; returns o [N, V].
        Every tensor fp32 on the CPU; the state contiguous (it is written through its pointer)."""
        N, K = q_NK.shape
        V = v_NV.shape[1]
        args = [q_NK, k_NK, v_NV, g_NK, beta_N]
        shapes_ok = (k_NK.shape == g_NK.shape == (N, K) and tuple(v_NV.shape) == (N, V) and beta_N.numel() == N
                     and tuple(state_NKV.shape) == (N, K, V))
        if (not shapes_ok or any(t.dtype != torch.float32 or not t.is_cpu for t in [*args, state_NKV])
                or not state_NKV.is_contiguous()):
            raise ValueError(f"kda_decode: q {tuple(q_NK.shape)}, k {tuple(k_NK.shape)}, v {tuple(v_NV.shape)}, "
                             f"g {tuple(g_NK.shape)}, beta {tuple(beta_N.shape)}, state {tuple(state_NKV.shape)} "
                             f"(expected fp32 CPU tensors, a contiguous state)")
        args = [t.contiguous() for t in args]
        o = torch.empty(N, V, dtype=torch.float32)
        status = self.lib.moeswap_kda_decode(*[t.data_ptr() for t in args], state_NKV.data_ptr(), o.data_ptr(),
                                             N, K, V, float(scale), float(eps), self._threads())
        if status:
            self._fail(status, f"kda_decode ({N} heads, K {K}, V {V})")
        return o

    def kda_train_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, S0: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
        """The KDA token recurrence over [N, T, .] heads (q normalised and scaled, k normalised): returns
        (o [N, T, V], the final state [N, K, V], the state at each chunk start and the end [N, T/chunk+1, K, V])."""
        N, T, K = q.shape
        V = v.shape[-1]
        self._check_kda("kda_train_forward", q, k, v, g, beta, S0)
        o = torch.empty(N, T, V, dtype=torch.float32)
        S_end = torch.empty(N, K, V, dtype=torch.float32)
        checkpoints = torch.empty(N, (T + chunk - 1) // chunk + 1, K, V, dtype=torch.float32)
        status = self.lib.moeswap_kda_train_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
                                                    beta.data_ptr(), S0.data_ptr(), o.data_ptr(), S_end.data_ptr(),
                                                    checkpoints.data_ptr(), N, T, K, V, chunk, self._threads())
        if status:
            self._fail(status, f"kda_train_forward ({N} heads, T {T}, K {K}, V {V})")
        return o, S_end, checkpoints

    def kda_train_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, checkpoints: torch.Tensor, d_o: torch.Tensor, dS_end: torch.Tensor,
                           chunk: int) -> tuple[torch.Tensor, ...]:
        """Gradients (dq, dk, dv, dg, dbeta, dS0) of kda_train_forward's outputs, from its checkpoints."""
        N, T, K = q.shape
        V = v.shape[-1]
        self._check_kda("kda_train_backward", q, k, v, g, beta, dS_end, d_o, checkpoints)
        dq, dk, dg = (torch.empty(N, T, K, dtype=torch.float32) for _ in range(3))
        dv = torch.empty(N, T, V, dtype=torch.float32)
        dbeta = torch.empty(N, T, dtype=torch.float32)
        dS0 = torch.empty(N, K, V, dtype=torch.float32)
        status = self.lib.moeswap_kda_train_backward(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), checkpoints.data_ptr(),
            d_o.data_ptr(), dS_end.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dg.data_ptr(),
            dbeta.data_ptr(), dS0.data_ptr(), N, T, K, V, chunk, self._threads())
        if status:
            self._fail(status, f"kda_train_backward ({N} heads, T {T}, K {K}, V {V})")
        return dq, dk, dv, dg, dbeta, dS0

    @staticmethod
    def _check_kda(what: str, q, k, v, g, beta, state, *more) -> None:
        N, T, K = q.shape
        V = v.shape[-1]
        ok = (tuple(k.shape) == tuple(g.shape) == (N, T, K) and tuple(v.shape) == (N, T, V)
              and tuple(beta.shape) == (N, T) and tuple(state.shape) == (N, K, V) and V <= 4096)
        tensors = (q, k, v, g, beta, state, *more)
        if not ok or any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in tensors):
            raise ValueError(f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
                             f"{tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)} (expected "
                             f"contiguous fp32 CPU tensors [N, T, K], [N, T, V], [N, T] and [N, K, V], V <= 4096)")


def _text(s: ctypes.c_char_p) -> str:
    return (s.value or b"").decode()


def _ptrs(tensors: Sequence[torch.Tensor]):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _act(act: str) -> int:
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r} (expected one of {', '.join(ACTS)})")
    return ACTS[act]


def _resident_format(what: str, table_E6: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, T: int,
                     kind: str, int8_activations: bool) -> int:
    """The *_resident kernels' format code (resident_format_code), once the router's output and the resident
    table are as they read them; else a ValueError."""
    if (kind not in FORMAT_CODES or ids_TK.dtype != torch.int64 or ids_TK.ndim != 2 or ids_TK.shape[0] != T
            or w_TK.shape != ids_TK.shape or w_TK.dtype != torch.float32 or table_E6.dtype != torch.int64
            or table_E6.ndim != 2 or table_E6.shape[1] != TABLE_ROW
            or not all(t.is_contiguous() and t.is_cpu for t in (table_E6, ids_TK, w_TK))):
        raise ValueError(f"{what}: table {tuple(table_E6.shape)} {table_E6.dtype}, ids {tuple(ids_TK.shape)} "
                         f"{ids_TK.dtype}, weights {tuple(w_TK.shape)} {w_TK.dtype}, kind {kind!r} (expected "
                         f"contiguous CPU tensors: int64 ids and fp32 weights [{T}, K], int64 table [E, 6])")
    return resident_format_code(kind, int8_activations)


def resident_format_code(kind: str | None, int8_activations: bool) -> int:
    """The *_resident kernels' `format` for experts of `kind` (None: MXFP4): FORMAT_CODES, or MXFP4_Q8 for
    MXFP4 on int8 activations (which are for MXFP4 experts only)."""
    if int8_activations and kind == "mxfp4":
        return MXFP4_Q8
    return FORMAT_CODES.get(kind or "mxfp4", FORMAT_CODES["mxfp4"])



def _checked(packed: torch.Tensor, scale: torch.Tensor, in_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 contiguous [O, in/2] and [O, in/32] on the CPU, or a ValueError naming the shapes."""
    scale = mx.as_scale_bytes(scale, "MXFP4 kernel")
    if (packed.dtype != torch.uint8 or packed.ndim != 2
            or packed.shape[1] * 2 != in_dim or not packed.is_cpu):
        raise ValueError(f"MXFP4 kernel: packed {tuple(packed.shape)} {packed.dtype} / scale {tuple(scale.shape)} "
                         f"{scale.dtype} do not fit input width {in_dim} (expected CPU uint8 [O, {in_dim // 2}] "
                         f"and [O, {in_dim // 32}])")
    mx.check_blocks("MXFP4", packed, scale, mx.BLOCK // 2, "packed")
    return packed.contiguous(), scale.contiguous()


