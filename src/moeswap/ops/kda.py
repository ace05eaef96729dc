"""Kimi Delta Attention core: the token recurrence (reference, decode) and the chunked form (prefill).

Knows nothing of projections or checkpoints: inputs are already normalised q/k, v, the log-decay g
and beta. State S is [B, H, Dk, Dv] in fp32. Entry points: `kda_recurrent`, `kda_chunked`.
Shapes: B batch, T tokens, H heads, K key dim, V value dim, C chunk length.
"""

from __future__ import annotations

import torch


def kda_recurrent(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: S <- diag(exp g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q."""
    S = state_BHKV.float()
    q, k, v, g, beta = (t.float() for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        pred_BHV = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        u_BHV = beta[:, t].unsqueeze(-1) * (v[:, t] - pred_BHV)
        S = S + k[:, t].unsqueeze(-1) * u_BHV.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, dim=1), S


def kda_chunked(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `kda_recurrent`, a chunk at a time.

    Inside a chunk, with G_t the cumulative log decay, the updates u solve the unit lower-triangular
    system (I + A) u = beta (v - (e^G_t * k_t)^T S0), A_ts = beta_t sum_i k_ti k_si e^(G_ti - G_si).
    Pairwise decays are formed as e^(G_t - G_s) with s <= t only, so every exponent is <= 0: the
    bounded K3 gate (down to -5 per token) would overflow the usual e^G * e^-G factorisation.
    """
    B, T, H, K = k_BTHK.shape
    S = state_BHKV.float()
    # work per head: [B, H, T, .]
    q, k, v, g = (t.float().transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK))
    beta = beta_BTH.float().transpose(1, 2)
    outs = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end]
        # G in fp64: differences of large nearly equal fp32 sums would lose |G| * 2^-24
        G64_BHCK = g[:, :, start:end].double().cumsum(dim=2)
        G_BHCK = G64_BHCK.float()
        C = end - start
        causal_CC = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        diff_BHCCK = (G64_BHCK.unsqueeze(3) - G64_BHCK.unsqueeze(2)).float()  # [t, s] = G_t - G_s
        decay_BHCCK = torch.where(causal_CC[..., None], diff_BHCCK, float("-inf")).exp()
        kk_BHCC = torch.einsum("bhtk,bhsk,bhtsk->bhts", kc, kc, decay_BHCCK)
        qk_BHCC = torch.einsum("bhtk,bhsk,bhtsk->bhts", qc, kc, decay_BHCCK)
        A_BHCC = (bc.unsqueeze(-1) * kk_BHCC).tril(-1)
        eye = torch.eye(C, dtype=A_BHCC.dtype, device=A_BHCC.device)
        k_decayed_BHCK = kc * G_BHCK.exp()
        rhs_BHCV = bc.unsqueeze(-1) * (vc - k_decayed_BHCK @ S)
        u_BHCV = torch.linalg.solve_triangular(eye + A_BHCC, rhs_BHCV, upper=False, unitriangular=True)
        outs.append((qc * G_BHCK.exp()) @ S + qk_BHCC @ u_BHCV)
        # carry the state to the end of the chunk: every exponent G_C - G_s <= 0
        to_end_BHCK = (G64_BHCK[:, :, -1:] - G64_BHCK).float().exp()
        S = S * G_BHCK[:, :, -1].exp().unsqueeze(-1) + (kc * to_end_BHCK).transpose(-1, -2) @ u_BHCV
    return torch.cat(outs, dim=2).transpose(1, 2), S
