"""Lab 7: grouped-query attention (GQA) by indexing, not by copying.

In GQA, Hq query heads share Hkv < Hq key/value heads: query heads are split into Hkv consecutive
groups of Hq // Hkv, and every head of group g reads K/V head g (stages/contract.py; also
FlashAttention's and SDPA ``enable_gqa``'s rule). ``k.repeat_interleave(Hq // Hkv, dim=1)`` would give
the same result but copy K and V Hq // Hkv times; a kernel just computes which K/V head to read.

Your job, marked ``TODO(lab)``: the K/V head of query head ``h``. The kernel is one program per
(batch, query head), for short sequences (N <= BLOCK).

    python -m labs check gqa_indexing
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def kv_head_of(h, Hq, Hkv):
    """The K/V head that query head h reads (h, Hq, Hkv integers, Hq % Hkv == 0)."""
    # TODO(lab): the group size is Hq // Hkv; which group is head h in?
    raise NotImplementedError("TODO(lab): kv_head_of")


@triton.jit
def gqa_attention_kernel(Q, K, V, O, scale, Hq, Hkv, N,
                         sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, so_b, so_h,
                         D: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // Hq, bh % Hq
    hk = kv_head_of(h, Hq, Hkv)
    idx = tl.arange(0, BLOCK)
    ds = tl.arange(0, D)
    inside = idx[:, None] < N
    q = tl.load(Q + b * sq_b + h * sq_h + idx[:, None] * D + ds[None, :], mask=inside, other=0.0)
    k = tl.load(K + b * sk_b + hk * sk_h + idx[:, None] * D + ds[None, :], mask=inside, other=0.0)
    v = tl.load(V + b * sv_b + hk * sv_h + idx[:, None] * D + ds[None, :], mask=inside, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    s = tl.where(idx[None, :] < N, s, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=1)[:, None])
    o = tl.dot(p / tl.sum(p, axis=1)[:, None], v, input_precision="ieee")
    tl.store(O + b * so_b + h * so_h + idx[:, None] * D + ds[None, :], o, mask=inside)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Non-causal GQA attention: float32 q [B, Hq, N, D], k, v [B, Hkv, N, D], contiguous, N <= 64."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq must be a multiple of Hkv, got Hq={Hq}, Hkv={Hkv}")
    if N > 64:
        raise ValueError(f"this lab's kernel holds the whole sequence in one tile: N <= 64, got {N}")
    o = torch.empty_like(q)
    block = max(16, triton.next_power_of_2(N))
    gqa_attention_kernel[(B * Hq,)](q, k, v, o, D ** -0.5, Hq, Hkv, N,
                                    q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                    v.stride(0), v.stride(1), o.stride(0), o.stride(1), D=D, BLOCK=block)
    return o
