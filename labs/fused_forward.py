"""Lab 8: the fused attention forward, written from a skeleton.

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
    # TODO(lab): the kernel body. The steps, each a few lines:
    #   1. b, h from bh (bh = b * H + h); this program's rows (pid_m * BLOCK_M + tl.arange) and their
    #      mask (rows < Nq); ds = tl.arange(0, D).
    #   2. Load the Q tile once (strides! masked rows load 0); pointers to this head's K and V.
    #   3. The running state: m = -inf, l = 0, acc = 0 (float32, [BLOCK_M] and [BLOCK_M, D]).
    #   4. Loop over the keys, BLOCK_N at a time (for n0 in range(0, hi, BLOCK_N)): load K and V
    #      tiles (masked), scores s = q kᵀ · scale (tl.dot(q, tl.trans(k), input_precision="ieee")),
    #      -inf where the key is past Nk or, if CAUSAL, right of the row's diagonal (j > i + Nk - Nq).
    #      Causal rows see nothing past the tile's last diagonal: you may stop the loop there (lab 2).
    #   5. The online softmax update of lab 1. Careful: a row may have seen no key yet (m = -inf),
    #      and -inf - (-inf) is NaN.
    #   6. After the loop: O = acc / l, LSE = m + log(l); a row that saw no key gets O = 0, LSE = +inf.
    #   7. Store O (strides) and LSE (LSE + bh * Nq + rows) for the real rows only.
    raise NotImplementedError("TODO(lab): fused_attention_kernel")


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
