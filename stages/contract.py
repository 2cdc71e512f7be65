"""The stage contract: what every stage exports, and the one input check they all share.

A stage is a package under ``stages/`` that exports a :class:`Stage`. The harness, the tests and a
learner's own kernel all plug in through this one small surface:

* ``attention(q, k, v, *, causal=False, sm_scale=None) -> o`` for ``[B, H, N, D]`` tensors;
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
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

#: dtypes every stage accepts, by the short names the harness and the CLI use.
DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

#: head dims every stage supports. Powers of two keep every tile a power of two (Triton's
#: ``tl.arange`` needs that) without padding the head dim inside the kernels.
HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Problem:
    """One attention problem: shapes, dtype and masking. Sizes in elements."""

    B: int
    H: int
    N: int
    D: int
    dtype: str = "fp16"
    causal: bool = False

    def __post_init__(self) -> None:
        for name in ("B", "H", "N", "D"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def element_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def heads(self) -> int:
        """Independent (batch, head) pairs: the grid's second axis in every stage."""
        return self.B * self.H

    @property
    def qkvo_bytes(self) -> int:
        """Bytes of Q, K, V and O together: the least any attention kernel must move."""
        return 4 * self.heads * self.N * self.D * self.element_bytes

    @property
    def flops(self) -> float:
        """Matmul FLOPs of the forward pass: 2·N²·D for QKᵀ plus 2·N²·D for PV, per head.

        Causal counts half, the convention of the FlashAttention papers and Triton's tutorial
        (the exact count, N(N+1)/2 pairs, differs from N²/2 by under 1/N).
        """
        full = 4.0 * self.heads * self.N * self.N * self.D
        return full / 2 if self.causal else full

    @classmethod
    def of(cls, q: torch.Tensor, *, causal: bool = False) -> "Problem":
        B, H, N, D = q.shape
        name = next(n for n, dt in DTYPES.items() if dt == q.dtype)
        return cls(B, H, N, D, name, causal)


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
    dtypes: tuple[torch.dtype, ...] = tuple(DTYPES.values()),
) -> float:
    """Check a stage's inputs and return the softmax scale to use.

    Raises ``TypeError`` for wrong types and ``ValueError`` for wrong values; every message names
    the argument, what was given and what is allowed, so a user mistake never reaches the Triton
    compiler (whose tracebacks would not say which argument was wrong).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [B, H, N, D], got {_describe(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, N, D], got {t.dim()}-D shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name}.dtype must be one of {allowed}, got {str(t.dtype).replace('torch.', '')}")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last (head) dim, got stride(-1)={t.stride(-1)}; "
                f"call {name}.contiguous() first")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must have the same shape [B, H, N, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, N, D = q.shape
    if N == 0 or B == 0 or H == 0:
        raise ValueError(f"q, k, v must have B, H, N >= 1, got shape {tuple(q.shape)}")
    if D not in head_dims:
        raise ValueError(f"head dim D (q.shape[-1]) must be one of {list(head_dims)}, got {D}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_describe(causal)}")
    if sm_scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float or None, got {_describe(sm_scale)}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a finite positive float or None (meaning 1/sqrt(D)), got {sm_scale!r}")
    return float(sm_scale)


#: When True, every new output starts as NaN, so an element a kernel forgets to write fails the
#: comparison with the reference. The tests switch it on (tests/conftest.py); timing runs leave it off,
#: because filling is a pass over the output that the kernel would be charged for.
poison_outputs: bool = False


def new_output(q: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous ``[B, H, N, D]`` output for ``q``'s problem (NaN-filled when poisoning)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if poison_outputs:
        out.fill_(float("nan"))
    return out
