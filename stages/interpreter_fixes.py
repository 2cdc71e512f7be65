"""Workarounds for two bf16 bugs of Triton's CPU interpreter, applied only when it is in use.

Triton 3.6's interpreter keeps bfloat16 values as raw 16-bit integers in NumPy arrays.

- It hands them to ``np.matmul`` as integers, so every ``tl.dot`` on bf16 tiles returns garbage
  (errors of 1e9 seen here). The fix widens bf16 operands to float32 first, which is exact (bf16 is
  the top half of a float32) and is what the tensor cores do internally (bf16 products, fp32
  accumulation).
- It converts float32 to bf16 by cutting the low 16 bits (rounding toward zero), where the GPU's
  ``cvt.rn.bf16.f32`` and PyTorch round to nearest, ties to even. Cutting doubles the worst rounding
  error of every bf16 value a kernel stores, so a kernel that stores bf16 intermediates (stage A's
  S, P, dP, dS) measured ~3x PyTorch's bf16 error under the interpreter and ~1x on the GPU. The fix
  rounds to nearest even, as the hardware does.

On a GPU the kernels are compiled and neither fix is involved.
"""

from __future__ import annotations

import numpy as np


def _bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns; NaN stays a (quiet) NaN, inf stays inf."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def apply() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_attention_lab_bf16_fix", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            a_data = _bf16_bits_to_float32(a.data) if a.dtype == tl.bfloat16 else a.data.astype(np.float32)
            b_data = _bf16_bits_to_float32(b.data) if b.dtype == tl.bfloat16 else b.data.astype(np.float32)
            out = np.matmul(a_data, b_data, dtype=np.float32).astype(d.data.dtype) + d.data
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_float32_to_bf16_bits(src.data), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder._attention_lab_bf16_fix = True
