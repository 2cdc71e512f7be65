"""Stage B's CUDA C++ twin, registered as ``b_cuda``: the basic tiled kernel of ``flash_b.cu``.

Where the Triton kernel says ``tl.load`` and ``tl.dot``, ``flash_b.cu`` spells the mechanics out:
``__shared__ T Ks[32][D + pad]``, a plain load-to-register-then-store copy, ``__syncthreads()``,
one fp32 score per lane, warp-shuffle row maxima. Read it beside ``kernels.py``.

How it is built and called
--------------------------
The ``.cu`` file is plain CUDA with an ``extern "C"`` launcher (no torch headers), so on the first
:func:`attention` call ``nvcc`` compiles it in a few seconds into a shared library
(``-shared -O3`` plus ``-gencode`` for the GPU in hand: ``sm_90a`` on Hopper, ``sm_80`` with
``compute_80`` PTX otherwise), cached under ``~/.cache/attention-lab/cuda`` (override with the
environment variable ``ATTN_LAB_CUDA_BUILD_DIR``), and loaded with :mod:`ctypes`. The launcher gets
raw device pointers, element strides and torch's current CUDA stream. This avoids compiling torch's
C++ headers (a minute per extension with ``torch.utils.cpp_extension``), and the library is exactly
what the CPU tests compile with ``nvcc -cubin``. ``ATTN_LAB_CUDA_FAST_MATH=1`` adds ``--use_fast_math``.
Importing this module needs neither a GPU nor ``nvcc``.

The helpers :func:`find_nvcc`, :func:`gencode_flags`, :func:`build_library` and :func:`launch_args`
are shared with ``stages/c_optimized/cuda_twin.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .. import ops, register
from ..contract import HbmTraffic, Problem, Stage, cdiv, new_output, validate_inputs

SOURCE = Path(__file__).with_name("flash_b.cu")
BR = 32  # query rows per thread block (flash_b.cu: BR)
BC = 32  # keys per K/V tile (flash_b.cu: BC)
KERNEL_NAME = "flash_b_fwd_kernel"  # Nsight Compute shows it as flash_b_fwd_kernel<T, D, PAD>
MAX_GRID_Y = 65535  # B*H goes on the grid's y axis


# ---------------------------------------------------------------------------------------------
# Building (shared with the stage C twin)

def find_nvcc() -> str | None:
    """Path of ``nvcc``: ``$CUDA_HOME/bin``, torch's idea of CUDA_HOME, then ``PATH``; None if absent."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        homes.append(CUDA_HOME)
    except Exception:  # pragma: no cover - very old torch or a broken install
        pass
    for home in homes:
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def gencode_flags(capability: tuple[int, int]) -> list[str]:
    """``-gencode`` flags for a GPU of compute ``capability`` (major, minor).

    Hopper (9.0) gets ``sm_90a`` machine code. Everything else gets ``sm_80`` machine code plus
    ``compute_80`` PTX, which the driver compiles at load time for newer GPUs (sm_89, sm_100, ...).
    """
    if tuple(capability) < (8, 0):
        raise RuntimeError(
            f"the CUDA twins use cp.async, ldmatrix and bf16 mma.sync, which need compute capability 8.0+ "
            f"(Ampere or newer); this GPU is sm_{capability[0]}{capability[1]}")
    if tuple(capability) == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80"]


def build_dir() -> Path:
    """Where built libraries are cached: ``$ATTN_LAB_CUDA_BUILD_DIR`` or ``~/.cache/attention-lab/cuda``."""
    return Path(os.environ.get("ATTN_LAB_CUDA_BUILD_DIR") or Path.home() / ".cache" / "attention-lab" / "cuda")


