"""Lab 6, solution: the backward pass's delta pre-pass, delta_i = sum_d dO[i, d] · O[i, d].

The attention backward needs, for every query row, dS = P ∘ (dP − delta) with dP = dO Vᵀ. The row
term delta_i = rowsum(dP ∘ P) equals rowsum(dO ∘ O) (because O = P V), which is cheap to compute
up front from two [N, D] arrays instead of inside the N×N loop. FlashAttention-2 does exactly this as
a separate small kernel before the main backward loop.

Your job, marked ``TODO(lab)``: the kernel body. One program handles ``BLOCK_ROWS`` rows; the head dim
D need not be a power of two (here it is padded to ``D_PAD`` inside the kernel with a mask, never by
copying). Accumulate in float32 whatever the input dtype.

    python -m labs check delta_prepass
"""

from __future__ import annotations

import stages  # noqa: F401  (turns the Triton interpreter on when there is no GPU)
import torch
import triton
import triton.language as tl


@triton.jit
def delta_kernel(O, DO, DELTA, n_rows, stride_o, stride_do, D,
                 D_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, D_PAD)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_do + cols[None, :], mask=mask, other=0.0)
    # Products in float32: in fp16 the D products would each lose bits before the sum.
    tl.store(DELTA + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < n_rows)


def delta(o: torch.Tensor, do: torch.Tensor, block_rows: int = 16) -> torch.Tensor:
    """rowsum(dO ∘ O) over the last dim: float32 [..., N] for o, do [..., N, D] of one dtype."""
    if o.shape != do.shape:
        raise ValueError(f"o and do must have one shape, got {tuple(o.shape)} and {tuple(do.shape)}")
    D = o.shape[-1]
    o2, do2 = o.reshape(-1, D), do.reshape(-1, D)  # a view when the rows are evenly strided
    n_rows = o2.shape[0]
    out = torch.empty(n_rows, dtype=torch.float32, device=o.device)
    d_pad = max(16, triton.next_power_of_2(D))
    delta_kernel[(triton.cdiv(n_rows, block_rows),)](o2, do2, out, n_rows, o2.stride(0), do2.stride(0), D,
                                                     D_PAD=d_pad, BLOCK_ROWS=block_rows)
    return out.reshape(o.shape[:-1])
