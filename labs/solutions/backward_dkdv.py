"""Lab 9, solution: the backward's dK/dV kernel, recomputing P instead of reading it.

The forward saved only O and the row log-sum-exp LSE (lab 8). With S = Q Kᵀ · scale and
P = exp(S − LSE) (exactly softmax(S): LSE is the row's normalizer), the gradients of O = P V are

    dV = Pᵀ dO,      dP = dO Vᵀ,      dS = P ∘ (dP − δ),      dK = dSᵀ Q · scale,

with δ_i = rowsum(dO_i ∘ O_i) (lab 6's pre-pass; it equals rowsum(P ∘ dP) because O = P V). A
program owns ``BLOCK_N`` keys of one (batch, head): it keeps its K and V tiles and two accumulators,
dK and dV, on chip and walks *all* the query rows, ``BLOCK_M`` at a time, recomputing that tile of
P from Q, K and LSE. Nothing N×N is ever stored (FlashAttention-2, Dao 2023, Algorithm 2: the outer
loop over K/V blocks, the inner over Q blocks; FlashAttention, Dao et al. 2022, Appendix B.2 derives
the gradients).

Your job, marked ``TODO(lab)``: the loop over the query tiles and the stores. What the check asks:

* q, dO ``[B, H, Nq, D]``; k, v, dK, dV ``[B, H, Nk, D]``, all contiguous; LSE and δ float32
  ``[B, H, Nq]``; Nq != Nk, neither a multiple of the tiles;
* ``CAUSAL`` bottom-right aligned (row i sees key j iff j <= i + Nk − Nq). A row that sees no key
  has LSE = +inf, so exp(s − LSE) is 0 there without a special case;
* ``scale`` is an argument (the check does not always use 1/sqrt(D)).

    python -m labs check backward_dkdv

The check launches ``dkdv_kernel`` itself into NaN-filled dK and dV and compares them with PyTorch
autograd of a float64 reference.
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, scale, Nq, Nk,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Program (pid_n, b * H + h): keys pid_n * BLOCK_N ... of head (b, h)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Nk
    ds = tl.arange(0, D)
    q_head = bh * Nq * D    # contiguous [B, H, N, D]: head (b, h) starts at (b * H + h) * N * D
    kv_head = bh * Nk * D
    kv_offs = kv_head + cols[:, None] * D + ds[None, :]
    k = tl.load(K + kv_offs, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + kv_offs, mask=col_ok[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    offset = Nk - Nq

    # Causal: key j is seen by rows i >= j - offset only, so the query tiles above this key tile's
    # first key see none of it: start at the tile holding row (first key - offset).
    lo = 0
    if CAUSAL:
        lo = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
    for m0 in range(lo, Nq, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < Nq
        q_offs = q_head + rows[:, None] * D + ds[None, :]
        q = tl.load(Q + q_offs, mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + q_offs, mask=row_ok[:, None], other=0.0)
        # A padded row gets LSE = +inf, so its P is 0 whatever its (zero) scores are.
        lse = tl.load(LSE + bh * Nq + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + bh * Nq + rows, mask=row_ok, other=0.0)

        # Recompute this tile of P exactly as the forward had it: the saved LSE normalizes it.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + offset)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)

        dv += tl.dot(tl.trans(p), do, input_precision="ieee")             # dV = Pᵀ dO
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")              # dP = dO Vᵀ
        dsc = p * (dp - delta[:, None])                                   # dS = P ∘ (dP − δ)
        dk += tl.dot(tl.trans(dsc), q, input_precision="ieee")            # dK = dSᵀ Q (× scale below)

    # S = Q Kᵀ · scale, so dK picks up the scale once; applying it after the loop saves a multiply per tile.
    tl.store(DK + kv_offs, dk * scale, mask=col_ok[:, None])
    tl.store(DV + kv_offs, dv, mask=col_ok[:, None])


def dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
         delta: torch.Tensor, *, causal: bool = False, scale: float | None = None, block_m: int = 16,
         block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(dK, dV) for contiguous float32 q, do [B, H, Nq, D], k, v [B, H, Nk, D] and float32 lse,
    delta [B, H, Nq] (D a power of two >= 16)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dkdv_kernel[(triton.cdiv(Nk, block_n), B * H)](q, k, v, do, lse, delta, dk, dv,
                                                   D ** -0.5 if scale is None else scale, Nq, Nk,
                                                   D=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    return dk, dv
