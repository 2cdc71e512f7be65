"""Row strides the host has checked, so that every head dim gets 16-byte loads.

A ``tl.load`` of a tile's rows becomes 16-byte vector loads (and, pipelined, ``cp.async`` copies
of 16 bytes) only where Triton can prove that every row starts on a 16-byte boundary: the base
pointer and every stride multiplied into the address a multiple of 16 bytes. Triton learns that
about an integer argument only by specializing it, and its only fact is "divisible by 16". A
contiguous [B, H, N, D] tensor has row stride D, so at a head dim of 8 mod 16 (40, 72, 88, 136,
200, ...) that fact is missing although each row does start on a 16-byte boundary (8 elements of 2
bytes), and the compiled kernel loads every element on its own: at D 72 on sm_80 the one-pass
kernel issued 192 two-byte loads per thread and no ``cp.async`` at all, where D 80 issued 48
16-byte copies; at D 200 the scalar addresses spilled 1.5-2 KB of registers per thread. The same
held for the split-KV decode kernel and the backward's kernels on every architecture.

So the host checks the strides (:func:`row_alignment`: every stride but the head dim's a multiple
of the elements in 16 bytes) and, where they are and Triton would not know it, hands the kernel
that count as a constexpr ``ALIGN``; the kernel rewrites each stride as ``(stride >> 3) << 3``
(:func:`aligned`), the same value, whose low bits Triton then knows to be zero. A layout that fails
the check, or whose strides are all multiples of 16 elements already, compiles without it
(``ALIGN`` = 1): the first loads as before, correctly; the second spends no instructions on it. It
is one more compile-time fact of the layout, like the ones Triton specializes on, and at a given
head dim it does not change as a cache grows (the row stride decides it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: bytes a vector load or ``cp.async`` moves at once
VECTOR_BYTES = 16
#: Tell the kernels what the strides allow (``LAB_ROW_ALIGNMENT=0``: never, the kernels as Triton alone
#: compiles them; ``experiments/row_alignment.py`` compares the two).
ROW_ALIGNMENT = os.environ.get("LAB_ROW_ALIGNMENT", "1") == "1"


def row_alignment(*tensors: torch.Tensor) -> int:
    """The ``ALIGN`` constexpr of the ``tl`` kernels: the elements in 16 bytes (8 for fp16/bf16, 4 for
    fp32) when every stride of every tensor but its last (the head dim, contiguous) is a multiple of
    that count and Triton would not know it of them all (some stride is not a multiple of 16, the fact
    it specializes on), else 1: nothing to tell, and no instructions spent telling it. (Base pointers
    need no check here: Triton specializes their alignment itself.)"""
    elements = VECTOR_BYTES // tensors[0].element_size()
    strides = [s for t in tensors for s in t.stride()[:-1]]
    if ROW_ALIGNMENT and all(s % elements == 0 for s in strides) and any(s % 16 for s in strides):
        return elements
    return 1


@triton.jit
def aligned(stride, ALIGN: tl.constexpr):
    """``stride`` unchanged, written so that Triton knows it is a multiple of ``ALIGN`` (checked on the
    host by :func:`row_alignment`): shifted right and back, whose low bits Triton knows to be zero (two
    shifts; a division would also handle negative values, at more instructions)."""
    if ALIGN == 8:
        stride = (stride >> 3) << 3
    elif ALIGN == 4:
        stride = (stride >> 2) << 2
    return stride


@triton.jit
def aligned_strides(stride_b, stride_h, stride_n, ALIGN: tl.constexpr):
    """A tensor's batch, head and row strides through :func:`aligned`."""
    return aligned(stride_b, ALIGN), aligned(stride_h, ALIGN), aligned(stride_n, ALIGN)
