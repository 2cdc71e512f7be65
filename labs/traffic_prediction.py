"""Lab 11: predict the HBM bytes of stage A and stage B, from their traffic models.

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


def stage_a_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, dtype: str, causal: bool) -> tuple[int, int]:
    """(read, write) bytes of stage A's three forward kernels, no cache."""
    # TODO(lab): the scores kernel (Q and K re-read per tile, S written), the softmax (the visible
    # entries of S read twice, P written) and PV (P read, V re-read per tile, O written); per query
    # head, times B * Hq. For causal you need the number of visible (query, key) pairs of a head:
    # a closed form, or a sum over rows.
    raise NotImplementedError("TODO(lab): stage_a_bytes")


def stage_b_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, dtype: str, causal: bool) -> tuple[int, int]:
    """(read, write) bytes of stage B's fused forward kernel, no cache (forward only: no LSE written)."""
    # TODO(lab): Q once, K and V once per Q tile of BLOCK_M rows, O written once.
    raise NotImplementedError("TODO(lab): stage_b_bytes")
