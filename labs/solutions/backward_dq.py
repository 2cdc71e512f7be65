"""Lab 13, solution: dQ in a second pass, one program per query tile, in a fixed order.

Lab 9's program owns a K/V tile and walks the queries, so it can finish dK and dV alone. dQ is the
other way round: dQ_i = scale · Σ_j dS_ij K_j sums over *every* key tile, so in lab 9's kernel every
program holds a piece of every dQ row. Two ways out (FlashAttention-2, Dao 2023, section 3.2): add the
pieces into an fp32 buffer with atomics (fewer products, but the order of the additions, and so the
last bits, depends on which program gets there first), or a second kernel whose program owns a query
tile and walks the key tiles, recomputing P and dP once more (two more products per tile pair, and
bitwise reproducible: the sum runs in one order). Stage C measured both and keeps the faster on each
GPU (``tuned/h200-backward.json``: mostly this one); on Hopper its Gluon twin is ``hopper_bwd.py``'s
dQ kernel.

With S = Q Kᵀ · scale, P = exp(S − LSE), dP = dO Vᵀ and dS = P ∘ (dP − δ) (δ from lab 6):

    dQ = dS K · scale.

Your job, marked ``TODO(lab)``: the loop over the key tiles and the store. What the check asks:

* q, dO, dQ ``[B, H, Nq, D]``; k, v ``[B, H, Nk, D]``, contiguous; LSE and δ float32 ``[B, H, Nq]``;
  Nq != Nk, neither a multiple of the tiles;
* ``CAUSAL`` bottom-right aligned (row i sees key j iff j <= i + Nk − Nq); a row that sees no key has
  LSE = +inf and must get dQ = 0; the loop must stop at the last key any row of the tile sees (the
  kernel counts the key tiles it visits into ``TILES``, and the count must be the fewest);
* ``scale`` is an argument.

    python -m labs check backward_dq

The check launches ``dq_kernel`` into a NaN-filled dQ and compares it with PyTorch autograd of a
float64 reference, then runs it again and asks for the same bits.
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, TILES, scale, Nq, Nk,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Program (pid_m, b * H + h): query rows pid_m * BLOCK_M ... of head (b, h)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Nq
    ds = tl.arange(0, D)
    q_offs = bh * Nq * D + rows[:, None] * D + ds[None, :]
    q = tl.load(Q + q_offs, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_offs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh * Nq + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh * Nq + rows, mask=row_ok, other=0.0)
    kv_head = bh * Nk * D
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    offset = Nk - Nq

    # Causal: the tile's last row sees keys up to (last row + offset); no tile past that one.
    hi = Nk
    if CAUSAL:
        hi = tl.minimum(tl.maximum(tl.minimum(pid_m * BLOCK_M + BLOCK_M, Nq) + offset, 0), Nk)
    tiles = 0
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < Nk
        kv_offs = kv_head + cols[:, None] * D + ds[None, :]
        k = tl.load(K + kv_offs, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + kv_offs, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + offset)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)           # P, recomputed once more
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")           # dP = dO Vᵀ
        dsc = p * (dp - delta[:, None])                                # dS = P ∘ (dP − δ)
        dq += tl.dot(dsc, k, input_precision="ieee")                   # dQ += dS K, one tile at a time
        tiles += 1
    tl.store(TILES + bh * tl.num_programs(0) + pid_m, tiles)
    tl.store(DQ + q_offs, dq * scale, mask=row_ok[:, None])


def dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
       delta: torch.Tensor, *, causal: bool = False, scale: float | None = None, block_m: int = 16,
       block_n: int = 16) -> torch.Tensor:
    """dQ for contiguous float32 q, do [B, H, Nq, D], k, v [B, H, Nk, D] and float32 lse, delta
    [B, H, Nq] (D a power of two >= 16)."""
    B, H, Nq, D = q.shape
    out = torch.empty_like(q)
    grid = (triton.cdiv(Nq, block_m), B * H)
    tiles = torch.zeros(grid[1] * grid[0], dtype=torch.int32, device=q.device)
    dq_kernel[grid](q, k, v, do, lse, delta, out, tiles, D ** -0.5 if scale is None else scale, Nq, k.shape[2],
                    D=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    return out
