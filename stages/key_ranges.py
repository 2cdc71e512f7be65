"""A padding mask's key ranges in one launch: what :func:`stages.hf.lab_mask` hands stage C when each
sequence's keys are one unbroken range (a static KV cache's filled slots, a left-padded batch).

**Why a kernel for a few integers.** ``generate`` with a static cache builds the step's mask *outside*
the compiled, CUDA-graphed forward, in eager PyTorch, once per generated token. Written as tensor
operations (compare with the positions, find the first and last real key, check that the real keys
are one run, stack, convert) the ranges took about 30 small operations, each a kernel launch of a few
microseconds of host time for a handful of integers, twice the launches of transformers' own SDPA
mask. A decode step of a small model is host-bound, so that is time every token pays. Here one
program per sequence walks its row of the padding mask once and writes its start, its end and two
flags: one launch.

The same computation as tensor operations (:func:`key_ranges_torch`) stays for what cannot launch a
Triton kernel: a traced call (``torch.compile`` fuses those operations into a kernel or two of its
own) and CPU tensors on a machine with a GPU; the tests hold the two to the same answers.

What is computed, per sequence b of the keys ``kv_offset .. kv_offset + kv_length`` (key j is real
where the 2-D padding mask is nonzero at ``kv_offset + j``; past the mask's end it is padding; no mask
means every key is real):

* ``end``: the filled length, ``q_offset + q_length - kv_offset`` (the newest query's position + 1);
  causal, keys at or past it are not real (a static cache's unfilled slots);
* ``start``: the first real key (``end`` if there is none);
* ``stop``: causal, ``end`` (trailing pads stay inside: causality hides them from every real
  token); bidirectional, one past the last real key (``start`` if none);
* ``fits``: the real keys are exactly one run (else a range would attend to the wrong keys);
* ``whole``: the range is all ``kv_length`` keys (then no range is needed at all).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreted
from .contract import CompiledKernel, Problem
from .launch import FastLaunch, Launch, compiles_without_interpreter

#: keys a program reads per step of its loop
BLOCK_KEYS = 1024


@triton.jit(do_not_specialize=["B", "T", "K", "KV_OFFSET", "END_ADD", "STRIDE_B", "STRIDE_T"])
def _key_ranges_kernel(mask, filled, out, B, T, K, KV_OFFSET, END_ADD, STRIDE_B, STRIDE_T,
                       HAS_MASK: tl.constexpr, FILLED_ON_DEVICE: tl.constexpr, CAUSAL: tl.constexpr,
                       BLOCK: tl.constexpr):
    b = tl.program_id(0)
    # The filled length: a static cache keeps it on the device (read here, so the host never waits).
    if FILLED_ON_DEVICE:
        end = tl.load(filled).to(tl.int32) + END_ADD
    else:
        end = END_ADD
    # Causal, no key at or past `end` is real: the walk stops there (a static cache's unfilled slots
    # are never read).
    hi = K
    if CAUSAL:
        hi = tl.minimum(K, tl.maximum(end, 0))
    first = K
    last = -1
    count = 0
    for j0 in range(0, hi, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        inside = j < hi
        if HAS_MASK:
            pos = KV_OFFSET + j
            row = mask + b.to(tl.int64) * STRIDE_B + pos.to(tl.int64) * STRIDE_T
            real = (tl.load(row, mask=inside & (pos < T), other=0) != 0) & inside
        else:
            real = inside
        first = tl.minimum(first, tl.min(tl.where(real, j, K), axis=0))
        last = tl.maximum(last, tl.max(tl.where(real, j, -1), axis=0))
        count += tl.sum(real.to(tl.int32), axis=0)
    some = count > 0
    start = tl.where(some, first, end)
    stop = tl.where(some, last + 1, start)
    # One run of real keys from `start` holds `count` keys exactly when it ends at start + count.
    fits = count == stop - start
    if CAUSAL:
        stop = end
    whole = (start == 0) & (stop == K)
    # Rows of `out` [4, B]: start, stop, fits, whole (each row contiguous, so the first two reach the
    # attention kernels as [B] tensors without a copy).
    tl.store(out + b, start)
    tl.store(out + B + b, stop)
    tl.store(out + 2 * B + b, fits.to(tl.int32))
    tl.store(out + 3 * B + b, whole.to(tl.int32))


#: one lean launch per (mask dtype or None, dtype of the filled length on the device or None, causal): a
#: FastLaunch's kept kernel must see pointers of one dtype
_LAUNCHES: dict[tuple, FastLaunch] = {}


def _launch(mask_dtype, filled_dtype, causal: bool) -> FastLaunch:
    key = (mask_dtype, filled_dtype, causal)
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = FastLaunch(
            _key_ranges_kernel, dict(HAS_MASK=mask_dtype is not None, FILLED_ON_DEVICE=filled_dtype is not None,
                                     CAUSAL=causal, BLOCK=BLOCK_KEYS),
            ("mask", "filled", "out", "B", "T", "K", "KV_OFFSET", "END_ADD", "STRIDE_B", "STRIDE_T"), pointers=3,
            num_warps=4)
    return launch


def ranges_mask(out: torch.Tensor) -> torch.Tensor:
    """The key ranges of ``out`` (rows start and stop of a [≥2, B] int32 tensor) as the int32
    [B, 1, 1, 2] attention mask :func:`stages.hf.key_ranges_mask` describes: a view whose two columns
    are ``out``'s rows, contiguous, so the kernels take them without a copy."""
    return out[:2].t().reshape(-1, 1, 1, 2)


