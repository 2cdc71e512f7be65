"""Lab 2: causal tile skipping.

Under a causal mask, query row i sees key j only if j <= i + (Nk - Nq) (bottom-right aligned, as in
stages/contract.py; here Nk >= Nq). Stage B walks *every* K/V tile and masks the scores it may not
see; a tile wholly right of the diagonal is loaded and computed only to be thrown away. Stage C
stops the loop at the last tile that holds a visible key: about half the work for Nq = Nk.

The kernel below is correct already: it masks. Your job: choose the loop's end ``hi`` (marked
``TODO(lab)``) so that a program visits only the tiles its rows can see. The kernel counts the tiles
each program visits, and the check compares that count with the fewest that give the right answer:

    python -m labs check causal_skip

Shapes: q [Nq, D], k and v [Nk, D], float32, one head.
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def causal_attention_kernel(Q, K, V, O, TILES, scale, Nq, Nk,
                            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + ds[None, :], mask=rows[:, None] < Nq, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)

    # TODO(lab): the end of the key range this program's rows can see. Its last row is
    # (pid + 1) * BLOCK_M - 1 (or Nq - 1); that row sees keys up to row + (Nk - Nq); never past Nk.
    # Use tl.minimum. (Writing hi = Nk gives the right output but visits every tile.)
    hi = Nk
    raise NotImplementedError("TODO(lab): choose hi")

    tiles = 0
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * D + ds[None, :], mask=cols[:, None] < Nk, other=0.0)
        v = tl.load(V + cols[:, None] * D + ds[None, :], mask=cols[:, None] < Nk, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = (cols[None, :] < Nk) & (cols[None, :] <= rows[:, None] + (Nk - Nq))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
        tiles += 1
    tl.store(O + rows[:, None] * D + ds[None, :], acc / l_i[:, None], mask=rows[:, None] < Nq)
    tl.store(TILES + pid, tiles)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 16,
              block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (bottom-right aligned, Nk >= Nq) and the number of K/V tiles each program
    visited. q [Nq, D], k, v [Nk, D], float32, D a power of two >= 16."""
    Nq, D = q.shape
    Nk = k.shape[0]
    if Nk < Nq:
        raise ValueError(f"this lab needs Nk >= Nq (every row sees a key); got Nq={Nq}, Nk={Nk}")
    o = torch.empty_like(q)
    grid = triton.cdiv(Nq, block_m)
    tiles = torch.zeros(grid, dtype=torch.int32)
    causal_attention_kernel[(grid,)](q, k, v, o, tiles, D ** -0.5, Nq, Nk, D=D, BLOCK_M=block_m, BLOCK_N=block_n)
    return o, tiles
