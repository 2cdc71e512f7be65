"""Stage A: textbook attention, one Triton kernel per line of the formula.

    S = scale · Q Kᵀ        kernel 1 (tiled matmul)      writes S: N×N per head, to HBM
    P = softmax(S)          kernel 2 (row softmax)       reads S, writes P: N×N per head
    O = P V                 kernel 3 (tiled matmul)      reads P and V, writes O

Nothing here is deliberately slow: both matmuls are tiled and run on tensor cores (``tl.dot``), and
every load is a coalesced tile. What makes stage A slow is *where the intermediates live*: S and P
are written to device memory and read back, O(N²) bytes per head, while Q, K, V and O are only
O(N·D). At N = 4096, D = 64 the two N×N matrices are N/(2D) = 32× larger than Q, K, V and O together.

Read top to bottom: the three kernels, then ``attention`` (the launcher), then the traffic and
workspace models that the harness sets beside Nsight Compute's measurement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import DTYPES, CompiledKernel, HbmTraffic, Problem, cdiv, new_output, validate_inputs
from ..launch import Launch, compiles_without_interpreter, meta_inputs

# Tiles of the two matmuls. 64×64 output tiles with a 32-wide reduction step are a middle-of-the-road
# choice that fits every head dim on every GPU; stage A's cost is dominated by the N² traffic anyway.
SCORE_BLOCK_M, SCORE_BLOCK_N, SCORE_BLOCK_K = 64, 64, 32
PV_BLOCK_M, PV_BLOCK_K = 64, 64
SOFTMAX_BLOCK = 1024  # columns of a row processed per step of the row-softmax kernel
NUM_WARPS = 4


@triton.jit
def naive_scores_kernel(
    Q, K, S, scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    H, N,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """S[bh, m, n] = scale · Σ_d Q[b, h, m, d] · K[b, h, n, d]: a tiled matmul, one output tile per program."""
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_K):  # the reduction runs over the head dim
        ds = d0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_base + rows[:, None] * stride_qn + ds[None, :], mask=rows[:, None] < N, other=0.0)
        k = tl.load(k_base + cols[:, None] * stride_kn + ds[None, :], mask=cols[:, None] < N, other=0.0)
        acc = tl.dot(q, tl.trans(k), acc, input_precision=DOT_PRECISION)

    # S is stored in the input dtype, as PyTorch's eager `q @ k.transpose(-2, -1)` would store it.
    s_ptrs = S + bh.to(tl.int64) * N * N + rows[:, None] * N + cols[None, :]
    tl.store(s_ptrs, (acc * scale).to(S.dtype.element_ty), mask=(rows[:, None] < N) & (cols[None, :] < N))


@triton.jit
def naive_softmax_kernel(S, P, N, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """P[bh, m, :] = softmax(S[bh, m, :]), one row per program; causal rows mask columns n > m.

    A row can be longer than one block of registers (N = 16384 and beyond), so the kernel walks it
    in chunks, twice: pass 1 finds the row max m and the sum l of exp(s - m) *online* (when a chunk
    raises the max, the sum so far is rescaled by exp(m_old - m_new)); pass 2 re-reads S and writes
    P = exp(s - m) / l. The online max/sum of pass 1 is the very recurrence stage B uses to keep S
    off the device memory altogether.
    """
    row = tl.program_id(0)  # flattened (bh, m)
    m_idx = row % N
    base = row.to(tl.int64) * N
    m = tl.full((BLOCK,), float("-inf"), tl.float32)  # per-lane running max, merged at the end
    l = tl.zeros((BLOCK,), tl.float32)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        valid = cols < N
        if CAUSAL:
            valid = valid & (cols <= m_idx)
        s = tl.load(S + base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, s)
        # Lanes that have seen only -inf keep l = 0; guard exp(-inf - -inf) = NaN.
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        l = l * alpha + tl.where(valid, tl.exp(s - m_new), 0.0)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(l * tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max)), axis=0)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        valid = cols < N
        if CAUSAL:
            valid = valid & (cols <= m_idx)
        s = tl.load(S + base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.where(valid, tl.exp(s - row_max) / row_sum, 0.0)
        tl.store(P + base + cols, p.to(P.dtype.element_ty), mask=cols < N)


@triton.jit
def naive_pv_kernel(
    P, V, O,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, N,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """O[b, h, m, :] = Σ_n P[bh, m, n] · V[b, h, n, :]: a tiled matmul over the N² matrix P."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D)
    p_base = P + bh.to(tl.int64) * N * N
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh

    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_K):
        ns = n0 + tl.arange(0, BLOCK_K)
        p = tl.load(p_base + rows[:, None] * N + ns[None, :], mask=(rows[:, None] < N) & (ns[None, :] < N), other=0.0)
        v = tl.load(v_base + ns[:, None] * stride_vn + ds[None, :], mask=ns[:, None] < N, other=0.0)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)

    o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on + ds[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=rows[:, None] < N)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products ("ieee"), not TF32, so fp32 means fp32 accuracy. fp16/bf16 dots
    # always run on tensor cores with fp32 accumulation; the flag does not apply to them.
    return "ieee" if dtype == torch.float32 else "tf32"