def key_ranges_torch(attention_mask: torch.Tensor | None, batch_size: int, q_length: int, kv_length: int, q_offset,
                     kv_offset: int, causal: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`key_ranges` as tensor operations (about 30 of them), for a traced call and for CPU
    tensors where the kernel runs on a GPU; the same arguments and results."""
    end = q_offset + q_length - kv_offset  # (a 0-d tensor under a static cache: its filled length)
    if isinstance(end, torch.Tensor):
        lengths = end.to(device=device, dtype=torch.int32).reshape(1).expand(batch_size).contiguous()
    else:
        lengths = torch.full((batch_size,), end, dtype=torch.int32, device=device)
    j = torch.arange(kv_length, device=device)
    if attention_mask is None:
        real = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    else:
        real = attention_mask[:, kv_offset:kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if real.shape[-1] < kv_length:  # (a mask shorter than the keys: padding after its end)
            real = torch.nn.functional.pad(real, (0, kv_length - real.shape[-1]))
    if causal:
        real = real & (j[None, :] < lengths[:, None])
    some = real.any(dim=-1)
    # First real key and one past the last (argmax finds the first True), both `end` for pads only.
    starts = torch.where(some, real.to(torch.int32).argmax(dim=-1), lengths).to(torch.int32)
    stops = torch.where(some, kv_length - real.flip(-1).to(torch.int32).argmax(dim=-1), starts).to(torch.int32)
    fits = (((j[None, :] >= starts[:, None]) & (j[None, :] < stops[:, None])) == real).all(dim=-1)
    if causal:
        stops = lengths
    whole = (starts == 0) & (stops == kv_length)
    out = torch.stack([starts, stops, fits.to(torch.int32), whole.to(torch.int32)])
    return ranges_mask(out), out[2:]


def kernel_can_run(device, *tensors) -> bool:
    """Whether :func:`key_ranges` may launch its kernel for tensors on ``device``: a CUDA device (or
    the interpreter, which runs it on the CPU), every given tensor there, and nothing traced (a traced
    call takes :func:`key_ranges_torch`, which the compiler fuses)."""
    if device is None or torch.compiler.is_compiling():
        return False
    device = torch.device(device)
    if not (device.type == "cuda" or (interpreted() and device.type == "cpu")):
        return False
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return all(not isinstance(t, torch.Tensor) or (t.device == device and not is_fake(t)
                                                   and not is_traceable_wrapper_subclass(t)) for t in tensors)


def key_ranges(attention_mask: torch.Tensor | None, batch_size: int, q_length: int, kv_length: int, q_offset,
               kv_offset: int, causal: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The key range of each sequence and whether it says everything, in one launch.

    ``attention_mask``: transformers' 2-D padding mask [B, tokens] (nonzero = a real token; shorter
    than ``kv_offset + kv_length`` means padded at the end) or None; ``q_offset``: an int, or a 0-d
    integer tensor on ``device`` (a static cache's filled length, never read on the host). Returns
    ``(ranges, flags)``: the int32 [B, 1, 1, 2] ranges mask (:func:`ranges_mask`) and an int32 [2, B]
    tensor whose rows say, per sequence, ``fits`` (its real keys are one run) and ``whole`` (its range
    is every key). Nothing waits for the GPU. Falls back to :func:`key_ranges_torch` where the kernel
    cannot run (:func:`kernel_can_run`)."""
    if not kernel_can_run(device, attention_mask, q_offset):
        return key_ranges_torch(attention_mask, batch_size, q_length, kv_length, q_offset, kv_offset, causal, device)
    out = torch.empty(4, batch_size, dtype=torch.int32, device=device)
    on_device = isinstance(q_offset, torch.Tensor)
    end_add = q_length - kv_offset + (0 if on_device else int(q_offset))
    if attention_mask is None:
        mask, tokens, strides = out, 0, (0, 0)  # (an unused pointer: the kernel reads no mask)
    else:
        mask, tokens, strides = attention_mask, attention_mask.shape[-1], attention_mask.stride()
    _launch(None if attention_mask is None else attention_mask.dtype, q_offset.dtype if on_device else None, causal)(
        (batch_size,), mask, q_offset if on_device else out, out, batch_size, tokens, kv_length, kv_offset, end_add,
        *strides)
    return ranges_mask(out), out[2:]


@compiles_without_interpreter
def compile(problem: Problem, arch: int, causal: bool = True, mask_dtype: str | None = "bool",
            filled_dtype: str | None = "int64") -> list[CompiledKernel]:
    """The kernel as a GPU would run it for ``problem.B`` sequences of ``problem.N`` keys, compiled
    for ``sm_<arch>`` without a GPU (``mask_dtype``, ``filled_dtype``: a torch dtype's name, or None
    for no padding mask / a filled length known on the host)."""
    def meta(shape, dtype):
        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")

    out = meta((4, problem.B), "int32")
    mask = out if mask_dtype is None else meta((problem.B, problem.N), mask_dtype)
    filled = out if filled_dtype is None else meta((), filled_dtype)
    launch = Launch(_key_ranges_kernel, (problem.B,), dict(
        mask=mask, filled=filled, out=out, B=problem.B, T=problem.N, K=problem.N, KV_OFFSET=0, END_ADD=1,
        STRIDE_B=problem.N, STRIDE_T=1, HAS_MASK=mask_dtype is not None, FILLED_ON_DEVICE=filled_dtype is not None,
        CAUSAL=causal, BLOCK=BLOCK_KEYS), num_warps=4)
    return [launch.compile(arch)]


__all__ = ["BLOCK_KEYS", "compile", "kernel_can_run", "key_ranges", "key_ranges_torch", "ranges_mask"]
