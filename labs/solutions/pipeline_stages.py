"""Lab 3, solution: choose ``num_stages`` and predict the ``cp.async`` instructions in the PTX, then check.

With ``num_stages = 1`` every K/V load of the loop below is a plain ``ld.global``: the warps wait for
device memory, then compute. With ``num_stages = s > 1`` Triton software-pipelines the loop: it copies
the K and V tiles of later iterations straight into shared memory with ``cp.async`` (no registers on
the way), groups each iteration's copies with ``cp.async.commit_group`` and, before the math needs a
tile, waits with ``cp.async.wait_group n``: "until at most n groups are still in flight". So while
tile j is being computed, the copies of the next tiles are already on their way.

This lab compiles the kernel for an A100 (sm_80) on the CPU: no GPU needed (a few seconds). Your job,
marked ``TODO(lab)``:

1. ``NUM_STAGES``: how many K/V tiles should be in flight or resident at once so that while tile j is
   computed, the copy of tile j+1 is already running (double buffering)?
2. ``predict_ptx_counts(num_stages, block_m, block_n, d)``: how many of each instruction appear in
   the PTX, for any pipeline depth and any tile (``block_m`` query rows, ``block_n`` keys, head dim
   ``d``, each 32, 64 or 128)? Read ``ptx_counts`` for a few values first
   (``python -c "from labs import pipeline_stages as m; print(m.ptx_counts(2, 64, 32, 128))"``),
   find the rule (think in bytes: how much one thread copies per instruction), write it down.

The check asks your prediction for all 108 combinations (4 depths, 27 tiles), compares them with the
counts this Triton version gives (each taken from the compiler when the lab was written), and
compiles its own copy of this kernel for three of them, drawn at random, to count afresh. While your
prediction runs the compiler is off limits: calling ``ptx_counts`` (or the compile helper, Triton's
compiler, or any other process) fails the check, since a count you asked the compiler for is not a
prediction.

    python -m labs check pipeline_stages
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import triton
import triton.language as tl

from labs.compile_helper import compile_ptx, count_instructions

# Two buffers per K/V tile: tile j is read from one while tile j+1 is copied into the other.
NUM_STAGES = 2

#: the instructions the check counts (static occurrences in the PTX text)
COUNTED = ("cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group", "ld.global")

D, BLOCK_M, BLOCK_N = 64, 64, 64


@triton.jit
def attention_kernel(Q, K, V, O, scale, Nk,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + ds[None, :])
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for n0 in range(0, Nk, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * D + ds[None, :])   # the loads the pipeliner turns into cp.async
        v = tl.load(V + cols[:, None] * D + ds[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    tl.store(O + rows[:, None] * D + ds[None, :], (acc / l_i[:, None]).to(tl.float16))


def ptx_counts(num_stages: int, block_m: int = BLOCK_M, block_n: int = BLOCK_N, d: int = D,
               arch: int = 80) -> dict[str, int]:
    """How often each instruction of ``COUNTED`` appears in the kernel's PTX for ``sm_<arch>``
    (fp16 pointers 16-byte aligned, Nk a multiple of 16, 4 warps). A few seconds per call; for
    exploring, not for your prediction."""
    ptx = compile_ptx(__name__, "attention_kernel", num_stages=num_stages, arch=arch,
                      constexprs={"D": d, "BLOCK_M": block_m, "BLOCK_N": block_n})
    return count_instructions(ptx, COUNTED)


def predict_ptx_counts(num_stages: int, block_m: int, block_n: int, d: int) -> dict[str, int]:
    """Your prediction of ``ptx_counts(num_stages, block_m, block_n, d)`` (sm_80), for num_stages
    1 to 4 and block_m, block_n, d each 32, 64 or 128: a formula, not a compile."""
    # Every copy and every vector load moves 16 bytes per thread (8 halves, the widest access; the
    # rows are 16-byte aligned). 128 threads move 2 KB per instruction, so an r x d fp16 tile takes
    # r * d * 2 / 2048 instructions per thread (at least one: the smallest tile here is 2 KB).
    def per_thread(rows: int) -> int:
        return rows * d * 2 // (16 * 4 * 32)

    q, kv = per_thread(block_m), per_thread(block_n)
    if num_stages == 1:
        # No pipelining: Q, K and V all as plain vector loads into registers.
        return {"cp.async.cg.shared.global": 0, "cp.async.commit_group": 0, "cp.async.wait_group": 0,
                "ld.global": q + 2 * kv}
    # The prologue issues the copies of the first num_stages - 1 iterations, the loop body those of
    # one more: num_stages copies of K and of V in the code, each closed by its own commit_group.
    # Inside the loop there is one wait before K is used and one before V is, whatever the depth.
    # Q is loaded once, before the loop, with plain loads.
    return {"cp.async.cg.shared.global": 2 * kv * num_stages, "cp.async.commit_group": 2 * num_stages,
            "cp.async.wait_group": 2, "ld.global": q}
