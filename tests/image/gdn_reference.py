"""Eager pure-PyTorch Gated DeltaNet reference: an oracle independent of FLA and Megatron.

Conventions follow the public FLA API (not its code):

* ``q, k``: ``[B, T, H, K]``; ``v``: ``[B, T, H, V]``; ``g`` (log decay, <= 0) and ``beta``
  (write strength in (0, 1)): ``[B, T, H]``. ``scale`` defaults to ``K ** -0.5``.
* Packed sequences: ``B == 1`` and ``cu_seqlens`` (``[N + 1]``, int) marks sequence
  boundaries; the state restarts at zero at every boundary.
* State ``h`` is ``[K, V]`` per head. One token::

      h <- exp(g_t) * h
      u_t = beta_t * (v_t - h^T k_t)
      h <- h + k_t u_t^T
      o_t = scale * h^T q_t

  i.e. ``h_t = A_t h_{t-1} + beta_t k_t v_t^T`` with ``A_t = exp(g_t) (I - beta_t k_t k_t^T)``.

Two forms are given. :func:`gdn_recurrent` is the token loop above. :func:`gdn_chunked`
splits the packed buffer into ``num_ranks`` equal contiguous parts (the layout of FLA's CP
context), reduces each rank's part of each sequence to an affine summary
``H_out = M H_in + S`` with a chunkwise (WY / UT-transform) computation, composes the
summaries in rank order to obtain each part's incoming state, and only then produces the
outputs. The two forms share no code beyond the input conventions, so agreement between
them checks both.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "l2norm",
    "causal_conv1d_ref",
    "gdn_recurrent",
    "gdn_chunked",
    "segment_summary",
    "compose_summaries",
    "contiguous_rank_bounds",
    "random_gdn_inputs",
    "max_abs",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` over the last dim (any shape, any float dtype)."""
    return x * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