def build_library(source: Path, capability: tuple[int, int], stage_name: str) -> Path:
    """Compile ``source`` into a shared library for ``capability`` (cached); return its path.

    The cache key hashes the source text, the flags and nvcc's version, so editing the ``.cu`` file
    rebuilds on the next call. The library is written under a temporary name and renamed, so two
    processes building at once cannot load a half-written file.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError(
            f"stage {stage_name} needs a CUDA GPU and nvcc; nvcc was not found "
            "(set CUDA_HOME or put nvcc on PATH)")
    flags = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", *gencode_flags(capability)]
    if os.environ.get("ATTN_LAB_CUDA_FAST_MATH", "0") not in ("", "0"):
        flags.append("--use_fast_math")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *flags, version]).encode()).hexdigest()[:16]
    out_dir = build_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{source.stem}-sm{capability[0]}{capability[1]}-{key}.so"
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [nvcc, *flags, str(source), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"stage {stage_name}: nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, target)
    return target


_LIBS: dict[tuple[str, tuple[int, int]], ctypes.CDLL] = {}
_LOCK = threading.Lock()


def load_library(source: Path, capability: tuple[int, int], stage_name: str, entry: str) -> ctypes.CDLL:
    """Build (first time) and load ``source``'s library; declare the launcher ``entry``'s signature."""
    with _LOCK:
        lib = _LIBS.get((str(source), capability))
        if lib is None:
            lib = ctypes.CDLL(str(build_library(source, capability, stage_name)))
            fn = getattr(lib, entry)
            fn.restype = ctypes.c_int
            fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_int] * 4
                           + [ctypes.c_float] + [ctypes.c_int] * 4 + [ctypes.c_void_p])
            err = getattr(lib, entry.replace("_forward", "_error_string"))
            err.restype, err.argtypes = ctypes.c_char_p, [ctypes.c_int]
            _LIBS[(str(source), capability)] = lib
        return lib


def require_cuda(q: torch.Tensor, stage_name: str) -> None:
    """A clear RuntimeError when there is no GPU to run on (before any build is attempted)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"stage {stage_name} needs a CUDA GPU and nvcc; torch.cuda.is_available() is False here "
            "(the Triton stages run on the CPU interpreter, the CUDA twins cannot)")
    if q.device.type != "cuda":
        raise ValueError(f"stage {stage_name} needs q, k, v on a CUDA device, got device {q.device}")
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:
        raise ValueError(f"stage {stage_name} puts B*H on the grid's y axis (at most {MAX_GRID_Y}), "
                         f"got B*H = {q.shape[0] * q.shape[1]}")


HEAD_DIMS = (64, 128)  # the head dims flash_b.cu is instantiated for


def refuse_extended_shapes(q: torch.Tensor, k: torch.Tensor, stage_name: str) -> None:
    """A ValueError naming the argument for the shapes of the extended contract that the twin's
    kernels do not implement (checked before any build): grouped-query attention (Hq != Hkv) and
    different query and key lengths (Nq != Nk). Its head dims are checked by ``validate_inputs``.
    The twin teaches shared-memory staging; the Triton stage B handles these shapes."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"stage {stage_name} needs as many key/value heads as query heads (no grouped-query "
                         f"attention): k and v have Hkv = {k.shape[1]} heads (dim 1), q has Hq = {q.shape[1]}; "
                         f"use stage 'b' for Hq != Hkv")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"stage {stage_name} needs as many keys as queries: k and v have Nk = {k.shape[2]} rows "
                         f"(dim 2), q has Nq = {q.shape[2]}; use stage 'b' for Nq != Nk")


def aligned(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t`` itself when its pointer and B/H/N strides are multiples of ``elements`` elements,
    else a fresh contiguous copy (the kernels' vector accesses need that alignment).

    Views made by transposing or slicing whole heads (``x.transpose(1, 2)`` of a ``[B, N, H, D]``
    tensor) are always aligned; only odd offsets into a larger buffer trigger the copy, which is
    then extra memory and traffic outside the stage's models.
    """
    ok = t.data_ptr() % (elements * t.element_size()) == 0 and all(s % elements == 0 for s in t.stride()[:3])
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def launch_args(q, k, v, o) -> tuple:
    """Pointers and the 12 element strides (B, H, N of q, k, v, o) in the launcher's order."""
    strides = (ctypes.c_int64 * 12)(*[s for t in (q, k, v, o) for s in t.stride()[:3]])
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), strides)


def call_launcher(lib: ctypes.CDLL, entry: str, q, k, v, o, scale: float, causal: bool, layout: int,
                  stage_name: str) -> None:
    """Launch on torch's current stream of q's device; raise RuntimeError on a CUDA error."""
    B, H, N, D = q.shape
    dtype_code = 0 if q.dtype == torch.float16 else 1
    stream = torch.cuda.current_stream(q.device).cuda_stream
    rc = getattr(lib, entry)(*launch_args(q, k, v, o), B, H, N, D, ctypes.c_float(scale), int(causal),
                             dtype_code, layout, q.device.index, ctypes.c_void_p(stream))
    if rc != 0:
        msg = getattr(lib, entry.replace("_forward", "_error_string"))(rc).decode()
        raise RuntimeError(f"stage {stage_name}: kernel launch failed with CUDA error {rc}: {msg}")


