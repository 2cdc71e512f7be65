"""Stage C's CUDA C++ twin, registered as ``c_cuda``: the optimized kernel of ``flash_c.cu``.

Every mechanism Triton generates for stage C is written out by hand in ``flash_c.cu``: 16-byte
``cp.async`` copies with ``commit_group``/``wait_group`` double buffering, padded (or XOR-swizzled)
shared-memory rows, ``ldmatrix`` (``.trans`` for V) feeding ``mma.sync.m16n8k16`` tensor-core
instructions, Q/S/O tiles held in registers, an exp2 online softmax with log2(e) folded into the
scale, and causal tile skipping. Tiles: 64 query rows per block (4 warps x 16 rows), 64 keys per tile.

Build and launch work exactly as for ``b_cuda`` (``stages/b_tiled/cuda_twin.py``): ``nvcc`` builds a
shared library on the first call (cached under ``$ATTN_LAB_CUDA_BUILD_DIR`` or
``~/.cache/attention-lab/cuda``), ctypes calls its ``extern "C"`` launcher on torch's current stream.
Importing this module needs neither a GPU nor ``nvcc``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import ops, register
from ..b_tiled.cuda_twin import aligned, call_launcher, load_library, require_cuda
from ..contract import HbmTraffic, Problem, Stage, cdiv, new_output, validate_inputs

SOURCE = Path(__file__).with_name("flash_c.cu")
BR = 64  # query rows per thread block (flash_c.cu: BR)
BC = 64  # keys per K/V tile (flash_c.cu: BC)
KERNEL_NAME = "flash_c_fwd_kernel"  # Nsight Compute shows it as flash_c_fwd_kernel<T, D, LAYOUT>

#: shared-memory layouts, as the launcher numbers them (flash_c.cu: enum Layout)
UNPADDED, PADDED, SWIZZLED = 0, 1, 2


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None, smem_pad: bool = True, swizzle: bool = False) -> torch.Tensor:
    """softmax(q kᵀ · sm_scale [+ causal mask]) v with ``flash_c.cu``; ``[B, H, N, D]``, fp16/bf16, D ∈ {64, 128}.

    Shared-memory layout: ``smem_pad=True`` (default) pads rows by 8 elements (16 bytes);
    ``smem_pad=False`` leaves rows of D elements, so each ``ldmatrix`` phase hits one group of 4
    banks 8 times (8-way conflict); ``smem_pad=False, swizzle=True`` permutes 16-byte chunks by XOR
    with the row index instead of padding. Strided inputs are read in place through their strides.
    """
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale, head_dims=(64, 128),
                            dtypes=(torch.float16, torch.bfloat16))
    # flash_c.cu predates the extended contract: one K/V head per query head, Nq = Nk, D 64/128.
    # Say so here, before nvcc or the GPU is involved (validate_inputs already named the head dim).
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"c_cuda needs Hq == Hkv (no grouped-query attention), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}; use stage 'c' for GQA/MQA")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"c_cuda needs Nq == Nk, got q {tuple(q.shape)}, k {tuple(k.shape)}; use stage 'c' "
                         f"for queries and keys of different lengths")
    for name, value in (("smem_pad", smem_pad), ("swizzle", swizzle)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    if smem_pad and swizzle:
        raise ValueError("choose one shared-memory layout: smem_pad=True or swizzle=True (with smem_pad=False)")
    require_cuda(q, "c_cuda")
    layout = PADDED if smem_pad else (SWIZZLED if swizzle else UNPADDED)
    if ops.traced(q, k, v):
        return _forward_op(q, k, v, causal, scale, layout)
    return _forward(q, k, v, causal, scale, layout)


def _forward(q, k, v, causal: bool, scale: float, layout: int) -> torch.Tensor:
    q, k, v = (aligned(t, 8) for t in (q, k, v))  # 16-byte (8-element) cp.async copies
    o = new_output(q)
    lib = load_library(SOURCE, torch.cuda.get_device_capability(q.device), "c_cuda", "flash_c_forward")
    call_launcher(lib, "flash_c_forward", q, k, v, o, scale, causal, layout, "c_cuda")
    return o


# The twin as a custom op (forward only), so a traced program holds it as one node; see stages/ops.py.
def _forward_op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                layout: int) -> torch.Tensor:
    return _forward(q, k, v, causal, scale, layout)


def _forward_fake(q, k, v, causal, scale, layout):
    return ops.empty_output(q)


_forward_op = ops.define("c_cuda_forward", _forward_op_impl, _forward_fake)


def kv_rows_read(problem: Problem) -> int:
    """K rows (= V rows) one (batch, head) loads, summed over its query tiles.

    Non-causal: each of the T_q = ceil(N/64) query tiles loads all N rows. Causal: query tile t
    loads K/V tiles 0..t only (tile skipping), i.e. min(64·(t+1), N) rows; summed over t that is
    64·T_q·(T_q−1)/2 + N (every tile but the last is full). Rows past N are zero-filled, not read.
    """
    n = problem.N
    tiles_q = cdiv(n, BR)
    if not problem.causal:
        return tiles_q * n
    return BC * tiles_q * (tiles_q - 1) // 2 + n


def hbm_bytes(problem: Problem, **_layout) -> HbmTraffic:
    # (the shared-memory layout switches of the variants do not change device-memory traffic)
    """Bytes ``flash_c.cu`` requests from global memory, if no cache helped.

    Per (batch, head), with e bytes per element: Q read once (N·D·e), K and V read
    ``kv_rows_read(problem)``·D·e each (N·D·e·ceil(N/64) non-causal, about half of that causal),
    O written once (N·D·e).
    """
    e, d = problem.element_bytes, problem.D
    read = problem.heads * (problem.N * d * e + 2 * kv_rows_read(problem) * d * e)
    return HbmTraffic(read=read, write=problem.heads * problem.N * d * e)


def workspace_bytes(problem: Problem) -> int:
    """0: besides the output, one call allocates nothing on the device (m, l, S and O live in registers).

    Exception not modelled: an input whose pointer or B/H/N strides are not multiples of 8 elements
    (16 bytes) is first copied (``stages/b_tiled/cuda_twin.py: aligned``); views of whole heads never are.
    """
    return 0


STAGE = register(Stage(
    name="c_cuda",
    title="C in CUDA C++: cp.async pipeline, ldmatrix + mma.sync tensor cores, padded smem",
    techniques=(
        "16-byte cp.async copies, double-buffered K/V (commit_group / wait_group 1)",
        "padded shared-memory rows (+16 B) against ldmatrix bank conflicts (or XOR swizzle)",
        "ldmatrix (.trans for V) + mma.sync.m16n8k16 tensor cores, fp32 accumulators",
        "register tiling: Q fragments, S/P and O stay in registers; P reused as the A operand",
        "online softmax with exp2, log2(e) folded into the scale; row sums reduced once at the end",
        "causal tile skipping; longest query tiles scheduled first",
    ),
    attention=attention,
    hbm_bytes=hbm_bytes,
    workspace_bytes=workspace_bytes,
    kernel_names=(KERNEL_NAME,),
    requires_cuda=True,
    variants={"unpadded": {"smem_pad": False}, "swizzled": {"smem_pad": False, "swizzle": True}},
))
