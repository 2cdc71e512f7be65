"""The stage contract: what every stage exports, and the one input check they all share.

A stage is a package under ``stages/`` that exports a :class:`Stage`. The harness, the tests and a
learner's own kernel all plug in through this one small surface:

* ``attention(q, k, v, *, causal=False, sm_scale=None) -> o``: q ``[B, Hq, Nq, D]``, k and v
  ``[B, Hkv, Nk, D]``, o ``[B, Hq, Nq, D]``. Grouped-query attention: ``Hq % Hkv == 0`` and query
  head h reads KV head ``h // (Hq // Hkv)`` (no copy of K/V). ``causal=True`` is aligned to the
  bottom right: query i sees key j iff ``j <= i + Nk - Nq`` (a row that sees no key outputs 0).
  Head dims: every multiple of 8 from 8 to 256. The output is differentiable: ``o.backward(do)``
  runs the stage's own backward kernels;
* ``hbm_bytes(problem) -> HbmTraffic``: the bytes the stage's kernels request from device memory;
* ``workspace_bytes(problem) -> int``: extra device memory one call allocates besides the output;
* a title and the list of techniques the stage adds over the one before.

The traffic model counts every byte a kernel *asks* global memory for, as if no cache helped. The
Nsight Compute measurement (``python -m harness profile``) counts what really crossed the DRAM
interface; the gap between the two is the L2 cache's share of the work, and each stage README says
where to expect it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

#: dtypes every stage accepts, by the short names the harness and the CLI use.
DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

#: head dims every stage supports: every multiple of 8 up to 256. Triton's ``tl.arange`` needs a
#: power-of-two length, so the kernels pad the head dim to :func:`padded_head_dim` *inside* the
#: kernel (masked loads and stores; the inputs are never copied).
HEAD_DIMS: tuple[int, ...] = tuple(range(8, 257, 8))


def padded_head_dim(D: int) -> int:
    """The power-of-two tile width a kernel uses for head dim ``D`` (at least 16: ``tl.dot``'s
    smallest reduction). Columns past ``D`` are masked on load (zeros) and on store."""
    return max(16, 1 << (D - 1).bit_length())


def causal_offset(Nq: int, Nk: int) -> int:
    """Bottom-right causal alignment: query row i sees key j iff ``j <= i + causal_offset(Nq, Nk)``."""
    return Nk - Nq


def visible_keys(i: int, Nq: int, Nk: int, causal: bool) -> int:
    """How many keys query row ``i`` sees (0 for a causal row above the first key when Nq > Nk)."""
    if not causal:
        return Nk
    return min(Nk, max(0, i + causal_offset(Nq, Nk) + 1))


def visible_pairs(Nq: int, Nk: int, causal: bool) -> int:
    """(query, key) pairs that enter the softmax, per head: Nq·Nk, or the causal count."""
    if not causal:
        return Nq * Nk
    off = causal_offset(Nq, Nk)
    # Rows lo..hi see i + off + 1 keys (1 up to Nk - 1): an arithmetic series; rows from
    # Nk - 1 - off on see all Nk; rows before -off see none.
    lo, hi = max(0, -off), min(Nq - 1, Nk - 2 - off)
    partial = (hi - lo + 1) * (lo + hi + 2 * off + 2) // 2 if hi >= lo else 0
    return partial + max(0, Nq - max(0, Nk - 1 - off)) * Nk


@dataclass(frozen=True)
class Problem:
    """One attention problem: shapes, dtype and masking. Sizes in elements.

    ``H`` and ``N`` are the query heads and query rows (Hq, Nq); ``Hkv`` and ``Nk`` the key/value
    heads and rows, defaulting to ``H`` and ``N`` (plain multi-head self-attention), so
    ``Problem(B, H, N, D)`` means what it always meant.
    """

    B: int
    H: int
    N: int
    D: int
    dtype: str = "fp16"
    causal: bool = False
    Hkv: int | None = None
    Nk: int | None = None

    def __post_init__(self) -> None:
        if self.Hkv is None:
            object.__setattr__(self, "Hkv", self.H)
        if self.Nk is None:
            object.__setattr__(self, "Nk", self.N)
        for name in ("B", "H", "N", "D", "Hkv", "Nk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.H % self.Hkv:
            raise ValueError(f"H (query heads) must be a multiple of Hkv (key/value heads), got H={self.H}, "
                             f"Hkv={self.Hkv}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def Hq(self) -> int:
        return self.H

    @property
    def Nq(self) -> int:
        return self.N

    @property
    def group(self) -> int:
        """Query heads per key/value head (1: multi-head; H: multi-query)."""
        return self.H // self.Hkv

    @property
    def element_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def heads(self) -> int:
        """Independent (batch, query head) pairs: the grid's second axis in every stage."""
        return self.B * self.H

    @property
    def kv_heads(self) -> int:
        """(batch, key/value head) pairs: K and V hold this many [Nk, D] matrices each."""
        return self.B * self.Hkv

    @property
    def q_bytes(self) -> int:
        """Bytes of Q (and of O, which has Q's shape)."""
        return self.heads * self.N * self.D * self.element_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes of K (and of V)."""
        return self.kv_heads * self.Nk * self.D * self.element_bytes

    @property
    def qkvo_bytes(self) -> int:
        """Bytes of Q, K, V and O together: the least any attention kernel must move."""
        return 2 * self.q_bytes + 2 * self.kv_bytes

    @property
    def pairs(self) -> int:
        """(query, key) pairs in the softmax per head: Nq·Nk, or the visible ones when causal."""
        return visible_pairs(self.N, self.Nk, self.causal)

    @property
    def flops(self) -> float:
        """Matmul FLOPs of the forward pass: 2·D per visible (query, key) pair for QKᵀ and 2·D for
        PV, per query head: 4·B·Hq·Nq·Nk·D, the causal count taking only the visible pairs
        (N(N+1)/2 when Nq = Nk, about half). The backward pass counts 2.5× this (the
        FlashAttention papers' convention: five matmuls to the forward's two)."""
        return 4.0 * self.heads * self.pairs * self.D

    @property
    def bwd_flops(self) -> float:
        return 2.5 * self.flops

    def pass_flops(self, pass_: str = "fwd") -> float:
        """FLOPs of one call of a pass: ``fwd`` :attr:`flops`, ``bwd`` :attr:`bwd_flops`, ``fwd_bwd``
        (a training step) their sum, 3.5× the forward."""
        return {"fwd": self.flops, "bwd": self.bwd_flops, "fwd_bwd": self.flops + self.bwd_flops}[pass_]

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor | None = None, *, causal: bool = False) -> "Problem":
        B, H, N, D = q.shape
        name = next(n for n, dt in DTYPES.items() if dt == q.dtype)
        Hkv, Nk = (k.shape[1], k.shape[2]) if k is not None else (H, N)
        return cls(B, H, N, D, name, causal, Hkv, Nk)


@dataclass(frozen=True)
class HbmTraffic:
    """Bytes requested from device memory by one call, split into reads and writes."""

    read: int
    write: int

    @property
    def total(self) -> int:
        return self.read + self.write


@dataclass(frozen=True)
class Stage:
    """What a stage package exports (see the module docstring)."""

    name: str                       # registry key: "a", "b", "c", ...
    title: str                      # one line for tables and figures
    techniques: tuple[str, ...]     # what this stage adds over the previous one
    attention: Callable[..., torch.Tensor]
    hbm_bytes: Callable[[Problem], HbmTraffic]
    workspace_bytes: Callable[[Problem], int]
    kernel_names: tuple[str, ...] = field(default=())  # prefixes of its GPU kernels (for ncu filters)
    requires_cuda: bool = False     # True for stages with no CPU/interpreter path (the CUDA twins)
    #: named keyword-argument sets for ``attention``: the ablation switches (``hbm_bytes`` takes the
    #: same keywords, since a switch such as the tile shape changes the bytes). The harness runs each
    #: variant on the same inputs to measure what one optimization is worth, e.g. stage C's
    #: ``{"-pipelining": {"pipelining": False}, ...}`` or a CUDA twin's ``{"unpadded": {"smem_pad": False}}``.
    variants: dict = field(default_factory=dict)
    #: ``compile(problem, arch) -> list[CompiledKernel]``: compile the stage's kernels for an NVIDIA
    #: GPU of compute capability ``arch`` (80, 90) without needing one, for ``harness inspect``
    #: and the compiled-code tests. None where a stage cannot (the CUDA twins use nvcc instead).
    compile: Callable[..., list] | None = None
    #: the backward pass's models (None: the stage has no backward of its own, e.g. a CUDA twin):
    #: ``bwd_hbm_bytes(problem, **switches)``: bytes the backward kernels request, given the saved
    #: forward; ``train_workspace_bytes(problem)``: extra device memory at the peak of one training
    #: step (forward + backward) besides q, k, v, o, dO and the three gradients (A: its saved P).
    bwd_hbm_bytes: Callable[..., HbmTraffic] | None = None
    train_workspace_bytes: Callable[[Problem], int] | None = None
    #: whether ``attention`` takes ``key_starts``/``key_lengths`` (:func:`validate_key_ranges`): a key
    #: range per batch entry, what a static KV cache or a left-padded batch needs (``stages/hf.py``)
    key_ranges: bool = False


@dataclass(frozen=True)
class CompiledKernel:
    """One compiled GPU kernel: its name, launch shape and the compiler's outputs by stage name
    (``"ptx"``, ``"ttgir"``, ...). ``shared_bytes`` is the static shared memory Triton allocates."""

    name: str
    asm: dict
    shared_bytes: int
    num_warps: int
    num_stages: int


def slugify(name: str) -> str:
    """A GPU's name as a directory/file name, shared by ``results/<slug>/`` and stage C's tuning
    cache: ``'NVIDIA H200'`` -> ``'h200'``; ``'NVIDIA GeForce RTX 4090'`` -> ``'geforce-rtx-4090'``."""
    name = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"
    return f"{type(t).__name__} {t!r}"


def validate_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> float:
    """Check a stage's inputs and return the softmax scale to use.

    q is ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]`` with ``Hq % Hkv == 0``. Raises ``TypeError``
    for wrong types and ``ValueError`` for wrong values; every message names the argument, what was
    given and what is allowed, so a user mistake never reaches the Triton compiler (whose
    tracebacks would not say which argument was wrong).
    """
    # Every call of every stage passes through here, so the checks read each shape and stride once
    # and build no message (no f-string) unless they fail. A model calls attention with the same
    # layout in every layer and step: a layout of GPU tensors that passed is remembered (every fact
    # the checks read is in the key) and passes again at the cost of building the key.
    key = None
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and ((q.is_cuda and k.is_cuda and v.is_cuda)
                 or (remember_cpu_layouts and not (q.is_meta or k.is_meta or v.is_meta)))
            and head_dims is HEAD_DIMS
            and dtypes is None and (causal is True or causal is False) and (sm_scale is None or type(sm_scale) is float)):
        key = (q.shape, k.shape, v.shape, q.stride(-1), k.stride(-1), v.stride(-1), q.dtype, k.dtype, v.dtype,
               q.get_device(), k.get_device(), v.get_device(), causal, sm_scale)
        scale = _PASSED.get(key)
        if scale is not None:
            return scale
    if dtypes is None:
        dtypes = _DTYPES
    shapes = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [B, H, N, D], got {_describe(t)}")
        shape = t.shape
        if len(shape) != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, D], got {t.dim()}-D shape {tuple(shape)}")
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device (shapes without data); attention needs real tensors "
                             f"on a CUDA GPU or the CPU")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name}.dtype must be one of {allowed}, got {str(t.dtype).replace('torch.', '')}")
        last_stride = t.stride()[3]
        if last_stride != 1 and shape[3] > 1:
            raise ValueError(
                f"{name} must be contiguous in its last (head) dim, got stride(-1)={last_stride}; "
                f"call {name}.contiguous() first")
        shapes.append(shape)
    q_shape, k_shape, v_shape = shapes
    if k_shape != v_shape:
        raise ValueError(f"k and v must have the same shape [B, Hkv, Nk, D], got k {tuple(k_shape)}, "
                         f"v {tuple(v_shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q_shape
    Bk, Hkv, Nk, Dk = k_shape
    if Bk != B:
        raise ValueError(f"q and k must have the same batch size B (dim 0), got q {tuple(q_shape)}, "
                         f"k {tuple(k_shape)}")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim D (dim 3), got q {tuple(q_shape)}, "
                         f"k {tuple(k_shape)}")
    if not (B and Hq and Nq and Hkv and Nk):
        raise ValueError(f"q, k, v must have B, H, N >= 1, got q {tuple(q_shape)}, k {tuple(k_shape)}")
    if Hq % Hkv:
        raise ValueError(f"the query heads of q (Hq = {Hq}, dim 1) must be a multiple of the key/value heads "
                         f"of k and v (Hkv = {Hkv}): grouped-query attention shares each K/V head among "
                         f"Hq / Hkv query heads")
    # The default set is tested by arithmetic, not by scanning its 32 entries.
    if not ((D % 8 == 0 and 8 <= D <= 256) if head_dims is HEAD_DIMS else D in head_dims):
        raise ValueError(f"head dim D (q.shape[-1]) must be {_allowed_head_dims(head_dims)}, got {D}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_describe(causal)}")
    if sm_scale is not None:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
            raise TypeError(f"sm_scale must be a float or None, got {_describe(sm_scale)}")
        if not math.isfinite(sm_scale) or sm_scale <= 0:
            raise ValueError(f"sm_scale must be a finite positive float or None (meaning 1/sqrt(D)), got {sm_scale!r}")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # Triton compiles for the GPU here; a CPU tensor would reach the kernel as a bad pointer. (Last,
        # so a wrong argument is named first wherever the tensors are.)
        raise ValueError("q, k and v are on the CPU, but this machine runs the kernels compiled on its GPU (the "
                         "Triton interpreter is off): move them to the GPU (.cuda()), or set TRITON_INTERPRET=1 "
                         "before importing stages to run the kernels in the CPU interpreter")
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    if key is not None:
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()  # a model's layouts come back within a step; a cleared table refills
        _PASSED[key] = scale
    return scale


def validate_key_ranges(q: torch.Tensor, k: torch.Tensor, key_starts, key_lengths) -> tuple:
    """Check optional per-batch key ranges and return them ready for a kernel (contiguous).

    ``key_starts`` and ``key_lengths``: None or int32 tensors of shape [B] on q's device. Batch
    entry b attends to keys ``key_starts[b] <= j < key_lengths[b]`` of its Nk (a static KV cache's
    filled slots, a left-padded prompt), causal aligned to the range's end (query i sees key j iff
    also ``j <= i + key_lengths[b] - Nq``). Their values live on the device and are not read here
    (that would wait for the GPU on every call); a kernel clamps them to 0 <= start <= end <= Nk."""
    B = q.shape[0]
    checked = []
    for name, t in (("key_starts", key_starts), ("key_lengths", key_lengths)):
        if t is None:
            checked.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be None or an int32 tensor of shape [B] = [{B}], got {_describe(t)}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor of shape [B] = [{B}], got dtype "
                            f"{str(t.dtype).replace('torch.', '')}; convert it with .to(torch.int32)")
        if tuple(t.shape) != (B,):
            raise ValueError(f"{name} must have shape [B] = [{B}] (one value per batch entry), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        checked.append(t if t.is_contiguous() else t.contiguous())
    return tuple(checked)


def key_ranges_alignment(key_starts, key_lengths) -> tuple | None:
    """What a layout key must hold of a call's key ranges: None without them, else each one's 16-byte
    alignment (None for one not passed); Triton specializes a pointer on nothing else."""
    if key_starts is None and key_lengths is None:
        return None
    return tuple(None if t is None else t.data_ptr() % 16 == 0 for t in (key_starts, key_lengths))


_DTYPES = tuple(DTYPES.values())
#: layouts of GPU inputs that passed :func:`validate_inputs` -> the scale it returned
_PASSED: dict = {}
_PASSED_MAX = 4096
#: True: remember CPU layouts too (the tests, which have no GPU, check the memory with it)
remember_cpu_layouts: bool = False


def _allowed_head_dims(head_dims: tuple[int, ...]) -> str:
    if tuple(head_dims) == HEAD_DIMS:
        return "a multiple of 8 from 8 to 256"
    return f"one of {list(head_dims)}"


#: When True, every new output starts as NaN, so an element a kernel forgets to write fails the
#: comparison with the reference. The tests switch it on (tests/conftest.py); timing runs leave it off,
#: because filling is a pass over the output that the kernel would be charged for.
poison_outputs: bool = False


def validate_backward_inputs(do, q, k, v, o, lse, scale, *, causal: bool = False) -> None:
    """Check what a stage's backward is given beside q, k, v (which :func:`validate_inputs` checks):
    the output gradient ``do`` and the forward's output ``o``, shaped like q and contiguous in the
    head dim, and its fp32 row log-sum-exp ``lse`` ``[B, Hq, Nq]``, contiguous."""
    validate_inputs(q, k, v, causal=causal, sm_scale=scale)
    for name, t in (("do", do), ("o", o)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor shaped like q, got {type(t).__name__}")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q's shape, dtype and device {tuple(q.shape)}/{q.dtype}/{q.device}, "
                             f"got {tuple(t.shape)}/{t.dtype}/{t.device}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dim, got stride(-1)={t.stride(-1)}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous() or lse.device != q.device:
        raise ValueError(f"lse must be a contiguous float32 tensor of shape {tuple(q.shape[:3])} on {q.device}, "
                         f"got {tuple(lse.shape)}, {lse.dtype}, contiguous={lse.is_contiguous()}, {lse.device}")


def new_output(q: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous ``[B, H, N, D]`` output for ``q``'s problem (NaN-filled when poisoning)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (cheaper than torch.empty: no shape parse)
    if poison_outputs:
        out.fill_(float("nan"))
    return out
