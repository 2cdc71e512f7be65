"""Stage A: textbook attention, one Triton kernel per line of the formula, forward and backward.

Forward (``attention``)::

    S = scale · Q Kᵀ        naive_scores_kernel   (tiled matmul)    writes S: Nq×Nk per query head
    P = softmax(S)          naive_softmax_kernel  (row softmax)     reads S, writes P: Nq×Nk per head
    O = P V                 naive_pv_kernel       (tiled matmul)    reads P and V, writes O

Backward (``o.backward(dO)``), from the saved P, again one kernel per line::

    dV = Pᵀ dO                      naive_grad_kv_kernel     (sums the query heads of a KV group)
    dP = dO Vᵀ                      naive_scores_kernel      (the same matmul as S = Q Kᵀ)
    dS = P ⊙ (dP − rowsum(P ⊙ dP))  naive_softmax_bwd_kernel (row kernel, like the softmax)
    dQ = scale · dS K               naive_pv_kernel          (the same matmul as O = P V)
    dK = scale · dSᵀ Q              naive_grad_kv_kernel

Nothing here is deliberately slow: the matmuls are tiled and run on tensor cores (``tl.dot``), and
every load is a coalesced tile. What makes stage A slow is *where the intermediates live*: S, P, dP
and dS are written to device memory and read back, O(Nq·Nk) bytes per head, while Q, K, V and O are
only O(N·D). At N = 4096, D = 64 the two forward intermediates are N/(2D) = 32× larger than Q, K, V
and O together.

The contract's generalities cost the kernels only index arithmetic: grouped-query attention reads
KV head ``h // GROUP`` (no copy of K or V), Nq and Nk are separate sizes (S is Nq×Nk), causal masking
is aligned to the bottom right, and any head dim that is a multiple of 8 is handled by tiles of the
next power of two (``D_PAD``) whose extra columns are masked on load and store.

Read top to bottom: the kernels, the launch plans, the autograd function, then the traffic and
workspace models that the harness sets beside Nsight Compute's measurement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import contract, ops
from ..contract import DTYPES, CompiledKernel, HbmTraffic, Problem, cdiv, new_output, padded_head_dim, validate_inputs
from ..launch import Launch, compiles_without_interpreter

# Tiles of the matmuls. 64×64 output tiles with a 32-wide reduction step are a middle-of-the-road
# choice that fits every head dim on every GPU; stage A's cost is dominated by the N² traffic anyway.
SCORE_BLOCK_M, SCORE_BLOCK_N, SCORE_BLOCK_K = 64, 64, 32   # S = Q Kᵀ and dP = dO Vᵀ
PV_BLOCK_M, PV_BLOCK_K = 64, 64                            # O = P V and dQ = dS K
KV_BLOCK_N, KV_BLOCK_M = 64, 64                            # dV = Pᵀ dO and dK = dSᵀ Q
SOFTMAX_BLOCK = 1024  # columns of a row per step of the two row kernels; fixed, so no kernel is compiled per Nk


def _num_warps(d_pad: int) -> int:
    # A [64, D_PAD] fp32 accumulator is 64·D_PAD/(32·warps) registers per thread: at D_PAD = 256
    # four warps would need 128 for the accumulator alone, so the widest tiles get eight.
    return 8 if d_pad > 128 else 4


# --------------------------------------------------------------------------------------------------
# Forward kernels
# --------------------------------------------------------------------------------------------------

# The sizes are runtime values (no kernel per sequence length). The N×N buffers' rows are ROW_STRIDE
# elements apart, Nk rounded up to 16 (``row_stride``), so that stride keeps Triton's divisibility-by-16
# fact (16-byte vector loads of S and P rows) at every Nk.
@triton.jit(do_not_specialize=["N_Q", "N_K"])
def naive_scores_kernel(
    Q, K, S, scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    H, GROUP, N_Q, N_K, ROW_STRIDE,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """S[bh, m, n] = scale · Σ_d Q[b, h, m, d] · K[b, h // GROUP, n, d]: a tiled matmul, one output
    tile per program. S is [B·H, N_Q, N_K], rows ROW_STRIDE elements apart. (The backward reuses it for dP = dO Vᵀ.)"""
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    h_kv = h // GROUP  # grouped-query attention: the query heads of a group share one K/V head
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The reduction runs over the head dim in BLOCK_K steps. D need not be a multiple of BLOCK_K
    # (D = 80 with BLOCK_K = 32, or D = 8 with the smallest dot width 16): the columns past D load
    # as zeros and add nothing to the sum.
    for d0 in range(0, D, BLOCK_K):
        ds = d0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_base + rows[:, None] * stride_qn + ds[None, :],
                    mask=(rows[:, None] < N_Q) & (ds[None, :] < D), other=0.0)
        k = tl.load(k_base + cols[:, None] * stride_kn + ds[None, :],
                    mask=(cols[:, None] < N_K) & (ds[None, :] < D), other=0.0)
        acc = tl.dot(q, tl.trans(k), acc, input_precision=DOT_PRECISION)

    # S is stored in the input dtype, as PyTorch's eager `q @ k.transpose(-2, -1)` would store it.
    # (So in fp16 a score beyond ±65504 becomes ±inf, exactly as it does in PyTorch.)
    s_ptrs = S + bh.to(tl.int64) * N_Q * ROW_STRIDE + rows[:, None].to(tl.int64) * ROW_STRIDE + cols[None, :]
    tl.store(s_ptrs, (acc * scale).to(S.dtype.element_ty), mask=(rows[:, None] < N_Q) & (cols[None, :] < N_K))


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def naive_softmax_kernel(S, P, N_Q, N_K, ROW_STRIDE, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """P[bh, m, :] = softmax(S[bh, m, :]), one row per program. Causal (bottom-right aligned): row m
    sees column n iff n <= m + N_K - N_Q; every other entry of P is written as 0.

    A row can be longer than one block of registers (N_K = 16384 and beyond), so the kernel walks it
    in chunks, twice: pass 1 finds the row max and the sum of exp(s - max) *online* (when a chunk
    raises the max, the sum so far is rescaled by exp(m_old - m_new)); pass 2 re-reads S and writes
    P = exp(s - max) / sum. The online max/sum of pass 1 is the very recurrence stage B uses to keep
    S off the device memory altogether.

    -inf is a legitimate score (masked, or an fp16 score that overflowed), so a lane's running max
    can be -inf, and -inf - (-inf) is NaN: every exponential taken against a max that may be -inf
    is guarded. A row whose max stays -inf (it sees no key, or every key it sees scored -inf) gets
    P = 0, hence O = 0. +inf scores are not guarded: inf - inf is NaN, as in PyTorch's softmax.
    """
    row = tl.program_id(0)  # flattened (bh, m)
    m_idx = row % N_Q
    last_visible = m_idx + N_K - N_Q  # the bottom-right causal diagonal; < 0: the row sees no key
    base = row.to(tl.int64) * ROW_STRIDE
    NEG_INF: tl.constexpr = float("-inf")
    m = tl.full((BLOCK,), NEG_INF, tl.float32)  # per-lane running max, merged at the end
    l = tl.zeros((BLOCK,), tl.float32)          # per-lane running sum of exp(s - m)
    for n0 in range(0, N_K, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        valid = cols < N_K
        if CAUSAL:
            valid = valid & (cols <= last_visible)
        s = tl.load(S + base + cols, mask=valid, other=NEG_INF).to(tl.float32)
        m_new = tl.maximum(m, s)
        # While a lane's max is -inf, everything it has seen is -inf and it holds no mass (l = 0).
        # Exponentials against that max would be exp(-inf - -inf) = NaN, so they are taken against a
        # finite stand-in, 0, instead: exp(-inf - 0) = 0 is exactly the "no mass" they should add.
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.exp(s - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    # Same guard for the row: a row whose max is -inf (no key visible, or all it sees scored -inf)
    # has row_sum = 0; max 0 and sum 1 make every P below exp(-inf - 0) / 1 = 0, with no 0 / 0.
    empty_row = row_max == NEG_INF
    row_max = tl.where(empty_row, 0.0, row_max)
    row_sum = tl.sum(l * tl.exp(m - row_max), axis=0)
    row_sum = tl.where(empty_row, 1.0, row_sum)
    for n0 in range(0, N_K, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        valid = cols < N_K
        if CAUSAL:
            valid = valid & (cols <= last_visible)
        s = tl.load(S + base + cols, mask=valid, other=NEG_INF).to(tl.float32)
        p = tl.where(valid, tl.exp(s - row_max) / row_sum, 0.0)
        tl.store(P + base + cols, p.to(P.dtype.element_ty), mask=cols < N_K)


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def naive_pv_kernel(
    P, V, O, scale,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, GROUP, N_Q, N_K, ROW_STRIDE,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """O[b, h, m, :] = scale · Σ_n P[bh, m, n] · V[b, h // GROUP, n, :]: a tiled matmul over the
    N_Q×N_K matrix P (scale is 1 in the forward; the backward reuses it for dQ = scale · dS K).

    The output tile is D_PAD wide (a power of two, as ``tl.arange`` needs); columns past D are
    masked on load (zeros) and on store, so no padded copy of V or O ever exists."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    h_kv = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D_PAD)
    p_base = P + bh.to(tl.int64) * N_Q * ROW_STRIDE
    v_base = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh

    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    for n0 in range(0, N_K, BLOCK_K):
        ns = n0 + tl.arange(0, BLOCK_K)
        p = tl.load(p_base + rows[:, None].to(tl.int64) * ROW_STRIDE + ns[None, :],
                    mask=(rows[:, None] < N_Q) & (ns[None, :] < N_K), other=0.0)
        v = tl.load(v_base + ns[:, None] * stride_vn + ds[None, :],
                    mask=(ns[:, None] < N_K) & (ds[None, :] < D), other=0.0)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)

    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on + ds[None, :]
    tl.store(o_ptrs, (acc * scale).to(O.dtype.element_ty), mask=(rows[:, None] < N_Q) & (ds[None, :] < D))


# --------------------------------------------------------------------------------------------------
# Backward kernels (the two matmuls of the forward are reused: dP = dO Vᵀ and dQ = scale · dS K)
# --------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N_Q", "N_K"])
def naive_grad_kv_kernel(
    A, Y, OUT, scale,
    stride_yb, stride_yh, stride_ym,
    stride_ob, stride_oh, stride_on,
    H, H_KV, GROUP, N_Q, N_K, ROW_STRIDE,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """OUT[b, g, n, :] = scale · Σ_{h in group g} Σ_m A[b·H + h, m, n] · Y[b, h, m, :].

    A transposed matmul (Aᵀ Y) whose sum also runs over the GROUP query heads that share KV head g:
    dV = Pᵀ dO (A = P, Y = dO, scale 1) and dK = scale · dSᵀ Q (A = dS, Y = Q). Summing inside the
    kernel is what grouped-query attention's gradient is: each K/V row was read by GROUP query heads,
    so it collects GROUP contributions, and no per-query-head copy of dK or dV is ever made."""
    pid_n, bg = tl.program_id(0), tl.program_id(1)
    b, g = bg // H_KV, bg % H_KV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # key rows n of this output tile
    ds = tl.arange(0, D_PAD)

    acc = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    for i in range(0, GROUP):
        h = g * GROUP + i
        a_base = A + (b * H + h).to(tl.int64) * N_Q * ROW_STRIDE
        y_base = Y + b.to(tl.int64) * stride_yb + h.to(tl.int64) * stride_yh
        for m0 in range(0, N_Q, BLOCK_M):
            ms = m0 + tl.arange(0, BLOCK_M)
            # Load A's [BLOCK_M, BLOCK_N] tile along its rows (coalesced) and transpose it on chip.
            a = tl.load(a_base + ms[:, None].to(tl.int64) * ROW_STRIDE + cols[None, :],
                        mask=(ms[:, None] < N_Q) & (cols[None, :] < N_K), other=0.0)
            y = tl.load(y_base + ms[:, None] * stride_ym + ds[None, :],
                        mask=(ms[:, None] < N_Q) & (ds[None, :] < D), other=0.0)
            acc = tl.dot(tl.trans(a), y, acc, input_precision=DOT_PRECISION)

    out_ptrs = OUT + b.to(tl.int64) * stride_ob + g.to(tl.int64) * stride_oh + cols[:, None] * stride_on + ds[None, :]
    tl.store(out_ptrs, (acc * scale).to(OUT.dtype.element_ty), mask=(cols[:, None] < N_K) & (ds[None, :] < D))


@triton.jit(do_not_specialize=["N_K"])
def naive_softmax_bwd_kernel(P, DP, DS, N_K, ROW_STRIDE, BLOCK: tl.constexpr):
    """dS[bh, m, :] = P[bh, m, :] ⊙ (dP[bh, m, :] − delta_m), with delta_m = Σ_n P[bh, m, n] · dP[bh, m, n].

    The softmax's backward, one row per program like the forward softmax, and in two passes like it:
    pass 1 sums delta along the row, pass 2 writes dS. This is the textbook form (PyTorch's softmax
    backward): delta comes from the stored P and dP themselves, so where the softmax cannot move
    (a row with a single visible key: P = 1, delta = dP) dS is exactly 0. Stages B and C, which never
    hold a row of P, use the equal dO · O instead. Masked (causal) entries of P are 0, so their dS is
    0 without a mask here; a row that saw no key has P = 0 and gets dS = 0."""
    row = tl.program_id(0)  # flattened (bh, m)
    base = row.to(tl.int64) * ROW_STRIDE
    delta_lanes = tl.zeros((BLOCK,), tl.float32)
    for n0 in range(0, N_K, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        p = tl.load(P + base + cols, mask=cols < N_K, other=0.0).to(tl.float32)
        dp = tl.load(DP + base + cols, mask=cols < N_K, other=0.0).to(tl.float32)
        delta_lanes += p * dp
    delta = tl.sum(delta_lanes, axis=0)
    for n0 in range(0, N_K, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        p = tl.load(P + base + cols, mask=cols < N_K, other=0.0).to(tl.float32)
        dp = tl.load(DP + base + cols, mask=cols < N_K, other=0.0).to(tl.float32)
        tl.store(DS + base + cols, (p * (dp - delta)).to(DS.dtype.element_ty), mask=cols < N_K)


# --------------------------------------------------------------------------------------------------
# Launch plans: the kernels of one call, written down so they can be run (attention) or compiled
# for a GPU that is not here (compile).
# --------------------------------------------------------------------------------------------------

def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products ("ieee"), not TF32, so fp32 means fp32 accuracy. fp16/bf16 dots
    # always run on tensor cores with fp32 accumulation; the flag does not apply to them.
    return "ieee" if dtype == torch.float32 else "tf32"


def _scores_launch(q, k, s, scale: float) -> Launch:
    """S = scale · q kᵀ into the [B·Hq, Nq, Nk] buffer s (q: [B, Hq, Nq, D], k: [B, Hkv, Nk, D])."""
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    return Launch(
        naive_scores_kernel, (cdiv(N_Q, SCORE_BLOCK_M), cdiv(N_K, SCORE_BLOCK_N), B * H),
        dict(Q=q, K=k, S=s, scale=scale,
             stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qn=q.stride(2),
             stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
             H=H, GROUP=H // H_KV, N_Q=N_Q, N_K=N_K, ROW_STRIDE=s.stride(1), D=D,
             BLOCK_M=SCORE_BLOCK_M, BLOCK_N=SCORE_BLOCK_N, BLOCK_K=min(SCORE_BLOCK_K, padded_head_dim(D)),
             DOT_PRECISION=_dot_precision(q.dtype)),
        num_warps=4)


def _pv_launch(p, v, o, scale: float) -> Launch:
    """o = scale · p v (p: [B·Hq, Nq, Nk], v: [B, Hkv, Nk, D], o: [B, Hq, Nq, D])."""
    B, H, N_Q, D = o.shape
    H_KV, N_K = v.shape[1], v.shape[2]
    d_pad = padded_head_dim(D)
    return Launch(
        naive_pv_kernel, (cdiv(N_Q, PV_BLOCK_M), B * H),
        dict(P=p, V=v, O=o, scale=scale,
             stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2),
             stride_ob=o.stride(0), stride_oh=o.stride(1), stride_on=o.stride(2),
             H=H, GROUP=H // H_KV, N_Q=N_Q, N_K=N_K, ROW_STRIDE=p.stride(1), D=D, D_PAD=d_pad, BLOCK_M=PV_BLOCK_M,
             BLOCK_K=PV_BLOCK_K,
             DOT_PRECISION=_dot_precision(v.dtype)),
        num_warps=_num_warps(d_pad))


def _grad_kv_launch(a, y, out, scale: float) -> Launch:
    """out = scale · aᵀ y summed over each KV head's query group (a: [B·Hq, Nq, Nk], y: [B, Hq, Nq, D],
    out: [B, Hkv, Nk, D])."""
    B, H, N_Q, D = y.shape
    H_KV, N_K = out.shape[1], out.shape[2]
    d_pad = padded_head_dim(D)
    return Launch(
        naive_grad_kv_kernel, (cdiv(N_K, KV_BLOCK_N), B * H_KV),
        dict(A=a, Y=y, OUT=out, scale=scale,
             stride_yb=y.stride(0), stride_yh=y.stride(1), stride_ym=y.stride(2),
             stride_ob=out.stride(0), stride_oh=out.stride(1), stride_on=out.stride(2),
             H=H, H_KV=H_KV, GROUP=H // H_KV, N_Q=N_Q, N_K=N_K, ROW_STRIDE=a.stride(1), D=D, D_PAD=d_pad,
             BLOCK_N=KV_BLOCK_N, BLOCK_M=KV_BLOCK_M, DOT_PRECISION=_dot_precision(y.dtype)),
        num_warps=_num_warps(d_pad))


def row_stride(n_k: int) -> int:
    """Elements from one row of an N×N buffer (S, P, dP, dS) to the next: Nk rounded up to 16, so
    every row starts 32-byte aligned (fp16: 16-byte vector loads) whatever Nk is, and the kernels
    need no variant per Nk. At most 15 unused elements per row."""
    return cdiv(n_k, 16) * 16


def nn_buffer(B_H: int, n_q: int, n_k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A [B·Hq, Nq, Nk] buffer for S, P, dP or dS with rows :func:`row_stride` elements apart."""
    return torch.empty((B_H, n_q, row_stride(n_k)), dtype=dtype, device=device)[..., :n_k]


def forward_plan(q, k, v, s, p, o, *, causal: bool, scale: float) -> list[Launch]:
    """The three forward launches, in order (s and p are the caller's [B·Hq, Nq, Nk] buffers,
    :func:`nn_buffer`)."""
    B, H, N_Q, _ = q.shape
    N_K = k.shape[2]
    softmax = Launch(naive_softmax_kernel, (B * H * N_Q,),
                     dict(S=s, P=p, N_Q=N_Q, N_K=N_K, ROW_STRIDE=s.stride(1), CAUSAL=causal, BLOCK=SOFTMAX_BLOCK),
                     num_warps=4)
    return [_scores_launch(q, k, s, scale), softmax, _pv_launch(p, v, o, 1.0)]


def backward_plan(q, k, v, p, do, dp, ds, dq, dk, dv, *, scale: float) -> list[Launch]:
    """The five backward launches, in order: dV, dP, dS, dQ, dK (dp and ds: [B·Hq, Nq, Nk] buffers)."""
    B, H, N_Q, _ = q.shape
    N_K = k.shape[2]
    softmax_bwd = Launch(naive_softmax_bwd_kernel, (B * H * N_Q,),
                         dict(P=p, DP=dp, DS=ds, N_K=N_K, ROW_STRIDE=p.stride(1), BLOCK=SOFTMAX_BLOCK), num_warps=4)
    return [
        _grad_kv_launch(p, do, dv, 1.0),     # dV = Pᵀ dO
        _scores_launch(do, v, dp, 1.0),      # dP = dO Vᵀ
        softmax_bwd,                         # dS = P ⊙ (dP − delta)
        _pv_launch(ds, k, dq, scale),        # dQ = scale · dS K
        _grad_kv_launch(ds, q, dk, scale),   # dK = scale · dSᵀ Q
    ]


# --------------------------------------------------------------------------------------------------
# The differentiable call
# --------------------------------------------------------------------------------------------------

def _new_gradient(like: torch.Tensor) -> torch.Tensor:
    """A contiguous gradient buffer shaped like ``like`` (NaN-filled when the tests poison outputs,
    so an element the backward forgets to write is caught)."""
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if contract.poison_outputs:
        out.fill_(float("nan"))
    return out


def _forward(q, k, v, causal: bool, scale: float):
    """O and P: three kernels, P kept (what the custom op and the eager path both run)."""
    B, H, N_Q, _ = q.shape
    N_K = k.shape[2]
    # The two N_Q×N_K intermediates: this is the allocation that runs out of memory at large N.
    s = nn_buffer(B * H, N_Q, N_K, q.dtype, q.device)
    p = nn_buffer(B * H, N_Q, N_K, q.dtype, q.device)
    o = new_output(q)
    for launch in forward_plan(q, k, v, s, p, o, causal=causal, scale=scale):
        launch.run()
    # S dies here; P stays alive until the backward: N_Q·N_K elements per query head held for the
    # whole time between the forward and the backward of a training step.
    return o, p


def _forward_op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, scale)


def _forward_fake(q, k, v, causal, scale):
    B, H, N_Q, _ = q.shape
    return ops.empty_output(q), nn_buffer(B * H, N_Q, k.shape[2], q.dtype, q.device)


def _backward(do, q, k, v, p, scale: float):
    """Five kernels from the saved P, with dP and dS materialized as [B·Hq, Nq, Nk] buffers, the
    textbook way autograd would run it."""
    do = ops.maybe_contiguous(do)  # the kernels address the head dim as contiguous (e.g. an expanded dO)
    dp = nn_buffer(*p.shape, p.dtype, p.device)  # the backward's own two N_Q×N_K buffers
    ds = nn_buffer(*p.shape, p.dtype, p.device)
    dq, dk, dv = _new_gradient(q), _new_gradient(k), _new_gradient(v)
    for launch in backward_plan(q, k, v, p, do, dp, ds, dq, dk, dv, scale=scale):
        launch.run()
    return dq, dk, dv


def _backward_op_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, p, scale)


def _backward_fake(do, q, k, v, p, scale):
    return ops.empty_output(q), ops.empty_output(k), ops.empty_output(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    _, p = output
    ctx.save_for_backward(q, k, v, p)
    ctx.mark_non_differentiable(p)
    ctx.scale = scale


def _grad(ctx, do, dp):
    q, k, v, p = ctx.saved_tensors
    backward = _backward_op if ops.traced(do, q) else _backward
    dq, dk, dv = backward(do, q, k, v, p, ctx.scale)
    return dq, dk, dv, None, None


#: the custom ops (stages/ops.py): ``torch.ops.attention_lab.a_forward`` and ``a_backward``
_forward_op = ops.define("a_forward", _forward_op_impl, _forward_fake, setup_context=_setup_context, backward=_grad)
_backward_op = ops.define("a_backward", _backward_op_impl, _backward_fake)
#: the eager path's autograd node: the same forward, saved P and backward as the op's
NaiveAttention = ops.autograd_function("NaiveAttention", _forward, _setup_context, _grad)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None) -> torch.Tensor:
    """Textbook attention: S and P materialized in device memory. q [B, Hq, Nq, D], k and v
    [B, Hkv, Nk, D]; returns O [B, Hq, Nq, D], differentiable through stage A's backward kernels.
    Traced (``torch.compile``) the call is the custom op ``torch.ops.attention_lab.a_forward``; eager,
    the same implementation without the dispatcher."""
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    if ops.traced(q, k, v):
        return _forward_op(q, k, v, causal, scale)[0]
    if ops.needs_grad(q, k, v):
        return NaiveAttention.apply(q, k, v, causal, scale)[0]
    return _forward(q, k, v, causal, scale)[0]


@compiles_without_interpreter
def compile(problem: Problem, arch: int, *, backward: bool = False) -> list[CompiledKernel]:
    """Compile the forward's three kernels for ``problem`` on an sm_``arch`` GPU (no GPU needed);
    ``backward=True``: the backward's five launches instead (dV, dP, dS, dQ, dK)."""
    dtype = DTYPES[problem.dtype]

    def meta(*shape):
        return torch.empty(shape, dtype=dtype, device="meta")

    q = meta(problem.B, problem.H, problem.N, problem.D)
    k = meta(problem.B, problem.Hkv, problem.Nk, problem.D)
    nn = nn_buffer(problem.heads, problem.N, problem.Nk, dtype, "meta")
    scale = problem.D ** -0.5
    if backward:
        launches = backward_plan(q, k, k, nn, q, nn, nn, q, k, k, scale=scale)
    else:
        launches = forward_plan(q, k, k, nn, nn, q, causal=problem.causal, scale=scale)
    return [launch.compile(arch) for launch in launches]


# --------------------------------------------------------------------------------------------------
# Models (derivation in README.md). e = bytes per element; per query head unless said otherwise.
# We count what the kernels *request*: masked lanes issue no load, so the padded columns past D and
# the causal entries the softmax skips cost nothing; re-reads of a K/V head by the query heads of
# its group are counted once per query head (the L2 cache usually serves all but the first).
# --------------------------------------------------------------------------------------------------

def _matmul_reads(p: Problem) -> tuple[int, int]:
    """Bytes one pass of the scores-shaped matmul (S = Q Kᵀ, dP = dO Vᵀ) requests of its two operands:
    the [Nq, D] operand once per 64-column tile, the [Nk, D] operand once per 64-row tile, per query head."""
    e = p.element_bytes
    rows_operand = p.heads * p.N * p.D * e * cdiv(p.Nk, SCORE_BLOCK_N)
    cols_operand = p.heads * p.Nk * p.D * e * cdiv(p.N, SCORE_BLOCK_M)
    return rows_operand, cols_operand


def hbm_bytes(p: Problem) -> HbmTraffic:
    """Bytes the three forward kernels request from device memory for one call (no cache assumed).

    scores:  each 64×64 S tile reads a 64×D slice of Q and of K: Q is read ⌈Nk/64⌉ times, K (its
             KV head, once per query head) ⌈Nq/64⌉ times; writes S once (Nq·Nk·e).
    softmax: reads the visible entries of S twice (pass 1 for max/sum, pass 2 to write P) and
             writes all of P once. The second read of a row is normally an L2 hit.
    PV:      each 64-row O tile reads its 64×Nk slice of P and all of V: P once, V ⌈Nq/64⌉ times;
             writes O once.
    """
    e, BH = p.element_bytes, p.heads
    nn = BH * p.N * p.Nk * e
    visible = BH * p.pairs * e
    q_reads, k_reads = _matmul_reads(p)
    v_reads = BH * p.Nk * p.D * e * cdiv(p.N, PV_BLOCK_M)
    read = q_reads + k_reads + 2 * visible + nn + v_reads
    write = nn + nn + p.q_bytes
    return HbmTraffic(read=read, write=write)


def bwd_hbm_bytes(p: Problem) -> HbmTraffic:
    """Bytes the five backward kernels request for one call, given the saved P (no cache assumed).

    dV = Pᵀ dO:   P once; dO once per 64-row tile of dV (⌈Nk/64⌉ times); writes dV.
    dP = dO Vᵀ:   as the scores kernel: dO ⌈Nk/64⌉ times, V ⌈Nq/64⌉ times; writes dP.
    dS:           P and dP twice each (pass 1 for delta, pass 2 for dS; the second mostly L2 hits);
                  writes dS.
    dQ = dS K:    as the PV kernel: dS once, K ⌈Nq/64⌉ times; writes dQ.
    dK = dSᵀ Q:   dS once, Q ⌈Nk/64⌉ times; writes dK.
    """
    e, BH = p.element_bytes, p.heads
    nn = BH * p.N * p.Nk * e
    by_kv_tile = p.q_bytes * cdiv(p.Nk, KV_BLOCK_N)        # dO (for dV) or Q (for dK), per 64 key rows
    by_q_tile = BH * p.Nk * p.D * e * cdiv(p.N, PV_BLOCK_M)  # K for dQ, per 64 query rows
    do_reads, v_reads = _matmul_reads(p)
    dv = nn + by_kv_tile
    dp = do_reads + v_reads
    ds = 4 * nn
    dq = nn + by_q_tile
    dk = nn + by_kv_tile
    read = dv + dp + ds + dq + dk
    write = 2 * nn + p.q_bytes + 2 * p.kv_bytes  # dP and dS; dQ; dK and dV
    return HbmTraffic(read=read, write=write)


def workspace_bytes(p: Problem) -> int:
    """Extra device memory of one forward call besides the output, bytes: S and P, Nq·Nk elements per
    query head each (rows padded to :func:`row_stride`), both alive while the softmax kernel runs (it
    reads S and writes P)."""
    return 2 * p.heads * p.N * row_stride(p.Nk) * p.element_bytes


def train_workspace_bytes(p: Problem) -> int:
    """Extra device memory at the peak of one training step (forward + backward), bytes, besides
    q, k, v, o, dO and the three gradients: the saved P plus the backward's dP and dS, all three
    Nq·Nk per query head and alive together while the dS kernel runs (the forward's peak, S + P, is
    lower; rows padded to :func:`row_stride`)."""
    return 3 * p.heads * p.N * row_stride(p.Nk) * p.element_bytes
