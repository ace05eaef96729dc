"""Kimi Delta Attention core: the token recurrence (reference, decode) and the chunked form (prefill). Knows
nothing of projections or checkpoints: inputs are normalised q/k, v, the log-decay g and beta; the state S
is [B, H, Dk, Dv] in fp32. Entry points: `kda_recurrent` (the reference), `kda_decode_step`, `kda_chunked`,
`kda_chunked_pairwise` (its reference), `kda_for_training`, and on CUDA `kda_fla` (chosen by `fla_selected`).
Shapes: B batch, T tokens, H heads, K key dim, V value dim, C chunk length, N sub-chunk length.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from moeswap.ops import cpu_kernels

L2_EPS = 1e-6  # inside the square root, as the reference implementations (fla's kernels too)
ENV_BACKEND = "MOESWAP_KDA_BACKEND"  # "torch": never flash-linear-attention; "auto" (or unset): where it runs


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_decode_step(q_B1HK: torch.Tensor, k_B1HK: torch.Tensor, v_B1HV: torch.Tensor, g_B1HK: torch.Tensor,
                    beta_B1H: torch.Tensor, state_BHKV: torch.Tensor, scale: float) -> torch.Tensor:
    """One token with raw (unnormalised) q and k: q <- l2norm(q) * scale, k <- l2norm(k), then the
    recurrence of `kda_recurrent`; the state is updated in place. Returns o [B, 1, H, V] fp32."""
    B, _, H, K = q_B1HK.shape
    V = v_B1HV.shape[-1]
    run = None
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q_B1HK, k_B1HK, v_B1HV, g_B1HK, beta_B1H, state_BHKV))
    if (state_BHKV.device.type == "cpu" and state_BHKV.dtype == torch.float32 and state_BHKV.is_contiguous()
            and not grad):
        if torch.compiler.is_compiling():  # the kernel as a torch op: a ctypes call would break the graph
            run = torch.ops.moeswap.kda_decode if cpu_kernels.kernel_ready() else None
        else:
            kernel = cpu_kernels.kernel()
            run = kernel.kda_decode if kernel is not None else None
    if run is not None:
        flat = lambda t, w: t.float().reshape(B * H, w)  # noqa: E731
        o = run(flat(q_B1HK, K), flat(k_B1HK, K), flat(v_B1HV, V), flat(g_B1HK, K), beta_B1H.float().reshape(B * H),
                state_BHKV.view(B * H, K, V), scale, L2_EPS)
        return o.view(B, 1, H, V)
    o, S = kda_recurrent(l2_normalize(q_B1HK.float()) * scale, l2_normalize(k_B1HK.float()), v_B1HV, g_B1HK,
                         beta_B1H, state_BHKV)  # which copies the state where autograd may keep it
    state_BHKV.copy_(S)
    return o


def kda_recurrent(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: S <- diag(exp g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q."""
    # a copy where autograd records: it keeps S for backward, and callers write the result back into state_BHKV
    S = state_BHKV.to(torch.float32, copy=torch.is_grad_enabled())
    q, k, v, g, beta = (t.float() for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        pred_BHV = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        u_BHV = beta[:, t].unsqueeze(-1) * (v[:, t] - pred_BHV)
        S = S + k[:, t].unsqueeze(-1) * u_BHV.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def kda_chunked_pairwise(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `kda_recurrent`, a chunk at a time; every pairwise decay formed explicitly
    ([B, H, C, C, K] per chunk, `_intra_chunk_pairwise`): the plain reference for `kda_chunked`.

    Inside a chunk, with G_t the cumulative log decay, the updates u solve the unit lower-triangular
    system (I + A) u = beta (v - (e^G_t * k_t)^T S0), A_ts = beta_t sum_i k_ti k_si e^(G_ti - G_si).
    Pairwise decays are formed as e^(G_t - G_s) with s <= t only, so every exponent is <= 0: the
    bounded K3 gate (down to -5 per token) would overflow the usual e^G * e^-G factorisation.
    """
    return _chunked(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV, chunk, _intra_chunk_pairwise)


def _intra_chunk_pairwise(q: torch.Tensor, k: torch.Tensor, G64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kk[t, s] = sum_i k_ti k_si e^(G_ti - G_si) (s < t) and qk[t, s] likewise with q_t (s <= t), [B, H, C, C],
    from the whole [B, H, C, C, K] tensor of pairwise decays."""
    C = k.shape[2]
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    diff_BHCCK = (G64.unsqueeze(3) - G64.unsqueeze(2)).float()  # [t, s] = G_t - G_s
    decay_BHCCK = torch.where(causal_CC[..., None], diff_BHCCK, float("-inf")).exp()
    kk_BHCC = torch.einsum("bhtk,bhsk,bhtsk->bhts", k, k, decay_BHCCK)
    qk_BHCC = torch.einsum("bhtk,bhsk,bhtsk->bhts", q, k, decay_BHCCK)
    return kk_BHCC.tril(-1), qk_BHCC


def _chunked(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTHK: torch.Tensor,
             beta_BTH: torch.Tensor, state_BHKV: torch.Tensor, chunk: int,
             intra: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked delta rule with the intra-chunk products from `intra(q, k, G64) -> (kk, qk)`."""
    # a copy where autograd records: it keeps S for backward, and callers write the result back into state_BHKV
    S = state_BHKV.to(torch.float32, copy=torch.is_grad_enabled())
    # work per head: [B, H, T, .]
    q, k, v, g = (t.float().transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK))
    beta = beta_BTH.float().transpose(1, 2)
    outs = []
    for start in range(0, k.shape[2], chunk):
        end = start + chunk
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end]
        # G in fp64: differences of large nearly equal fp32 sums would lose |G| * 2^-24
        G64_BHCK = g[:, :, start:end].double().cumsum(dim=2)
        G_BHCK = G64_BHCK.float()
        kk_BHCC, qk_BHCC = intra(qc, kc, G64_BHCK)
        A_BHCC = bc.unsqueeze(-1) * kk_BHCC
        eye = torch.eye(kc.shape[2], dtype=A_BHCC.dtype, device=A_BHCC.device)
        rhs_BHCV = bc.unsqueeze(-1) * (vc - (kc * G_BHCK.exp()) @ S)
        u_BHCV = torch.linalg.solve_triangular(eye + A_BHCC, rhs_BHCV, upper=False, unitriangular=True)
        outs.append((qc * G_BHCK.exp()) @ S + qk_BHCC @ u_BHCV)
        # carry the state to the end of the chunk: every exponent G_C - G_s <= 0
        to_end_BHCK = (G64_BHCK[:, :, -1:] - G64_BHCK).float().exp()
        S = S * G_BHCK[:, :, -1].exp().unsqueeze(-1) + (kc * to_end_BHCK).transpose(-1, -2) @ u_BHCV
    return torch.cat(outs, dim=2).transpose(1, 2), S


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G64: torch.Tensor, sub: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kk[t, s] = sum_i k_ti k_si e^(G_ti - G_si) (s < t) and qk[t, s] likewise with q_t (s <= t), [B, H, C, C].

    Pairs within one sub-chunk of `sub` tokens are formed pairwise ([B, H, N, N, K]); a pair with s in
    an earlier sub-chunk factors through that sub-chunk's first position r: e^(G_t - G_r) e^(G_r - G_s),
    both exponents <= 0 (G decreases), so the products are matmuls and nothing can overflow."""
    B, H, C, K = k.shape
    kk = torch.zeros(B, H, C, C, dtype=k.dtype, device=k.device)
    qk = torch.zeros_like(kk)
    for r in range(0, C, sub):
        e = min(r + sub, C)
        Gi = G64[:, :, r:e]
        n = e - r
        diff = (Gi.unsqueeze(3) - Gi.unsqueeze(2)).float()  # [B, H, n, n, K]: [t, s] = G_t - G_s
        causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
        decay = torch.where(causal[..., None], diff, float("-inf")).exp()
        ks = k[:, :, r:e]
        kk[:, :, r:e, r:e] = torch.einsum("bhtsk,bhsk->bhts", decay * k[:, :, r:e].unsqueeze(3), ks)
        qk[:, :, r:e, r:e] = torch.einsum("bhtsk,bhsk->bhts", decay * q[:, :, r:e].unsqueeze(3), ks)
        if r:
            to_r = (Gi - G64[:, :, r:r + 1]).float().exp()  # e^(G_t - G_r) <= 1
            from_r = (G64[:, :, r:r + 1] - G64[:, :, :r]).float().exp()  # e^(G_r - G_s) <= 1, s < r
            right = (k[:, :, :r] * from_r).transpose(-1, -2)  # [B, H, K, r]
            kk[:, :, r:e, :r] = (k[:, :, r:e] * to_r) @ right
            qk[:, :, r:e, :r] = (q[:, :, r:e] * to_r) @ right
    return kk.tril(-1), qk


def kda_chunked(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor,
    chunk: int = 64,
    sub: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_chunked_pairwise` with the intra-chunk decays factored (`_intra_chunk`): the [C, C, K]
    pairwise tensor shrinks to sub-chunk blocks and the rest are matmuls (faster on CPU: docs/benchmarks.md).

    Used for prefill under autograd and off the CPU; CPU inference runs the recurrence in C
    (cpu_kernels.kda_layer).
    """
    return _chunked(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV, chunk,
                    lambda q, k, G64: _intra_chunk(q, k, G64, sub))


TRAIN_CHECKPOINT = 64  # tokens between the states the training forward keeps (backward replays a chunk)


class KDATokenRecurrence(torch.autograd.Function):
    """`kda_recurrent` with the C kernels' forward and backward (csrc/kda_train.c): training on the CPU,
    where the chunked form under autograd is far slower (docs/benchmarks.md). Inputs as kda_recurrent's, fp32."""

    @staticmethod
    def forward(ctx, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV):
        kernel = cpu_kernels.kernel()
        B, T, H, K = q_BTHK.shape
        heads = lambda t: t.float().transpose(1, 2).reshape(B * H, T, -1).contiguous()  # noqa: E731
        q, k, v, g = (heads(t) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK))
        beta = beta_BTH.float().transpose(1, 2).reshape(B * H, T).contiguous()
        S0 = state_BHKV.float().reshape(B * H, K, -1).contiguous()
        o, S_end, checkpoints = kernel.kda_train_forward(q, k, v, g, beta, S0, TRAIN_CHECKPOINT)
        ctx.save_for_backward(q, k, v, g, beta, checkpoints)
        ctx.shape = (B, T, H, K, v.shape[-1])
        return o.reshape(B, H, T, -1).transpose(1, 2), S_end.reshape(B, H, K, -1)

    @staticmethod
    def backward(ctx, d_o_BTHV, dS_BHKV):
        q, k, v, g, beta, checkpoints = ctx.saved_tensors
        B, T, H, K, V = ctx.shape
        d_o = (torch.zeros(B * H, T, V) if d_o_BTHV is None else
               d_o_BTHV.float().transpose(1, 2).reshape(B * H, T, V).contiguous())
        dS = torch.zeros(B * H, K, V) if dS_BHKV is None else dS_BHKV.float().reshape(B * H, K, V).contiguous()
        dq, dk, dv, dg, dbeta, dS0 = cpu_kernels.kernel().kda_train_backward(q, k, v, g, beta, checkpoints, d_o, dS,
                                                                             TRAIN_CHECKPOINT)
        back = lambda t: t.reshape(B, H, T, -1).transpose(1, 2)  # noqa: E731
        return (back(dq), back(dk), back(dv), back(dg), dbeta.reshape(B, H, T).transpose(1, 2),
                dS0.reshape(B, H, K, V))


def kda_for_training(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence under autograd: the C kernels' Function on the CPU (fp32), else `kda_chunked`."""
    tensors = (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, state_BHKV)
    if all(t.is_cpu for t in tensors) and q_BTHK.dtype == torch.float32 and cpu_kernels.kernel() is not None:
        return KDATokenRecurrence.apply(*tensors)
    return kda_chunked(*tensors)


@functools.cache
def _fla_kda():
    """The module fla.ops.kda of flash-linear-attention (the `fla-core` package), or None where it does not
    import. Imported on first use from CUDA tensors only: on a machine without a GPU its import warns and
    takes seconds, and CPU runs never use it."""
    try:
        import fla.ops.kda as fla_kda
    except Exception:  # not installed, or its import fails on this platform: the torch path runs
        return None
    return fla_kda


def fla_selected(*tensors: torch.Tensor) -> bool:
    """Whether inference on these tensors goes to `kda_fla`: all are on CUDA, fla imports, and
    $MOESWAP_KDA_BACKEND is not "torch". CPU tensors never do (the C kernels and torch stay the reference)."""
    backend = os.environ.get(ENV_BACKEND) or "auto"
    if backend not in ("auto", "torch"):
        raise ValueError(f"{ENV_BACKEND}={backend!r}: expected auto or torch")
    return backend == "auto" and all(t.is_cuda for t in tensors) and _fla_kda() is not None


def kda_fla(q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTHK: torch.Tensor,
            beta_BTH: torch.Tensor, state_BHKV: torch.Tensor, scale: float, *, allow_cpu: bool = False,
            core: Callable | None = None) -> torch.Tensor:
    """The recurrence of `kda_decode_step` (raw q and k) in flash-linear-attention's kernels: one token in
    `fused_recurrent_kda`, more in `chunk_kda`. Their conventions are this module's: [B, T, H, K] inputs, g the
    log decay per key channel, beta after its sigmoid, the state [B, H, K, V] fp32 (S <- diag(exp g) S;
    S <- S + beta k (v - S^T k)^T; o = S^T q), q and k l2-normalised in the kernel with the epsilon inside
    the square root (1e-6, L2_EPS), q then times `scale`. The state is updated in place; returns o
    [B, T, H, V] fp32. For CUDA tensors; `allow_cpu` lets tests run it on CPU ones (Triton's interpreter),
    and `core` stands in for fla's function there (tests: fla's torch reference, where a kernel does not
    run in the interpreter)."""
    if not allow_cpu and not state_BHKV.is_cuda:
        raise ValueError("kda_fla runs on CUDA tensors (allow_cpu=True for tests)")
    if core is None:
        fla_kda = _fla_kda()
        if fla_kda is None:
            raise RuntimeError("flash-linear-attention (fla-core) does not import here")
        core = fla_kda.fused_recurrent_kda if q_BTHK.shape[1] == 1 else fla_kda.chunk_kda
    o_BTHV, S_BHKV = core(q=q_BTHK.float(), k=k_BTHK.float(), v=v_BTHV.float(), g=g_BTHK.float(),
                          beta=beta_BTH.float(), scale=scale, initial_state=state_BHKV.float(),
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    state_BHKV.copy_(S_BHKV)
    return o_BTHV
