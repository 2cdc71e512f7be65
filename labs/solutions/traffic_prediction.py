"""Lab 11, solution: predict the HBM bytes of stage A and stage B, from their traffic models.

The memory-wall argument in numbers: stage A writes S and P to device memory and reads them back,
O(N²) bytes; stage B keeps them on chip but still re-reads K and V once per Q tile, O(N²·D/BLOCK_M)
(FlashAttention, Dao et al. 2022, Theorem 2: Θ(N²·d²/M) accesses for on-chip memory of M elements).
Each stage's README derives the bytes its kernels *request* for one forward call, no cache assumed
(``stages/a_naive/README.md`` and ``stages/b_tiled/README.md``, section "Traffic model").

Your job, marked ``TODO(lab)``: both models, as plain arithmetic on the problem's sizes:

* ``stage_a_bytes(...)`` and ``stage_b_bytes(...)`` return ``(read, write)`` in bytes for one
  forward call of B batches, Hq query heads, Hkv key/value heads, Nq query rows, Nk keys, head dim D,
  dtype "fp16", "bf16" or "fp32", causal or not.
* Things the READMEs say that matter: the tile sizes (stage A's matmuls use 64-row and 64-column
  tiles; stage B's BLOCK_M is 64, or 32 for fp32), what causal masking saves (stage A: only the
  softmax's reads of the visible entries; stage B: nothing), and that under GQA each query head
  requests its K/V head's tiles itself.
* Causal is bottom-right aligned: row i sees keys j <= i + Nk − Nq, none if that is negative, at
  most Nk.

The check draws a few hundred problems at random (any sizes, up to tens of thousands of rows) and
compares with the stages' own ``hbm_bytes``. While your functions run nothing under ``stages/`` may
run (the check stops it): predicting means working the formula out, not asking the model.

    python -m labs check traffic_prediction
"""

from __future__ import annotations

ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def visible_pairs(Nq: int, Nk: int, causal: bool) -> int:
    """(query, key) pairs in the softmax of one head."""
    if not causal:
        return Nq * Nk
    # Row i sees i + (Nk − Nq) + 1 keys when that is positive; the last row sees all Nk, and each
    # row above it one fewer, down to 1 (or down to Nk − Nq + 1 when Nq < Nk: the first query row
    # already sees that many). So the counts are the integers a+1 ... Nk with a = max(Nk − Nq, 0).
    a = max(Nk - Nq, 0)
    return Nk * (Nk + 1) // 2 - a * (a + 1) // 2


def stage_a_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, dtype: str, causal: bool) -> tuple[int, int]:
    """(read, write) bytes of stage A's three forward kernels, no cache."""
    e = ELEMENT_BYTES[dtype]
    heads = B * Hq                      # GQA: each query head requests its K/V head's tiles itself
    nn = heads * Nq * Nk * e            # one full S (or P)
    q_reads = heads * Nq * D * e * cdiv(Nk, 64)   # scores: Q once per 64-column tile of S
    k_reads = heads * Nk * D * e * cdiv(Nq, 64)   # scores: K once per 64-row tile of S
    softmax_reads = 2 * heads * visible_pairs(Nq, Nk, causal) * e  # pass 1 (max, sum) and pass 2
    pv_reads = nn + heads * Nk * D * e * cdiv(Nq, 64)              # P once, V once per 64-row O tile
    read = q_reads + k_reads + softmax_reads + pv_reads
    write = nn + nn + heads * Nq * D * e                           # S, P and O
    return read, write


def stage_b_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, dtype: str, causal: bool) -> tuple[int, int]:
    """(read, write) bytes of stage B's fused forward kernel, no cache (forward only: no LSE written)."""
    e = ELEMENT_BYTES[dtype]
    heads = B * Hq
    block_m = 32 if dtype == "fp32" else 64  # exact fp32 products keep 64-row tiles from fitting registers
    row = D * e
    # Q once; every Q tile walks all Nk rows of K and of V, causal or not (B does not skip tiles).
    read = heads * row * (Nq + 2 * cdiv(Nq, block_m) * Nk)
    write = heads * Nq * row            # O once
    return read, write
