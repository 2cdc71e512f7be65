"""A workaround for one bug of Triton's CPU interpreter, applied only when it is in use.

Triton 3.6's interpreter keeps bfloat16 values as raw 16-bit integers in NumPy arrays and hands them
to ``np.matmul`` as integers, so every ``tl.dot`` on bf16 tiles returns garbage (errors of 1e9 seen
here). On a GPU the same kernels are compiled and unaffected. The fix widens bf16 operands to
float32 first, which is exact (bf16 is the top half of a float32) and is what the tensor cores do
internally (bf16 products, fp32 accumulation).
"""

from __future__ import annotations

import numpy as np


def _bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


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

    builder.create_dot = create_dot
    builder._attention_lab_bf16_fix = True
