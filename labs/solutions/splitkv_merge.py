"""Lab 10, solution: merge the partial results of split-KV decoding, exactly.

Decoding has one query row per sequence and a long cache of keys: one program per row would leave
most of the GPU idle. Split-KV (flash-decoding; stage C's ``decode.py``) cuts the keys into chunks,
runs the online softmax over each chunk in its own program, and leaves per row and split s a
*normalized* partial output and the chunk's log-sum-exp:

    O_s = Σ_{j in s} exp(x_j − L_s) v_j,      L_s = log Σ_{j in s} exp(x_j)      (natural log)

A second, small kernel merges them. The row's log-sum-exp is the log-sum-exp of the chunks', and
its output the chunks' outputs weighted by their share of the total mass:

    L = log Σ_s exp(L_s),      O = Σ_s exp(L_s − L) · O_s

Your job, marked ``TODO(lab)``: that merge, for ``BLOCK_R`` rows per program. What makes it hard:

* the L_s can be huge or tiny (|L_s| in the hundreds or thousands here): exp(L_s) overflows or
  underflows float32, so subtract their maximum first (the online softmax's trick, one level up);
* a split in which a row saw no key (a causal row, an empty chunk) has L_s = −inf and O_s = 0:
  its weight must come out 0, never NaN (−inf − (−inf) is NaN);
* a row with no key in any split gets O = 0 and L = +inf (the convention of lab 8 and stage C:
  the backward's exp(s − L) is then 0);
* D need not be a power of two: the kernel works on ``BLOCK_D`` columns, masked.

Averaging the O_s, or taking the O_s of the largest L_s, looks right on easy data and is wrong:
the check's splits have different lengths and logits far apart and close together.

    python -m labs check splitkv_merge
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def merge_kernel(O_PART, LSE_PART, O, LSE, ROWS, SPLITS,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """O_PART [SPLITS, ROWS, D] and LSE_PART [SPLITS, ROWS] (float32, contiguous) into
    O [ROWS, D] and LSE [ROWS]; program p merges rows p * BLOCK_R ..."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    ds = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (ds[None, :] < D)
    # One pass over the splits with a running maximum m, the way the main kernel walks key tiles:
    # den = Σ exp(L_s − m) and acc = Σ exp(L_s − m) O_s, rescaled whenever m grows.
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for s in range(SPLITS):
        part = s * ROWS + rows
        lse_s = tl.load(LSE_PART + part, mask=row_ok, other=float("-inf"))
        o_s = tl.load(O_PART + part[:, None] * D + ds[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse_s)
        # While every split so far was empty m_new is -inf: subtract 0 instead, so the weights are
        # exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_old = tl.exp(m - m_use)   # rescales what was summed against the old maximum
        w = tl.exp(lse_s - m_use)   # this split's mass relative to the new one: <= 1, never overflows
        den = den * w_old + w
        acc = acc * w_old[:, None] + w[:, None] * o_s
        m = m_new
    # den >= 1 for any row that saw a key (its largest split contributes exp(0)); 0 for none.
    seen = den > 0.0
    out = acc / tl.where(seen, den, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, den, 1.0)), float("inf"))
    tl.store(O + rows[:, None] * D + ds[None, :], out, mask=mask)
    tl.store(LSE + rows, lse, mask=row_ok)


def merge(o_part: torch.Tensor, lse_part: torch.Tensor, block_r: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [rows, D], LSE [rows]) from float32 o_part [splits, rows, D] and lse_part [splits, rows]."""
    splits, rows, D = o_part.shape
    o = torch.empty(rows, D, dtype=torch.float32)
    lse = torch.empty(rows, dtype=torch.float32)
    merge_kernel[(triton.cdiv(rows, block_r),)](o_part.contiguous(), lse_part.contiguous(), o, lse, rows, splits,
                                                D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_R=block_r)
    return o, lse