def plan(q, k, v, s, p, o, *, causal: bool, scale: float) -> list[Launch]:
    """The three launches of one call, in order (S and P are the caller's N×N buffers)."""
    B, H, N, D = q.shape
    precision = _dot_precision(q.dtype)
    scores = Launch(
        naive_scores_kernel, (cdiv(N, SCORE_BLOCK_M), cdiv(N, SCORE_BLOCK_N), B * H),
        dict(Q=q, K=k, S=s, scale=scale,
             stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qn=q.stride(2),
             stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
             H=H, N=N, D=D, BLOCK_M=SCORE_BLOCK_M, BLOCK_N=SCORE_BLOCK_N, BLOCK_K=min(SCORE_BLOCK_K, D),
             DOT_PRECISION=precision),
        num_warps=NUM_WARPS)
    softmax = Launch(
        naive_softmax_kernel, (B * H * N,),
        dict(S=s, P=p, N=N, CAUSAL=causal, BLOCK=min(SOFTMAX_BLOCK, triton.next_power_of_2(N))),
        num_warps=NUM_WARPS)
    pv = Launch(
        naive_pv_kernel, (cdiv(N, PV_BLOCK_M), B * H),
        dict(P=p, V=v, O=o,
             stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2),
             stride_ob=o.stride(0), stride_oh=o.stride(1), stride_on=o.stride(2),
             H=H, N=N, D=D, BLOCK_M=PV_BLOCK_M, BLOCK_K=PV_BLOCK_K, DOT_PRECISION=precision),
        num_warps=NUM_WARPS)
    return [scores, softmax, pv]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None) -> torch.Tensor:
    """Textbook attention: three kernels, S and P materialized in device memory. Returns O [B, H, N, D]."""
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    B, H, N, D = q.shape
    # The two N×N intermediates: this is the allocation that runs out of memory at large N.
    s = torch.empty((B * H, N, N), dtype=q.dtype, device=q.device)
    p = torch.empty_like(s)
    o = new_output(q)
    for launch in plan(q, k, v, s, p, o, causal=causal, scale=scale):
        launch.run()
    return o


@compiles_without_interpreter
def compile(problem: Problem, arch: int) -> list[CompiledKernel]:
    """Compile the three kernels for ``problem`` on an sm_``arch`` GPU (no GPU needed)."""
    q, k, v = meta_inputs(problem.B, problem.H, problem.N, problem.D, DTYPES[problem.dtype])
    nn = torch.empty((problem.heads, problem.N, problem.N), dtype=q.dtype, device="meta")
    launches = plan(q, k, v, nn, nn, torch.empty_like(q), causal=problem.causal, scale=problem.D ** -0.5)
    return [launch.compile(arch) for launch in launches]


# --------------------------------------------------------------------------------------------------
# Models (derivation in README.md). e = bytes per element, BH = B·H heads.
# --------------------------------------------------------------------------------------------------

def hbm_bytes(p: Problem) -> HbmTraffic:
    """Bytes the three kernels request from device memory for one call (no cache assumed).

    scores:  each 64×64 S tile reads a 64×D slice of Q and of K:  Q and K read ⌈N/64⌉ times each;
             writes S once (N² e per head).
    softmax: reads S twice (pass 1 for max/sum, pass 2 to write P) and writes P once. The second
             read of a row (N·e bytes, 32 KB at N = 16384) is normally an L2 hit.
    PV:      each 64-row O tile reads its 64×N slice of P and all of V: P once, V ⌈N/64⌉ times;
             writes O once.
    """
    e, BH, N, D = p.element_bytes, p.heads, p.N, p.D
    nn = BH * N * N * e
    qkv_tile_reads = BH * N * D * e * (cdiv(N, SCORE_BLOCK_N) + cdiv(N, SCORE_BLOCK_M))  # Q per column tile, K per row tile
    v_reads = BH * N * D * e * cdiv(N, PV_BLOCK_M)
    read = qkv_tile_reads + 2 * nn + nn + v_reads
    write = nn + nn + BH * N * D * e
    return HbmTraffic(read=read, write=write)


def workspace_bytes(p: Problem) -> int:
    """Extra device memory of one call besides the output: S and P, N² elements per head each.

    Both are alive together while the softmax kernel runs (it reads S and writes P).
    """
    return 2 * p.heads * p.N * p.N * p.element_bytes
