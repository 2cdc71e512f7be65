"""Lab 8, solution: the fused attention forward, written from a skeleton.

Stage B in one kernel: a program owns ``BLOCK_M`` query rows of one (batch, head), keeps its Q tile
on chip, walks the keys ``BLOCK_N`` at a time, folds each tile of scores into a running maximum
``m``, a running sum ``l`` and an unnormalized output ``acc`` (the online softmax of lab 1), and
writes O = acc / l and the row's log-sum-exp LSE = m + log(l) once at the end. S and P never leave
the program: that is the whole trick of FlashAttention (Dao et al., 2022, "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", Algorithm 1; FlashAttention-2, Dao 2023,
Algorithm 1 for this loop order).

Your job, marked ``TODO(lab)``: the kernel body, from the program ids to the stores. The skeleton
lists the steps. What the check asks of it:

* q ``[B, H, Nq, D]``, k and v ``[B, H, Nk, D]``, any strides except a contiguous head dim (the check
  passes a ``[B, N, H, D]`` tensor transposed, so ``stride_qn`` is not ``D``); Nq and Nk need not be
  multiples of the tiles, and Nq != Nk;
* ``CAUSAL``: bottom-right aligned as in stages/contract.py: row i sees key j iff j <= i + Nk - Nq.
  With Nq > Nk the first rows see no key at all: their O is 0 and their LSE is +inf (stage C's
  convention: the backward computes P = exp(s - LSE), and +inf makes that 0, never NaN);
* ``scale`` is an argument (not always 1/sqrt(D)); LSE is natural-log, float32 ``[B, H, Nq]``.

    python -m labs check fused_forward

The check launches ``fused_attention_kernel`` itself, into buffers filled with NaN (a row your kernel
never writes shows up), and compares O and LSE with a float64 reference for several shapes, causal
and not, batches and heads with different data.
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def fused_attention_kernel(
    Q, K, V, O, LSE, scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, Nq, Nk,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Program (pid_m, b * H + h): query rows pid_m * BLOCK_M ... of head (b, h)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    # 1. Which head, which rows. Rows past Nq exist in the last tile only; they are masked everywhere.
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Nq
    ds = tl.arange(0, D)

    # 2. The Q tile, loaded once and kept for the whole loop (that is what "Q tile resident" means).
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + ds[None, :],
                mask=row_ok[:, None], other=0.0)
    K_bh = K + b * stride_kb + h * stride_kh
    V_bh = V + b * stride_vb + h * stride_vh

    # 3. The running state: m = -inf (no key seen), l = 0, acc = 0.
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)

    # 4. The key range. Causal: this tile's last row sees keys up to last_row + Nk - Nq, so the loop
    # may stop there (lab 2); non-causal rows see everything.
    offset = Nk - Nq
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(tl.minimum((pid_m + 1) * BLOCK_M, Nq) + offset, Nk)
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < Nk
        k = tl.load(K_bh + cols[:, None] * stride_kn + ds[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(V_bh + cols[:, None] * stride_vn + ds[None, :], mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        # A padded key loaded as 0 scores 0, not -inf: without the mask it would take a share of the
        # softmax. The causal mask hides the keys right of each row's diagonal.
        visible = col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(visible, s, float("-inf"))
        # 5. The online softmax. A row that has seen no key yet keeps m = -inf; exponentiate against
        # 0 instead, since -inf - (-inf) is NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    # 6. Normalize once, at the end. l = 0 only for a row that saw no key: O = 0, LSE = +inf.
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("inf"))

    # 7. Store the real rows only: the last tile's rows past Nq would land in the next head's rows
    # (or past the end of O for the last head).
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + ds[None, :], out,
             mask=row_ok[:, None])
    tl.store(LSE + bh * Nq + rows, lse, mask=row_ok)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, block_m: int = 16, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE) for float32 q [B, H, Nq, D], k, v [B, H, Nk, D] (D a power of two >= 16, head dim
    contiguous). LSE is float32 [B, H, Nq], natural log, +inf for a row that sees no key."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    o = torch.empty(B, H, Nq, D, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, dtype=torch.float32)
    fused_attention_kernel[(triton.cdiv(Nq, block_m), B * H)](
        q, k, v, o, lse, D ** -0.5 if scale is None else scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], H, Nq, Nk,
        D=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    return o, lse
