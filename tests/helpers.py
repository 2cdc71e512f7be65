"""Helpers shared by the stage tests: fresh inputs and the error check against float64."""

from __future__ import annotations

import torch

from harness.reference import reference_attention, rel_err, torch_same_precision

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

#: Errors below this are rounding noise whatever PyTorch achieves (fp32 errors are ~1e-7).
ABS_FLOOR = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-5}


def make_qkv(B, H, N, D, dtype, device, *, layout="bhnd", scale=1.0, seed=None):
    """Fresh random q, k, v. ``layout="bnhd"`` gives strided views: a [B, N, H, D] tensor
    transposed to [B, H, N, D], as a model that keeps heads interleaved would pass them."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    def one():
        shape = (B, N, H, D) if layout == "bnhd" else (B, H, N, D)
        t = (torch.randn(shape, generator=g) * scale).to(dtype).to(device)
        return t.transpose(1, 2) if layout == "bnhd" else t
    return one(), one(), one()


def check_against_reference(o, q, k, v, *, causal, dtype_name, sm_scale=None, factor=2.0):
    """The stage's error must be within ``factor``× PyTorch's own same-precision error (or under the
    rounding floor), every element finite, shape and dtype preserved. Returns (err, torch_err)."""
    assert o.shape == q.shape and o.dtype == q.dtype
    assert torch.isfinite(o).all(), "output has NaN/inf: an element was not written, or overflowed"
    ref = reference_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    err = rel_err(o, ref)
    torch_err = rel_err(torch_same_precision(q, k, v, causal=causal, sm_scale=sm_scale), ref)
    assert err <= max(factor * torch_err, ABS_FLOOR[dtype_name]), (
        f"relative error {err:.3e} vs PyTorch same-precision {torch_err:.3e}")
    # Each head separately, so a batch/head offset bug cannot hide behind a good average.
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            head_err = rel_err(o[b, h], ref[b, h])
            assert head_err <= max(4 * factor * torch_err, 4 * ABS_FLOOR[dtype_name]), (
                f"head (b={b}, h={h}) error {head_err:.3e}")
    return err, torch_err
