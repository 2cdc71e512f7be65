"""Lab 5, solution: the lazy rescale (FlashAttention-4's rule, used by stage C's Hopper kernel).

The online softmax rescales O (and l) by alpha = 2^(m_old - m_new) every time a row's running maximum
grows: D multiplies per row per tile, almost always for nothing once the first tiles have set the
maximum. The lazy rule keeps the maximum that P is computed against (``m_used``) where it is unless a
tile's maximum exceeds it by more than ``TAU`` (log2 units). Then P = 2^(s - m_used) <= 2^TAU, which
fp32 (and even fp16, up to 65504) holds, and the final O / l is still *exact*: any common reference
point cancels in the division. Only the size of the numbers changes, never the result.

Scores here are already in log2 units (the scale includes log2 e), so ``exp2`` is the exponential.
Your job, marked ``TODO(lab)``: the decision and the update in ``lazy_step``. The kernel counts, per
row, how many times it rescaled; the check compares the output with PyTorch and the count with the
rule (a row's first tile always "rescales": m_used starts at -inf).

    python -m labs check lazy_rescale
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TAU = 8.0  # log2 units: P never exceeds 2^8 = 256


@triton.jit
def lazy_step(m_used, l_i, acc, rescales, s, v, TAU: tl.constexpr):
    """Fold one tile of scores s [BLOCK_M, BLOCK_N] (log2 units, -inf where masked) into the state.

    m_used [BLOCK_M]     the reference maximum P is computed against (-inf before the first tile)
    l_i, acc             running sum of P and of P·V, relative to m_used
    rescales [BLOCK_M]   int32: how many times each row changed m_used so far
    Returns (m_used, l_i, acc, rescales).
    """
    tile_max = tl.max(s, axis=1)
    need = tile_max > m_used + TAU          # true on a row's first tile (m_used = -inf)
    m_new = tl.where(need, tile_max, m_used)
    # exp2(-inf - finite) = 0 on the first tile: the empty state is scaled to nothing, not NaN.
    alpha = tl.where(need, tl.math.exp2(m_used - m_new), 1.0)
    l_i = l_i * alpha
    acc = acc * alpha[:, None]
    rescales += need.to(tl.int32)
    m_used = m_new
    p = tl.math.exp2(s - m_used[:, None])  # <= 2^TAU by construction
    l_i = l_i + tl.sum(p, axis=1)
    acc = acc + tl.dot(p, v, input_precision="ieee")
    return m_used, l_i, acc, rescales


@triton.jit
def lazy_attention_kernel(Q, K, V, O, RESCALES, qk_scale, Nq, Nk,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAU: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + ds[None, :], mask=rows[:, None] < Nq, other=0.0)
    m_used = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    rescales = tl.zeros((BLOCK_M,), tl.int32)
    for n0 in range(0, Nk, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * D + ds[None, :], mask=cols[:, None] < Nk, other=0.0)
        v = tl.load(V + cols[:, None] * D + ds[None, :], mask=cols[:, None] < Nk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(cols[None, :] < Nk, s, float("-inf"))
        m_used, l_i, acc, rescales = lazy_step(m_used, l_i, acc, rescales, s, v, TAU)
    tl.store(O + rows[:, None] * D + ds[None, :], acc / l_i[:, None], mask=rows[:, None] < Nq)
    tl.store(RESCALES + rows, rescales, mask=rows < Nq)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 16,
              block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / sqrt(D)) v with the lazy rescale, and the per-row rescale counts (int32 [Nq]).
    float32 q [Nq, D], k, v [Nk, D], D a power of two >= 16."""
    Nq, D = q.shape
    o = torch.empty_like(q)
    rescales = torch.empty(Nq, dtype=torch.int32)
    lazy_attention_kernel[(triton.cdiv(Nq, block_m),)](q, k, v, o, rescales, D ** -0.5 * LOG2E, Nq, k.shape[0],
                                                       D=D, BLOCK_M=block_m, BLOCK_N=block_n, TAU=TAU)
    return o, rescales