def _bounds(cu_seqlens: Optional[torch.Tensor], total: int) -> List[Tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Depthwise causal conv. ``x``: ``[B, T, D]``, ``weight``: ``[D, W]``, ``bias``: ``[D]``.

    ``y[t, d] = sum_{i<W} weight[d, i] * x[t - (W - 1) + i, d]`` with zeros before each
    sequence start; then SiLU when ``activation`` is ``"silu"``/``"swish"``. Returns ``[B, T, D]``.
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    outs = []
    for b in range(B):
        pieces = []
        for s, e in _bounds(cu_seqlens if B == 1 else None, T):
            seg = x[b, s:e].transpose(0, 1).unsqueeze(0)  # [1, D, L]
            seg = F.pad(seg, (W - 1, 0))
            y = F.conv1d(seg, weight.unsqueeze(1), bias, groups=D)  # [1, D, L]
            pieces.append(y[0].transpose(0, 1))
        outs.append(torch.cat(pieces, 0))
    y = torch.stack(outs, 0)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    return y


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule.

    Returns ``o`` ``[B, T, H, V]`` (dtype of ``v``) and final states ``[N, H, K, V]`` (float of
    the compute dtype; ``N`` = batch size, or number of packed sequences when ``cu_seqlens``).
    ``initial_state`` is ``[N, H, K, V]`` or None (zeros).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    dt = torch.promote_types(q.dtype, torch.float32)
    o = torch.zeros(B, T, H, V, dtype=dt, device=q.device)
    finals = []
    n = 0
    for b in range(B):
        for s, e in _bounds(cu_seqlens if B == 1 else None, T):
            h = (
                initial_state[n].to(dt)
                if initial_state is not None
                else torch.zeros(H, K, V, dtype=dt, device=q.device)
            )
            rows = []
            for t in range(s, e):
                qt, kt, vt = q[b, t].to(dt), k[b, t].to(dt), v[b, t].to(dt)  # [H,K],[H,K],[H,V]
                h = h * torch.exp(g[b, t].to(dt))[:, None, None]
                u = beta[b, t].to(dt)[:, None] * (vt - torch.einsum("hkv,hk->hv", h, kt))
                h = h + kt[:, :, None] * u[:, None, :]
                rows.append(scale * torch.einsum("hkv,hk->hv", h, qt))
            o[b, s:e] = torch.stack(rows, 0)
            finals.append(h)
            n += 1
    return o.to(v.dtype), torch.stack(finals, 0)


def _chunk_terms(q, k, v, g, beta, scale):
    """Per-chunk quantities for one contiguous chunk of one sequence.

    Inputs per head-major layout: ``q, k`` ``[H, C, K]``, ``v`` ``[H, C, V]``, ``g, beta``
    ``[H, C]``. Returns a dict with the UT-transformed rows ``W0`` ``[H, C, V]`` and ``Wk``
    ``[H, C, K]`` (so that ``u = W0 - Wk @ H_in``), the decay-weighted keys for the state
    update, the cumulative log decay and the intra-chunk causal score matrix.
    """
    H, C, K = k.shape
    gam = torch.cumsum(g, dim=-1)  # [H, C]
    diff = gam[:, :, None] - gam[:, None, :]  # [H, C, C], gam_i - gam_j
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(0)
    neg_inf = torch.full_like(diff, float("-inf"))
    dec_strict = torch.exp(torch.where(strict, diff, neg_inf))
    dec_incl = torch.exp(torch.where(incl, diff, neg_inf))
    kk = torch.einsum("hik,hjk->hij", k, k)
    Lm = beta[:, :, None] * dec_strict * kk  # strictly lower
    eye = torch.eye(C, dtype=k.dtype, device=k.device).expand(H, C, C)
    Tm = torch.linalg.solve_triangular(eye + Lm, eye, upper=False, unitriangular=True)
    W0 = Tm @ (beta[:, :, None] * v)
    Wk = Tm @ ((beta * torch.exp(gam))[:, :, None] * k)
    k_end = torch.exp(gam[:, -1:] - gam)[:, :, None] * k  # [H, C, K]
    qk = scale * dec_incl * torch.einsum("hik,hjk->hij", q, k)  # [H, C, C]
    return {"gam": gam, "W0": W0, "Wk": Wk, "k_end": k_end, "qk": qk}


def _chunk_summary(t):
    """(M, S) of one chunk: ``H_out = M @ H_in + S`` with ``M`` ``[H,K,K]``, ``S`` ``[H,K,V]``."""
    H, C, K = t["Wk"].shape
    eye = torch.eye(K, dtype=t["Wk"].dtype, device=t["Wk"].device)
    decay_all = torch.exp(t["gam"][:, -1])[:, None, None]
    M = decay_all * eye - t["k_end"].transpose(1, 2) @ t["Wk"]
    S = t["k_end"].transpose(1, 2) @ t["W0"]
    return M, S


def _chunk_output(t, q, H_in):
    """Outputs ``[H, C, V]`` and outgoing state of one chunk given its incoming state."""
    U = t["W0"] - t["Wk"] @ H_in
    scale_q = torch.exp(t["gam"])[:, :, None]
    o = t["qk"] @ U + t["scale"] * scale_q * (q @ H_in)
    H_out = torch.exp(t["gam"][:, -1])[:, None, None] * H_in + t["k_end"].transpose(1, 2) @ U
    return o, H_out


def compose_summaries(first, second):
    """Summary of running ``first`` then ``second``: ``(M2 M1, M2 S1 + S2)``.

    Associative, not commutative: the order is the rank (time) order.
    """
    M1, S1 = first
    M2, S2 = second
    return M2 @ M1, M2 @ S1 + S2


def _chunks(length: int, chunk_size: int) -> List[Tuple[int, int]]:
    return [(a, min(a + chunk_size, length)) for a in range(0, length, chunk_size)]


def segment_summary(q, k, v, g, beta, scale, chunk_size=64):
    """Affine summary ``(M, S)`` of one contiguous piece of one sequence (head-major inputs)."""
    H, L, K = k.shape
    M = torch.eye(K, dtype=k.dtype, device=k.device).expand(H, K, K)
    S = torch.zeros(H, K, v.shape[-1], dtype=k.dtype, device=k.device)
    for a, b in _chunks(L, chunk_size):
        t = _chunk_terms(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale)
        M, S = compose_summaries((M, S), _chunk_summary(t))
    return M, S


def _segment_outputs(q, k, v, g, beta, scale, H_in, chunk_size=64):
    outs = []
    H = H_in
    for a, b in _chunks(k.shape[1], chunk_size):
        t = _chunk_terms(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale)
        t["scale"] = scale
        o, H = _chunk_output(t, q[:, a:b], H)
        outs.append(o)
    return torch.cat(outs, 1), H


def contiguous_rank_bounds(total: int, num_ranks: int) -> List[Tuple[int, int]]:
    """Rank ``r`` owns packed tokens ``[r*T/P, (r+1)*T/P)`` (T divisible by P)."""
    if total % num_ranks:
        raise ValueError(f"total tokens {total} not divisible by num_ranks {num_ranks}")
    part = total // num_ranks
    return [(r * part, (r + 1) * part) for r in range(num_ranks)]


def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    num_ranks: int = 1,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise gated delta rule with per-rank summaries composed in rank order.

    Same inputs/outputs as :func:`gdn_recurrent`. For ``B > 1`` each batch row is split into
    ``num_ranks`` parts on its own; for packed input (``B == 1`` + ``cu_seqlens``) the packed
    buffer is split, so a sequence may span several ranks and start mid-rank.
    Phase 1 (rank-local, parallelisable): each rank's piece of each sequence -> ``(M_r, S_r)``.
    Phase 2 (sequential over ranks): ``H_{r+1} = M_r H_r + S_r``.
    Phase 3 (rank-local): outputs of each piece from its incoming state ``H_r``.
    """
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    dt = torch.promote_types(q.dtype, torch.float32)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=dt, device=q.device)
    ranks = contiguous_rank_bounds(T, num_ranks)
    finals = []
    n = 0

    def hm(x, b, s, e):  # [L, H, ...] -> head-major [H, L, ...]
        return x[b, s:e].to(dt).transpose(0, 1)

    for b in range(B):
        for s, e in _bounds(cu_seqlens if B == 1 else None, T):
            pieces = [(max(s, rs), min(e, re)) for rs, re in ranks if max(s, rs) < min(e, re)]
            args = [
                tuple(hm(x, b, ps, pe) for x in (q, k, v, g, beta)) for ps, pe in pieces
            ]
            # Phase 1: per-rank summaries (independent of any incoming state).
            summaries = [segment_summary(*a, scale, chunk_size) for a in args]
            # Phase 2: compose in rank order.
            H_r = (
                initial_state[n].to(dt)
                if initial_state is not None
                else torch.zeros(H, K, v.shape[-1], dtype=dt, device=q.device)
            )
            incoming = []
            for M, S in summaries:
                incoming.append(H_r)
                H_r = M @ H_r + S
            # Phase 3: local outputs.
            for (ps, pe), a, H_in in zip(pieces, args, incoming):
                out, _ = _segment_outputs(*a, scale, H_in, chunk_size)
                o[b, ps:pe] = out.transpose(0, 1)
            finals.append(H_r)
            n += 1
    return o.to(v.dtype), torch.stack(finals, 0)


def random_gdn_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    dtype=torch.float64,
    seed: int = 0,
    device="cpu",
) -> Sequence[torch.Tensor]:
    """Random well-conditioned inputs: l2-normalised ``k``, ``g = logsigmoid(.)``, ``beta`` in (0,1)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    q = r(B, T, H, K)
    k = l2norm(r(B, T, H, K))
    v = r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H) + 2.0)
    beta = torch.sigmoid(r(B, T, H))
    return q, k, v, g, beta


def max_abs(x: torch.Tensor) -> float:
    return float(x.detach().abs().max()) if x.numel() else 0.0


if __name__ == "__main__":  # pragma: no cover - quick manual check
    q, k, v, g, b = random_gdn_inputs(1, 100, 2, 8, 6)
    o1, h1 = gdn_recurrent(q, k, v, g, b)
    o2, h2 = gdn_chunked(q, k, v, g, b, chunk_size=16, num_ranks=4)
    print(max_abs(o1 - o2), max_abs(h1 - h2), math.isfinite(max_abs(o1)))
