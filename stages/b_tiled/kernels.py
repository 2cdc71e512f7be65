"""Stage B: one fused kernel, S and P kept on chip, online softmax. No pipelining.

One program owns a BLOCK_M-row tile of Q for one (batch, query head). It loads that tile once, then
walks over K and V in BLOCK_N-row tiles. For each tile it computes the scores S_ij = scale·Q_i K_jᵀ
in registers, and folds them into three running quantities per row, exactly the recurrence of
FlashAttention (Dao et al. 2022, section 3.1):

    m_new = max(m_i, rowmax(S_ij))             running max
    P_ij  = exp(S_ij - m_new)                  this tile's unnormalized probabilities
    l_i   = l_i · exp(m_i - m_new) + rowsum(P_ij)    running softmax denominator
    O_i   = O_i · exp(m_i - m_new) + P_ij V_j        running (unnormalized) output
    m_i   = m_new

and at the end O_i / l_i. S_ij and P_ij live only inside one loop iteration: the N×N matrices of
stage A never exist. What still crosses device memory is Q (once), K and V (once per Q tile: the
O(N²·D/BLOCK_M) term) and O (once).

The shapes of the contract: query head h reads key/value head h // GROUP (grouped-query attention,
by index, no copy); Nq and Nk may differ, and causal masking is aligned to the bottom right (query i
sees key j iff j <= i + Nk - Nq), so a row may see no key at all and must output 0; the head dim D
is padded to a power of two D_PAD inside the kernel (``tl.arange`` needs one) with the columns past
D masked on every load and store.

The backward pass (``_backward``, autograd's formula for the stage's custom op) recomputes P from Q, K and the row log-sum-exp L
that the forward saves, instead of storing P: three kernels, a delta pre-pass, a dK/dV kernel and
(by default) a dQ kernel; see README.md for the derivation.

Deliberately left out, because each is one of stage C's lessons: the loads are plain synchronous
loads (``num_stages=1``: the kernel stalls on every K/V tile), tiles are a fixed 64×64 for every head
dim and GPU (32×32 only where registers force it: fp32, and the backward at D > 128), the softmax
uses ``exp`` with a separate scale multiply, and causal attention visits every K/V tile and masks,
even tiles wholly above the diagonal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops
from ..contract import (DTYPES, CompiledKernel, HbmTraffic, Problem, cdiv, new_output, padded_head_dim,
                        validate_backward_inputs, validate_inputs)
from ..launch import Launch, compiles_without_interpreter

BLOCK_M = 64   # rows of Q per program (and per step of the dK/dV kernel's loop)
BLOCK_N = 64   # rows of K/V per loop step (and per dK/dV program)
#: The tile is fixed, except where a 64-row tile cannot work at all (see :func:`tile_shape`).
NUM_WARPS = 4
NUM_STAGES = 1  # no software pipelining: each K/V load completes before the math that needs it

#: the two ways of computing dQ in the backward pass (see README.md, "Two ways to get dQ")
DQ_METHODS = ("separate", "atomic")
STAT_BYTES = 4  # L and delta are one fp32 per query row


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

# Sizes are runtime values (no kernel per sequence length); strides keep their divisibility facts.
@triton.jit(do_not_specialize=["N_Q", "N_K"])
def tiled_attention_kernel(
    Q, K, V, O, LSE, scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, N_Q, N_K, GROUP,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv_h = h // GROUP  # grouped-query attention: GROUP query heads share one K/V head
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims[None, :] < D  # the padding columns are never read (loads give 0) nor written
    diag = N_K - N_Q            # bottom-right causal: row i sees columns j <= i + diag
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    # The Q tile stays in registers for the whole loop: it is read from device memory once.
    q = tl.load(q_base + rows[:, None] * stride_qn + dims[None, :], mask=(rows[:, None] < N_Q) & dim_ok,
                other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)   # running row max
    l_i = tl.zeros((BLOCK_M,), tl.float32)                 # running row sum of exp
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)           # running unnormalized output

    for n0 in range(0, N_K, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < N_K) & dim_ok
        k = tl.load(k_base + cols[:, None] * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        valid = cols[None, :] < N_K
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))

        # A row may have seen no valid column yet (always so for a causal row above the first key
        # when Nq > Nk): then m_new is -inf, and exp(s - m_new) would be exp(-inf + inf) = NaN.
        # Subtracting 0 instead gives exp(-inf) = 0: the row's p, l and acc simply stay 0.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A row that saw no key has l = 0 and acc = 0: dividing by 1 instead outputs the required 0.
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on + dims[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(rows[:, None] < N_Q) & dim_ok)
    if WRITE_LSE:
        # L = m + log(l), the log of the softmax denominator: all the backward needs to rebuild P.
        # +inf for a row that saw no key, so that the backward's exp(S - L) is 0 there.
        lse = tl.where(seen, m_i + tl.log(l_safe), float("inf"))
        tl.store(LSE + bh.to(tl.int64) * N_Q + rows, lse, mask=rows < N_Q)


# --------------------------------------------------------------------------------------------------
# Backward. With P = softmax(S), S = scale·Q Kᵀ, O = P V and dO given:
#   dV = Pᵀ dO     dP = dO Vᵀ     dS = P ∘ (dP − delta)     dQ = scale·dS K     dK = scale·dSᵀ Q
# where delta_i = Σ_j P_ij dP_ij = rowsum(dO_i ∘ O_i). P is recomputed tile by tile as exp(S − L).
# --------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N_Q"])
def tiled_attention_bwd_delta_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    H, N_Q,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO ∘ O) for one Q tile: one fp32 per query row, read by both later kernels."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    mask = (rows[:, None] < N_Q) & (dims[None, :] < D)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on
                + dims[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows[:, None] * stride_don
                 + dims[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N_Q + rows, delta, mask=rows < N_Q)


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def tiled_attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    H, N_Q, N_K, GROUP,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK and dV of one K/V tile of one (batch, KV head). The tile's K and V stay in registers while
    the program walks every Q tile of every query head in the KV head's group, so the group's sum
    (GQA) is taken on chip and each dK/dV element is written once, by one program: no atomics.
    With ATOMIC_DQ it also adds this K/V tile's share of dQ, scale·dS K, into an fp32 buffer."""
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    H_KV = H // GROUP
    b, kv_h = bkv // H_KV, bkv % H_KV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims[None, :] < D
    col_ok = cols < N_K
    diag = N_K - N_Q
    kv_mask = col_ok[:, None] & dim_ok
    k = tl.load(K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + cols[:, None] * stride_kn
                + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + cols[:, None] * stride_vn
                + dims[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, D_PAD), tl.float32)
    dv = tl.zeros((BLOCK_N, D_PAD), tl.float32)

    for g in range(GROUP):
        h = kv_h * GROUP + g
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        stats = (b * H + h).to(tl.int64) * N_Q  # this head's rows of L and delta
        for m0 in range(0, N_Q, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < N_Q
            q_mask = row_ok[:, None] & dim_ok
            q = tl.load(q_base + rows[:, None] * stride_qn + dims[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_base + rows[:, None] * stride_don + dims[None, :], mask=q_mask, other=0.0)
            lse = tl.load(LSE + stats + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + stats + rows, mask=row_ok, other=0.0)

            # Recompute this tile of P exactly as the forward normalized it: exp(S - L). Masked
            # pairs (causal, padding rows and columns) get 0, and rows that saw no key have L = +inf.
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            valid = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + diag)
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)

            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
            if ATOMIC_DQ:
                # Every K/V tile of the row adds its share; the additions land in whatever order the
                # programs reach them, so fp32 rounding (and the result's last bits) varies run to run.
                # "relaxed": nothing else is read through these additions, so they need no ordering
                # against other memory traffic (the default, acq_rel, would fence each one).
                dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION) * scale
                tl.atomic_add(DQ_ACC + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
                              + rows[:, None] * stride_dqn + dims[None, :], dq, mask=q_mask, sem="relaxed")

    dk = dk * scale  # S = scale·Q Kᵀ, so dK = scale·dSᵀ Q (one multiply per element, at the end)
    tl.store(DK + b.to(tl.int64) * stride_dkb + kv_h.to(tl.int64) * stride_dkh + cols[:, None] * stride_dkn
             + dims[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b.to(tl.int64) * stride_dvb + kv_h.to(tl.int64) * stride_dvh + cols[:, None] * stride_dvn
             + dims[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def tiled_attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    H, N_Q, N_K, GROUP,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dQ of one Q tile of one (batch, query head), shaped like the forward: Q, dO, L and delta stay
    in registers while the program walks the K/V tiles. It recomputes S, P, dP and dS, which the
    dK/dV kernel already computed once: that repeated work buys a dQ that one program owns, summed
    in a fixed order (bitwise reproducible)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kv_h = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims[None, :] < D
    row_ok = rows < N_Q
    q_mask = row_ok[:, None] & dim_ok
    diag = N_K - N_Q
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qn
                + dims[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows[:, None] * stride_don
                 + dims[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * N_Q + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * N_Q + rows, mask=row_ok, other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    dq = tl.zeros((BLOCK_M, D_PAD), tl.float32)

    for n0 in range(0, N_K, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < N_K) & dim_ok
        k = tl.load(k_base + cols[:, None] * stride_kn + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        valid = row_ok[:, None] & (cols[None, :] < N_K)
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + diag)
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    dq = dq * scale
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqn
             + dims[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)


# --------------------------------------------------------------------------------------------------
# Launch plans: the kernels with their grids and arguments, for running and for compiling.
# --------------------------------------------------------------------------------------------------

def tile_shape(D: int, dtype: torch.dtype | str, *, backward: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for head dim ``D``: the fixed 64×64, halved to 32×32 where a 64-row tile
    cannot work. Registers force it, not tuning (ptxas, sm_80 and sm_90; ``experiments/resource_check.py``):

    * fp32 inputs, any D: their exact ("ieee") products run on the FMA units, where every thread
      keeps its slices of both operands in registers across the whole head dim. 64-row tiles
      spilled 2-35 KB per thread at D = 64; 32-row tiles spill nothing in the forward. (At
      D > 128, three 64-row fp32 operand tiles would not fit an A100's shared memory either.)
    * the ``backward`` at D > 128, any dtype: a dK/dV program keeps two fp32 accumulators of
      BLOCK_N × D_PAD, 64 × 256 × 2 × 4 bytes = 256 registers per thread at 4 warps, more than a
      thread has (255); the 64-row version spilled 4-7 KB per thread inside its loop."""
    fp32 = (DTYPES[dtype] if isinstance(dtype, str) else dtype) == torch.float32
    if fp32 or (backward and padded_head_dim(D) > 128):
        return BLOCK_M // 2, BLOCK_N // 2
    return BLOCK_M, BLOCK_N


def _strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    """Element strides of the B, H and N dims (the head dim is contiguous by contract)."""
    return (0, 0, 0) if t is None else tuple(t.stride()[:3])


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products, not TF32 (see stage A); fp16/bf16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_dq_method(dq_method: object) -> None:
    if dq_method not in DQ_METHODS:
        raise ValueError(f"dq_method must be one of {', '.join(repr(m) for m in DQ_METHODS)}, got {dq_method!r}")


def forward_plan(q, k, v, o, lse, *, causal: bool, scale: float) -> list[Launch]:
    """The forward kernel; ``lse`` is the fp32 ``[B, Hq, Nq]`` buffer for L, or None (forward only)."""
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    BM, BN = tile_shape(D, q.dtype)
    names = ("q", "k", "v", "o")
    strides = {f"stride_{n}{ax}": s for n, t in zip(names, (q, k, v, o)) for ax, s in zip("bhn", _strides(t))}
    return [Launch(
        tiled_attention_kernel, (cdiv(N_Q, BM), B * H),
        dict(Q=q, K=k, V=v, O=o, LSE=lse, scale=scale, **strides,
             H=H, N_Q=N_Q, N_K=N_K, GROUP=H // H_KV, D=D, D_PAD=padded_head_dim(D),
             BLOCK_M=BM, BLOCK_N=BN, CAUSAL=causal, WRITE_LSE=lse is not None,
             DOT_PRECISION=_dot_precision(q.dtype)),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)]


def backward_plan(q, k, v, o, do, lse, delta, dq, dk, dv, *, causal: bool, scale: float,
                  dq_method: str) -> list[Launch]:
    """The three backward launches: delta pre-pass, dK/dV, then dQ (``"separate"``); or two
    (``"atomic"``, where ``dq`` is a zero-filled fp32 buffer the dK/dV kernel adds into)."""
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    BM, BN = tile_shape(D, q.dtype, backward=True)
    shape = dict(H=H, N_Q=N_Q, D=D, D_PAD=padded_head_dim(D))
    more = dict(N_K=N_K, GROUP=H // H_KV, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=causal,
                DOT_PRECISION=_dot_precision(q.dtype))

    def strides(**tensors):
        return {f"stride_{n}{ax}": s for n, t in tensors.items() for ax, s in zip("bhn", _strides(t))}

    atomic = dq_method == "atomic"
    launches = [
        Launch(tiled_attention_bwd_delta_kernel, (cdiv(N_Q, BM), B * H),
               dict(O=o, DO=do, DELTA=delta, **strides(o=o, do=do), **shape, BLOCK_M=BM),
               num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        Launch(tiled_attention_bwd_dkdv_kernel, (cdiv(N_K, BN), B * H_KV),
               dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DK=dk, DV=dv, DQ_ACC=dq if atomic else None,
                    scale=scale, **strides(q=q, k=k, v=v, do=do, dk=dk, dv=dv, dq=dq if atomic else None),
                    **shape, **more, ATOMIC_DQ=atomic),
               num_warps=NUM_WARPS, num_stages=NUM_STAGES),
    ]
    if not atomic:
        launches.append(Launch(
            tiled_attention_bwd_dq_kernel, (cdiv(N_Q, BM), B * H),
            dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DQ=dq, scale=scale,
                 **strides(q=q, k=k, v=v, do=do, dq=dq), **shape, **more),
            num_warps=NUM_WARPS, num_stages=NUM_STAGES))
    return launches


# --------------------------------------------------------------------------------------------------
# The public entry point and its autograd wrapper
# --------------------------------------------------------------------------------------------------

def _row_stats(q: torch.Tensor) -> torch.Tensor:
    """An fp32 ``[B, Hq, Nq]`` buffer, one value per query row (L or delta)."""
    return torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)


def _forward(q, k, v, causal: bool, scale: float, store_lse: bool, dq_method: str):
    """O, and the fp32 row log-sum-exp L [B, Hq, Nq] when ``store_lse`` (None otherwise):
    what the custom op and the eager path both run. ``dq_method`` is the backward's, carried here so
    the autograd formula sees it among the inputs."""
    o = new_output(q)
    lse = _row_stats(q) if store_lse else None
    for launch in forward_plan(q, k, v, o, lse, causal=causal, scale=scale):
        launch.run()
    return o, lse


def _forward_op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, store_lse: bool,
                dq_method: str) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _forward(q, k, v, causal, scale, store_lse, dq_method)
    return o, (lse if lse is not None else q.new_empty(0, dtype=torch.float32))  # an op returns tensors


def _forward_fake(q, k, v, causal, scale, store_lse, dq_method):
    return ops.empty_output(q), q.new_empty(q.shape[:3] if store_lse else (0,), dtype=torch.float32)


def _backward(do, q, k, v, o, lse, causal: bool, scale: float, dq_method: str):
    """The backward: recompute P tile by tile from the saved O and L (``backward_plan``)."""
    do = ops.maybe_contiguous(do)  # e.g. the broadcast gradient of o.sum(): the kernels need unit stride
    delta = _row_stats(q)
    dk, dv = new_output(k), new_output(v)
    atomic = dq_method == "atomic"
    # Atomics need a zeroed fp32 buffer to add into; for fp32 inputs that buffer is dQ itself.
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else new_output(q)
    for launch in backward_plan(q, k, v, o, do, lse, delta, dq, dk, dv, causal=causal, scale=scale,
                                dq_method=dq_method):
        launch.run()
    if atomic and q.dtype != torch.float32:
        dq = dq.to(q.dtype)
    return dq, dk, dv


def _backward_op_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float,
                 dq_method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, causal, scale, dq_method)


def _backward_fake(do, q, k, v, o, lse, causal, scale, dq_method):
    return ops.empty_output(q), ops.empty_output(k), ops.empty_output(v)


def _setup_context(ctx, inputs, output) -> None:
    """The forward saves O and L, not P (the backward recomputes P from them)."""
    q, k, v, causal, scale, store_lse, dq_method = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.mark_non_differentiable(lse)
    ctx.args = (causal, scale, dq_method)


def _grad(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if lse.numel() == 0 and q.numel():
        raise RuntimeError("attention_lab::b_forward ran with store_lse=False, so it kept no row log-sum-exp for "
                           "the backward to rebuild P from: call it with store_lse=True when gradients are wanted")
    backward = _backward_op if ops.traced(do, q) else _backward
    dq, dk, dv = backward(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


#: the custom ops (stages/ops.py): ``torch.ops.attention_lab.b_forward`` and ``b_backward``
_forward_op = ops.define("b_forward", _forward_op_impl, _forward_fake, setup_context=_setup_context, backward=_grad)
_backward_op = ops.define("b_backward", _backward_op_impl, _backward_fake)
#: the eager path's autograd node: the same forward, saved tensors and backward as the op's
_TiledAttention = ops.autograd_function("StageBAttention", _forward, _setup_context, _grad)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None, dq_method: str = "separate") -> torch.Tensor:
    """Fused tiled attention with online softmax. Returns O ``[B, Hq, Nq, D]``, differentiable.

    ``dq_method`` picks how the backward pass gets dQ: ``"separate"`` (a kernel of its own,
    deterministic) or ``"atomic"`` (added by the dK/dV kernel with fp32 atomics: fewer FLOPs, not
    bitwise reproducible). When no input requires a gradient, only the forward kernel runs and the
    row log-sum-exp is not written. Traced (``torch.compile``) the call is the custom op
    ``torch.ops.attention_lab.b_forward``; eager, the same implementation without the dispatcher.
    """
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    _check_dq_method(dq_method)
    store_lse = ops.needs_grad(q, k, v)
    if ops.traced(q, k, v):
        return _forward_op(q, k, v, causal, scale, store_lse, dq_method)[0]
    if store_lse:
        return _TiledAttention.apply(q, k, v, causal, scale, True, dq_method)[0]
    return _forward(q, k, v, causal, scale, False, dq_method)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                       sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with its row log-sum-exp: (O, lse), lse fp32 ``[B, Hq, Nq]`` in natural log of the
    scaled scores, +inf for a row that sees no key. No autograd: what a caller that merges blocks by
    their log-sum-exp needs (split-KV, ring attention), and what :func:`attention_backward` takes."""
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    return _forward(q, k, v, causal, scale, True, "separate")


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, *, causal: bool, scale: float,
                       dq_method: str = "separate") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention whose softmax is normalized by ``lse`` (natural log, as
    :func:`attention_with_lse` returns it) with output ``o``: any O and L, not only this call's own,
    which is what lets ring attention take one block's exact share of the gradient."""
    # A gradient, an output and a log-sum-exp may come in any layout: made contiguous where the kernels need it.
    do, o = (ops.maybe_contiguous(t) if isinstance(t, torch.Tensor) else t for t in (do, o))
    lse = lse.contiguous() if isinstance(lse, torch.Tensor) else lse
    validate_backward_inputs(do, q, k, v, o, lse, scale, causal=causal)
    _check_dq_method(dq_method)
    return _backward(do, q, k, v, o, lse, causal, float(scale), dq_method)


@compiles_without_interpreter
def compile(problem: Problem, arch: int, *, backward: bool = False,
            dq_method: str | None = None) -> list[CompiledKernel]:
    """Compile the forward kernel for ``problem`` on an sm_``arch`` GPU without one; with
    ``backward=True`` or a ``dq_method`` also the backward kernels that method launches."""
    if dq_method is not None:
        _check_dq_method(dq_method)
    dtype, p = DTYPES[problem.dtype], problem

    def meta(*shape, dt=dtype):  # storage-free stand-ins: shapes, strides and dtype, no memory
        return torch.empty(shape, dtype=dt, device="meta")

    q, o, do = (meta(p.B, p.H, p.N, p.D) for _ in range(3))
    k, v = (meta(p.B, p.Hkv, p.Nk, p.D) for _ in range(2))
    scale = p.D ** -0.5
    launches = forward_plan(q, k, v, o, None, causal=p.causal, scale=scale)
    if backward or dq_method is not None:
        method = dq_method or "separate"
        lse, delta = meta(p.B, p.H, p.N, dt=torch.float32), meta(p.B, p.H, p.N, dt=torch.float32)
        dq = meta(p.B, p.H, p.N, p.D, dt=torch.float32) if method == "atomic" else meta(p.B, p.H, p.N, p.D)
        launches += backward_plan(q, k, v, o, do, lse, delta, dq, meta(*k.shape), meta(*v.shape),
                                  causal=p.causal, scale=scale, dq_method=method)
    return [launch.compile(arch) for launch in launches]


# --------------------------------------------------------------------------------------------------
# Models (derived in README.md). Bytes count the real head dim D: a masked-off padding column is
# not requested from memory at all, and rows are contiguous, so no 32-byte sector is half used.
# --------------------------------------------------------------------------------------------------

def hbm_bytes(p: Problem, *, dq_method: str = "separate", write_lse: bool = False) -> HbmTraffic:
    """Bytes requested from device memory by one forward call (no cache assumed).

    Q: each row read once.  K and V: every (query head, Q tile) program walks all Nk rows of its
    group's K/V head, so each K/V head is read ⌈Nq/BLOCK_M⌉ times *per query head of its group*
    (causal too: stage B visits the tiles above the diagonal as well).  O: written once. Per query
    head, reads = D·e·(Nq + 2·⌈Nq/BLOCK_M⌉·Nk): the N²·D/BLOCK_M term of FlashAttention's IO analysis (Dao et al. 2022, Theorem 2)
    (BLOCK_M from :func:`tile_shape`: 64, or 32 for fp32).
    ``write_lse`` adds L (4 bytes per query row), written only when a backward pass will follow.
    ``dq_method`` is accepted (and checked) like ``attention``'s; it changes only the backward.
    In practice one head's K and V (2·Nk·D·e, 4 MB at N = 16384, D = 64) stay in the 50+ MB L2 of a
    modern data-center GPU while neighbouring programs re-read them, so the DRAM measurement lands
    far below this model: see README.md.
    """
    _check_dq_method(dq_method)
    row = p.D * p.element_bytes
    BM, _ = tile_shape(p.D, p.dtype)
    read = p.heads * row * (p.N + 2 * cdiv(p.N, BM) * p.Nk)
    write = p.heads * p.N * (row + (STAT_BYTES if write_lse else 0))
    return HbmTraffic(read=read, write=write)


def bwd_hbm_bytes(p: Problem, *, dq_method: str = "separate") -> HbmTraffic:
    """Bytes requested from device memory by one backward call, given the saved O and L.

    With e bytes per element, row = D·e, R = B·Hq·Nq query rows, T_k = ⌈Nk/BLOCK_N⌉, T_q = ⌈Nq/BLOCK_M⌉
    (the backward's tiles of :func:`tile_shape`):

    * delta pre-pass: reads O and dO (2·R·row), writes delta (4·R).
    * dK/dV kernel: reads K and V once (2·B·Hkv·Nk·row); each of the T_k programs of a K/V head
      re-reads Q, dO, L and delta of every query head of its group: T_k·R·(2·row + 8).
      Writes dK and dV once (2·B·Hkv·Nk·row).
    * ``"separate"`` dQ kernel: reads Q, dO, L, delta once (R·(2·row + 8)) and, per (query head,
      Q tile), all of its K/V head's K and V (2·B·Hq·T_q·Nk·row); writes dQ (R·row).
    * ``"atomic"``: zero-fills the fp32 dQ buffer (4·R·D written); each of the T_k programs adds its
      share of every query row with atomics, counted as a 4-byte read and a 4-byte write per element
      (T_k·R·4·D each way); for fp16/bf16 a cast reads the buffer and writes dQ (4·R·D + R·row).
    """
    _check_dq_method(dq_method)
    row = p.D * p.element_bytes
    rows_q = p.heads * p.N
    BM, BN = tile_shape(p.D, p.dtype, backward=True)
    kv_tiles = cdiv(p.Nk, BN)
    kv_once = 2 * p.kv_heads * p.Nk * row
    read = 2 * rows_q * row                                          # delta pre-pass
    write = rows_q * STAT_BYTES
    read += kv_once + kv_tiles * rows_q * (2 * row + 2 * STAT_BYTES)  # dK/dV
    write += kv_once
    if dq_method == "separate":
        read += rows_q * (2 * row + 2 * STAT_BYTES) + 2 * p.heads * cdiv(p.N, BM) * p.Nk * row
        write += rows_q * row
    else:
        acc = rows_q * p.D * 4
        write += acc + kv_tiles * acc      # zero fill, then the atomics' writes
        read += kv_tiles * acc             # the atomics' reads
        if p.dtype != "fp32":
            read += acc
            write += rows_q * row
    return HbmTraffic(read=read, write=write)


def workspace_bytes(p: Problem) -> int:
    """No device memory besides the output: S, P, m and l live in registers (forward only, L unwritten)."""
    return 0


def train_workspace_bytes(p: Problem, *, dq_method: str = "separate") -> int:
    """Extra device memory at the peak of a forward + backward step, bytes: L (saved by the forward)
    and delta (4 bytes per query row each), plus for ``"atomic"`` with fp16/bf16 inputs the fp32 dQ
    accumulator (4·D bytes per query row; for fp32 inputs it is dQ itself).

    Not modelled: a gradient dO whose last dim is not contiguous is first copied (the kernels need
    unit stride there); ``o.sum().backward()`` makes such a broadcast dO.
    """
    _check_dq_method(dq_method)
    rows_q = p.heads * p.N
    extra = rows_q * p.D * 4 if dq_method == "atomic" and p.dtype != "fp32" else 0
    return 2 * rows_q * STAT_BYTES + extra
