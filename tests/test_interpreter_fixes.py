"""The CPU interpreter's bf16 must behave as the GPU's: dots on bf16 tiles and float32 -> bf16
rounding (to nearest, ties to even, as ``cvt.rn.bf16.f32`` and PyTorch round). Without the fixes in
``stages/interpreter_fixes.py`` the dot returns garbage and the cast truncates, which made bf16
gradient tests fail at random under the interpreter."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import stages  # noqa: F401  (applies the fixes when the interpreter is on)
import triton
import triton.language as tl
from stages.interpreter_fixes import _float32_to_bf16_bits

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="checks the Triton CPU interpreter (TRITON_INTERPRET=1)")


def test_float32_to_bf16_bits_rounds_like_pytorch():
    specials = torch.tensor([float("inf"), -float("inf"), 3.4e38, -0.0, 0.0, 1e-40, -1e-41, 65504.0,
                             1.00390625, 1.01171875, -1.00390625])  # the last three are exact ties
    values = torch.cat([specials, torch.randn(10_000) * 10.0 ** torch.randint(-30, 30, (10_000,))])
    bits = _float32_to_bf16_bits(values.numpy())
    assert np.array_equal(bits.view(np.int16), values.to(torch.bfloat16).view(torch.int16).numpy())
    nan = torch.from_numpy(_float32_to_bf16_bits(np.array([np.nan], dtype=np.float32)).view(np.int16))
    assert torch.isnan(nan.view(torch.bfloat16)).all()


@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, tl.load(X + i).to(Y.dtype.element_ty))


@triton.jit
def _dot_kernel(A, B, C, M: tl.constexpr):
    i = tl.arange(0, M)
    a = tl.load(A + i[:, None] * M + i[None, :])
    b = tl.load(B + i[:, None] * M + i[None, :])
    tl.store(C + i[:, None] * M + i[None, :], tl.dot(a, b))


@interpreter_only
def test_interpreter_casts_float32_to_bf16_as_the_gpu_does():
    x = torch.randn(4096)
    y = torch.full((4096,), float("nan"), dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, 4096)
    assert torch.equal(y, x.to(torch.bfloat16))


@interpreter_only
def test_interpreter_dot_on_bf16_tiles():
    a, b = (torch.randn(16, 16).to(torch.bfloat16) for _ in range(2))
    c = torch.full((16, 16), float("nan"))
    _dot_kernel[(1,)](a, b, c, 16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)
