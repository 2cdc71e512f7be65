"""Lab 1: the inner loop of stage B, from notebook 03's NumPy.

Notebook 03 wrote the online softmax in NumPy: walk over the keys in blocks, keep per query row a
running maximum ``m``, a running sum ``l`` of exponentials and an unnormalized output ``acc``, and
rescale the old ``l`` and ``acc`` whenever the maximum grows. Here the same recurrence runs inside a
Triton kernel, one program per tile of ``BLOCK_M`` query rows, one loop step per ``BLOCK_N`` keys.

Your job: fill in ``online_softmax_step`` (marked ``TODO(lab)``). Everything else is done. Check it:

    python -m labs check online_softmax

Shapes: q [Nq, D], k and v [Nk, D], float32, one head (no batch), no causal mask. Units: none.
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v):
    """Fold one tile of scores into the running state.

    m_i [BLOCK_M]      running row maximum of the scores seen so far (-inf before the first tile)
    l_i [BLOCK_M]      running row sum of exp(score - m_i)
    acc [BLOCK_M, D]   running sum of exp(score - m_i) * v_row
    s   [BLOCK_M, BLOCK_N]  this tile's scaled scores (masked ones are -inf)
    v   [BLOCK_N, D]   this tile's values
    Returns the new (m_i, l_i, acc).
    """
    # TODO(lab): the online softmax update. You need tl.maximum, tl.max(x, axis=1), tl.exp,
    # tl.sum(x, axis=1) and tl.dot(p, v). Remember to rescale the old l_i and acc by
    # exp(m_old - m_new) before adding this tile's part.
    raise NotImplementedError("TODO(lab): online_softmax_step")


@triton.jit
def attention_kernel(Q, K, V, O, scale, Nq, Nk,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + ds[None, :], mask=rows[:, None] < Nq, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for n0 in range(0, Nk, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * D + ds[None, :], mask=cols[:, None] < Nk, other=0.0)
        v = tl.load(V + cols[:, None] * D + ds[None, :], mask=cols[:, None] < Nk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(cols[None, :] < Nk, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v)
    tl.store(O + rows[:, None] * D + ds[None, :], acc / l_i[:, None], mask=rows[:, None] < Nq)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(D)) v for float32 q [Nq, D], k, v [Nk, D] (D a power of two, >= 16)."""
    Nq, D = q.shape
    o = torch.empty_like(q)
    attention_kernel[(triton.cdiv(Nq, block_m),)](q, k, v, o, D ** -0.5, Nq, k.shape[0],
                                                  D=D, BLOCK_M=block_m, BLOCK_N=block_n)
    return o