# ---------------------------------------------------------------------------------------------
# The stage

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None, smem_pad: bool = False) -> torch.Tensor:
    """softmax(q kᵀ · sm_scale [+ causal mask]) v with ``flash_b.cu``; ``[B, H, N, D]``, fp16/bf16, D ∈ {64, 128}
    (q, k and v of one shape: no grouped-query attention, Nq = Nk).

    ``smem_pad=True`` pads each shared-memory row by 2 elements (4 bytes, one bank), which removes
    the bank conflict of the column-wise K reads (32 lanes reading 32 K rows at one column; see
    flash_b.cu and ``stages/bank_model.py``). Strided inputs are read in place through their strides.
    """
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale, head_dims=HEAD_DIMS,
                            dtypes=(torch.float16, torch.bfloat16))
    refuse_extended_shapes(q, k, "b_cuda")
    if not isinstance(smem_pad, bool):
        raise TypeError(f"smem_pad must be a bool, got {type(smem_pad).__name__} {smem_pad!r}")
    require_cuda(q, "b_cuda")
    if ops.traced(q, k, v):
        return _forward_op(q, k, v, causal, scale, smem_pad)
    return _forward(q, k, v, causal, scale, smem_pad)


def _forward(q, k, v, causal: bool, scale: float, smem_pad: bool) -> torch.Tensor:
    q, k, v = (aligned(t, 2) for t in (q, k, v))  # 4-byte (2-element) vector loads
    o = new_output(q)
    lib = load_library(SOURCE, torch.cuda.get_device_capability(q.device), "b_cuda", "flash_b_forward")
    call_launcher(lib, "flash_b_forward", q, k, v, o, scale, causal, int(smem_pad), "b_cuda")
    return o


# The twin as a custom op (forward only: the twins teach the forward's mechanics), so a traced
# program holds it as one node; see stages/ops.py.
def _forward_op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                smem_pad: bool) -> torch.Tensor:
    return _forward(q, k, v, causal, scale, smem_pad)


def _forward_fake(q, k, v, causal, scale, smem_pad):
    return ops.empty_output(q)


_forward_op = ops.define("b_cuda_forward", _forward_op_impl, _forward_fake)


def hbm_bytes(problem: Problem, **_layout) -> HbmTraffic:
    # (the shared-memory layout switches of the variants do not change device-memory traffic)
    """Bytes ``flash_b.cu`` requests from global memory, if no cache helped.

    Per (batch, head), with e bytes per element and T_q = ceil(N / 32) query tiles:

    * Q: each query tile loads its 32 rows once               -> N·D·e
    * K and V: every query tile loads every K/V tile, also under causal masking (B does not skip
      tiles above the diagonal), and rows past N are zero-filled, not read -> 2·T_q·N·D·e
    * O: written once                                          -> N·D·e (write)

    The K/V term is the O(N²·D/B_r) of the README; with B_r = 32 it is twice stage C's B_r = 64.
    """
    e, n, d = problem.element_bytes, problem.N, problem.D
    tiles_q = cdiv(n, BR)
    read = problem.heads * (n * d * e + 2 * tiles_q * n * d * e)
    return HbmTraffic(read=read, write=problem.heads * n * d * e)


def workspace_bytes(problem: Problem) -> int:
    """0: besides the output, one call allocates nothing on the device (m, l and O live on chip).

    Exception not modelled: an input whose pointer or strides are not a multiple of 2 elements is
    first copied (see :func:`aligned`); views of whole heads never are.
    """
    return 0


STAGE = register(Stage(
    name="b_cuda",
    title="B in CUDA C++: tiled flash attention, synchronous shared-memory staging",
    techniques=(
        "__shared__ K/V tiles filled by plain loads + __syncthreads()",
        "online softmax (running max m, running sum l) in fp32 registers",
        "S and P stay on chip (P through a 4 KiB shared buffer)",
        "optional +4-byte row padding against the column-read bank conflict",
    ),
    attention=attention,
    hbm_bytes=hbm_bytes,
    workspace_bytes=workspace_bytes,
    kernel_names=(KERNEL_NAME,),
    requires_cuda=True,
    variants={"padded": {"smem_pad": True}},
))
